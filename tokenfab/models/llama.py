"""Llama (``LlamaForCausalLM``): GQA attention with RoPE, SiLU-GLU MLP, pre-norm residual blocks.

Reference: transformers ``modeling_llama.py``. Qwen3 and Qwen3-MoE reuse these blocks (see qwen3.py,
qwen3_moe.py).
"""
from __future__ import annotations

import torch
from torch import nn

from tokenfab.config import ModelConfig
from tokenfab.kernels import dispatch
from tokenfab.kernels.cpu.ops import decode_blocks as cpu_decode_blocks
from tokenfab.layers.attention_metadata import AttentionMetadata
from tokenfab.layers.linear import Linear
from tokenfab.layers.mlp import GatedMLP
from tokenfab.layers.norm import RMSNorm
from tokenfab.layers.paged_attention import paged_mha
from tokenfab.layers.rotary import RotaryEmbedding
from tokenfab.models.base import CausalLM
from tokenfab.parallel.distributed import current_tp


class LlamaAttention(nn.Module):
    """q/k/v projections, optional per-head q/k RMSNorm (Qwen3), RoPE, paged attention, o_proj.

    x [T, hidden] -> [T, hidden]; cache is (k_cache, v_cache), each [num_blocks, block_size, Hkv, head_dim].
    """

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, qk_norm: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        tp = current_tp()
        if tp is not None:  # this rank's query heads and (possibly replicated) KV heads; o_proj is row-parallel
            self.num_heads, self.num_kv_heads = tp.size("heads"), tp.size("kv_heads")
        b = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim, b)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, b)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, b)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, b)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.rotary = rotary
        self.rot_dim = cfg.rope.dim
        self.scale = cfg.softmax_scale()
        self.qkv_proj: Linear | None = None
        self.decode_block = True  # decode-only CPU batches: the whole block in one kernel call (see fuse)
        self._block_ok = False

    def fuse(self) -> None:
        """After loading: q_proj, k_proj and v_proj read the same x, so they become one GEMM over their concatenated
        rows (``qkv_proj``, as vLLM's QKVParallelLinear; each output column is the same dot product as before). Then
        decide whether :func:`~tokenfab.kernels.cpu.ops.decode_blocks.gqa_decode` can run decode-only batches:
        tokenfab's VNNI linears (CPU bf16 with AVX512-BF16), full-width float32 RoPE tables."""
        if self.qkv_proj is None and self.num_heads:
            self.qkv_proj = Linear.concat([self.q_proj, self.k_proj, self.v_proj])
        self.o_proj.fuse()
        self._block_ok = (self.qkv_proj is not None and self.rot_dim == self.head_dim
                          and all(l.vnni_packed is not None for l in (self.qkv_proj, self.o_proj))
                          and getattr(self.rotary, "cos", None) is not None and self.rotary.cos.dtype == torch.float32)

    def decode_block_args(self) -> tuple[list, list, list[int], float] | None:
        """(weights, biases, dims, eps) of :func:`~tokenfab.kernels.cpu.ops.decode_blocks.gqa_decode` for this layer
        (with the rotary tables and ``scale``, all it needs besides the step's tensors), or None where the block does not
        apply (see :meth:`fuse`)."""
        if not self._block_ok:
            return None
        norms = [self.q_norm.weight, self.k_norm.weight] if self.qk_norm else []
        return ([self.qkv_proj.vnni_packed, self.o_proj.vnni_packed] + norms, [self.qkv_proj.bias, self.o_proj.bias],
                [self.num_heads, self.num_kv_heads, self.head_dim, self.o_proj.out_features],
                self.q_norm.eps if self.qk_norm else 0.0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cache, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        if self.num_heads == 0:  # tensor parallel with more ranks than heads: contributes nothing to the sum
            return x.new_zeros(T, self.o_proj.out_features)
        if self._block_ok and self.decode_block and meta.cpu_decode_block(x, cache[0]):
            dec = meta.decode
            w, biases, dims, eps = self.decode_block_args()
            return cpu_decode_blocks.gqa_decode(x, positions, meta.slot_mapping, cache[0], cache[1],
                                                dec.block_tables, dec.context_lens, w, biases, dims, self.rotary.cos,
                                                self.rotary.sin, self.rotary.interleave, eps, self.scale)
        if self.qkv_proj is not None:
            H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
            q, k, v = self.qkv_proj(x).split([H * D, Hk * D, Hk * D], dim=-1)
            q, k, v = q.view(T, H, D), k.view(T, Hk, D), v.view(T, Hk, D)
        else:
            q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.rot_dim == self.head_dim and getattr(self.rotary, "cos", None) is not None:  # GPU path: one kernel
            # for the q / k norms, RoPE and the K / V cache write (dispatch.qk_rope_cache; None elsewhere)
            rot = self.rotary
            qr = dispatch.qk_rope_cache(positions, q, k, v, rot.cos, rot.sin, rot.interleave, meta.slot_mapping,
                                        cache[0], cache[1], self.q_norm.weight if self.qk_norm else None,
                                        self.k_norm.weight if self.qk_norm else None,
                                        self.q_norm.eps if self.qk_norm else 0.0)
            if qr is not None:
                o = paged_mha(qr, k, v, cache[0], cache[1], meta, self.scale, kv_written=True)
                return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rot_dim == self.head_dim:
            q, k = self.rotary(positions, q, k)
        else:  # partial rotary: rotate the first rot_dim dims
            qr, kr = self.rotary(positions, q[..., : self.rot_dim], k[..., : self.rot_dim])
            q = torch.cat([qr, q[..., self.rot_dim:]], -1)
            k = torch.cat([kr, k[..., self.rot_dim:]], -1)
        o = paged_mha(q, k, v, cache[0], cache[1], meta, self.scale)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)). ``mlp`` maps [T, hidden] -> [T, hidden].

    Under tensor parallel, attention and MLP return this rank's partial sums and are all-reduced here, once each.
    """

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.tp = current_tp()
        self.splits_residual = self.tp is None  # CausalLM.forward may pass split_residual=True (GPU path)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, cache, meta: AttentionMetadata,
                residual: torch.Tensor | None = None, split_residual: bool = False):
        """h [T, hidden] -> h + attn + mlp [T, hidden]. With ``split_residual`` (the GPU path, single device): the
        layer's input is h + ``residual`` (None: h alone) and it returns (mlp_out, residual) whose sum is the
        output, so every residual add runs inside a fused add + RMSNorm (the next layer's input norm or the final
        norm), as vLLM's fused_add_rms_norm: 2 norm kernels and no add kernel per layer. Same rounding as the plain
        path: each sum is rounded once to h's dtype."""
        if split_residual and self.tp is None:
            if residual is None:
                x, residual = self.input_layernorm(h), h
            else:
                x, residual = self.input_layernorm(h, residual)
            x, residual = self.post_attention_layernorm(self.self_attn(positions, x, cache, meta), residual)
            return self.mlp(x), residual
        if residual is not None:
            h = h + residual
        if self.tp is not None:
            h = h + self.tp.all_reduce(self.self_attn(positions, self.input_layernorm(h), cache, meta))
            return h + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(h)))
        x, h = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(h), cache, meta), h)
        return h + self.mlp(x)  # h = h + attn(...) was rounded once, inside the fused norm


class LlamaForCausalLM(CausalLM):
    """Llama. Subclasses override :meth:`make_attention` / :meth:`make_mlp`."""

    qk_norm = False

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__(cfg)
        self.rotary = RotaryEmbedding(cfg.rope, max_positions, cfg.max_position_embeddings)
        for i in range(cfg.num_hidden_layers):
            self.model.layers.append(DecoderLayer(cfg, self.make_attention(i), self.make_mlp(i)))

    def make_attention(self, layer_idx: int) -> nn.Module:
        return LlamaAttention(self.cfg, self.rotary, qk_norm=self.qk_norm)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        tp = current_tp()  # tensor parallel: this rank's intermediate channels (down_proj row-parallel)
        inter = self.cfg.intermediate_size if tp is None else tp.size("intermediate")
        return GatedMLP(self.cfg.hidden_size, inter, self.cfg.mlp_bias)

    def make_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> list:
        kv_heads = self.cfg.num_key_value_heads if self.tp is None else self.tp.size("kv_heads")
        shape = (num_blocks, block_size, kv_heads, self.cfg.head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(self.cfg.num_hidden_layers)]
