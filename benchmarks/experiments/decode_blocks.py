"""The three CPU paths of a decode-only step side by side on one engine:

- ``stack``: the whole decoder stack as one C++ call (engine/cpu_decode_stack.py);
- ``blocks``: the modules, each attention layer as one C++ call (``cpu_decode_blocks.mla_decode`` for MLA,
  ``cpu_decode_blocks.gqa_decode`` for Llama / Qwen3);
- ``modules``: the modules with attention in Python-level ops.

    .venv/bin/python benchmarks/experiments/decode_blocks.py [--model DIR] [--batch 1,4,16] [--context 512]

Decode steps cycle through the three in runs of ``--steps``, ``--rounds`` times; median step time each. All three
give bit-identical outputs (tests/test_decode_blocks.py, tests/test_decode_stack.py), so only the time differs; the
default 5 x 20 steps per path are about the least that separates them from this VM's step-to-step noise. Writes
<out>/<date>-<model folder>-decode-blocks.md (default benchmarks/results).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from benchmarks.results_file import write_markdown  # noqa: E402


PATHS = ("stack", "blocks", "modules")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    ap.add_argument("--batch", default="1,4,16", help="decode batch sizes, comma-separated (default 1,4,16)")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per sequence (default 512)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per block (default 20)")
    ap.add_argument("--rounds", type=int, default=5, help="on/off blocks per batch size (default 5)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"), help="output folder")
    args = ap.parse_args()
    from tokenfab import LLM, SamplingParams
    from tokenfab.default_model import ensure_default_model
    from tokenfab.layers.mla import MLAttention
    from tokenfab.models.llama import LlamaAttention
    batches = [int(b) for b in args.batch.split(",")]
    total = len(PATHS) * args.rounds * (args.steps + 1) + 10
    llm = LLM(args.model or ensure_default_model(), max_model_len=args.context + total + 16,
              max_num_seqs=max(batches), progress=False)
    eng = llm.llm_engine
    layers = [m for m in eng.runner.model.modules() if isinstance(m, (MLAttention, LlamaAttention))]
    if not layers or not all(m._block_weights is not None if isinstance(m, MLAttention) else m._block_ok
                             for m in layers):
        print("the decode blocks do not apply here (need CPU bf16 with AVX512-BF16 kernels and an MLA or "
              "Llama-family model)", file=sys.stderr)
        return 2
    stack = eng.runner.cpu_decode_stack
    if stack is None:
        print("the decode stack does not apply here (engine/cpu_decode_stack.py)", file=sys.stderr)
        return 2
    rows = []
    for B in batches:
        for i in range(B):
            eng.add_request(f"b{B}-{i}", None, [(7 * j + 13 * i) % 4000 + 5 for j in range(args.context)],
                            SamplingParams(max_tokens=total, ignore_eos=True, temperature=0.0))
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        times = {p: [] for p in PATHS}
        for _ in range(args.rounds):
            for path in PATHS:
                eng.runner.cpu_decode_stack = stack if path == "stack" else None
                for m in layers:
                    m.decode_block = path != "modules"
                eng.step()  # untimed switch-over step
                for _ in range(args.steps):
                    t = time.perf_counter()
                    eng.step()
                    times[path].append(time.perf_counter() - t)
        eng.runner.cpu_decode_stack = stack
        for m in layers:
            m.decode_block = True
        med = {p: statistics.median(v) for p, v in times.items()}
        rows.append((B, med))
        print(f"batch {B}: " + ", ".join(f"{p} {med[p] * 1e3:.2f} ms" for p in PATHS)
              + f"; stack / blocks {med['stack'] / med['blocks']:.2f}, blocks / modules "
              f"{med['blocks'] / med['modules']:.2f}")
        for i in range(B):
            eng.abort_request(f"b{B}-{i}")
        while eng.has_unfinished_requests():
            eng.step()
    date = dt.date.today().isoformat()
    name = os.path.basename(os.path.normpath(args.model or "default"))
    lines = [f"# Decode paths: whole stack, attention blocks, modules; {name} ({date})", "",
             f"Command: `benchmarks/experiments/decode_blocks.py {' '.join(sys.argv[1:])}`; {torch.get_num_threads()} threads, "
             f"context {args.context}, {args.rounds} rounds of {args.steps} steps per path, paths cycled.", "",
             "| batch | stack ms/step | blocks ms/step | modules ms/step | stack / blocks | blocks / modules |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {B} | {m['stack'] * 1e3:.2f} | {m['blocks'] * 1e3:.2f} | {m['modules'] * 1e3:.2f} | "
              f"{m['stack'] / m['blocks']:.2f} | {m['blocks'] / m['modules']:.2f} |" for B, m in rows]
    write_markdown(args.out, f"{date}-{name}-decode-blocks.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
