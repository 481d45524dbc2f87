"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention; sparse layers use a softmax top-k router over routed
experts (no shared expert); ``mlp_only_layers`` / ``decoder_sparse_step`` choose the sparse layers.

Reference: transformers ``modeling_qwen3_moe.py``.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenfab.layers.moe import RoutedExperts, SoftmaxTopKRouter, route
from tokenfab.models.qwen3 import Qwen3ForCausalLM
from tokenfab.parallel.distributed import current_tp


class Qwen3MoeBlock(nn.Module):
    """x [T, hidden] -> sum over the top-k experts of weight * expert(x)."""

    def __init__(self, cfg):
        super().__init__()
        self.gate = SoftmaxTopKRouter(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        tp = current_tp()  # tensor parallel: whole experts per rank (expert parallel); output all-reduced by the layer
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                     None if tp is None else tp.r("experts"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, ids, aligned = route(self.gate, self.experts, x)
        return self.experts(x, w, ids, aligned=aligned)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention with a softmax top-k MoE block (no shared expert) in
    ``cfg.moe_layers`` and Qwen3's dense MLP elsewhere. Reference: transformers ``modeling_qwen3_moe.py``."""
    def make_mlp(self, layer_idx: int) -> nn.Module:
        if layer_idx in self.cfg.moe_layers:
            return Qwen3MoeBlock(self.cfg)
        return super().make_mlp(layer_idx)
