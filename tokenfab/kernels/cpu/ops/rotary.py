"""Rotary position embedding on CPU tensors (csrc/rotary.cpp).
"""
from __future__ import annotations

import torch

from tokenfab.kernels.cpu import build


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         interleave: bool) -> torch.Tensor:
    """Rotary embedding of x [T, H, dim] at positions [T] (int64) with float32 tables cos/sin [P, dim/2]; returns
    a new contiguous [T, H, dim] in x's dtype. ``interleave``: DeepSeek's (2i, 2i+1) pairs, output in halves."""
    return build.load().rope(x, positions, cos, sin, interleave)
