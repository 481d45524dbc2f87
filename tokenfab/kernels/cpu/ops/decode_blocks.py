"""The attention of a decode-only batch as one call per layer (csrc/decode_blocks.cpp): MLA's absorbed decode and
grouped-query attention, from the layer input to o_proj's output.
"""
from __future__ import annotations

import torch

from tokenfab.kernels.cpu import build


def mla_decode(x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, weights: list[torch.Tensor], dims: list[int],
               cos: torch.Tensor, sin: torch.Tensor, interleave: bool, eps_q: float, eps_kv: float,
               scale: float) -> torch.Tensor:
    """MLA's absorbed decode for a decode-only batch in one call, from the layer input to o_proj's output.

    The same kernels in the same order as :class:`tokenfab.layers.mla.MLAttention`'s Python path (fused q_a|kv_a
    GEMM, q_a / kv_a RMSNorm, q_b GEMM, RoPE, cache write, q_nope W_UK, paged latent attention, W_UV, o_proj), so
    the output and the latent rows written to ``cache`` are bit-identical to it, without its ~25 Python-level ops.

    Args:
        x: [T, hidden] bf16, one token per sequence. positions, slot_mapping: [T] int64.
        cache: [num_blocks, block_size, C + R] bf16 latent pool, written at ``slot_mapping``.
        block_tables: [T, max_blocks] int64; context_lens: [T] int64 (including this step's token).
        weights: [qkv_a, q_a_norm, kv_a_norm, q_b, w_uk, w_uv_t, o_proj]: linears from :func:`pack_linear_weight`,
            head weights from :func:`pack_head_weights`, norm weights bf16.
        dims: [q_lora_rank, C (kv_lora_rank), R (rope dim), heads, qk_nope_head_dim, v_head_dim, hidden].
        cos, sin: float32 RoPE tables [P, R / 2]; interleave: DeepSeek's pair layout.
        eps_q, eps_kv: the two RMSNorm epsilons; scale: softmax scale.

    Returns:
        [T, hidden] bf16.

    Raises:
        RuntimeError: shapes or dtypes outside the above, or a slot outside the cache.
    """
    return build.load().mla_decode(x, positions, slot_mapping, cache, block_tables, context_lens, weights, dims, cos,
                                   sin, bool(interleave), float(eps_q), float(eps_kv), float(scale))


def gqa_decode(x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
               weights: list[torch.Tensor], biases: list[torch.Tensor | None], dims: list[int], cos: torch.Tensor,
               sin: torch.Tensor, interleave: bool, eps: float, scale: float) -> torch.Tensor:
    """Grouped-query attention (Llama, Qwen3) for a decode-only batch in one call, from the layer input to o_proj's
    output: the kernels of :class:`tokenfab.models.llama.LlamaAttention`'s Python path in the same order (fused
    q|k|v GEMM, Qwen3's per-head q/k RMSNorm, RoPE, k/v cache writes, paged decode attention, o_proj), so the
    output and the cache rows written are bit-identical to it.

    Args:
        x: [T, hidden] bf16, one token per sequence. positions, slot_mapping: [T] int64.
        k_cache, v_cache: [num_blocks, block_size, Hk, D] bf16, written at ``slot_mapping``.
        block_tables: [T, max_blocks] int64; context_lens: [T] int64 (including this step's token).
        weights: [qkv, o_proj] from :func:`pack_linear_weight` (qkv rows = q | k | v), then [q_norm, k_norm] [D]
            bf16 for Qwen3. biases: [qkv bias [(H + 2 Hk) D] or None, o_proj bias or None].
        dims: [H, Hk, D, hidden]. cos, sin: float32 RoPE tables [P, D / 2]; interleave: pair layout.
        eps: the q/k RMSNorm epsilon (unused without them); scale: softmax scale.

    Returns:
        [T, hidden] bf16.

    Raises:
        RuntimeError: shapes or dtypes outside the above, or a slot outside the cache.
    """
    return build.load().gqa_decode(x, positions, slot_mapping, k_cache, v_cache, block_tables, context_lens, weights,
                             biases, dims, cos, sin, bool(interleave), float(eps), float(scale))
