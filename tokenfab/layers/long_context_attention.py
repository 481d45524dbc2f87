"""Prefill attention over long contexts, key block by key block: activation memory bounded at any context length.

The short-context prefill paths (:mod:`tokenfab.layers.paged_attention`) gather a group's whole context and score
each query block against every key it can see: a [B, H, 256, L] score block and a gathered (for MLA, expanded)
copy of the context, both growing with the context length L. Past :data:`LONG_CONTEXT_TOKENS` keys a prefill group
runs here instead:

* the context is read from the paged pool in key blocks of :data:`KEY_BLOCK` tokens (``key_block(k0, k1)``: the
  caller gathers, and for MLA expands, only those rows);
* each key block is attended by the queries that see it, as one flash-attention call (PyTorch's CPU flash kernel,
  ``aten::_scaled_dot_product_flash_attention_for_cpu``, which tiles internally and returns the log-sum-exp; the
  plain-PyTorch :func:`block_attention_reference` elsewhere): with no mask for queries that see the whole block,
  with a [B, 1, <= PARTIAL_QUERY_BLOCK, KEY_BLOCK] mask for the few on its causal diagonal;
* the per-block results are merged by their log-sum-exp (as FlashAttention's split-KV / vLLM's
  ``merge_attn_states``): o = sum_b exp(lse_b - lse) o_b with lse = log sum_b exp(lse_b).

Memory besides the KV pool: the float32 output accumulator [B, H, Q, Dv] and log-sum-exp [B, H, Q] of the chunk
(Q <= max_num_batched_tokens), one key block and one partial mask, whatever L is. No score matrix over the context
exists at any time.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from tokenfab.layers.attention_metadata import AttentionGroup

LONG_CONTEXT_TOKENS = 8192  # prefill groups with more context tokens than this take the key-block path
KEY_BLOCK = 4096  # keys per block (tokens; a multiple of the KV block size)
PARTIAL_QUERY_BLOCK = 1024  # queries per masked call on a key block's causal diagonal

KeyBlock = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def applies(group: AttentionGroup) -> bool:
    """True for a prefill group (q_len > 1) whose gathered context exceeds :data:`LONG_CONTEXT_TOKENS`."""
    return group.q_len > 1 and group.max_context > LONG_CONTEXT_TOKENS


def block_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one key block with its log-sum-exp, in plain PyTorch (float32 softmax).

    q [B, H, Q, D]; k [B, Hk, n, D]; v [B, Hk, n, Dv] (H a multiple of Hk); mask None or additive [B, 1, Q, n].
    Returns (o [B, H, Q, Dv] in q's dtype, lse [B, H, Q] float32, natural log of sum exp(scale q k^T + mask));
    rows that see no key get o = 0 and lse = -inf.
    """
    B, H, Q, D = q.shape
    Hk = k.shape[1]
    if Hk != H:
        k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
    s = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if mask is not None:
        s.add_(mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    return torch.matmul(p.to(v.dtype), v), lse


def _flash_applies(q: torch.Tensor, v: torch.Tensor) -> bool:
    """PyTorch's CPU flash kernel takes q (CPU, float32 / bfloat16) and values as wide as the keys."""
    return q.device.type == "cpu" and v.shape[-1] == q.shape[-1] and q.dtype in (torch.float32, torch.bfloat16)


def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of q over one key block: PyTorch's CPU flash kernel when it applies (CPU, Dv == D), else
    :func:`block_attention_reference`. Same shapes and contract as the reference."""
    if _flash_applies(q, v):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.to(q.dtype), v.to(q.dtype), 0.0, False, attn_mask=mask, scale=scale)
        return o, lse.float()
    return block_attention_reference(q, k, v, mask, scale)


def merge_partial(out: torch.Tensor, lse: torch.Tensor, a: int, b: int, o_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Fold a partial result (o_b [B, H, b-a, Dv], lse_b [B, H, b-a]) into queries a..b-1 of the running
    normalized output ``out`` [B, H, Q, Dv] (float32) and log-sum-exp ``lse`` [B, H, Q], in place."""
    la = lse[:, :, a:b]
    m = torch.maximum(la, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # both -inf: weights 0, stays -inf
    wa, wb = torch.exp(la - m), torch.exp(lse_b - m)
    s = wa + wb
    s_safe = torch.where(s > 0, s, torch.ones_like(s))
    oa = out[:, :, a:b]
    oa.mul_((wa / s_safe).unsqueeze(-1)).add_(o_b.float() * (wb / s_safe).unsqueeze(-1))
    lse[:, :, a:b] = m + torch.log(s)


def blocked_prefill_attention(q: torch.Tensor, group: AttentionGroup, key_block: KeyBlock, scale: float,
                              out_dim: int, key_block_tokens: int = KEY_BLOCK) -> torch.Tensor:
    """Causal prefill attention of a group over its paged context, one key block at a time.

    Args:
        q: [B, H, Q, D] queries (Q = the group's q_len; padding rows have query_pos -1 and are discarded later).
        group: the prefill group (query_pos [B, Q] gives each query's absolute position; key j is visible to a
            query at position p when j <= p).
        key_block: ``key_block(k0, k1)`` -> (k [B, Hk, k1-k0, D], v [B, Hk, k1-k0, Dv']) for context positions
            [k0, k1) of every sequence (rows past a sequence's context may hold anything: they are masked),
            Dv' >= out_dim (only the first out_dim value columns are returned).
        scale: softmax scale.
        out_dim: value width Dv returned per head.
        key_block_tokens: keys per block (a multiple of the KV block size).

    Returns:
        [B, H, Q, out_dim] in q's dtype.
    """
    B, H, Q, _ = q.shape
    qpos = group.query_pos
    valid = qpos >= 0
    big = torch.iinfo(qpos.dtype).max
    qmin = torch.where(valid, qpos, big).amin(0).cpu().numpy()  # per query index: smallest real position
    # (nondecreasing: each sequence's positions grow along the index and sequences only drop out, as padding)
    reach = np.maximum.accumulate(qpos.amax(0).cpu().numpy())  # largest position among query indices <= i
    kend = int(reach[-1]) + 1
    out, lse, dv = None, None, None
    for k0 in range(0, kend, key_block_tokens):
        k1 = min(k0 + key_block_tokens, kend)
        first = int(np.searchsorted(reach, k0))  # queries before it see no key of the block
        full = max(first, int(np.searchsorted(qmin, k1 - 1)))  # from here on every query sees all of [k0, k1)
        if first == Q:
            continue
        k, v = key_block(k0, k1)
        if out is None:
            dv = v.shape[-1]
            out = q.new_zeros(B, H, Q, dv, dtype=torch.float32)
            lse = torch.full((B, H, Q), float("-inf"), dtype=torch.float32, device=q.device)
        kpos = torch.arange(k0, k1, device=q.device)
        for a in range(first, full, PARTIAL_QUERY_BLOCK):  # the block's causal diagonal: masked, sub-blocked
            b = min(full, a + PARTIAL_QUERY_BLOCK)
            qp = qpos[:, a:b]
            visible = kpos.view(1, 1, -1) <= qp.unsqueeze(-1)  # [B, b-a, n]
            mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
            o_b, lse_b = _block_attention(q[:, :, a:b], k, v, mask.unsqueeze(1), scale)
            lse_b = torch.where((qp >= k0).unsqueeze(1), lse_b, torch.full_like(lse_b, float("-inf")))
            merge_partial(out, lse, a, b, o_b, lse_b)
        # every query from `full` on sees the whole block: no mask; one call where the flash kernel tiles it,
        # else (the plain-PyTorch path materializes its scores) in sub-blocks of PARTIAL_QUERY_BLOCK queries
        step = Q if _flash_applies(q, v) else PARTIAL_QUERY_BLOCK
        for a in range(full, Q, step):
            b = min(Q, a + step)
            o_b, lse_b = _block_attention(q[:, :, a:b], k, v, None, scale)
            merge_partial(out, lse, a, b, o_b, lse_b)
    return out[..., :out_dim].to(q.dtype)
