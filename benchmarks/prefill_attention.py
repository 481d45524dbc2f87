"""CPU prefill attention at SmolLM2-135M's shapes (9 query / 3 KV heads of 64, bf16 or float32), paths side by side:
tokenfab's flash kernel (kernels/cpu/csrc/flash_prefill.cpp), PyTorch's CPU flash kernel as
tokenfab/layers/flash_prefill.py maps a group onto it (causal from the top left, a prefix merged by log-sum-exp),
and the GEMM + fused causal softmax path (layers/paged_attention.py::_prefill_attention_fused); interleaved, one
thread, thread CPU time (best of the rounds), GFLOP/s of exact causal attention (4 d per query-key pair a query
sees). The results decide which path ``flash_prefill.applies`` takes on each CPU path. tokenfab's kernel runs bf16
with AVX512-BF16 only: elsewhere (float32, an AVX2 CPU) its column is left out.

    .venv/bin/python benchmarks/prefill_attention.py [--rounds 5] [--dtype bf16|float32] [--name prefill-attention]

Writes benchmarks/results/<date>-<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.results_file import write_results  # noqa: E402

# (label, per-sequence (first query position, queries))
CASES = [("one 512-token prompt", [(0, 512)]), ("one 2,048-token prompt", [(0, 2048)]),
         ("two 1,024-token prompts", [(0, 1024), (0, 1024)]),
         ("2,048-token chunk after 2,048 cached tokens", [(2048, 2048)]),
         ("chunks after 0 / 512 / 1,536 cached tokens", [(0, 512), (512, 512), (1536, 512)])]


def group(seqs):
    from tokenfab.layers.attention_metadata import AttentionGroup
    Q = max(n for _, n in seqs)
    qp = torch.full((len(seqs), Q), -1, dtype=torch.long)
    for b, (s, n) in enumerate(seqs):
        qp[b, :n] = torch.arange(s, s + n)
    g = AttentionGroup.__new__(AttentionGroup)
    g.query_pos, g.q_len, g.max_context = qp, Q, max(s + n for s, n in seqs)
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", choices=("bf16", "float32"), default="bf16")
    ap.add_argument("--name", default="prefill-attention")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    from tokenfab.kernels.cpu import isa
    from tokenfab.layers import flash_prefill, paged_attention
    from tokenfab.kernels import dispatch

    def torch_flash(q, k, v, g, scale):
        saved = flash_prefill._amx
        flash_prefill._amx = lambda: True  # the PyTorch-kernel branch, whatever this CPU's path
        try:
            return flash_prefill.flash_prefill_attention(q, k, v, g, scale)
        finally:
            flash_prefill._amx = saved
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    probe = torch.zeros(1, 3, 8, 64, dtype=dtype)
    paths = {"tokenfab": lambda q, k, v, g, s: dispatch.flash_prefill_attention(q, k, v, g.query_pos, s),
             "pytorch": torch_flash, "fused": paged_attention._prefill_attention_fused}
    if not dispatch.flash_prefill_applies(probe, probe, probe):
        del paths["tokenfab"]
    rows, payload = [], {"date": dt.date.today().isoformat(), "cpu_path": isa.selected_level(), "dtype": args.dtype,
                         "cases": {}}
    for label, seqs in CASES:
        g0 = group(seqs)
        B, Q, L = len(seqs), g0.q_len, g0.max_context
        torch.manual_seed(0)
        q = torch.randn(B, 9, Q, 64).to(dtype)
        k, v = torch.randn(B, 3, L, 64).to(dtype), torch.randn(B, 3, L, 64).to(dtype)
        flop = 4 * 64 * 9 * sum(n * s + n * (n + 1) / 2 for s, n in seqs)
        times = {p: [] for p in paths}
        for _ in range(args.rounds):
            for p, fn in paths.items():
                g = group(seqs)  # fresh: no state cached from the other path
                t = time.thread_time()
                fn(q, k, v, g, 0.125)
                times[p].append(time.thread_time() - t)
        best = {p: min(ts) for p, ts in times.items()}
        payload["cases"][label] = {"seqs": seqs, "flop": flop, "seconds": times}
        ratios = [best[p] / best["fused"] for p in paths if p != "fused"]
        rows.append(f"| {label} | " + " | ".join(f"{best[p] * 1e3:.1f} ({flop / best[p] / 1e9:.0f})" for p in paths)
                    + "".join(f" | {r:.2f}" for r in ratios) + " |")
    names = {"tokenfab": "tokenfab flash", "pytorch": "PyTorch flash", "fused": "fused"}
    head = ([f"{names[p]} ms (GFLOP/s)" for p in paths] + [f"{names[p]} x fused" for p in paths if p != "fused"])
    lines = [f"# CPU prefill attention: flash kernels vs GEMM + fused causal softmax ({payload['date']})", "",
             f"Command: `benchmarks/prefill_attention.py --rounds {args.rounds} --dtype {args.dtype}`; one thread, "
             f"thread CPU time, best of {args.rounds} interleaved rounds; CPU path `{payload['cpu_path']}` "
             f"(TOKENFAB_CPU_ISA); torch {torch.__version__}. SmolLM2-135M shapes: 9 query / 3 KV heads of 64, "
             f"{args.dtype}.", "",
             "| case | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)] + rows
    write_results(args.out, f"{payload['date']}-{args.name}", payload, lines)


if __name__ == "__main__":
    main()
