"""The AVX2 kernel of INT4 group-32 / MXFP4 routed-expert stacks (kernels/cpu/csrc/packed_experts_avx2.cpp) against
the PyTorch reference path it replaces on CPUs without AVX512-BF16 (PackedExperts.reference_grouped_linear: 1,024
dequantized rows at a time, float32 F.linear), at DeepSeek-V3 / Kimi K2 expert shapes (gate|up 4096 x 7168, down
7168 x 2048), 8 experts: one token routed to all 8 (decode, batch 1), 16 tokens spread 2 per expert (decode batch),
512 tokens spread 64 per expert (prefill). Random packed bytes (speed does not depend on the values), float32 x,
2 threads, best of 3 repeats, both paths alternated in one process. Also the kernel's rate over the packed bytes it
streams (GB/s). NOTES 84.

    PYTHONPATH=. python benchmarks/experiments/avx2_packed_experts.py
"""
from __future__ import annotations

import time

import torch


def best_s(f, reps: int = 3) -> float:
    f()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    from tokenfab.kernels.cpu import ops
    from tokenfab.quant.int4_group import Int4GroupExperts
    from tokenfab.quant.mxfp4_experts import Mxfp4Experts
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    E = 8
    print("| format | weight [n x K] | tokens (per expert) | AVX2 kernel ms | reference ms | reference / kernel | "
          "kernel GB/s of packed bytes |")
    print("|---|---|---|---:|---:|---:|---:|")
    for fmt in ("int4", "mxfp4"):
        for n, k in ((4096, 7168), (7168, 2048)):
            st = Int4GroupExperts(E, n, k) if fmt == "int4" else Mxfp4Experts(E, n, k)
            st.packed.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, st.packed.shape, generator=g, dtype=torch.int64)
                            .to(st.packed.dtype) if fmt == "int4" else
                            torch.randint(0, 256, st.packed.shape, generator=g, dtype=torch.int64).to(torch.uint8))
            if fmt == "int4":
                st.scale.copy_((torch.rand(st.scale.shape, generator=g) * 0.02 + 1e-3).bfloat16())
            else:
                st.scale.copy_(torch.randint(118, 124, st.scale.shape, generator=g, dtype=torch.int64).to(torch.uint8))
            st.prepare()
            assert st._avx2, "the AVX2 expert kernel does not run here (needs a CPU without AVX512-BF16)"
            for per in (1, 2, 64):
                counts = [per] * E
                x = torch.randn(sum(counts), k, generator=g)
                experts = list(range(E))
                a = best_s(lambda: st.grouped_linear(x, experts, counts))
                b = best_s(lambda: st.reference_grouped_linear(x, experts, counts))
                gbs = st.nbytes / a / 1e9
                print(f"| {fmt} | {n} x {k} | {per * E} ({per}) | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} | "
                      f"{gbs:.1f} |", flush=True)
            del st
    print(f"kernels: {'avx2' if ops.packed_experts_avx2_applies() else '?'}")


if __name__ == "__main__":
    main()
