"""Qwen3 (``Qwen3ForCausalLM``): Llama blocks plus per-head RMSNorm on q and k before RoPE.

Reference: transformers ``modeling_qwen3.py`` (q_norm / k_norm over head_dim).
"""
from __future__ import annotations

from tokenfab.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama's layers with RMSNorm over each head's q and k before RoPE (``qk_norm``)."""
    qk_norm = True
