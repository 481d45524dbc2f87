"""Sampling without top-k / top-p in one pass per row (csrc/sampling.cpp).
"""
from __future__ import annotations

import torch

from tokenfab.kernels.cpu import build


def sample_plain(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row without top-k / top-p, in one pass per row.

    Args:
        logits: [N, V] float32 (-inf for forbidden tokens). temps: [N] float32 temperatures (< 1e-5: greedy).
        u: [N] uniforms in [0, 1).

    Returns:
        int64 [N]: for sampled rows the first j with cdf_j > u * cdf_{V-1} (capped just below the total) over
        exp(x / t - max), summed in float64: the draw of :func:`tokenfab.engine.sampler.inverse_cdf_sample` on
        ``softmax(x / t)`` up to float32 rounding of the exponentials; for greedy rows the first argmax.
    """
    return build.load().sample_plain(logits, temps, u)
