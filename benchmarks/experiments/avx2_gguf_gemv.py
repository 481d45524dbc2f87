"""The AVX2 kernel of packed GGUF linears (kernels/cpu/csrc/gguf_gemv_avx2.cpp) against ``F.linear`` on the float32
copy of the same weight (what a CPU without AVX512-BF16 ran before: quant/packed_weight.keep_dense_copy): Q4_0 /
Q4_1 / Q8_0 at SmolLM2-135M's shapes (gate|up 1536 x 576, down 576 x 1536, the tied LM head 49152 x 576), K-quants
(random bytes with finite scales; K must be a multiple of 256) at Llama-3.2-1B's MLP shapes (gate 8192 x 2048,
down 2048 x 8192), for decode rows (1, 4, 16:
the GEMV on the packed bytes) and prefill rows (64, 512, 2048: tiles dequantized into a float32 GEMM; the LM head
only up to 512 rows, as prefill computes the last positions' logits). Best of 5 repeats, both alternated in one
process, 2 threads. NOTES 81, 84.

    PYTHONPATH=. python benchmarks/experiments/avx2_gguf_gemv.py [--rows 1,4,16,64,512,2048] [--types Q4_1,Q8_0]
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
    import argparse
    import gguf
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16,64,512,2048", help="comma-separated rows of x")
    ap.add_argument("--types", default="Q4_1,Q8_0",
                    help="comma-separated GGUF types (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)")
    args = ap.parse_args()
    from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf
    from tokenfab.quant.gguf_weight import GGUFWeight
    torch.set_num_threads(2)
    print("| type | weight [n x K] | rows | packed µs | float32 copy µs | copy / packed |")
    print("|---|---|---:|---:|---:|---:|")
    from tokenfab.quant import gguf_kquants
    for name in args.types.split(","):
        kquant = name in gguf_kquants.SUPER_BYTES
        for n, k in ((8192, 2048), (2048, 8192)) if kquant else ((1536, 576), (576, 1536), (49152, 576)):
            rng = np.random.default_rng(0)
            if kquant:  # random bytes, finite fp16 d (and dmin): speed does not depend on the values
                sb = gguf_kquants.SUPER_BYTES[name]
                raw = rng.integers(0, 256, size=(n, k // 256, sb), dtype=np.uint8)
                q6 = name == "Q6_K"  # fp16 d at bytes 208..209; else d, dmin at 0..3
                d = (rng.standard_normal((n, k // 256, 1 if q6 else 2)) * 0.05).astype(np.float16).view(np.uint8)
                raw[..., 208 if q6 else 0:210 if q6 else 4] = d
                raw = raw.reshape(n, -1)
            else:
                w = rng.standard_normal((n, k)).astype(np.float32)
                raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[name])
            dense = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])))
            gw = GGUFWeight.from_rows(torch.from_numpy(raw), name, k)
            for m in (int(r) for r in args.rows.split(",")):
                if n > 16384 and m > 512:
                    continue
                x = torch.randn(m, k)
                reps = max(2, int(2e7 // (m * n * k)))
                a = best_us(lambda: cpu_gguf.gguf_gemv_avx2(x, gw.tiles, gw.block.ggml_type, n, None), reps)
                b = best_us(lambda: torch.nn.functional.linear(x, dense), reps)
                print(f"| {name} | {n} x {k} | {m} | {a:.0f} | {b:.0f} | {b / a:.2f} |", flush=True)


if __name__ == "__main__":
    main()
