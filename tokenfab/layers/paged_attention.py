"""Attention over a paged KV pool, batched: one SDPA call per group (decode group, prefill group) per layer.

The cache of a layer is a tensor [num_blocks, block_size, ...]. New K/V rows are scattered to their slots
(``slot_mapping``); each group then gathers its sequences' blocks through their block tables into a padded
[B, max_blocks * block_size, ...] view and runs scaled-dot-product attention with a causal key mask.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from tokenfab.kernels import dispatch
from tokenfab.layers import flash_prefill, long_context_attention
from tokenfab.layers.attention_metadata import AttentionGroup, AttentionMetadata


def write_cache(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """Scatter ``rows`` [T, ...] into ``cache`` [num_blocks, block_size, ...] at flat slots ``slot_mapping`` [T]."""
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, rows.to(cache.dtype))


def gather_cache(cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """The group's context from ``cache``: [B, max_blocks * block_size, ...] (block-table order = token order).

    ``index_select`` on the flattened block ids (about 3x faster on CPU than advanced indexing with a 2-D index)."""
    bt = group.block_tables
    g = cache.index_select(0, bt.reshape(-1))  # [B * max_blocks, block_size, ...]
    return g.view(bt.shape[0], bt.shape[1] * cache.shape[1], *cache.shape[2:])


def gather_cache_range(cache: torch.Tensor, group: AttentionGroup, k0: int, k1: int) -> torch.Tensor:
    """Context positions [k0, k1) of every sequence of the group from ``cache``: [B, k1 - k0, ...] (``k0`` a
    multiple of the block size; rows past a sequence's context hold whatever its block table points at)."""
    bs = cache.shape[1]
    c0, c1 = k0 // bs, -(-k1 // bs)
    bt = group.block_tables[:, c0:c1]
    g = cache.index_select(0, bt.reshape(-1))
    return g.view(bt.shape[0], bt.shape[1] * bs, *cache.shape[2:])[:, k0 - c0 * bs: k1 - c0 * bs]


def run_groups(meta: AttentionMetadata, q: torch.Tensor, out_dim: int,
               attend: Callable[[AttentionGroup, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Run ``attend(group, q_group)`` for the decode and prefill groups and scatter results to the flat batch.

    Args:
        q: [T, H, Dq] queries of the flat batch.
        out_dim: width Dv of the attention output per head.
        attend: maps (group, q_group [B, H, q_len, Dq]) to an output [B, H, q_len, Dv].

    Returns:
        [T, H, Dv] attention outputs in flat-batch order.
    """
    T, H = q.shape[0], q.shape[1]
    groups = [g for g in (meta.decode, meta.prefill) if g is not None]
    if all(g.flat_range is not None for g in groups):  # contiguous groups: slice, no gather/scatter copies
        outs = []
        for g in groups:
            a, b = g.flat_range
            B, Q = g.token_index.shape
            qg = q[a:b].view(B, Q, H, -1).transpose(1, 2)
            outs.append(attend(g, qg).transpose(1, 2).reshape(B * Q, H, out_dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
    out = q.new_empty(T + 1, H, out_dim)  # row T collects padding writes
    q_pad = torch.cat([q, q.new_zeros(1, *q.shape[1:])], 0)
    for group in groups:
        B, Q = group.token_index.shape
        qg = q_pad[group.token_index].transpose(1, 2)  # [B, H, Q, Dq]
        og = attend(group, qg)  # [B, H, Q, Dv]
        out[group.token_index.reshape(-1)] = og.transpose(1, 2).reshape(B * Q, H, out_dim)
    return out[:T]


def fused_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup,
                 scale: float) -> torch.Tensor | None:
    """Decode attention straight from the paged pool (:func:`tokenfab.kernels.dispatch.paged_decode_attention`:
    the Triton kernel on CUDA/ROCm, the C++ kernel on CPU), or None when no kernel applies (another dtype, kernels
    unavailable, long MLA contexts without AVX512-BF16) and the caller should gather instead.

    q [B, H, D]; k_cache [num_blocks, block_size, Hk, D]; v_cache [num_blocks, block_size, Hk, Dv] (strided views
    allowed). Returns [B, H, Dv] in q's dtype.
    """
    return dispatch.paged_decode_attention(q, k_cache, v_cache, group.block_tables, group.context_lens,
                                           group.max_context, scale)


def causal_mask(group: AttentionGroup) -> torch.Tensor:
    """[B, 1, q_len, L] bool mask, key j visible to a query at position p when j <= p. Padded queries see key 0
    only (their output is discarded), never an all-masked row. Built once per step and cached on the group."""
    m = getattr(group, "_bool_mask", None)
    if m is None:
        keys = torch.arange(group.max_context, device=group.query_pos.device)
        qpos = group.query_pos.clamp(min=0)
        m = (keys.view(1, 1, -1) <= qpos.unsqueeze(-1)).unsqueeze(1)
        group._bool_mask = m
    return m


def additive_mask(group: AttentionGroup, dtype: torch.dtype) -> torch.Tensor:
    """The causal mask as 0 / -inf in ``dtype`` [B, 1, q_len, L] (SDPA's fast CPU kernel wants a float mask)."""
    cache = group.__dict__.setdefault("_float_masks", {})
    if dtype not in cache:
        cache[dtype] = torch.zeros(causal_mask(group).shape, dtype=dtype,
                                   device=group.query_pos.device).masked_fill_(~causal_mask(group), float("-inf"))
    return cache[dtype]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AttentionGroup, scale: float) -> torch.Tensor:
    """Causal attention of a group, choosing the kernel by shape (measured on CPU, benchmarks/NOTES.md).

    Args:
        q: [B, H, Q, D]; k: [B, Hk, L, D]; v: [B, Hk, L, Dv] with H a multiple of Hk (grouped-query / MLA latent)
            and Dv <= D.
    Returns:
        [B, H, Q, Dv] in q's dtype.

    Prefill (Q > 1): on CPU PyTorch's flash kernel (:mod:`tokenfab.layers.flash_prefill`; where it does not apply,
    two GEMMs per causal query block with the fused causal softmax between them); elsewhere, in causal query blocks,
    SDPA with each block's additive mask when Dv == D, and for MLA's expanded prefill (Dv != D) explicit matmuls with a
    float32 softmax (SDPA with zero-padded values was faster but raised the bf16 KL against the fp32 reference 50x
    on the tiny DeepSeek test model, tests/test_bf16.py). Decode (Q = 1; the gathered path, used when
    :func:`fused_decode` does not apply): scores = mask + scale * q k^T in one ``baddbmm`` over a transposed view of
    k (no copy), softmax in float32 as transformers' eager attention does, then one ``bmm`` with v; bf16 at the
    ``avx2`` ISA level (:func:`tokenfab.kernels.dispatch.cpu_bf16_gemm_slow`) runs both GEMMs on float32 copies,
    rounding the scores, weights and output to bf16 where the bf16 path does.
    """
    B, H, Q, D = q.shape
    Hk, L, Dv = k.shape[1], k.shape[2], v.shape[-1]
    if Q > 1:
        if flash_prefill.applies(q, k, v):
            return flash_prefill.flash_prefill_attention(q, k, v, group, scale)
        if dispatch.causal_softmax_applies(q, k, v):
            return _prefill_attention_fused(q, k, v, group, scale)
        return _prefill_attention(q, k, v, group, scale)
    G = H // Hk
    # bf16 GEMMs without bf16 dot products run on float32 copies, each output rounded as the bf16 GEMM's
    cdt = torch.float32 if dispatch.cpu_bf16_gemm_slow(q) else q.dtype
    mask = additive_mask(group, cdt)  # [B, 1, 1, L]
    m = mask.view(B, 1, L) if Hk == 1 else mask.expand(B, Hk, 1, L).reshape(B * Hk, 1, L)
    s = torch.baddbmm(m, q.reshape(B * Hk, G, D).to(cdt), k.reshape(B * Hk, L, D).to(cdt).transpose(1, 2),
                      alpha=scale).to(q.dtype)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype)
    return dispatch.bmm(p, v.reshape(B * Hk, L, Dv)).view(B, H, 1, Dv)


PREFILL_QUERY_BLOCK = 256  # queries per block in prefill attention (tokens)


def _query_blocks(group: AttentionGroup, Q: int):
    """Yield (q0, q1, kend) for query blocks [q0, q1) of PREFILL_QUERY_BLOCK: kend is the number of keys any
    sequence's queries in the block can see (causal), so the block never touches keys past it."""
    key_end = (group.query_pos.max(dim=0).values + 1).tolist()  # per query index: keys any sequence needs
    for q0 in range(0, Q, PREFILL_QUERY_BLOCK):
        q1 = min(Q, q0 + PREFILL_QUERY_BLOCK)
        yield q0, q1, max(1, max(key_end[q0:q1]))


def block_mask(group: AttentionGroup, q0: int, q1: int, kend: int, dtype: torch.dtype) -> torch.Tensor:
    """The causal mask of queries q0..q1-1 over keys 0..kend-1 as 0 / -inf in ``dtype``: [B, 1, q1 - q0, kend]
    (key j visible to a query at position p when j <= p; padded queries see key 0 only). Built per query block,
    so no [q_len, context] mask of the whole chunk ever exists."""
    qpos = group.query_pos[:, q0:q1].clamp(min=0)
    keys = torch.arange(kend, device=qpos.device)
    visible = (keys.view(1, 1, -1) <= qpos.unsqueeze(-1)).unsqueeze(1)
    return torch.zeros(visible.shape, dtype=dtype, device=qpos.device).masked_fill_(~visible, float("-inf"))


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AttentionGroup,
                       scale: float) -> torch.Tensor:
    """Prefill attention in query blocks of PREFILL_QUERY_BLOCK: each block attends only to the keys up to its
    last query's position (causal: the upper triangle is never computed, ~2x fewer FLOPs for a whole prompt) and
    its score matrix and mask (:func:`block_mask`) stay small enough for the cache. SDPA's fused kernel when
    Dv == D; explicit matmuls with a float32 softmax otherwise (MLA's expanded form, where SDPA with padded values
    lost bf16 accuracy).

    q [B, H, Q, D], k [B, Hk, L, D], v [B, Hk, L, Dv] -> [B, H, Q, Dv].
    """
    B, H, Q, D = q.shape
    Hk, Dv = k.shape[1], v.shape[-1]
    if Dv != D and Hk != H:
        k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
    k, v = k.contiguous(), v.contiguous()  # one copy per layer; each block's q k^T then reads k in place (1.6x)
    out = q.new_empty(B, H, Q, Dv)
    for q0, q1, kend in _query_blocks(group, Q):
        qb, kb, vb, mb = q[:, :, q0:q1], k[:, :, :kend], v[:, :, :kend], block_mask(group, q0, q1, kend, q.dtype)
        if Dv == D:
            out[:, :, q0:q1] = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mb, scale=scale,
                                                              enable_gqa=H != Hk)
        else:
            s = torch.matmul(qb, kb.transpose(-1, -2)).float().mul_(scale).add_(mb)
            out[:, :, q0:q1] = torch.matmul(s.softmax(dim=-1).to(v.dtype), vb)
    return out


def _prefill_attention_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AttentionGroup,
                             scale: float) -> torch.Tensor:
    """CPU prefill attention in query blocks with two bf16 GEMMs and the fused causal softmax
    (kernels.dispatch.causal_softmax_) in between: the query heads of each KV head are stacked as rows of one GEMM (no
    repeated K/V), and the float32 conversion, scale, mask and softmax passes of the eager path become one.
    Measured against SDPA's CPU flash kernel with a block mask in benchmarks/NOTES.md.

    q [B, H, Q, D], k [B, Hk, L, D], v [B, Hk, L, Dv] -> [B, H, Q, Dv].
    """
    B, H, Q, D = q.shape
    Hk, Dv = k.shape[1], v.shape[-1]
    G = H // Hk
    k, v = k.contiguous(), v.contiguous()
    out = q.new_empty(B, H, Q, Dv)
    for q0, q1, kend in _query_blocks(group, Q):
        qb = q[:, :, q0:q1].reshape(B, Hk, G * (q1 - q0), D)  # row g * Qb + i: head g of the group, query i
        s = torch.matmul(qb, k[:, :, :kend].transpose(-1, -2))  # [B, Hk, G * Qb, kend]
        dispatch.causal_softmax_(s, group.query_pos[:, q0:q1], q1 - q0, scale)
        out[:, :, q0:q1] = torch.matmul(s, v[:, :, :kend]).view(B, H, q1 - q0, Dv)
    return out


