"""Attention kernels on CPU tensors: paged decode attention straight from the block table (csrc/paged_attention.cpp,
paged_attention_bf16.cpp), the causal softmax of gathered prefill attention (csrc/prefill_softmax.cpp) and causal
prefill attention in flash form (csrc/flash_prefill.cpp).
"""
from __future__ import annotations

import torch

from tokenfab.kernels.cpu import build


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * q k^T) v for one query token per sequence, reading K/V in place from the paged pool.

    Args:
        q: [B, H, D] (last dim contiguous).
        k_cache: [num_blocks, block_size, Hk, D]; v_cache: [num_blocks, block_size, Hk, Dv] (any strides with a
            contiguous last dim: MLA passes the latent pool as both, its first Dv columns as values). H % Hk == 0;
            query head h uses KV head h // (H / Hk).
        block_tables: [B, max_blocks] int64 block ids; context_lens: [B] int64 tokens to attend (<= max_blocks *
            block_size), the current token's K/V already written.
        scale: softmax scale.

    Returns:
        [B, H, Dv] in q's dtype; scores, softmax and the weighted sum accumulate in float32. With AVX512-BF16
        (:func:`has_bf16_dot`), bf16 inputs and D, Dv multiples of 32, products are bf16 x bf16 (exact in float32)
        and the softmax weights are rounded to bf16 before the value products, as the eager path does.

    Raises:
        RuntimeError: on shapes or dtypes outside the above (q, k_cache, v_cache share a dtype, or q is float32
            over a bf16 / fp16 pool: the pool's rows are widened exactly as they are read).
    """
    return build.load().paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, float(scale))


def causal_softmax_(scores: torch.Tensor, query_pos: torch.Tensor, q_len: int, scale: float) -> torch.Tensor:
    """In place: scores [B, Hx, R, L] (contiguous q k^T) -> causal softmax(scale * scores) in scores' dtype.

    Row r of (b, h) is query ``r % q_len`` of sequence b at absolute position ``query_pos[b, r % q_len]``
    (query_pos [B, q_len] int64, -1 for padding); key j is visible when j <= that position (padding rows see key 0
    only). Statistics in float32; masked keys get probability 0. Returns ``scores``.
    """
    build.load().causal_softmax_(scores, query_pos, int(q_len), float(scale))
    return scores


def flash_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Causal prefill attention (csrc/flash_prefill.cpp): q [B, H, Q, D], k [B, Hk, L, D], v [B, Hk, L, Dv], all
    bf16 with a contiguous last dimension, H a multiple of Hk, D even; query i of sequence b sits at position
    ``query_pos[b, i]`` (int64 [B, Q], -1 for padding, which sees key 0 only) and sees keys j <= it. Online softmax
    in float32 over blocks of 64 keys, probabilities rounded to bf16 for the PV product, float32 accumulation.
    Returns [B, H, Q, Dv] bf16. Raises RuntimeError on other shapes or dtypes."""
    return build.load().flash_prefill_attention(q, k, v, query_pos, float(scale))
