"""bf16 linears on tokenfab's VNNI-blocked weights (csrc/vnni_linear.cpp): a GEMV streaming each weight block once
for up to 4 rows, oneDNN's brgemm micro-kernel for more.
"""
from __future__ import annotations

import torch

from tokenfab.kernels.cpu import build
from tokenfab.kernels.cpu.ops import support


def vnni_linear_applies(weight: torch.Tensor) -> bool:
    """True when :func:`vnni_linear` can run ``weight`` [N, K]: bf16 on CPU, K even, and built kernels with
    AVX512-BF16 dot products."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and weight.shape[0] > 0 and support.has_bf16_dot())


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 (K even) -> VNNI blocks [ceil(N / 32), K / 2, 32, 2] bf16 for :func:`vnni_linear`
    (rows past N zero): each block of 32 output rows is one contiguous stream with the two k values of each pair
    side by side, the B layout of ``vdpbf16ps`` and of oneDNN's brgemm micro-kernel."""
    return build.load().pack_linear_weight(weight.detach())


def vnni_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                out_f32: bool = False) -> torch.Tensor:
    """y = x W^T (+ bias) over :func:`pack_linear_weight` of W [n, K].

    Args:
        x: [..., K] bf16 (last dim contiguous; 2-D row strides are kept).
        packed: the packed weight. n: output features (W's rows). bias: [n] (any float dtype) or None.
        out_f32: return the float32 accumulator itself (+ bias), unrounded: the LM head's logits.

    Returns:
        [..., n] bf16 (float32 with ``out_f32``): float32 accumulation, + bias in float32, one rounding to nearest
        even per output. Up to 4
        rows run a GEMV that streams each weight block once for all rows (decode); more rows run oneDNN's brgemm
        micro-kernel on 64 x 32 tiles (prefill). benchmarks/linear_kernels.py measures both against oneDNN's
        packed inner product.

    Raises:
        RuntimeError: x not bf16, or x's last dim / ``n`` not matching ``packed``.
    """
    return build.load().vnni_linear(x, packed, int(n), bias, bool(out_f32))


def vnni_linear_group(xs: list[torch.Tensor], packed: list[torch.Tensor], ns: list[int]) -> list[torch.Tensor]:
    """Several linears without bias in one call: ``[vnni_linear(x, p, n) for x, p, n in zip(xs, packed, ns)]``, the
    same bits, with the items of <= 4 rows (decode GEMVs) sharing one parallel region over all their 32-row weight
    blocks instead of one region each (fewer fork/joins; benchmarks/NOTES.md entry 47).

    Args:
        xs: per item x [..., K_i] bf16. packed: per item :func:`pack_linear_weight` of W_i [n_i, K_i]. ns: the n_i.

    Returns per item y [..., n_i] bf16.

    Raises:
        RuntimeError: mismatched lengths or an item whose shapes do not match its weight.
    """
    return build.load().vnni_linear_group(xs, packed, [int(n) for n in ns])
