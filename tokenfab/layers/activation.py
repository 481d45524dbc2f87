"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU-GLU: silu(gate) * up for ``gate_up`` [..., 2*I] laid out as [gate | up] -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
