"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenfab.kernels.cpu import ops as cpu_ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU-GLU: silu(gate) * up for ``gate_up`` [..., 2*I] laid out as [gate | up] -> [..., I] (one fused pass
    on CPU, kernels/cpu/ops.py)."""
    if gate_up.dim() == 2 and gate_up.stride(-1) == 1 and cpu_ops.available_for(gate_up):
        return cpu_ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