def paged_mha(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float, kv_written: bool = False) -> torch.Tensor:
    """Multi-head / grouped-query attention with a paged cache.

    Args:
        q: [T, H, D]; k, v: [T, Hkv, D] for this step's tokens (k already rotated).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        scale: softmax scale (head_dim^-0.5).
        kv_written: k and v are already in the caches at ``meta.slot_mapping`` (the fused RoPE + cache write,
            kernels.dispatch.qk_rope_cache); else they are written here.

    Returns:
        [T, H, D] in q's dtype.
    """
    if not kv_written:
        write_cache(k_cache, meta.slot_mapping, k)
        write_cache(v_cache, meta.slot_mapping, v)

    def attend(group: AttentionGroup, qg: torch.Tensor) -> torch.Tensor:
        if group.q_len == 1:
            o = fused_decode(qg[:, :, 0], k_cache, v_cache, group, scale)
            if o is not None:
                return o.unsqueeze(2)
        if long_context_attention.applies(group):  # key block by key block, memory bounded at any length
            def key_block(k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
                return (gather_cache_range(k_cache, group, k0, k1).transpose(1, 2).to(qg.dtype),
                        gather_cache_range(v_cache, group, k0, k1).transpose(1, 2).to(qg.dtype))
            return long_context_attention.blocked_prefill_attention(qg, group, key_block, scale, v.shape[-1])
        kg = gather_cache(k_cache, group).transpose(1, 2).to(qg.dtype)  # [B, Hkv, L, D]
        vg = gather_cache(v_cache, group).transpose(1, 2).to(qg.dtype)
        return attention(qg, kg, vg, group, scale)

    return run_groups(meta, q, v.shape[-1], attend)
