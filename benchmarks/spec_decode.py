"""Speculative decoding on the real default model (SmolLM2-135M-Instruct, bf16, CPU), offline ``LLM`` timing.

Three parts, one Markdown result (benchmarks/results/<date>-spec-decode-<label>.md):

1. ``verify``: wall time of one engine step verifying k = 0, 1, 3, 7 drafts per row at batch 1 and 16 (random
   draft tokens from a stub proposer, so every step verifies exactly k; k = 0 is the plain decode step, the fused
   CPU decode stack). Median over ``--steps`` steps after warm-up, contexts of ~300 tokens.
2. ``workload``: with and without ``{"method": "ngram", ...}``, on an input-grounded workload (chat prompts "Repeat
   the following code exactly, changing only the function name: <code>", whose output copies the input) and on
   the random workload (random token prompts, ignore_eos), at temperature 0 and 1.0, concurrency 1 (max_num_seqs 1)
   and 16: acceptance rate (accepted / draft tokens), mean acceptance length (1 + accepted / drafts), mean TPOT
   ((finish - first token) / (output tokens - 1) per request) and output tok/s (output tokens / wall time).
3. ``depth``: the acceptance ceiling of truncated-depth drafts (first N layers + final norm + tied head), in
   transformers float32: how often their argmax equals the full model's greedy token.

``--method draft_model [--draft PATH]`` runs the workloads with a draft model instead (default draft: the real default
model's own Q4_1 GGUF file, served packed, beside its dequantized bf16 copy as the target).

Usage: ``python benchmarks/spec_decode.py [--parts verify,workload,depth] [--k 4] [--method ngram|draft_model]
[--repeats R]``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_steps import step_seconds  # noqa: E402
from results_file import write_markdown  # noqa: E402

CODE = [
    '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
''',
    '''def parse_config(path):
    """Read key = value lines from a file into a dict, skipping comments."""
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            config[key.strip()] = value.strip()
    return config
''',
    '''def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1."""
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''',
    '''class Counter:
    """Count how often each word occurs in a text."""

    def __init__(self):
        self.counts = {}

    def add(self, text):
        for word in text.lower().split():
            self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, n):
        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]
