"""The AVX2 kernels of INT4 group-32 / MXFP4 routed-expert stacks (kernels/cpu/csrc/packed_experts_avx2.cpp) and FP8
block-scaled ones (fp8_linear_avx2.cpp, fp8_experts_avx2) against
the PyTorch reference path it replaces on CPUs without AVX512-BF16 (PackedExperts.reference_grouped_linear: 1,024
dequantized rows at a time, float32 F.linear), at DeepSeek-V3 / Kimi K2 expert shapes (gate|up 4096 x 7168, down
7168 x 2048), 8 experts: one token routed to all 8 (decode, batch 1), 16 tokens spread 2 per expert (decode batch),
512 tokens spread 64 per expert (prefill). Random packed bytes (speed does not depend on the values), float32 x,
2 threads, best of 3 repeats, both paths alternated in one process. Also the kernel's rate over the packed bytes it
streams (GB/s). NOTES 84 (INT4, MXFP4), 85 (FP8).

    PYTHONPATH=. python benchmarks/experiments/avx2_packed_experts.py [--formats int4,mxfp4,fp8] [--per 1,2,64]
        [--no-reference]

``--no-reference`` times the kernel alone (A/B runs of two kernel builds, alternated through TOKENFAB_KERNEL_CACHE).
"""
from __future__ import annotations

import argparse
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


def random_stack(fmt: str, E: int, n: int, k: int, g: torch.Generator):
    """An E-expert stack [n x k] of ``fmt`` with random packed bytes and scales of sensible size (finite values)."""
    from tokenfab.quant.fp8_block_experts import Fp8BlockExperts
    from tokenfab.quant.int4_group import Int4GroupExperts
    from tokenfab.quant.mxfp4_experts import Mxfp4Experts
    if fmt == "fp8":  # gate|up: two parts of n / 2 rows; down (n = 7168): one part
        st = Fp8BlockExperts(E, n, k, n // 2 if n == 4096 else n)
        st.packed.copy_(torch.randint(0, 127, st.packed.shape, generator=g, dtype=torch.int64).to(torch.uint8))
        st.scale.copy_(torch.rand(st.scale.shape, generator=g) * 1e-3 + 1e-4)
    elif fmt == "int4":
        st = Int4GroupExperts(E, n, k)
        st.packed.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, st.packed.shape, generator=g, dtype=torch.int64)
                        .to(st.packed.dtype))
        st.scale.copy_((torch.rand(st.scale.shape, generator=g) * 0.02 + 1e-3).bfloat16())
    else:
        st = Mxfp4Experts(E, n, k)
        st.packed.copy_(torch.randint(0, 256, st.packed.shape, generator=g, dtype=torch.int64).to(torch.uint8))
        st.scale.copy_(torch.randint(118, 124, st.scale.shape, generator=g, dtype=torch.int64).to(torch.uint8))
    return st


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="int4,mxfp4,fp8", help="comma-separated: int4, mxfp4, fp8")
    ap.add_argument("--per", default="1,2,64", help="comma-separated tokens per expert")
    ap.add_argument("--no-reference", action="store_true", help="time the kernel alone")
    args = ap.parse_args()
    from tokenfab.kernels.cpu.ops import fp8_linear as cpu_fp8
    from tokenfab.kernels.cpu.ops import packed_experts as cpu_packed_experts
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    E = 8
    print("| format | weight [n x K] | tokens (per expert) | AVX2 kernel ms | reference ms | reference / kernel | "
          "kernel GB/s of packed bytes |")
    print("|---|---|---|---:|---:|---:|---:|")
    for fmt in args.formats.split(","):
        for n, k in ((4096, 7168), (7168, 2048)):
            st = random_stack(fmt, E, n, k, g)
            st.prepare()
            assert st._avx2, "the AVX2 expert kernel does not run here (needs a CPU without AVX512-BF16)"
            for per in (int(v) for v in args.per.split(",")):
                counts = [per] * E
                x = torch.randn(sum(counts), k, generator=g)
                experts = list(range(E))
                a = best_s(lambda: st.grouped_linear(x, experts, counts))
                b = (float("nan") if args.no_reference else
                     best_s(lambda: st.reference_grouped_linear(x, experts, counts)))
                gbs = st.nbytes / a / 1e9
                print(f"| {fmt} | {n} x {k} | {per * E} ({per}) | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} | "
                      f"{gbs:.1f} |", flush=True)
            del st
    print(f"kernels: {'avx2' if cpu_packed_experts.packed_experts_avx2_applies() and cpu_fp8.fp8_block_linear_avx2_applies() else '?'}")


if __name__ == "__main__":
    main()
