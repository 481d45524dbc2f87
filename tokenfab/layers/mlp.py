"""The SiLU-GLU feed-forward block shared by every family (dense layers and shared experts)."""
from __future__ import annotations

import torch
from torch import nn

from tokenfab.layers.activation import silu_and_mul
from tokenfab.layers.linear import Linear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); x [T, hidden] -> [T, hidden]. Checkpoint names gate_proj/up_proj/down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)
        self._fused: torch.Tensor | None = None

    def fuse(self) -> None:
        """Concatenate gate and up weights into one [2I, hidden] matrix (one GEMM instead of two) after loading."""
        if self.gate_proj.bias is None:
            self._fused = torch.cat([self.gate_proj.weight, self.up_proj.weight], 0).contiguous()
            self.gate_proj.weight = self.up_proj.weight = None  # freed; _fused holds the data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            return self.down_proj(silu_and_mul(x @ self._fused.t()))
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
