"""bf16 paged decode attention reading K/V from DRAM: SmolLM2-135M's shapes (9 query / 3 KV heads of 64, block 16),
16 sequences whose blocks lie shuffled in a large pool in 2 MiB pages (as the engine's), µs per call and GB/s of
K/V bytes read. bf16 q over a bf16 pool runs the AVX512-BF16 kernel; float32 q the float32-tile one.

    PYTHONPATH=<checkout> python benchmarks/experiments/decode_attention_dram.py [--threads 1] [--pool-blocks 40000]
        [--q-dtype bfloat16|float32] [--pool-dtype bfloat16|float32]

Each timed pass runs 8 batches with distinct blocks (8 x 16 sequences), so a pass reads more than the L3 cache
holds whenever the pool does; ``--pool-blocks 1024`` (12 MB of K/V) measures the cache-resident case instead
(batches drawn with repeats). Best of 6 passes. Run it from two checkouts to compare kernels.
"""
from __future__ import annotations

import argparse
import time

import torch

H, HK, D, BS = 9, 3, 64, 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pool-blocks", type=int, default=40000, help="blocks of the K and of the V pool (6 KB each)")
    ap.add_argument("--contexts", default="512,1024", help="tokens per sequence, comma-separated")
    ap.add_argument("--q-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="float32: the float32-tile kernel (paged_attention.cpp) over the pool")
    ap.add_argument("--pool-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tokenfab.engine.hugepages import move_to_hugepages
    from tokenfab.kernels.cpu.ops import attention as cpu_attention
    nb, g = args.pool_blocks, torch.Generator().manual_seed(0)
    pools = [torch.randn(nb, BS, HK, D, generator=g).to(getattr(torch, args.pool_dtype)) for _ in range(2)]
    huge = move_to_hugepages(pools) > 0
    k, v = pools
    cells = []
    for L in (int(c) for c in args.contexts.split(",")):
        B, nbl = 16, L // BS
        perm = torch.randperm(nb, generator=g)
        tables = ([perm[i * B * nbl:(i + 1) * B * nbl].view(B, nbl).contiguous() for i in range(8)]
                  if nb >= 8 * B * nbl else [torch.randint(nb, (B, nbl), generator=g) for _ in range(8)])
        cl, q = torch.full((B,), L), torch.randn(B, H, D, generator=g).to(getattr(torch, args.q_dtype))
        cpu_attention.paged_decode_attention(q, k, v, tables[0], cl, D ** -0.5)
        best = float("inf")
        for _ in range(6):
            t = time.perf_counter()
            for bt in tables:
                cpu_attention.paged_decode_attention(q, k, v, bt, cl, D ** -0.5)
            best = min(best, (time.perf_counter() - t) / len(tables))
        nbytes = B * L * HK * D * 2 * k.element_size()
        cells.append(f"16 x {L}: {best * 1e6:.0f} µs, {nbytes / best / 1e9:.1f} GB/s")
    print(f"q {args.q_dtype}, pool {args.pool_dtype} x {nb} blocks, threads {args.threads}, 2 MiB pages {huge}: "
          + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
