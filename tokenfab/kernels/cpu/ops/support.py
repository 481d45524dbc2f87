"""Whether tokenfab's CPU kernels apply: a built extension, a CPU tensor's dtype, AVX512-BF16 dot products
(``TOKENFAB_CPU_ISA`` caps them: :mod:`tokenfab.kernels.cpu.isa`).
"""
from __future__ import annotations

import torch

from tokenfab.kernels.cpu import build


def available_for(x: torch.Tensor) -> bool:
    """True when the fused kernels apply to ``x``: a CPU tensor in float32 or bfloat16 and a built extension."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and build.load() is not None


def has_bf16_dot() -> bool:
    """True when the built kernels use AVX512-BF16 dot products (``vdpbf16ps``): built with them and not capped
    below ``avx512_bf16`` by ``TOKENFAB_CPU_ISA`` (:mod:`tokenfab.kernels.cpu.isa`)."""
    m = build.load()
    return bool(m is not None and m.has_bf16_dot and m.isa_cap() >= 1)
