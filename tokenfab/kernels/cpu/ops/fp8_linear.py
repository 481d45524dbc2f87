"""FP8 block-scaled linears and routed-expert stacks kept as e4m3 bytes (csrc/fp8_linear.cpp on AVX512-BF16,
csrc/fp8_linear_avx2.cpp on AVX2).
"""
from __future__ import annotations

import torch

from tokenfab.kernels.cpu import build
from tokenfab.kernels.cpu.ops import support


def fp8_block_linear_applies() -> bool:
    """True when :func:`fp8_block_linear` runs: built kernels with AVX512-BF16 dot products."""
    m = build.load()
    return bool(m is not None and support.has_bf16_dot() and hasattr(m, "fp8_block_linear"))


def fp8_block_linear_avx2_applies() -> bool:
    """True when :func:`fp8_block_linear_avx2` runs: kernels built with AVX2 + FMA + F16C and no AVX512-BF16 FP8
    kernel selected (:func:`fp8_block_linear_applies` False: a CPU without it, or ``TOKENFAB_CPU_ISA=avx2``)."""
    m = build.load()
    return bool(m is not None and getattr(m, "fp8_block_linear_avx2_built", False) and not fp8_block_linear_applies())


def fp8_block_linear_avx2(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) with W [n, K] FP8 block-scaled as published (as :func:`fp8_block_linear`), on AVX2:
    kernels/cpu/csrc/fp8_linear_avx2.cpp, the FP8 path of CPUs without AVX512-BF16.

    Args:
        x: [..., K] float32, K a multiple of 32. weight: float8_e4m3fn (or its uint8 bytes) [n, K], contiguous.
        scale_inv: float32 [ceil(n / 128), ceil(K / 128)], contiguous. bias: [n] (any float dtype) or None.

    Returns:
        [..., n] float32: float32 FMAs of x with the weight's float32 values (e4m3 * scale_inv, each rounded once as
        the reference computes it), + bias. Up to 16 rows of x: a GEMV converting the e4m3 bytes in registers;
        more: 64-row panels converted into a thread-local buffer for PyTorch's float32 GEMM.

    Raises:
        RuntimeError: shapes or dtypes outside the above, or kernels built without AVX2 / FMA / F16C (check
            :func:`fp8_block_linear_avx2_applies` first).
    """
    return build.load().fp8_block_linear_avx2(x, weight.view(torch.uint8), scale_inv, bias)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None, tiled: bool = False) -> torch.Tensor:
    """y = x W^T (+ bias) with W [n, K] FP8 block-scaled as published: W[r, c] = float32(weight[r, c]) *
    scale_inv[r // 128, c // 128] (tokenfab.quant.fp8_block_weight).

    Args:
        x: [..., K] bf16 or float32, K a multiple of 32.
        weight: float8_e4m3fn [n, K] (contiguous). scale_inv: float32 [ceil(n / 128), ceil(K / 128)].
        bias: [n] (any float dtype) or None.
        tiled: the weight's whole 16-row tiles are in the CPU tile layout (:func:`fp8_tiles_relayout` of its first
            n // 16 * 16 rows; the rest row-major): up to 16 rows of x run the tile GEMV (each weight converted once
            for all of them), more rows brgemm over converted tiles; never AMX.

    Returns:
        [..., n] in x's dtype: per 128-input block the exact products of x and the e4m3 values summed in float32,
        scaled once by the block's scale_inv, + bias, one rounding per output. Float32 x is split into three bf16
        parts, so it keeps float32 accuracy. Up to :func:`fp8_gemv_max_rows` rows (16 float32, 8 or 12 bf16 by K)
        run a GEMV that streams the FP8 bytes once (decode); on CPUs with AMX, bf16 x of more than 4 rows runs AMX
        tile products on 16 converted weight rows at a time; else more rows convert 32 weight rows at a time into a
        thread-local buffer for oneDNN's brgemm (bf16 x: each weight rounded once to bf16, the bf16 twin's).
        benchmarks/fp8_linear.py measures the GEMV against :func:`vnni_linear`.

    Raises:
        RuntimeError: shapes or dtypes outside the above, or kernels without AVX512-BF16 (check
            :func:`fp8_block_linear_applies` first).
    """
    return build.load().fp8_block_linear(x, weight.view(torch.uint8), scale_inv, bias, bool(tiled))


def fp8_gemv_max_rows(dtype: torch.dtype, k: int, tiled: bool = False) -> int:
    """Rows of x up to which :func:`fp8_block_linear` and :func:`fp8_experts_linear` run their GEMV on a CPU without
    AMX for ``k`` inputs (float32 x: 16; bf16 x: 8, or 12 where k >= 4096; a weight or expert stack in the tile
    layout, ``tiled``: 16, with or without AMX; the exact e4m3 values, scaled per block; beyond: brgemm); bf16 x past it multiplies each weight
    rounded once to bf16, as the dequantized bf16 twin holds it. The kernels' own rule (fp8_linear.cpp
    ``gemv_max_rows``, ``kTileGemvMaxRows``)."""
    m = build.load()
    return int(m.fp8_tiles_gemv_max_rows) if tiled else int(m.fp8_gemv_max_rows(dtype == torch.float32, int(k)))


def fp8_experts_applies() -> bool:
    """True when :func:`fp8_experts_linear` runs: built kernels with AVX512-BF16 dot products."""
    m = build.load()
    return bool(m is not None and support.has_bf16_dot() and hasattr(m, "fp8_experts_linear"))


def fp8_experts_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, experts: torch.Tensor,
                       offsets: torch.Tensor, part_rows: int, tiled: bool = False) -> torch.Tensor:
    """Grouped y = x W_e^T over a stack of routed experts kept as FP8 block-scaled bytes
    (kernels/cpu/csrc/fp8_linear.cpp).

    Args:
        x: [N, K] bf16 or float32, rows grouped by expert; K a multiple of 32.
        packed: uint8 [E, n, K] e4m3 bytes; scale: float32 [E, (n / part_rows) * ceil(part_rows / 128),
            ceil(K / 128)], each part of ``part_rows`` rows with its own 128-row blocks
            (tokenfab/quant/fp8_block_experts.py).
        experts: int64 [A] local expert ids; offsets: int64 [A + 1], rows [offsets[a], offsets[a + 1]) of x go to
            experts[a].
        tiled: ``packed`` is in the CPU tile layout (:func:`fp8_tiles_relayout`; part_rows a multiple of 16):
            segments of up to 16 rows of x run the tile GEMV (each weight converted once for all of them), longer
            ones brgemm over converted tiles.

    Returns:
        [N, n] in x's dtype. Raises RuntimeError on shape mismatches or without AVX512-BF16 (check
        :func:`fp8_experts_applies` first).
    """
    return build.load().fp8_experts_linear(x, packed, scale, experts, offsets, int(part_rows), bool(tiled))


def fp8_tiles_preferred() -> bool:
    """True where FP8 weights and expert stacks on :func:`fp8_block_linear` / :func:`fp8_experts_linear` take the
    CPU tile layout: kernels with AVX512-BF16 dot products and no AMX tiles granted (an AMX machine keeps the
    row-major bytes and its AMX tile path)."""
    m = build.load()
    return bool(m is not None and hasattr(m, "fp8_tiles_preferred") and m.fp8_tiles_preferred())


def fp8_tiles_relayout(packed: torch.Tensor, to_tiles: bool) -> None:
    """In place: every 16 rows of FP8 e4m3 bytes (uint8 [E, n, K] or [n, K], contiguous, on the CPU, n a multiple of
    16) into the CPU tile layout (``to_tiles``; per 16 rows and 4 inputs, 64 bytes holding two vdpbf16ps operands of
    the 16 rows: kernels/cpu/csrc/fp8_tiles.h), or back to the checkpoint layout (exact). The scales keep their
    layout.

    Raises:
        RuntimeError: another dtype, device or shape.
    """
    build.load().fp8_tiles_relayout(packed, bool(to_tiles))


def fp8_experts_avx2(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, experts: torch.Tensor,
                     offsets: torch.Tensor, part_rows: int) -> torch.Tensor:
    """:func:`fp8_experts_linear` on AVX2 (kernels/cpu/csrc/fp8_linear_avx2.cpp: the FP8 expert path of CPUs without
    AVX512-BF16); runs where :func:`fp8_block_linear_avx2_applies`.

    Args:
        x: [N, K] float32, rows grouped by expert; K a multiple of 32. packed, scale, experts, offsets, part_rows:
            as :func:`fp8_experts_linear` takes them.

    Returns:
        [N, n] float32: float32 FMAs of x with the reference's float32 weights (e4m3 * scale_inv of the row's part
        block, rounded once). Segments of up to 16 rows run the GEMV over the e4m3 bytes; longer ones multiply 64-row
        converted panels with PyTorch's float32 GEMM.

    Raises:
        RuntimeError: another dtype, mis-shaped buffers, part_rows not dividing n, bad experts / offsets, or kernels
            built without AVX2 / FMA / F16C.
    """
    return build.load().fp8_experts_avx2(x, packed, scale, experts, offsets, int(part_rows))
