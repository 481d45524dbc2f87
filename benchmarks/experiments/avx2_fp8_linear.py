"""The AVX2 kernel of FP8 block-scaled linears (kernels/cpu/csrc/fp8_linear_avx2.cpp) against ``F.linear`` on the
float32 copy a CPU without AVX512-BF16 kept before (quant/packed_weight.keep_dense_copy, within its 4 GiB budget;
past it, weights were dequantized per call), at DeepSeek-V3 shapes (a dense MLP's gate 18432 x 7168 cut to 4096
rows, its down 7168 x 4096 cut likewise, and q_b 24576 x 1536 cut to 8192 rows), for decode rows (1, 4, 16: the GEMV
on the e4m3 bytes) and prefill rows (64, 512: converted 64-row panels and PyTorch's float32 GEMM). Random e4m3 codes
(no NaN), float32 x, 2 threads, best of 5, both alternated in one process. NOTES 84.

    PYTHONPATH=. python benchmarks/experiments/avx2_fp8_linear.py
"""
from __future__ import annotations

import torch

from avx2_gguf_gemv import best_us  # this folder is on sys.path when the script runs


def main() -> None:
    from tokenfab.kernels.cpu.ops import fp8_linear as cpu_fp8
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    print("| weight [n x K] | rows | FP8 kernel µs | float32 copy µs | copy / kernel | kernel GB/s of FP8 bytes |")
    print("|---|---:|---:|---:|---:|---:|")
    for n, k in ((4096, 7168), (7168, 4096), (8192, 1536)):
        q = codes[torch.randint(len(codes), (n, k), generator=g)].view(torch.float8_e4m3fn)
        s = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.01 + 1e-4
        dense = q.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        for m in (1, 4, 16, 64, 512):
            x = torch.randn(m, k, generator=g)
            reps = max(2, int(3e8 // (m * n * k)))
            a = best_us(lambda: cpu_fp8.fp8_block_linear_avx2(x, q, s), reps)
            b = best_us(lambda: torch.nn.functional.linear(x, dense), reps)
            print(f"| {n} x {k} | {m} | {a:.0f} | {b:.0f} | {b / a:.2f} | {n * k / a / 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
