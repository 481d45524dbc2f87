"""RMSNorm as in the reference models (transformers' LlamaRMSNorm / DeepseekV3RMSNorm)."""
from __future__ import annotations

import torch
from torch import nn

from tokenfab.kernels.cpu import ops as cpu_ops


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), computed in float32 and cast back before the weight multiply.

    Shapes: x [..., hidden] any float dtype -> same shape and dtype. On CPU the fused kernel
    (kernels/cpu/ops.py) computes the same thing in one pass. Order of casts follows transformers exactly
    (``self.weight * hidden_states.to(input_dtype)``), which matters for bit-level bf16 agreement.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with ``residual`` (same shape and dtype): (norm(x + residual), x + residual), the sum rounded to
        x's dtype first exactly as ``h = h + x`` is (one fused pass on CPU)."""
        if residual is not None:
            if (x.dim() == 2 and x.dtype == self.weight.dtype == residual.dtype and x.stride(-1) == 1
                    and residual.stride(-1) == 1 and cpu_ops.available_for(x)):
                return cpu_ops.rms_norm(x, self.weight, self.eps, residual=residual)
            h = residual + x
            return self(h), h
        if x.dtype == self.weight.dtype and x.shape[-1] == self.weight.shape[0] and cpu_ops.available_for(x):
            return cpu_ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
