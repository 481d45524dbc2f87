"""lm-eval compatibility, checked: lm-eval's ``local-completions`` / ``local-chat-completions`` models against
``tokenfab serve`` and its ``hf`` model on the same weights, on two hand-made tasks in lm-eval's YAML format
(offline, local JSONL data):

* ``tokenfab_mc`` (multiple_choice: per-choice log-likelihoods, acc / acc_norm) — lm-eval's loglikelihood
  requests: token-id prompts, a list of prompts per request, ``echo`` with ``logprobs=1``, ``max_tokens=1``;
* ``tokenfab_gen`` (generate_until, exact_match) — greedy generation, plain and with ``--apply_chat_template``
  (``local-chat-completions`` against ``hf`` with the same chat template).

lm-eval lives in its own venv (heavy dependencies; never tokenfab's): ``python3 -m venv VENV && VENV/bin/pip
install torch==2.13.0 && VENV/bin/pip install 'lm-eval[api,hf]'`` (default VENV:
``~/.cache/tokenfab/lm-eval-venv``). Both sides run float32 by default, so per-item log-likelihoods agree to
float32 accumulation-order noise; the tolerance (``--tol``, nats per item) is stated in the result.

Run (about 5-10 minutes on 2 CPU cores):
    .venv/bin/python benchmarks/lm_eval_check.py --out benchmarks/results/$(date +%F)-lm-eval-check.md
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import socket
import subprocess
import sys
import time

MC_ITEMS = [
    ("The capital of France is", ["Paris", "London", "Rome", "Berlin"], 0),
    ("Water freezes at a temperature of zero degrees", ["Celsius", "Kelvin", "Newton", "Joule"], 0),
    ("The largest planet in our solar system is", ["Mars", "Venus", "Jupiter", "Mercury"], 2),
    ("A baby cat is called a", ["puppy", "kitten", "calf", "foal"], 1),
    ("The opposite of hot is", ["warm", "cold", "bright", "loud"], 1),
    ("Two plus two equals", ["three", "five", "four", "six"], 2),
    ("The sun rises in the", ["west", "north", "south", "east"], 3),
    ("Bees make", ["milk", "honey", "silk", "wool"], 1),
    ("The color of a clear daytime sky is", ["green", "red", "blue", "black"], 2),
    ("An apple is a kind of", ["fruit", "metal", "planet", "insect"], 0),
]
GEN_ITEMS = [
    ("What is the capital of France?", "Paris"), ("What is 2 plus 3?", "5"),
    ("What color is grass?", "green"), ("How many days are in a week?", "7"),
    ("What is the opposite of up?", "down"), ("What animal says moo?", "cow"),
]


# The tasks' YAML after their common head (task, the JSONL data file, test split, output_type).
_MC_YAML = """doc_to_text: "{{question}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""
_GEN_YAML = """doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n", "Question:"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0.0
filter_list:
  - name: strip
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


def write_tasks(root: str) -> str:
    """The two tasks (YAML + JSONL) under ``root``; returns the --include_path folder."""
    os.makedirs(root, exist_ok=True)
    mc, gen = os.path.join(root, "mc.jsonl"), os.path.join(root, "gen.jsonl")
    with open(mc, "w") as f:
        for q, ch, a in MC_ITEMS:
            f.write(json.dumps({"question": q, "choices": ch, "answer": a}) + "\n")
    with open(gen, "w") as f:
        for q, a in GEN_ITEMS:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    for name, data, output_type, rest in (("tokenfab_mc", mc, "multiple_choice", _MC_YAML),
                                          ("tokenfab_gen", gen, "generate_until", _GEN_YAML)):
        with open(os.path.join(root, name + ".yaml"), "w") as f:
            f.write(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    f"test_split: test\noutput_type: {output_type}\n" + rest)
    return root


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_server(model: str, port: int, dtype: str, log: str) -> subprocess.Popen:
    exe = os.path.join(os.path.dirname(sys.executable), "tokenfab")
    cmd = [exe, "serve", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--max-model-len", "2048", "--served-model-name", "smollm2"]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    import urllib.request
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tokenfab serve exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError("tokenfab serve did not come up in 600 s")


def run_lm_eval(venv: str, label: str, model: str, model_args: str, tasks: str, include: str, out: str,
                extra: list[str], reuse: bool = False) -> tuple[str, float]:
    cmd = [os.path.join(venv, "bin", "lm-eval"), "run", "--model", model, "--model_args", model_args,
           "--tasks", tasks, "--include_path", include, "--log_samples", "--output_path",
           os.path.join(out, label), "--seed", "1234", *extra]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    done = glob.glob(os.path.join(out, label, "**", "results_*.json"), recursive=True)
    if reuse and done:
        print(f"  (reusing {done[-1]})", flush=True)
        return " ".join(shlex.quote(c) for c in cmd), float("nan")
    with open(os.path.join(out, f"{label}.log"), "w") as log:
        p = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out)
    if p.returncode != 0:
        raise RuntimeError(f"lm-eval ({label}) failed with {p.returncode}; see {out}/{label}.log")
    return " ".join(shlex.quote(c) for c in cmd), time.perf_counter() - t0


def samples(out: str, label: str, task: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(out, label, "**", f"samples_{task}_*.jsonl"), recursive=True))
    if not files:
        raise RuntimeError(f"no samples_{task} file under {out}/{label}")
    with open(files[-1]) as f:
        rows = [json.loads(line) for line in f]
    return sorted(rows, key=lambda r: r["doc_id"])


def results(out: str, label: str) -> dict:
    files = sorted(glob.glob(os.path.join(out, label, "**", "results_*.json"), recursive=True))
    with open(files[-1]) as f:
        return json.load(f)["results"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: tokenfab's default model)")
    ap.add_argument("--venv", default=os.path.expanduser("~/.cache/tokenfab/lm-eval-venv"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tol", type=float, default=2e-3, help="largest |Δ log-likelihood| per item (nats)")
    ap.add_argument("--work", default="/tmp/tokenfab-lm-eval-check")
    ap.add_argument("--out", default=None, help="Markdown result file")
    ap.add_argument("--reuse", action="store_true", help="keep lm-eval runs already in --work (their time: nan)")
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.venv, "bin", "lm-eval")):
        print(f"no lm-eval in {args.venv}; create it as the docstring says.", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tokenfab.default_model import resolve_model
    model = resolve_model(args.model, quiet=True)
    os.makedirs(args.work, exist_ok=True)
    include = write_tasks(os.path.join(args.work, "tasks"))
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"
    cmds, times = {}, {}
    hf_args = f"pretrained={model},dtype={args.dtype}"
    cmds["hf"], times["hf"] = run_lm_eval(args.venv, "hf", "hf", hf_args, "tokenfab_mc,tokenfab_gen", include,
                                          args.work, ["--batch_size", "4", "--device", "cpu"], args.reuse)
    cmds["hf_chat"], times["hf_chat"] = run_lm_eval(args.venv, "hf_chat", "hf", hf_args, "tokenfab_gen", include,
                                                    args.work, ["--batch_size", "4", "--device", "cpu",
                                                                "--apply_chat_template"], args.reuse)
    server = start_server(model, port, args.dtype, os.path.join(args.work, "serve.log"))
    try:
        comp_args = (f"model=smollm2,base_url={base}/completions,tokenizer={model},tokenizer_backend=huggingface,"
                     "tokenized_requests=True,num_concurrent=1,max_retries=1")
        cmds["local-completions"], times["local-completions"] = run_lm_eval(
            args.venv, "local_completions", "local-completions", comp_args, "tokenfab_mc,tokenfab_gen", include,
            args.work, ["--batch_size", "4"], args.reuse)
        chat_args = (f"model=smollm2,base_url={base}/chat/completions,tokenizer={model},"
                     "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
        cmds["local-chat-completions"], times["local-chat-completions"] = run_lm_eval(
            args.venv, "local_chat", "local-chat-completions", chat_args, "tokenfab_gen", include, args.work,
            ["--apply_chat_template"], args.reuse)
    finally:
        server.terminate()
        server.wait(30)

    # ---- compare
    hf_mc, tf_mc = samples(args.work, "hf", "tokenfab_mc"), samples(args.work, "local_completions", "tokenfab_mc")
    rows, worst, greedy_diff = [], 0.0, 0
    for a, b in zip(hf_mc, tf_mc):
        la = [float(r[0][0]) for r in a["resps"]]
        lb = [float(r[0][0]) for r in b["resps"]]
        d = max(abs(x - y) for x, y in zip(la, lb))
        greedy_diff += sum(bool(r[0][1]) != bool(s[0][1]) for r, s in zip(a["resps"], b["resps"]))
        worst = max(worst, d)
        rows.append((a["doc_id"], la, lb, d, a["acc"], b["acc"]))
    gen_pairs = {}
    for name, (la, lb) in {"plain": ("hf", "local_completions"), "chat": ("hf_chat", "local_chat")}.items():
        A, B = samples(args.work, la, "tokenfab_gen"), samples(args.work, lb, "tokenfab_gen")
        gen_pairs[name] = [(a["doc_id"], a["resps"][0][0], b["resps"][0][0], a["exact_match"], b["exact_match"])
                           for a, b in zip(A, B)]
    res = {k: results(args.work, k) for k in ("hf", "hf_chat", "local_completions", "local_chat")}
    ok_ll = worst <= args.tol
    same_gen = {k: sum(x[1] == x[2] for x in v) for k, v in gen_pairs.items()}
    version = subprocess.run([os.path.join(args.venv, "bin", "python"), "-c",
                              "import importlib.metadata as m; print(m.version('lm-eval'))"],
                             capture_output=True, text=True).stdout.strip()
    lines = ["# lm-eval compatibility check", "",
             f"Model: `{model}` ({args.dtype} on both sides); lm-eval {version} in its own venv; tokenfab serve on 127.0.0.1. Script: `benchmarks/lm_eval_check.py`.", "",
             "Commands:", ""] + [f"- {k} ({times[k]:.0f} s): `{v}`" for k, v in cmds.items()] + [
             "", "## Scores", "", "| task | metric | hf | tokenfab (local-completions / local-chat-completions) |",
             "|---|---|---:|---:|"]
    for task, metric, ka, kb in (("tokenfab_mc", "acc,none", "hf", "local_completions"),
                                 ("tokenfab_mc", "acc_norm,none", "hf", "local_completions"),
                                 ("tokenfab_gen", "exact_match,strip", "hf", "local_completions"),
                                 ("tokenfab_gen (chat template)", "exact_match,strip", "hf_chat", "local_chat")):
        t = task.split(" ")[0]
        lines.append(f"| {task} | {metric} | {res[ka][t][metric]:.4f} | {res[kb][t][metric]:.4f} |")
    lines += ["", "## Per-item log-likelihoods (tokenfab_mc, every choice)", "",
              f"Largest |Δ log-likelihood| over {sum(len(r[1]) for r in rows)} (item, choice) pairs: "
              f"**{worst:.2e} nats** (tolerance {args.tol:g}: {'PASS' if ok_ll else 'FAIL'}); is_greedy flags "
              f"differing: {greedy_diff}.", "",
              "| doc | hf log-likelihoods | tokenfab log-likelihoods | max abs diff | acc hf / tokenfab |",
              "|---:|---|---|---:|---|"]
    for doc, la, lb, d, aa, ab in rows:
        lines.append(f"| {doc} | {', '.join(f'{x:.4f}' for x in la)} | {', '.join(f'{x:.4f}' for x in lb)} | "
                     f"{d:.1e} | {aa:g} / {ab:g} |")
    for name, pairs in gen_pairs.items():
        lines += ["", f"## Generations (tokenfab_gen, {name}): {same_gen[name]} of {len(pairs)} identical", "",
                  "| doc | hf | tokenfab | exact_match hf / tokenfab |", "|---:|---|---|---|"]
        for doc, a, b, ea, eb in pairs:
            lines.append(f"| {doc} | `{a!r}` | `{b!r}` | {ea:g} / {eb:g} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if ok_ll and all(same_gen[k] == len(v) for k, v in gen_pairs.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
