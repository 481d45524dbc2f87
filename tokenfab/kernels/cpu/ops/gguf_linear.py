"""Linears over GGUF block types kept packed (csrc/gguf_linear.cpp, gguf_gemv.h, gguf_gemv_i8.h on AVX512-BF16;
csrc/gguf_gemv_avx2.cpp on AVX2), and the opt-in int8-activation GEMV's setting.
"""
from __future__ import annotations

import os

import torch

from tokenfab.kernels.cpu import build
from tokenfab.kernels.cpu.ops import support


def gguf_linear_applies() -> bool:
    """True when :func:`gguf_linear` runs: built kernels with AVX512-BF16 dot products."""
    m = build.load()
    return bool(m is not None and support.has_bf16_dot() and hasattr(m, "gguf_linear"))


AVX2_GEMV_TYPES = (2, 3, 8, 12, 13, 14)  # Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K: the ggml types gguf_gemv_avx2 reads
AVX2_GEMV_MAX_ROWS = 16  # rows up to which the packed GEMV runs where the AVX2 kernel is the packed path


def gguf_gemv_avx2_applies(ggml_type: int) -> bool:
    """True when :func:`gguf_gemv_avx2` runs for this ggml type: kernels built with AVX2 + FMA + F16C, and no
    AVX512-BF16 GEMV selected (``TOKENFAB_CPU_ISA`` at ``avx2``, or a CPU without it: :func:`gguf_linear_applies`
    False); Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K."""
    m = build.load()
    return bool(m is not None and getattr(m, "gguf_gemv_avx2_built", False) and not gguf_linear_applies()
                and int(ggml_type) in AVX2_GEMV_TYPES)


