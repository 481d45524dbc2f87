"""DeepSeek-V3 / Kimi-K2 (``DeepseekV3ForCausalLM``): MLA attention, sigmoid group-limited MoE with shared
experts, dense first ``first_k_dense_replace`` layers, YaRN RoPE.

Reference: transformers ``modeling_deepseek_v3.py``. The MTP layers (``model.layers.{num_hidden_layers + i}``)
are not part of this model (the loader reports them as skipped); speculative decoding's ``mtp`` method loads them
as a drafter (models/deepseek_mtp.py).
"""
from __future__ import annotations

import torch
from torch import nn

from tokenfab.layers.mla import MLAttention
from tokenfab.layers.mlp import GatedMLP
from tokenfab.layers.moe import RoutedExperts, SigmoidGroupRouter, route
from tokenfab.layers.rotary import RotaryEmbedding
from tokenfab.layers.shared_expert_fold import fold_shared_experts
from tokenfab.models.base import CausalLM, layer_index
from tokenfab.models.llama import DecoderLayer
from tokenfab.parallel.distributed import current_tp


class DeepseekV3MoE(nn.Module):
    """Routed experts (sigmoid group-limited top-k) plus shared experts; x [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg):
        super().__init__()
        self.gate = SigmoidGroupRouter(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group,
                                       cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        tp = current_tp()  # tensor parallel: whole experts per rank, shared expert split by intermediate
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                     None if tp is None else tp.r("experts"))
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts if tp is None else tp.size("shared_intermediate")
        self.shared_experts = GatedMLP(cfg.hidden_size, shared) if cfg.n_shared_experts else None

        self.folded = None  # GPU path: shared experts stacked behind the routed ones (fuse())

    def fuse(self) -> None:
        """After loading, on the GPU code path: the shared experts become always-chosen routed experts
        (layers/shared_expert_fold.py), three launches fewer per decode step."""
        if self.folded is None:
            self.folded = fold_shared_experts(self.experts, self.shared_experts, self.gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.folded is not None:
            out = self.folded(x, self.gate, self.experts)
            if out is not None:
                return out
        w, ids, aligned = route(self.gate, self.experts, x)
        if self.shared_experts is None:
            return self.experts(x, w, ids, aligned=aligned)
        return self.experts(x, w, ids, plus=self.shared_experts(x), aligned=aligned)  # GPU: added in the k-sum


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 / Kimi-K2 (``DeepseekV3ForCausalLM``): MLA attention, dense MLPs in the first layers and routed MoE
    (sigmoid, group-limited top-k, shared experts) in ``cfg.moe_layers``; YaRN RoPE. Reference: transformers
    ``modeling_deepseek_v3.py``."""
    def __init__(self, cfg, max_positions: int):
        super().__init__(cfg)
        self.rotary = RotaryEmbedding(cfg.rope, max_positions, cfg.max_position_embeddings)
        tp = current_tp()  # tensor parallel: MLA heads and dense intermediate split (see tokenfab/parallel)
        inter = cfg.intermediate_size if tp is None else tp.size("intermediate")
        heads = None if tp is None else tp.r("heads")
        for i in range(cfg.num_hidden_layers):
            mlp = DeepseekV3MoE(cfg) if i in cfg.moe_layers else GatedMLP(cfg.hidden_size, inter)
            self.model.layers.append(DecoderLayer(cfg, MLAttention(cfg, self.rotary, heads), mlp))

    def is_skipped_weight(self, name: str) -> bool:
        idx = layer_index(name)
        if idx is not None and idx >= self.cfg.num_hidden_layers:  # MTP (num_nextn_predict_layers)
            return True
        if not self.cfg.n_shared_experts and ".mlp.shared_experts." in name:
            return True  # n_shared_experts 0: transformers still saves a zero-width shared MLP, which adds nothing
        return super().is_skipped_weight(name)

    def make_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> list:
        width = self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim
        return [torch.zeros(num_blocks, block_size, width, dtype=dtype, device=device)
                for _ in range(self.cfg.num_hidden_layers)]
