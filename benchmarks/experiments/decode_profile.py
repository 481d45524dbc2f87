"""Where a batch-1 decode step goes: torch-profiler table of one engine's decode steps, and the bandwidth each of the
model's GEMV shapes reaches alone against the copy bandwidth measured in the same run.

    .venv/bin/python benchmarks/experiments/decode_profile.py [--model DIR] [--context 512] [--steps 20]

Writes <out>/<date>-decode-profile.md (default benchmarks/results). NOTES.md entry 29 reads it.
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
from benchmarks.decode_floor import copy_bandwidth  # noqa: E402
from benchmarks.engine_steps import step_seconds  # noqa: E402
from benchmarks.results_file import write_markdown  # noqa: E402


def gemv_bandwidth(shapes: list[tuple[int, int]], threads: int) -> list[tuple[int, int, float, float]]:
    """(N, K, µs, GB/s) of a 1-row bf16 packed linear (the ``TOKENFAB_CPU_LINEAR`` backend) per weight shape [N, K];
    enough distinct weights (64 MB) that each call streams its weight from DRAM, best of 5 passes."""
    from tokenfab.layers.linear import pack_weight, packed_linear
    torch.set_num_threads(threads)
    out = []
    for n, k in shapes:
        ws = [pack_weight(torch.randn(n, k, dtype=torch.bfloat16)) for _ in range(max(4, int(64e6 // (n * k * 2))))]
        x = torch.randn(1, k, dtype=torch.bfloat16)
        for w in ws:
            packed_linear(x, w, None, n)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for w in ws:
                packed_linear(x, w, None, n)
            best = min(best, (time.perf_counter() - t) / len(ws))
        out.append((n, k, best * 1e6, n * k * 2 / best / 1e9))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before decoding (default: 512)")
    ap.add_argument("--steps", type=int, default=20, help="profiled decode steps (default: 20)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"), help="output folder")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile
    from tokenfab import LLM, SamplingParams
    from tokenfab.default_model import ensure_default_model
    from tokenfab.layers.linear import Linear

    threads = torch.get_num_threads()
    llm = LLM(args.model or ensure_default_model(), max_model_len=args.context + 3 * args.steps + 100, max_num_seqs=1,
              progress=False)
    eng = llm.llm_engine
    eng.add_request("p", None, [(7 * j) % 4000 + 5 for j in range(args.context)],
                    SamplingParams(max_tokens=3 * args.steps + 50, ignore_eos=True))
    walls = step_seconds(eng, args.steps, warmup=5)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            eng.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    shapes = sorted({(m.out_features, m.in_features) for m in eng.runner.model.modules() if isinstance(m, Linear)
                     and m._packed is not None})
    bw = copy_bandwidth()
    rows = gemv_bandwidth(shapes, threads)
    torch.set_num_threads(threads)
    date = dt.date.today().isoformat()
    lines = [f"# Batch-1 decode step profile ({date})", "", f"Command: `{' '.join(sys.argv)}`", "",
             f"Step (unprofiled, median of {args.steps}): {statistics.median(walls) * 1e3:.2f} ms; {threads} threads; "
             f"copy bandwidth {bw / 1e9:.1f} GB/s (read+write).", "",
             f"## torch profiler, {args.steps} decode steps (fused CPU kernels are pybind calls: not listed)", "",
             "```", table, "```", "", "## GEMV alone, weight streamed from DRAM", "",
             "| weight [N, K] | MB | µs | GB/s read | of copy bandwidth |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {n} x {k} | {n * k * 2 / 1e6:.2f} | {us:.1f} | {gbs:.1f} | {gbs * 1e9 / bw:.0%} |"
              for n, k, us, gbs in rows]
    write_markdown(args.out, f"{date}-decode-profile.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
