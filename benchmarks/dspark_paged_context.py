"""The DSpark drafter's pass with its keys read in place (paged form) against the gathered dense form it replaced.

Until this change the proposer gathered every drafting sequence's context rows out of each MLA draft layer's paged
cache into a padded [B, L, C + R] copy, widened it to float32 and attended with explicit einsums over
[B, H, N, L] float32 scores. Now each layer reads the rows in place through the block tables (the block's own N
rows written into spare tail blocks; N x H query heads per decode row) with the target's paged decode kernel
(models/dspark_drafter.PagedDraftContext). Both forms run here on the same drafter, pool and tables, alternated,
on this CPU (bf16: the C++ decode kernel; the GPU runs the Triton one).

Per (batch, context) cell: ms per drafter pass (``DSparkDrafter.block`` plus, for the dense form, the gather the
proposer did; for the paged form, the proposer's table builder), best of ``--reps`` alternated repetitions, and
bytes allocated per pass (PyTorch profiler, ``profile_memory``: every tensor the pass allocates, summed).

Drafter: one MLA draft layer at K3's attention width (kv_lora 512, rope 64, nope / v 128) with ``--heads`` heads
(K3's drafter: 96; default 16 for this 2-core CPU), hidden 1024, block size 8, random weights.

Usage: ``python benchmarks/dspark_paged_context.py [--batches 1 8] [--contexts 512 2048 8192] [--reps 5]``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_file import write_results  # noqa: E402


def make_drafter(heads: int, dtype: torch.dtype):
    from tokenfab.loader.dummy_weights import fill_dummy_weights
    from tokenfab.models.dspark_drafter import DSparkDrafter, set_param_dtypes
    from tokenfab.spec_decode.dspark_config import parse_dspark_config
    from tokenfab.testing.tiny_dspark import dspark_config
    mla = dict(num_attention_heads=heads, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128)
    cfg = parse_dspark_config(dspark_config("speculators", ["mla"], hidden=1024, target_hidden=1024, vocab=4096,
                                            target_layer_ids=[0, 1], target_num_layers=2, block_size=8,
                                            mask_token_id=3, intermediate=2048, markov_rank=0, confidence=False,
                                            mla=mla))
    emb = torch.nn.Embedding(cfg.vocab_size, 1024).to(dtype)
    dr = DSparkDrafter(cfg, emb, lambda h: h)
    fill_dummy_weights(dr, torch.device("cpu"), seed=0)
    set_param_dtypes(dr, dtype)
    return dr


def dense_pass(dr, caches, bt, rows, start, anchor):
    """What the proposer did before: gather [B, L, C + R] per MLA layer through the block table, then the dense
    block form."""
    B, bs = len(rows), caches[0].shape[1]
    L = int(start.max())
    pos = np.minimum(np.arange(L)[None, :], np.maximum(start[:, None] - 1, 0))
    slots = torch.from_numpy(bt[np.repeat(rows, L).reshape(B, L), pos // bs] * bs + pos % bs)
    ctx = [c.view(-1, c.shape[-1])[slots.reshape(-1)].view(B, L, -1) for c in caches]
    valid = torch.from_numpy(np.arange(L)[None, :] < start[:, None])
    return dr.block(torch.from_numpy(anchor), torch.from_numpy(start), ctx, valid)


def paged_pass(dr, caches, fake, rows, start, anchor):
    from tokenfab.spec_decode.dspark_proposer import DSparkProposer
    paged, a, s = DSparkProposer._paged_context(fake, rows, start, anchor)
    return dr.block(a, s, caches, None, paged)


def allocated_bytes(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return int(sum(max(e.cpu_memory_usage, 0) for e in prof.events() if e.cpu_memory_usage))


def cell(dr, B: int, L: int, reps: int, dtype: torch.dtype) -> dict:
    bs, N = 16, dr.cfg.block_size
    nt = -(-(bs - 1 + N) // bs)
    per_seq = -(-(L + N) // bs) + 1
    num_blocks = B * per_seq
    g = torch.Generator().manual_seed(B * 7 + L)
    perm = torch.randperm(num_blocks, generator=g).numpy()
    bt = perm.reshape(B, per_seq).astype(np.int64)
    width = dr.cfg.kv_lora_rank + dr.cfg.qk_rope_head_dim
    caches = [(torch.randn(num_blocks + B * nt, bs, width, generator=g) * 0.5).to(dtype) for _ in dr.mla_layers]
    rows = np.arange(B, dtype=np.int64)
    start = np.full(B, L, dtype=np.int64) - np.arange(B) % 3  # contexts L, L - 1, L - 2 (off the block grid)
    anchor = np.arange(B, dtype=np.int64) + 5
    fake = SimpleNamespace(bm=SimpleNamespace(block_size=bs, block_tables=bt, num_blocks=num_blocks), cfg=dr.cfg,
                           num_tail=nt, device=torch.device("cpu"))
    runs = {"dense": lambda: dense_pass(dr, caches, bt, rows, start, anchor),
            "paged": lambda: paged_pass(dr, caches, fake, rows, start, anchor)}
    with torch.inference_mode():
        d, p = runs["dense"]().float(), runs["paged"]().float()
        err = float((d - p).abs().max() / d.abs().max().clamp(min=1e-6))
        times = {k: [] for k in runs}
        for _ in range(reps):
            for k, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        mem = {k: allocated_bytes(fn) for k, fn in runs.items()}
    best = {k: min(v) * 1e3 for k, v in times.items()}
    return {"batch": B, "context": L, "dense_ms": best["dense"], "paged_ms": best["paged"],
            "speedup": best["dense"] / best["paged"], "dense_alloc_mb": mem["dense"] / 2 ** 20,
            "paged_alloc_mb": mem["paged"] / 2 ** 20, "max_rel_diff": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    dr = make_drafter(a.heads, dtype)
    rows = []
    from tqdm import tqdm
    for B in a.batches:
        for L in tqdm(a.contexts, desc=f"batch {B}"):
            rows.append(cell(dr, B, L, a.reps, dtype))
    cmd = "python benchmarks/dspark_paged_context.py " + " ".join(sys.argv[1:])
    from tokenfab.kernels import dispatch
    from tokenfab.kernels.cpu import isa as cpu_isa
    q = torch.zeros(1, 8 * a.heads, 576, dtype=dtype)
    lat = torch.zeros(2, 16, 1, 576, dtype=dtype)
    kernel = dispatch.paged_decode_attention(q, lat, lat[..., :512], torch.zeros(1, 1, dtype=torch.int64),
                                             torch.ones(1, dtype=torch.int64), 16, 1.0) is not None
    path = ("the C++ paged decode kernel" if kernel else "the gathered fallback (kernels/dispatch.py: no kernel for "
            "this dtype at this ISA level)")
    lines = ["# DSpark drafter pass: keys read in place (paged) vs gathered dense form", "",
             f"Command: `{cmd}` ({a.dtype}, CPU at ISA level {cpu_isa.selected_level()}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads; machine shared with other jobs: read the ratios, measured "
             f"alternated in one run). The paged form's attention ran {path}.", "",
             f"Drafter: 1 MLA draft layer, {a.heads} heads, kv_lora 512 + rope 64, hidden 1024, block size 8; "
             "page size 16; contexts L, L - 1, L - 2 across the batch. ms: best of "
             f"{a.reps} alternated passes. MB allocated: every tensor the pass allocates (PyTorch profiler). "
             "max rel diff: max |dense - paged| / max |dense| of the block's hidden states.", "",
             "| batch | context | dense ms | paged ms | dense / paged | dense MB allocated | paged MB allocated | "
             "max rel diff |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['dense_ms']:.2f} | {r['paged_ms']:.2f} | "
                     f"{r['speedup']:.2f}x | {r['dense_alloc_mb']:.1f} | {r['paged_alloc_mb']:.1f} | "
                     f"{r['max_rel_diff']:.1e} |")
    write_results(a.out, "2026-12-06-dspark-paged-context", {"command": cmd, "rows": rows}, lines)


if __name__ == "__main__":
    main()