def gguf_gemv_avx2(x: torch.Tensor, tiles: torch.Tensor, ggml_type: int, n: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for W [n, K] in Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K packed as tiles (as
    :func:`gguf_linear`), on AVX2: csrc/gguf_gemv_avx2.cpp, the packed path of CPUs without AVX512-BF16.

    Args:
        x: [..., K] float32, K a multiple of the block (32; 256 for K-quants). tiles: uint8 [ceil(n / 16),
            K / block, tile-block bytes]. ggml_type: 2, 3, 8, 12, 13 or 14. n: output features. bias: [n] (any
            float dtype) or None.

    Returns:
        [..., n] float32: per 32-input block (K-quant scale group) sum_k x_k q_k (float32 FMAs on the integer
        quants) scaled by d (d sc), + m (-(dmin m)) * the block's x sum (Q4_1, Q4_K, Q5_K; Q4_0 as m = -8 d),
        + bias: gguf's dequantized weight times x in float32 arithmetic. One row streams the packed bytes once with
        the quants unpacked in registers; up to 16 rows unpack each (sub-)block once into an L1 buffer shared by
        pairs of rows; more rows multiply panels of gguf's dequantized values with PyTorch's float32 GEMM.

    Raises:
        RuntimeError: another dtype or ggml type, mis-shaped tiles, or kernels built without AVX2 / FMA / F16C
            (check :func:`gguf_gemv_avx2_applies`).
    """
    return build.load().gguf_gemv_avx2(x, tiles, int(ggml_type), int(n), bias)


INT8_ENV = "TOKENFAB_GGUF_INT8_ACT"


def gguf_int8_setting() -> bool:
    """``TOKENFAB_GGUF_INT8_ACT`` read: unset, empty or ``0`` False (the default: exact bf16 products), ``1`` True.

    Raises:
        EngineConfigError: any other value (the message names the variable and its two values).
    """
    value = os.environ.get(INT8_ENV, "").strip()
    if value not in ("", "0", "1"):
        from tokenfab.errors import EngineConfigError
        raise EngineConfigError(f"{INT8_ENV}={value!r} is not a setting; use 1 (int8 activations for packed Q4_0 / "
                                "Q4_1 / Q8_0 decode batches of 5-16 rows) or 0 (exact bf16 products, the default).")
    return value == "1"


def gguf_int8_available() -> bool:
    """True when this machine's kernels can run :func:`gguf_linear`'s int8-activation GEMV: built with AVX512-VNNI,
    AVX512-BF16 dot products allowed, and no AMX path (AMX tiles run those rows exactly and faster)."""
    from tokenfab.kernels.cpu import isa
    m = build.load()
    return bool(gguf_linear_applies() and getattr(m, "gguf_int8_built", False) and isa.selected_level() != "amx")


def gguf_int8_activations(on: bool | None = None) -> bool:
    """The setting whether bf16 x of 5..16 rows of a Q4_0 / Q4_1 / Q8_0 :func:`gguf_linear` runs on int8
    activations where :func:`gguf_int8_available` (see :func:`gguf_linear`); sets it when ``on`` is not None and
    returns the value before. Starts from ``TOKENFAB_GGUF_INT8_ACT`` (:func:`gguf_int8_setting`). False without
    built kernels."""
    m = build.load()
    if m is None or not hasattr(m, "gguf_int8_activations"):
        return False
    return bool(m.gguf_int8_activations(-1 if on is None else int(bool(on))))


def gguf_int8_path(ggml_type: int, rows: int, dtype: torch.dtype) -> bool:
    """True when :func:`gguf_linear` of ``rows`` rows of ``dtype`` x on ``ggml_type`` takes the int8-activation
    GEMV here: bf16 x of 5..16 rows, Q4_0 / Q4_1 / Q8_0, :func:`gguf_int8_available` and the setting on."""
    return (dtype == torch.bfloat16 and 5 <= rows <= 16 and int(ggml_type) in (2, 3, 8) and gguf_int8_available()
            and gguf_int8_activations())


def gguf_linear(x: torch.Tensor, tiles: torch.Tensor, ggml_type: int, n: int,
                bias: torch.Tensor | None = None, out_f32: bool = False) -> torch.Tensor:
    """y = x W^T (+ bias) with W [n, K] in a GGUF block type, packed as tiles (tokenfab.quant.gguf_blocks).

    Args:
        x: [..., K] bf16 or float32 (last dim contiguous), K a multiple of 32 (256 for the K-quants).
        tiles: uint8 [ceil(n / 16), K / 32 (K / 256), 16 * block bytes] from ``gguf_blocks.pack_tiles``.
        ggml_type: 2 (Q4_0), 3 (Q4_1), 8 (Q8_0), 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K). n: output features. bias: [n]
            (any float dtype) or None. out_f32: float32 outputs (the accumulator, unrounded) for bf16 x too.

    Returns:
        [..., n] in x's dtype (float32 with ``out_f32``): per 32-input block the exact products of x and the integer quants summed in float32,
        scaled by the block's d (+ m * the block sum of x for Q4_1; K-quants: d * sc - dmin * m * the sub-block sum
        of x, Q6_K a scale per 16 inputs), + bias, one rounding per output. The K-quants never take the AMX path. Float32 x is
        split into three bf16 parts, so it keeps float32 accuracy. Up to 16 rows run a GEMV that streams the packed
        bytes once (decode); more rows dequantize 32 weight rows at a time into a thread-local buffer for oneDNN's
        brgemm (prefill); on CPUs with AMX, bf16 x of 5..16 rows on Q4_0 / Q4_1 / Q8_0 with bf16 outputs runs one
        AMX tile product per GGUF block instead of the GEMV (more rows still take the brgemm). Opt-in (``TOKENFAB_GGUF_INT8_ACT=1``), without AMX, bf16 x of 5..16 rows on Q4_0 / Q4_1 / Q8_0
        runs on int8 activations (:func:`gguf_int8_path`; csrc/gguf_gemv_i8.h): each row quantized per 32 inputs
        to int8 with scale dx = max |x| / 127 (llama.cpp's Q8_0 activations), the integer products exact, so x
        differs from the exact product's by at most dx / 2 per input. benchmarks/gguf_linear.py measures them against :func:`vnni_linear`.

    Raises:
        RuntimeError: shapes or dtypes outside the above, or kernels without AVX512-BF16 (check
            :func:`gguf_linear_applies` first).
    """
    return build.load().gguf_linear(x, tiles, int(ggml_type), int(n), bias, bool(out_f32))
