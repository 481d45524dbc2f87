"""INT4 group-32 and MXFP4 routed-expert stacks kept packed (csrc/packed_experts.cpp on AVX512-BF16,
csrc/packed_experts_avx2.cpp on AVX2), and their CPU tile layout.
"""
from __future__ import annotations

import torch

from tokenfab.kernels.cpu import build
from tokenfab.kernels.cpu.ops import support


def packed_experts_applies() -> bool:
    """True when :func:`packed_experts_linear` runs: built kernels with AVX512-BF16 dot products."""
    m = build.load()
    return bool(m is not None and support.has_bf16_dot() and hasattr(m, "packed_experts_linear"))


def packed_experts_linear(x: torch.Tensor, fmt: int, packed: torch.Tensor, scale: torch.Tensor,
                          experts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped y = x W_e^T over a stack of routed experts kept packed (kernels/cpu/csrc/packed_experts.cpp).

    Args:
        x: [N, K] bf16 or float32, rows sorted by expert. fmt: 0 = INT4 group-32 (packed int32 [E, n, K / 8],
            scale bf16 / fp16 [E, n, K / 32]), 1 = MXFP4 (packed uint8 [E, n, K / 2], scale uint8 E8M0); plus 16
            when the stack's whole 16-row tiles are in the CPU tile layout (:func:`packed_experts_relayout`).
        experts: int64 [A] local expert ids; offsets: int64 [A + 1], rows offsets[a]:offsets[a+1] use experts[a].

    Returns:
        [N, n] in x's dtype: per 32 values the exact products of x and the integer / E2M1 codes summed in float32
        and scaled once, float32 x split into three bf16 parts; one rounding per output.

    Raises:
        RuntimeError: shapes / dtypes outside the above, or kernels without AVX512-BF16 (check
            :func:`packed_experts_applies` first).
    """
    return build.load().packed_experts_linear(x, int(fmt), packed, scale, experts, offsets)


def packed_experts_avx2_applies() -> bool:
    """True when :func:`packed_experts_avx2` runs: kernels built with AVX2 + FMA + F16C and no AVX512-BF16 expert
    kernel selected (:func:`packed_experts_applies` False: a CPU without it, or ``TOKENFAB_CPU_ISA=avx2``)."""
    m = build.load()
    return bool(m is not None and getattr(m, "packed_experts_avx2_built", False) and not packed_experts_applies())


def packed_experts_avx2(x: torch.Tensor, fmt: int, packed: torch.Tensor, scale: torch.Tensor,
                        experts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped y = x W_e^T over an INT4 group-32 or MXFP4 expert stack in the checkpoint layout, on AVX2
    (kernels/cpu/csrc/packed_experts_avx2.cpp: the packed expert path of CPUs without AVX512-BF16).

    Args:
        x: [N, K] float32, rows sorted by expert. fmt: 0 (int4 group-32) or 1 (MXFP4).
        packed, scale: the stack's buffers as :func:`packed_experts_linear` takes them (no tile layout).
        experts: int64 [A] local expert ids; offsets: int64 [A + 1] row offsets into x (0 .. N).

    Returns:
        [N, n] float32 within float32 summation error of x times the reference's values ((nibble - 8) * scale,
        E2M1 * 2^(e - 127)). Segments of up to 16 rows run a register GEMV over the packed bytes (per 32-value group
        the products of x and the integer codes summed in float32, scaled once); longer ones
        multiply 64-row panels dequantized into a thread-local buffer with PyTorch's float32 GEMM.

    Raises:
        RuntimeError: another format or dtype, mis-shaped buffers, bad experts / offsets, or kernels built without
            AVX2 / FMA / F16C (check :func:`packed_experts_avx2_applies`).
    """
    return build.load().packed_experts_avx2(x, int(fmt), packed, scale, experts, offsets)


def packed_experts_relayout(fmt: int, packed: torch.Tensor, scale: torch.Tensor, to_tiles: bool) -> None:
    """In place: every whole 16 rows of every expert of an INT4 / MXFP4 stack (``fmt`` 0 / 1, buffers as in
    :func:`packed_experts_linear`, contiguous, on the CPU) into the CPU tile layout (``to_tiles``; per tile and
    32-value group, 16-bit words each holding four rows' codes as vdpbf16ps operands, and the scales group-major:
    kernels/cpu/csrc/packed_expert_tiles.h), or back to the checkpoint layout (exact). Rows past the last whole 16
    are left as they are.

    Raises:
        RuntimeError: buffers that are not such a stack.
    """
    build.load().packed_experts_relayout(int(fmt), packed, scale, bool(to_tiles))