''',
]


def grounded_prompts(tok, n):
    out = []
    for i in range(n):
        msg = [{"role": "user", "content": "Repeat the following code exactly, changing only the function name:\n\n"
                                           + CODE[i % len(CODE)]}]
        text = tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
        out.append({"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]})
    return out


def random_prompts(vocab, n, length, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(100, vocab - 100, size=length).tolist()} for _ in range(n)]


class FixedKProposer:
    """Stub: k random draft tokens per row, every step (the verification cost, whatever acceptance)."""

    def __init__(self, k, V):
        self.num_speculative_tokens, self.V = k, V
        self.rng = np.random.default_rng(0)

    def propose(self, seqs, rows, token_ids, lengths, max_lens):
        from tokenfab.spec_decode.proposer import Proposal
        d = self.rng.integers(0, self.V, size=(len(seqs), self.num_speculative_tokens)).astype(np.int64)
        return Proposal(d, np.minimum(self.num_speculative_tokens, max_lens).astype(np.int64))

    def on_verified(self, seqs, num_accepted):
        return None

    def preallocates_kv(self):
        return False


def verify_part(model, steps):
    from tokenfab import LLM, SamplingParams
    rows = []
    for k in (0, 1, 3, 7):
        spec = None if k == 0 else {"method": "ngram", "num_speculative_tokens": k, "verify_token_cost": 0.0,
                                    "verify_step_overhead": 0.0,
                                    "random_row_cost": 0.0}
        llm = LLM(model, progress=False, max_num_seqs=16, max_model_len=2048, speculative_config=spec)
        eng = llm.llm_engine
        V = eng.model_config.vocab_size
        if k:
            eng.spec.proposer = FixedKProposer(k, V)
        for bs in (1, 16):
            sp = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
            for i, p in enumerate(random_prompts(V, bs, 300, seed=bs)):
                eng.add_request(f"v{k}-{bs}-{i}", None, p["prompt_token_ids"], sp)
            while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or \
                    eng.scheduler.waiting:
                eng.step()
            ts = step_seconds(eng, steps, warmup=3)
            for rid in list(eng.requests):
                eng.abort_request(rid)
            rows.append((k, bs, statistics.median(ts) * 1e3))
            print(f"verify k={k} batch={bs}: {rows[-1][2]:.2f} ms/step", flush=True)
        del llm
    base = {bs: t for k, bs, t in rows if k == 0}
    lines = ["## Verification step cost", "",
             "One engine step (schedule, forward, verification / sampling, output processing), median of "
             f"{steps} steps; every row verifies exactly k random drafts (k = 0: the plain fused decode step).", "",
             "| k | batch | ms / step | x k=0 | tokens verified / step |", "|---|---|---|---|---|"]
    for k, bs, t in rows:
        lines.append(f"| {k} | {bs} | {t:.2f} | {t / base[bs]:.2f} | {bs * (k + 1)} |")
    return lines


def run_workload(model, prompts, sp, conc, spec, llm=None):
    """One timed ``generate`` of ``prompts`` (after a one-prompt warm-up); ``llm`` reused when given.
    Returns (metrics dict, output token lists)."""
    from tokenfab import LLM
    if llm is None:
        llm = LLM(model, progress=False, max_num_seqs=conc, max_model_len=2048, speculative_config=spec)
    llm.generate(prompts[:1], sp)  # warm-up
    eng = llm.llm_engine
    st0 = dict(eng.get_stats())
    t0 = time.monotonic()
    outs = llm.generate(prompts, sp)
    wall = time.monotonic() - t0
    st = eng.get_stats()
    tpots, ntok = [], 0
    for o in outs:
        n = len(o.outputs[0].token_ids)
        ntok += n
        m = o.metrics
        if n > 1 and m.first_token_time is not None and m.finished_time is not None:
            tpots.append((m.finished_time - m.first_token_time) / (n - 1))
    res = {"tpot_ms": 1e3 * statistics.mean(tpots), "tok_s": ntok / wall, "out_tokens": ntok}
    if spec:
        dt = st.get("spec_decode_num_draft_tokens", 0) - st0.get("spec_decode_num_draft_tokens", 0)
        dr = st.get("spec_decode_num_drafts", 0) - st0.get("spec_decode_num_drafts", 0)
        ac = st.get("spec_decode_num_accepted_tokens", 0) - st0.get("spec_decode_num_accepted_tokens", 0)
        res.update(rate=(ac / dt if dt else 0.0), length=(1 + ac / dr if dr else 1.0), drafts=dr, draft_tokens=dt,
                   accepted=ac)
    return res, [o.outputs[0].token_ids for o in outs]


def spec_description(spec, spec_extra) -> str:
    """The workload table's first sentence: which proposer, k and settings."""
    k = spec["num_speculative_tokens"]
    if spec["method"] == "ngram":
        head = f"ngram, k = {k}, prompt_lookup_max {spec['prompt_lookup_max']}, prompt_lookup_min " \
               f"{spec['prompt_lookup_min']}"
    else:
        head = f"draft_model `{os.path.basename(spec['model'])}`, k = {k}"
    return f"{head}, other settings default ({spec_extra or 'switch-off rule defaults'})"


def workload_part(model, spec, max_tokens, spec_extra, repeats=1, json_rows=None, concs=(1, 16)):
    """The workload table: for each concurrency one LLM without and one with ``spec`` (built once, reused by
    every workload, temperature and output length); each cell runs no-spec and spec alternately ``repeats`` times
    and reports the medians (TPOT, tok/s) and the summed acceptance counters. ``max_tokens``: an int or a tuple of
    output lengths (cells per length)."""
    mts = tuple(max_tokens) if isinstance(max_tokens, (tuple, list)) else (max_tokens,)
    from tokenfab import LLM, SamplingParams
    from tokenfab.engine.model_loader import load_tokenizer
    tok = load_tokenizer(model)
    lines = ["## Workloads", "", f"{spec_description(spec, spec_extra)}; max_tokens "
             f"{', '.join(str(m) for m in mts)}. Concurrency "
             "c = max_num_seqs, all requests submitted at once (offline LLM.generate); c = 1 runs 4 requests one "
             f"after another, c = 16 runs 16. Each cell: no-spec and spec runs alternated {repeats} time(s), "
             "medians quoted.", "",
             "| workload | T | c | max tokens | acceptance rate | acceptance length | TPOT ms (no spec) | "
             "TPOT ms (spec) | TPOT ratio | out tok/s (no spec) | out tok/s (spec) | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cells = {}
    for conc in concs:
        llms = [LLM(model, progress=False, max_num_seqs=conc, max_model_len=2048, speculative_config=s)
                for s in (None, spec)]
        for wl in ("grounded", "random"):
            for temp in (0.0, 1.0):
                for mt in mts:
                    n = 4 if conc == 1 else 16
                    if wl == "grounded":
                        prompts = grounded_prompts(tok, n)
                        sp = SamplingParams(temperature=temp, max_tokens=mt, seed=None)
                    else:
                        prompts = random_prompts(len(tok), n, 256)
                        sp = SamplingParams(temperature=temp, max_tokens=mt, ignore_eos=True)
                    runs = [[], []]
                    for _ in range(repeats):
                        for i in (0, 1):
                            runs[i].append(run_workload(model, prompts, sp, conc, (None, spec)[i], llm=llms[i]))
                    cells[(wl, temp, conc, mt)] = runs
                    print(f"{wl} T={temp:g} c={conc} max_tokens={mt}: " + "; ".join(
                        f"{'spec' if i else 'base'} tpot {[round(r[0]['tpot_ms'], 1) for r in runs[i]]}"
                        for i in (0, 1)), flush=True)
        del llms
    for wl, temp, conc, mt in ((w, t, c, m) for w in ("grounded", "random") for t in (0.0, 1.0) for c in concs
                               for m in mts):
        runs = cells[(wl, temp, conc, mt)]
        med = [{key: statistics.median(r[0][key] for r in runs[i]) for key in ("tpot_ms", "tok_s")}
               for i in (0, 1)]
        ac = sum(r[0]["accepted"] for r in runs[1])
        dt = sum(r[0]["draft_tokens"] for r in runs[1])
        dr = sum(r[0]["drafts"] for r in runs[1])
        rate, length = (ac / dt if dt else 0.0), (1 + ac / dr if dr else 1.0)
        same_all = all(b[1] == s[1] for b, s in zip(runs[0], runs[1]))
        same = "yes" if same_all else ("-" if temp > 0 else "NO")
        ratio = med[1]["tpot_ms"] / med[0]["tpot_ms"]
        lines.append(f"| {wl} | {temp:g} | {conc} | {mt} | {100 * rate:.1f}% | {length:.2f} | "
                     f"{med[0]['tpot_ms']:.2f} | {med[1]['tpot_ms']:.2f} | {ratio:.2f} | "
                     f"{med[0]['tok_s']:.1f} | {med[1]['tok_s']:.1f} | {same} |")
        if json_rows is not None:
            json_rows.append({"workload": wl, "temperature": temp, "concurrency": conc, "max_tokens": mt,
                              "acceptance_rate": rate, "acceptance_length": length, "drafts": dr,
                              "draft_tokens": dt, "accepted_tokens": ac,
                              "tpot_ms_no_spec": [r[0]["tpot_ms"] for r in runs[0]],
                              "tpot_ms_spec": [r[0]["tpot_ms"] for r in runs[1]],
                              "tok_s_no_spec": [r[0]["tok_s"] for r in runs[0]],
                              "tok_s_spec": [r[0]["tok_s"] for r in runs[1]],
                              "tpot_ratio": ratio, "same_tokens": same_all if temp == 0 else None})
        print(lines[-1], flush=True)
    return lines


def depth_part(model, max_tokens, depths=(4, 8, 12, 16, 20, 24, 28)):
    """Acceptance ceiling of a truncated-depth draft (the first N of the model's layers, its final norm and tied
    head; self-speculative layer skipping): transformers in float32 generates greedily from each prompt, then
    the fraction of positions where argmax(head(norm(h_N))) equals the full model's greedy token, i.e. the
    per-token acceptance probability at T = 0 of such a draft running on the target's accepted context."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    L_total = lm.config.num_hidden_layers
    lines = ["## Truncated-depth drafts (acceptance ceiling at T = 0)", "",
             f"First N of {L_total} layers + final norm + tied head, float32, {max_tokens} greedy tokens per prompt "
             "(4 grounded, 2 random): fraction of positions where the truncated model's argmax equals the full "
             "model's token.", "", "| N layers | grounded | random |", "|---|---|---|"]
    res = {}
    for name, ps in (("grounded", grounded_prompts(tok, 4)), ("random", random_prompts(len(tok), 2, 256))):
        for p in ps:
            ids = torch.tensor([p["prompt_token_ids"]])
            with torch.no_grad():
                out = lm.generate(ids, max_new_tokens=max_tokens, do_sample=False)
                L = ids.shape[1]
                hs = lm(out, output_hidden_states=True).hidden_states
                for n in depths:
                    pred = lm.lm_head(lm.model.norm(hs[n][0, L - 1:-1])).argmax(-1)
                    res.setdefault((name, n), []).append((pred == out[0, L:]).float().mean().item())
    for n in depths:
        lines.append(f"| {n} | {100 * statistics.mean(res[('grounded', n)]):.1f}% | "
                     f"{100 * statistics.mean(res[('random', n)]):.1f}% |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="verify,workload")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-tokens", default="128", help="output length, or a comma list (workload: cells per length)")
    ap.add_argument("--spec-extra", default="{}", help="extra speculative_config fields as JSON")
    ap.add_argument("--label", default=None, help="result name label (default: the method)")
    ap.add_argument("--method", default="ngram", choices=("ngram", "draft_model"))
    ap.add_argument("--draft", default=None, help="draft_model: checkpoint folder or .gguf file (default: the "
                    "real default model's Q4_1 GGUF, served packed)")
    ap.add_argument("--concurrency", default="1,16", help="workload: comma list of concurrencies")
    ap.add_argument("--repeats", type=int, default=1, help="workload: no-spec / spec runs alternated per cell")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    import json

    import torch
    if args.threads:
        torch.set_num_threads(args.threads)

    from tokenfab.default_model import default_model_path, real_model_gguf
    model = default_model_path()
    label = args.label or ("ngram" if args.method == "ngram" else "draft-model")
    spec_extra = json.loads(args.spec_extra)
    if args.method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    else:
        spec = {"method": "draft_model", "num_speculative_tokens": args.k, "model": args.draft or real_model_gguf()}
    spec.update(spec_extra)
    parts = args.parts.split(",")
    lines = [f"# Speculative decoding on {os.path.basename(model)} (bf16, CPU)", "",
             f"Measured {time.strftime('%Y-%m-%d')} on this project's 2-core VM (torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads; the VM was shared with other jobs, so absolute times are noisy: "
             "compare rows measured side by side).", "",
             f"Command: `python benchmarks/spec_decode.py --parts {args.parts} --k {args.k} --steps {args.steps} "
             f"--max-tokens {args.max_tokens} --spec-extra '{args.spec_extra}' --label {label} --threads {args.threads}"
             + (f" --method {args.method}" + (f" --draft {args.draft}" if args.draft else "") if args.method != "ngram"
                else "") + (f" --repeats {args.repeats}" if args.repeats != 1 else "")
             + (f" --concurrency {args.concurrency}" if args.concurrency != "1,16" else "") + "`",
             ""]
    json_rows: list = []
    if "verify" in parts:
        lines += verify_part(model, args.steps) + [""]
    if "depth" in parts:
        lines += depth_part(model, int(args.max_tokens.split(",")[0])) + [""]
    if "workload" in parts:
        lines += workload_part(model, spec, tuple(int(m) for m in args.max_tokens.split(",")), spec_extra,
                               args.repeats, json_rows,
                               tuple(int(c) for c in args.concurrency.split(","))) + [""]
    path = write_markdown(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                          f"{time.strftime('%Y-%m-%d')}-spec-decode-{label}.md", lines)
    if json_rows:
        with open(path[:-3] + ".json", "w") as f:
            json.dump({"command": lines[4], "model": model, "speculative_config": spec, "workload": json_rows}, f,
                      indent=1)
        print(f"wrote {path[:-3]}.json")


if __name__ == "__main__":
    main()
