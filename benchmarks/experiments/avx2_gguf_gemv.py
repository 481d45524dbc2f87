"""The AVX2 kernel of packed Q4_1 / Q8_0 linears (kernels/cpu/csrc/gguf_gemv_avx2.cpp) against ``F.linear`` on the
float32 copy of the same weight (what a CPU without AVX512-BF16 ran before: quant/packed_weight.keep_dense_copy), at
SmolLM2-135M's shapes (gate|up 1536 x 576, down 576 x 1536, the tied LM head 49152 x 576), for decode rows (1, 4, 16:
the GEMV on the packed bytes) and prefill rows (64, 512: tiles dequantized into a float32 GEMM). Best of 5 repeats,
both alternated in one process, 2 threads. NOTES 81.

    PYTHONPATH=. python benchmarks/experiments/avx2_gguf_gemv.py
"""
from __future__ import annotations

import time

import numpy as np
import torch


def best_us(f, reps: int) -> float:
    f()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def main() -> None:
    import gguf
    from tokenfab.kernels.cpu import ops
    from tokenfab.quant.gguf_weight import GGUFWeight
    torch.set_num_threads(2)
    print("| type | weight [n x K] | rows | packed µs | float32 copy µs | copy / packed |")
    print("|---|---|---:|---:|---:|---:|")
    for name in ("Q4_1", "Q8_0"):
        for n, k in ((1536, 576), (576, 1536), (49152, 576)):
            w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
            raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[name])
            dense = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])))
            gw = GGUFWeight.from_rows(torch.from_numpy(raw), name, k)
            for m in (1, 4, 16, 64, 512):
                x = torch.randn(m, k)
                reps = max(2, int(2e7 // (m * n * k)))
                a = best_us(lambda: ops.gguf_gemv_avx2(x, gw.tiles, gw.block.ggml_type, n, None), reps)
                b = best_us(lambda: torch.nn.functional.linear(x, dense), reps)
                print(f"| {name} | {n} x {k} | {m} | {a:.0f} | {b:.0f} | {b / a:.2f} |", flush=True)


if __name__ == "__main__":
    main()
