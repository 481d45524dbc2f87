"""y = x W^T for an FP8 block-scaled weight (DeepSeek-V3 / Kimi-K2 as published) kept packed, in Triton (CUDA/ROCm).

W [N, K] is stored as ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv`` float32 [ceil(N / 128), ceil(K / 128)];
W[n, k] = float(weight[n, k]) * scale_inv[n // 128, k // 128] (DeepSeek-V3's ``weight_dequant``, partial edge blocks
included). One program computes a [BLOCK_M, BLOCK_N] output tile: per BLOCK_K inputs it loads the FP8 bytes, decodes
E4M3FN in registers with integer operations (sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0 is
subnormal, S.1111.111 is NaN; OCP 8-bit floating point spec, section 4.1), multiplies by the block's scale and
accumulates ``tl.dot`` in IEEE float32. The bytes are read as uint8, so the same code runs in Triton's interpreter
(no FP8 in numpy) and on GPUs without FP8 tensor cores; on those that have them, an FP8 tensor-core GEMM with
per-block activation scales is the faster form (not built yet: the weight-only path keeps activations exact).

Reference and fallback: the dequantize-then-``F.linear`` path of the FP8 weight format (tests/test_triton_fp8.py
runs both in the interpreter, against the formula written out independently).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenfab.kernels.gpu.support import launch_linear

FP8_BLOCK = 128


@triton.jit
def _e4m3_to_f32(b):
    """uint8 E4M3FN codes (as int32) -> float32 values, exactly."""
    s = (b >> 7) & 1
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = ((s << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # 2^-9: m/8 * 2^(1 - 7)
    sub = tl.where(s == 1, -sub, sub)
    v = tl.where(e == 0, sub, normal)
    return tl.where((e == 15) & (m == 7), float("nan"), v)


@triton.jit
def _fp8_gemm(X, W, S, Y, BIAS, M, N, K, s_xm, s_wn, s_sn, s_ym,
              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pn = tl.program_id(0)
    pm = tl.program_id(1)
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = m < M
    nmask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        b = tl.load(W + n[:, None].to(tl.int64) * s_wn + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0).to(tl.int32)
        sc = tl.load(S + (n[:, None] // 128) * s_sn + kk[None, :] // 128, mask=nmask[:, None] & kmask[None, :],
                     other=0.0)
        w = _e4m3_to_f32(b) * sc
        x = tl.load(X + m[:, None].to(tl.int64) * s_xm + kk[None, :], mask=mmask[:, None] & kmask[None, :],
                    other=0.0)
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None].to(tl.int64) * s_ym + n[None, :], acc.to(Y.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float32 / bf16 / fp16) times an FP8 block-scaled weight -> [..., N] in x's dtype.

    Args:
        weight: [N, K] float8_e4m3fn (or its uint8 view), on x's device.
        scale_inv: [ceil(N / 128), ceil(K / 128)] float32.
        bias: [N] or None (added in float32 before the one rounding to x's dtype).

    Raises:
        ValueError: shapes that do not describe one [N, K] weight with 128 x 128 scale blocks.
    """
    N, K = weight.shape
    if x.shape[-1] != K or scale_inv.shape != (-(-N // FP8_BLOCK), -(-K // FP8_BLOCK)):
        raise ValueError(f"FP8 weight {tuple(weight.shape)} with weight_scale_inv {tuple(scale_inv.shape)} does not "
                         f"match inputs of width {x.shape[-1]} (one float32 scale per 128 x 128 block expected)")
    w8 = (weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight).contiguous()

    def launch(x2: torch.Tensor, y: torch.Tensor, block_m: int) -> None:
        M = x2.shape[0]
        s = scale_inv.float().contiguous()
        block_n, block_k = 64, 64
        _fp8_gemm[(triton.cdiv(N, block_n), triton.cdiv(M, block_m))](
            x2, w8, s, y, bias if bias is not None else y, M, N, K, x2.stride(0), w8.stride(0), s.stride(0),
            y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)

    return launch_linear(x, N, launch)
