"""Packed GGUF linears (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K; kernels/cpu/csrc/gguf_linear.cpp) against tokenfab's bf16
VNNI linear (kernels/cpu/csrc/vnni_linear.cpp) at the same shapes, side by side.

    .venv/bin/python benchmarks/gguf_linear.py [--rows 1,4,64,512] [--reps 5] [--mb 128]
    .venv/bin/python benchmarks/gguf_linear.py --formats bf16,Q4_1,Q4_K,Q6_K --shapes kquant --rows 1,8 \
        --name gguf-kquants
    .venv/bin/python benchmarks/gguf_linear.py --formats bf16,Q4_1,Q4_1+i8,Q8_0,Q8_0+i8 --rows 8,16 \
        --name gguf-int8-activations

``--shapes kquant``: K a multiple of 256 (the K-quants' super-block): SmolLM2-like [960, 512], [3072, 512],
[576, 1536] (SmolLM2-135M's own K = 576 is not; llama.cpp stores such tensors in other types) and the 4096-wide
model's [4096, 4096], [11008, 4096].

Every format gets enough distinct weights of each shape (``--mb`` MB of its own bytes) that a pass streams them
from memory, as a decode step streams its layers; the formats run the same input, alternated pass by pass, best
pass of ``--reps``. Rows <= 4 (the GEMV) are memory-bound: GB/s of weight bytes read per call (the packed bytes
for GGUF, 2 bytes per weight for bf16) and the time relative to bf16 (the packed formats read 1.06 / 0.56 / 0.63 of
a byte per weight, so at equal GB/s Q4_1 takes 0.31x bf16's time). More rows (the prefill GEMM): GFLOP/s.
Writes <out>/<date>-gguf-linear.{json,md} (default benchmarks/results).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.decode_floor import copy_bandwidth  # noqa: E402
from benchmarks.linear_bench import bandwidth_header, kernels_ready, run_meta, time_rate_cells  # noqa: E402
from benchmarks.results_file import write_results  # noqa: E402

# [N, K]: SmolLM2-135M's fused q|k|v, o_proj, gate|up, down; a 4096-wide model's square and MLP-up projections
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 4096), (11008, 4096)]
KQUANT_SHAPES = [(960, 512), (3072, 512), (576, 1536), (4096, 4096), (11008, 4096)]
FORMATS = ("bf16", "Q8_0", "Q4_0", "Q4_1")
INT8_SUFFIX = "+i8"  # e.g. Q4_1+i8: the same format with int8 activations on (TOKENFAB_GGUF_INT8_ACT; 5-16 rows)


def random_rows(name: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """GGUF rows of random quants with small finite fp16 scales (what the kernel reads; values do not matter)."""
    from tokenfab.quant.gguf_blocks import BLOCK_TYPES
    bt = BLOCK_TYPES[name]
    kb = k // bt.block_size
    raw = rng.integers(0, 256, size=(n, kb, bt.block_bytes), dtype=np.uint8)
    ns = 2 if bt.has_min else 1
    off = 208 if name == "Q6_K" else 0  # Q6_K's fp16 d is its last field
    raw[..., off:off + 2 * ns] = (rng.standard_normal((n, kb, ns)) * 0.01).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def time_shape(n: int, k: int, rows: int, reps: int, mb: float, formats=FORMATS) -> dict:
    """Best seconds per call of every format for weight [n, k] and ``rows`` input rows, and bytes per weight."""
    from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf
    from tokenfab.kernels.cpu.ops import vnni_linear as cpu_vnni
    from tokenfab.quant.gguf_weight import GGUFWeight
    rng = np.random.default_rng(0)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    runs, nbytes = {}, {}
    for fmt in formats:
        if fmt == "bf16":
            count = max(2, int(mb * 1e6 // (n * k * 2))) if rows <= 4 else 2
            ws = [cpu_vnni.pack_linear_weight(torch.randn(n, k, dtype=torch.bfloat16)) for _ in range(count)]
            runs[fmt] = (lambda ws: lambda i: cpu_vnni.vnni_linear(x, ws[i], n))(ws)
            nbytes[fmt] = n * k * 2
        else:
            qt = fmt.removesuffix(INT8_SUFFIX)
            one = GGUFWeight.from_rows(random_rows(qt, n, k, rng), qt, k)
            count = max(2, int(mb * 1e6 // one.nbytes)) if rows <= 4 else 2
            ws = [one] + [GGUFWeight.from_rows(random_rows(qt, n, k, rng), qt, k) for _ in range(count - 1)]
            for w in ws:
                w.prepare()
            runs[fmt] = (lambda ws: lambda i: ws[i].linear(x, None))(ws)
            nbytes[fmt] = one.nbytes
        runs[fmt] = (runs[fmt], count)
    best = {f: float("inf") for f in formats}
    int8_before = cpu_gguf.gguf_int8_activations()
    for _ in range(reps):
        for f, (fn, count) in runs.items():
            cpu_gguf.gguf_int8_activations(f.endswith(INT8_SUFFIX))
            fn(0)
            t = time.perf_counter()
            for i in range(count):
                fn(i)
            best[f] = min(best[f], (time.perf_counter() - t) / count)
    cpu_gguf.gguf_int8_activations(int8_before)
    return {"n": n, "k": k, "rows": rows, "seconds": best, "bytes": nbytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,64,512", help="input rows per call, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="passes per format (best is kept; default 5)")
    ap.add_argument("--mb", type=float, default=128, help="MB of distinct weights per format and shape (GEMV)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"), help="output folder")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help="bf16 first, then GGUF block types; a type with '+i8' (Q4_0 / Q4_1 / Q8_0) runs with int8 "
                         "activations on, the plain type with them off")
    ap.add_argument("--shapes", default="default", choices=["default", "kquant"], help="weight shapes (see above)")
    ap.add_argument("--name", default="gguf-linear", help="result file stem after the date")
    args = ap.parse_args()
    formats = tuple(args.formats.split(","))
    if formats[0] != "bf16":
        ap.error("--formats must start with bf16 (the ratios' base)")
    shapes = KQUANT_SHAPES if args.shapes == "kquant" else SHAPES
    from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf
    from tokenfab.kernels.cpu.ops import support as cpu_support
    if not kernels_ready(cpu_support.has_bf16_dot() and cpu_gguf.gguf_linear_applies(),
                         "the packed GGUF and VNNI linears need"):
        return 2
    threads = torch.get_num_threads()
    bw = copy_bandwidth()
    rows_list = [int(r) for r in args.rows.split(",")]
    results = [time_shape(n, k, rows, args.reps, args.mb, formats) for rows in rows_list for n, k in shapes]
    date = dt.date.today().isoformat()
    meta = run_meta(date, "benchmarks/gguf_linear.py", threads, copy_bandwidth=bw)
    lines = bandwidth_header("Packed GGUF linears vs the bf16 VNNI linear", meta) + [
             "Rows <= 4: GB/s of weight bytes read per call (packed bytes for GGUF) and the time relative to bf16 "
             "(×bf16 < 1: faster). More rows: GFLOP/s and ×bf16 time.", ""]
    head = "| rows | weight [N, K] | " + " | ".join(f"{f} µs | {f}" for f in formats) + " | " + " | ".join(
        f"{f} ×bf16" for f in formats[1:]) + " |"
    lines += [head, "|" + "---:|" * (2 + 2 * len(formats) + len(formats) - 1)]
    for r in results:
        n, k, rows, s = r["n"], r["k"], r["rows"], r["seconds"]
        cells = time_rate_cells(r, formats, 4)
        ratios = [f"{s[f] / s['bf16']:.2f}" for f in formats[1:]]
        lines.append(f"| {rows} | {n} x {k} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    write_results(args.out, f"{date}-{args.name}", {"meta": meta, "results": results}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
