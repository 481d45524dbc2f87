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
        self.gate_up: Linear | None = None

    def fuse(self) -> None:
        """After loading: one [2I, hidden] gate|up projection (one GEMM instead of two), packed when possible."""
        if self.gate_proj.bias is None and self.gate_up is None:
            self.gate_up = Linear.concat([self.gate_proj, self.up_proj])
        self.down_proj.fuse()  # now rather than after this module: a parent's fuse() may read it (DeepseekV3MoE)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; with ``residual`` (a [T, H] tensor the caller owns): ``residual`` + the MLP, the add
        in the down projection's GEMM where it can (Linear.forward_add_)."""
        if self.gate_up is not None:
            h = silu_and_mul(self.gate_up(x))
        else:
            h = torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(h) if residual is None else self.down_proj.forward_add_(h, residual)
