"""Rotary position embeddings: default, linear, Llama-3 and YaRN frequencies, and both rotary layouts.

Formulas follow transformers' ``modeling_rope_utils`` (``_compute_yarn_parameters``,
``_compute_llama3_parameters``) and the YaRN paper (Peng et al. 2023, arXiv:2309.00071).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tokenfab.config import RopeConfig
from tokenfab.kernels import dispatch


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def compute_inv_freq(rope: RopeConfig, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] float32 and the cos/sin attention factor for ``rope``.

    YaRN: frequencies blended between interpolation (inv_freq / factor) and extrapolation by a linear ramp over the
    correction range given by beta_fast / beta_slow and original_max_position_embeddings; attention factor =
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else mscale(factor), unless
    ``attention_factor`` is given. Llama-3: wavelength-banded scaling with low/high_freq_factor.
    """
    dim, base = rope.dim, rope.theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    factor = rope.factor
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wl, high_wl = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope.rope_type == "yarn":
        attention_factor = rope.attention_factor
        if attention_factor is None:
            if rope.mscale and rope.mscale_all_dim:
                attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        omax = rope.original_max_position_embeddings

        def corr_dim(num_rot: float) -> float:
            return (dim * math.log(omax / (num_rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        extra_factor = 1 - ramp
        return inter * (1 - extra_factor) + extra * extra_factor, float(attention_factor)
    raise ValueError(f"unsupported rope type {rope.rope_type}")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query/key tensors at given positions.

    A cos/sin table [max_positions, dim/2] (float32, attention factor folded in) is built once; ``forward`` gathers
    rows by position. Layouts: ``interleave=False`` rotates halves (x[:d/2], x[d/2:]) like HF ``rotate_half``;
    ``interleave=True`` rotates adjacent pairs (x[0::2], x[1::2]) and writes the result de-interleaved
    ([even-rotated | odd-rotated]) exactly like HF DeepSeek-V3's ``apply_rotary_pos_emb_interleave``. Only the
    relative layout of q and k matters for attention, and cached keys keep the layout they were written in.
    """

    def __init__(self, rope: RopeConfig, max_positions: int, max_position_embeddings: int):
        super().__init__()
        self.dim = rope.dim
        self.interleave = rope.interleave
        inv_freq, self.attention_factor = compute_inv_freq(rope, max_position_embeddings)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos() * self.attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * self.attention_factor, persistent=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, dim] with cos/sin [T, 1, dim/2] -> rotated x (same dtype)."""
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64; q [T, Hq, dim], k [T, Hk, dim] -> rotated (q, k) in their own dtype.

        cos/sin are cast to q's dtype first, as transformers does (``cos.to(dtype=x.dtype)``).
        """
        out = dispatch.rope(positions, q, k, self.cos, self.sin, self.interleave)  # CPU: one fused pass per tensor
        if out is not None:
            return out
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)
