"""Median engine decode step of 16 sequences at one context length: an ``LLM`` on the given model, 16 prompts of
``--context`` tokens (distinct token patterns), 120 decode steps timed one by one after 3 untimed
(benchmarks/engine_steps.py).

    PYTHONPATH=<checkout> python benchmarks/experiments/decode_step_batch16.py MODEL [--context 768]

MODEL: a checkpoint folder or a .gguf file. Run it from two checkouts, alternated, to compare.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from benchmarks.engine_steps import median_decode_ms  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=768)
    args = ap.parse_args()
    from tokenfab import LLM, SamplingParams
    llm = LLM(args.model, max_model_len=args.context + 400, max_num_seqs=16, progress=False)
    prompts = [[(7 * j + 131 * i) % 40000 + 5 for j in range(args.context)] for i in range(16)]
    ms = median_decode_ms(llm.llm_engine, prompts, SamplingParams(max_tokens=300, ignore_eos=True), steps=120)
    print(f"{os.path.basename(args.model.rstrip('/'))}: 16 x {args.context} tokens, median decode step {ms:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
