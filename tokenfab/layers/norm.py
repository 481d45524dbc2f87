"""RMSNorm as in the reference models (transformers' LlamaRMSNorm / DeepseekV3RMSNorm)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), computed in float32 and cast back before the weight multiply.

    Shapes: x [..., hidden] any float dtype -> same shape and dtype. Order of casts follows transformers exactly
    (``self.weight * hidden_states.to(input_dtype)``), which matters for bit-level bf16 agreement.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
