"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenfab.kernels import dispatch


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU-GLU: silu(gate) * up for ``gate_up`` [..., 2*I] laid out as [gate | up] -> [..., I] (one fused pass
    on CPU, kernels.dispatch.silu_and_mul)."""
    out = dispatch.silu_and_mul(gate_up)
    if out is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
