"""RMSNorm as in the reference models (transformers' LlamaRMSNorm / DeepseekV3RMSNorm)."""
from __future__ import annotations

import torch
from torch import nn

from tokenfab.kernels import dispatch


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), computed in float32 and cast back before the weight multiply.

    Shapes: x [..., hidden] any float dtype -> same shape and dtype. On CPU the fused kernel
    (kernels.dispatch.rms_norm) computes the same thing in one pass. Order of casts follows transformers exactly
    (``self.weight * hidden_states.to(input_dtype)``), which matters for bit-level bf16 agreement.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with ``residual`` (same shape and dtype): (norm(x + residual), x + residual), the sum rounded to
        x's dtype first exactly as ``h = h + x`` is (one fused pass on CPU)."""
        out = dispatch.rms_norm(x, self.weight, self.eps, residual)
        if out is not None:
            return out
        if residual is not None:
            h = residual + x
            return self(h), h
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
