"""Speculative decoding on the real default model (SmolLM2-135M-Instruct, bf16, CPU), offline ``LLM`` timing.

Two parts, one Markdown result (benchmarks/results/<date>-spec-decode-<label>.md):

1. ``verify``: wall time of one engine step verifying k = 0, 1, 3, 7 drafts per row at batch 1 and 16 (random
   draft tokens from a stub proposer, so every step verifies exactly k; k = 0 is the plain decode step, the fused
   CPU decode stack). Median over ``--steps`` steps after warm-up, contexts of ~300 tokens.
2. ``workload``: with and without ``{"method": "ngram", ...}``, on an input-grounded workload (chat prompts "Repeat
   the following code exactly, changing only the function name: <code>", whose output copies the input) and on
   the random workload (random token prompts, ignore_eos), at temperature 0 and 1.0, concurrency 1 (max_num_seqs 1)
   and 16: acceptance rate (accepted / draft tokens), mean acceptance length (1 + accepted / drafts), mean TPOT
   ((finish - first token) / (output tokens - 1) per request) and output tok/s (output tokens / wall time).

Usage: ``python benchmarks/spec_decode.py [--parts verify,workload] [--k 4] [--label ngram]``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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
            for _ in range(3):
                eng.step()
            ts = []
            for _ in range(steps):
                t0 = time.perf_counter()
                eng.step()
                ts.append(time.perf_counter() - t0)
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


def run_workload(model, prompts, sp, conc, spec):
    from tokenfab import LLM
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
        res.update(rate=(ac / dt if dt else 0.0), length=(1 + ac / dr if dr else 1.0), drafts=dr)
    return res, [o.outputs[0].token_ids for o in outs]


def workload_part(model, k, max_tokens, spec_extra):
    from tokenfab import SamplingParams
    from tokenfab.engine.model_loader import load_tokenizer
    tok = load_tokenizer(model)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
            **spec_extra}
    lines = ["## Workloads", "", f"ngram, k = {k}, prompt_lookup_max 4, prompt_lookup_min 1, other settings default "
             f"({spec_extra or 'switch-off rule defaults'}); max_tokens {max_tokens}. Concurrency c = max_num_seqs, "
             "all requests submitted at once (offline LLM.generate); c = 1 runs 4 requests one after another, "
             "c = 16 runs 16.", "",
             "| workload | T | c | acceptance rate | acceptance length | TPOT ms (no spec) | TPOT ms (spec) | "
             "TPOT ratio | out tok/s (no spec) | out tok/s (spec) | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for wl in ("grounded", "random"):
        for temp in (0.0, 1.0):
            for conc in (1, 16):
                n = 4 if conc == 1 else 16
                if wl == "grounded":
                    prompts = grounded_prompts(tok, n)
                    sp = SamplingParams(temperature=temp, max_tokens=max_tokens, seed=None)
                else:
                    prompts = random_prompts(len(tok), n, 256)
                    sp = SamplingParams(temperature=temp, max_tokens=max_tokens, ignore_eos=True)
                base, bt = run_workload(model, prompts, sp, conc, None)
                spc, st = run_workload(model, prompts, sp, conc, spec)
                same = "yes" if bt == st else ("-" if temp > 0 else "NO")
                lines.append(f"| {wl} | {temp:g} | {conc} | {100 * spc['rate']:.1f}% | {spc['length']:.2f} | "
                             f"{base['tpot_ms']:.2f} | {spc['tpot_ms']:.2f} | {spc['tpot_ms'] / base['tpot_ms']:.2f} | "
                             f"{base['tok_s']:.1f} | {spc['tok_s']:.1f} | {same} |")
                print(lines[-1], flush=True)
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="verify,workload")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--spec-extra", default="{}", help="extra speculative_config fields as JSON")
    ap.add_argument("--label", default="ngram")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    import json

    import torch
    if args.threads:
        torch.set_num_threads(args.threads)

    from tokenfab.default_model import default_model_path
    model = default_model_path()
    parts = args.parts.split(",")
    lines = [f"# Speculative decoding on {os.path.basename(model)} (bf16, CPU)", "",
             f"Measured {time.strftime('%Y-%m-%d')} on this project's 2-core VM (torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads; the VM was shared with other jobs, so absolute times are noisy: "
             "compare rows measured side by side).", "",
             f"Command: `python benchmarks/spec_decode.py --parts {args.parts} --k {args.k} --steps {args.steps} "
             f"--max-tokens {args.max_tokens} --spec-extra '{args.spec_extra}' --label {args.label} --threads {args.threads}`",
             ""]
    if "verify" in parts:
        lines += verify_part(model, args.steps) + [""]
    if "workload" in parts:
        lines += workload_part(model, args.k, args.max_tokens, json.loads(args.spec_extra)) + [""]
    write_markdown(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   f"{time.strftime('%Y-%m-%d')}-spec-decode-{args.label}.md", lines)


if __name__ == "__main__":
    main()
