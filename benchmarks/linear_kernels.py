"""tokenfab's VNNI-blocked linear (kernels/cpu/csrc/vnni_linear.cpp) against oneDNN's packed inner product, side by side,
at the default model's linear shapes and 1 to 2,048 rows.

    .venv/bin/python benchmarks/linear_kernels.py [--rows 1,2,4,16,256,2048] [--reps 5]

Each weight shape gets enough distinct weights (64 MB) that every call streams its weight from DRAM, as a decode
step does; both backends run the same inputs, alternated pass by pass, best pass of ``--reps``. Rows <= 4 are
memory-bound (GB/s of weight read; the copy bandwidth of the same run is the yardstick), larger row counts are
compute-bound (GFLOP/s). Writes <out>/<date>-linear-kernels.{json,md} (default benchmarks/results).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.decode_floor import copy_bandwidth  # noqa: E402
from benchmarks.linear_bench import bandwidth_header, kernels_ready, run_meta  # noqa: E402
from benchmarks.results_file import write_results  # noqa: E402

# [N, K] of the default model's linears (embedded DeepSeek-V3-architecture model, benchmarks/peers models): fused
# q_a|kv_a, q_b, o_proj, a routed / shared expert's gate_up and down, the dense layer's gate_up and down, lm_head
SHAPES = [(960, 768), (1024, 384), (768, 512), (768, 768), (768, 384), (3072, 768), (768, 1536), (8192, 768)]


def time_pair(n: int, k: int, rows: int, reps: int) -> dict:
    """Best seconds per call of both backends for weight [n, k] and ``rows`` input rows, plus their max |Δ|."""
    from tokenfab.kernels.cpu.ops import vnni_linear as cpu_vnni
    count = max(2, int(64e6 // (n * k * 2))) if rows <= 16 else 2
    ws = [torch.randn(n, k, dtype=torch.bfloat16) / k ** 0.5 for _ in range(count)]
    vnni = [cpu_vnni.pack_linear_weight(w) for w in ws]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws]
    del ws
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    runs = {
        "tokenfab": lambda i: cpu_vnni.vnni_linear(x, vnni[i], n),
        "onednn": lambda i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
    }
    diff = (runs["tokenfab"](0).float() - runs["onednn"](0).float()).abs().max().item()
    best = {name: float("inf") for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            fn(0)
            t = time.perf_counter()
            for i in range(count):
                fn(i)
            best[name] = min(best[name], (time.perf_counter() - t) / count)
    return {"n": n, "k": k, "rows": rows, "tokenfab_s": best["tokenfab"], "onednn_s": best["onednn"],
            "max_abs_diff": diff}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,16,256,2048", help="input rows per call, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="passes per backend (best is kept; default 5)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"), help="output folder")
    args = ap.parse_args()
    from tokenfab.kernels.cpu.ops import support as cpu_support
    if not kernels_ready(cpu_support.has_bf16_dot(), "tokenfab's VNNI linear needs"):
        return 2
    threads = torch.get_num_threads()
    bw = copy_bandwidth()
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    try:
        from tqdm import tqdm
    except ImportError:  # progress is optional
        def tqdm(it, **_):
            return it
    for rows in tqdm(rows_list, desc="rows"):
        for n, k in SHAPES:
            results.append(time_pair(n, k, rows, args.reps))
    date = dt.date.today().isoformat()
    meta = run_meta(date, "benchmarks/linear_kernels.py", threads, copy_bandwidth=bw)
    lines = bandwidth_header("tokenfab VNNI linear vs oneDNN packed linear", meta) + [
             "Rows <= 4: GB/s of weight read per call (memory-bound); more rows: GFLOP/s. Ratio = tokenfab time / "
             "oneDNN time (< 1: tokenfab faster).", "",
             "| rows | weight [N, K] | tokenfab µs | oneDNN µs | ratio | tokenfab | oneDNN | max abs diff |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        n, k, rows = r["n"], r["k"], r["rows"]
        if rows <= 4:
            rate = lambda s: f"{n * k * 2 / s / 1e9:.1f} GB/s"  # noqa: E731
        else:
            rate = lambda s: f"{2 * rows * n * k / s / 1e9:.0f} GFLOP/s"  # noqa: E731
        lines.append(f"| {rows} | {n} x {k} | {r['tokenfab_s'] * 1e6:.1f} | {r['onednn_s'] * 1e6:.1f} | "
                     f"{r['tokenfab_s'] / r['onednn_s']:.2f} | {rate(r['tokenfab_s'])} | {rate(r['onednn_s'])} | "
                     f"{r['max_abs_diff']:.3g} |")
    for rows in rows_list:
        sel = [r for r in results if r["rows"] == rows]
        tf, od = sum(r["tokenfab_s"] for r in sel), sum(r["onednn_s"] for r in sel)
        lines.append(f"| {rows} | all {len(sel)} shapes, summed | {tf * 1e6:.1f} | {od * 1e6:.1f} | {tf / od:.2f} | | | |")
    write_results(args.out, f"{date}-linear-kernels", {"meta": meta, "results": results}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
