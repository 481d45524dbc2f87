"""Routed experts over packed bf16 weights in one call, and DeepSeek-V3 / Kimi-K2 routing (csrc/moe.cpp).
"""
from __future__ import annotations

import torch

from tokenfab.kernels.cpu import build


def moe_experts_packed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, p13: list[torch.Tensor],
                       p2: list[torch.Tensor], start: int, shared_gate_up: torch.Tensor | None = None,
                       shared_down: torch.Tensor | None = None) -> torch.Tensor:
    """Routed SiLU-GLU experts over packed weights in one call: sum over slots j of weights[t, j] *
    expert_{ids[t, j]}(x[t]) for the experts this rank owns, optionally plus a shared expert.

    Args:
        x: [T, hidden] bf16. weights: [T, k] float32 routing weights. ids: [T, k] int64 global expert ids.
        p13, p2: per local expert ``e`` (global id ``start + e``), the packed gate_up [2I, hidden] and down
            [hidden, I] weights (:func:`tokenfab.layers.linear.pack_weight`: tokenfab's VNNI blocks or oneDNN's).
            Pairs routed to other experts add 0.
        shared_gate_up, shared_down: a shared expert's gate_up [2I_s, hidden] and down [hidden, I_s] weights from
            :func:`pack_linear_weight` (no bias; VNNI-packed routed experts only), or None.

    Returns [T, hidden] bf16, bit-identical to ``RoutedExperts.forward``'s packed Python path (same grouping,
    GEMMs, rounding and summation order) without its ~25 small ops per layer; with a shared expert, to that result
    ``+ GatedMLP(x)`` as bf16 tensors (DeepseekV3MoE.forward). With VNNI weights all experts' gate_up GEMVs run in one
    parallel region and all down GEMVs in another (:func:`vnni_linear_group`).

    Raises:
        RuntimeError: shapes outside the above, or a shared expert with oneDNN-packed routed experts.
    """
    return build.load().moe_experts_packed(x, weights, ids, p13, p2, int(start), shared_gate_up, shared_down)


def sigmoid_group_topk(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                       norm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Kimi-K2 routing (noaux_tc) from router logits [T, E] float32 and the score-correction bias [E]
    float32: returns (weights [T, top_k] float32, expert ids [T, top_k] int64), the same selection and weights as
    :class:`tokenfab.layers.moe.SigmoidGroupRouter`'s PyTorch path (transformers' ``DeepseekV3TopkRouter``), one
    pass per token. Experts come in descending choice-score order; ties go to the lower index.

    Raises:
        RuntimeError: dtypes or shapes outside the above, E not divisible by n_group, or top_k larger than the
            experts of the kept groups.
    """
    w, ids = build.load().sigmoid_group_topk(logits, bias, int(n_group), int(topk_group), int(top_k), bool(norm),
                                       float(scale))
    return w, ids
