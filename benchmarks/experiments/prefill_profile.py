"""A 2,048-token prefill step of the embedded default model (8 prompts x 256 tokens, the serve budget): median
step time, then torch-profiler and cProfile tables of 3 more. Read by benchmarks/NOTES.md entry 30.

    .venv/bin/python benchmarks/experiments/prefill_profile.py [--prompts 8] [--prompt-len 256]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="prompts prefilled in one step (default: 8)")
    ap.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt (default: 256)")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile
    from tokenfab import LLM, SamplingParams
    from tokenfab.default_model import ensure_default_model

    budget = args.prompts * args.prompt_len
    llm = LLM(ensure_default_model(), max_model_len=args.prompt_len + 16, max_num_seqs=args.prompts,
              max_num_batched_tokens=budget, progress=False)
    eng = llm.llm_engine
    n = [0]

    def one_prefill_step() -> float:
        for i in range(args.prompts):
            n[0] += 1
            eng.add_request(f"r{n[0]}", None, [(7 * j + i) % 4000 + 5 for j in range(args.prompt_len)],
                            SamplingParams(max_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        eng.step()  # the whole budget: every prompt's prefill in one step
        dt = time.perf_counter() - t
        while eng.has_unfinished_requests():
            eng.step()
        return dt

    for _ in range(2):
        one_prefill_step()
    step = statistics.median(one_prefill_step() for _ in range(5))
    print(f"prefill step {args.prompts}x{args.prompt_len} ({budget} tokens): {step * 1e3:.1f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            one_prefill_step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        one_prefill_step()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
