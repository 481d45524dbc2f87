"""Paged decode attention on CPU at SmolLM2-135M's shapes (9 query / 3 KV heads of 64, block 16, shuffled blocks),
float32 q over a float32, bf16 or fp16 pool: µs per call and GB/s of K/V bytes read, with the largest error against
a float32 computation on the pool's values.

    PYTHONPATH=. python benchmarks/experiments/decode_attention_pools.py [--pools float32,bfloat16,float16]

Run it from two checkouts (PYTHONPATH=<checkout>) to compare kernels; a kernel that refuses a pool dtype prints
"refused". Timing: best of 5 rounds of repeated calls after a warm-up call.
"""
from __future__ import annotations

import argparse
import time

import torch

from tokenfab.kernels.cpu.ops import attention as cpu_attention

H, HK, D, BS = 9, 3, 64, 16


def run_case(B: int, L: int, pool: torch.dtype) -> str:
    """One shape and pool dtype: 'µs, GB/s, err' or 'refused'."""
    g = torch.Generator().manual_seed(0)
    nb = B * L // BS
    k = torch.randn(nb, BS, HK, D, generator=g).to(pool)
    v = torch.randn(nb, BS, HK, D, generator=g).to(pool)
    bt = torch.randperm(nb, generator=g).view(B, L // BS)
    cl = torch.full((B,), L)
    q = torch.randn(B, H, D, generator=g)
    try:
        out = cpu_attention.paged_decode_attention(q, k, v, bt, cl, D ** -0.5)
    except RuntimeError:
        return "refused"
    reps = max(3, int(2e5 / (B * L)))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            cpu_attention.paged_decode_attention(q, k, v, bt, cl, D ** -0.5)
        best = min(best, (time.perf_counter() - t0) / reps)
    kf = k.float()[bt.flatten()].view(B, L, HK, D).repeat_interleave(H // HK, 2)
    vf = v.float()[bt.flatten()].view(B, L, HK, D).repeat_interleave(H // HK, 2)
    p = torch.softmax(torch.einsum("bhd,blhd->bhl", q, kf) * D ** -0.5, -1)
    err = (out - torch.einsum("bhl,blhd->bhd", p, vf)).abs().max().item()
    nbytes = 2 * B * L * HK * D * k.element_size()
    return f"{best * 1e6:,.1f} µs, {nbytes / best / 1e9:.1f} GB/s, err {err:.0e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pools", default="float32,bfloat16,float16")
    args = ap.parse_args()
    pools = [getattr(torch, n) for n in args.pools.split(",")]
    print(f"{torch.get_num_threads()} threads")
    print("| B | context | " + " | ".join(f"{str(p)[6:]} pool" for p in pools) + " |")
    print("|---:|---:|" + "---|" * len(pools))
    for B, L in [(1, 256), (1, 1024), (4, 1024), (16, 1024), (4, 8192)]:
        print(f"| {B} | {L} | " + " | ".join(run_case(B, L, p) for p in pools) + " |", flush=True)


if __name__ == "__main__":
    main()
