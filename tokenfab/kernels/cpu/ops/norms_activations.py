"""RMSNorm (optionally with the residual add) and SiLU-GLU on CPU tensors (csrc/norms_activations.cpp).
"""
from __future__ import annotations

import torch

from tokenfab.kernels.cpu import build


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [N, hidden] (weight [hidden], x's dtype) in transformers' order (float32 statistics, cast, then
    the weight multiply). With ``residual`` [N, hidden]: returns (norm(x + residual), x + residual), the sum
    rounded to x's dtype first, as ``h = h + x`` followed by the norm would."""
    out = build.load().rms_norm(x, residual, weight, float(eps))
    return out[0] if residual is None else (out[0], out[1])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x [N, 2I] laid out [gate | up] -> [N, I], rounded like the PyTorch ops."""
    return build.load().silu_and_mul(x)
