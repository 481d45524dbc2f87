"""y = x W^T for an FP8 block-scaled weight (DeepSeek-V3 / Kimi-K2 as published) kept packed, in Triton (CUDA/ROCm).

W [N, K] is stored as ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv`` float32 [ceil(N / 128), ceil(K / 128)];
W[n, k] = float(weight[n, k]) * scale_inv[n // 128, k // 128] (DeepSeek-V3's ``weight_dequant``, partial edge blocks
included). Two paths, chosen per call:

* bf16 activations on a GPU where PyTorch's block-scaled ``scaled_mm`` passes its load-time probe
  (kernels/gpu/fp8_scaled_mm.py; cuBLASLt on SM90): the activation is quantized per 1 x 128 block to e4m3 and the
  FP8 tensor cores multiply (DeepSeek-V3's own inference recipe; the activation rounding is the price).
* everywhere else, and as the fallback, the Triton kernel below, which keeps the activation exact: one program
  computes a [BLOCK_M, BLOCK_N] output tile over one slice of K (split-K at small M, kernels/gpu/split_k.py). Its K
  loop steps one 128 x 128 scale block at a time: it loads the tile's FP8 bytes (BLOCK_N rows of 128 contiguous
  bytes), converts them to the activation's dtype (every e4m3 value is exact in bf16, fp16 and float32), takes the
  partial product ``tl.dot`` over those 128 inputs (bf16 / fp16 on tensor cores with float32 accumulation; IEEE
  float32 for float32 activations) and adds it times the block's one scale, loaded once per (row block, k block)
  since BLOCK_N divides 128. E4M3FN is converted by the hardware where Triton has it (NVIDIA SM 8.9+, ROCm) and
  otherwise with integer operations (sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0 is subnormal,
  S.1111.111 is NaN; OCP 8-bit floating point spec, section 4.1). One activation row (decode at batch 1) takes a
  CUDA-core variant instead (``_fp8_gemv``: float32 products per thread with the block scale folded into the 128
  activations, row sums after the K loop; about 3.5 instructions per weight on sm_90 against about 6 through the
  tensor cores). Tile sizes, warps and pipeline stages are autotuned per (M bucket, N, K, split, dtypes) on a GPU;
  Triton's interpreter runs the first config.

Reference and fallback: the dequantize-then-``F.linear`` path of the FP8 weight format (tests/test_triton_fp8.py
runs both in the interpreter, against the formula written out independently).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenfab.kernels.gpu import split_k
from tokenfab.kernels.gpu.split_k import store_row, store_tile
from tokenfab.kernels.gpu.support import autotune_configs, interpreting, launch_linear, quick_bench

FP8_BLOCK = 128
NOMINAL_BLOCK_N = 32  # the tile width the split-K choice assumes (autotuning may pick another)


@triton.jit
def e4m3_to_f32(b):
    """uint8 E4M3FN codes (as int32) -> float32 values, exactly."""
    s = (b >> 7) & 1
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = ((s << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # 2^-9: m/8 * 2^(1 - 7)
    sub = tl.where(s == 1, -sub, sub)
    v = tl.where(e == 0, sub, normal)
    return tl.where((e == 15) & (m == 7), float("nan"), v)


def _configs() -> list:
    """BLOCK_N (a divisor of 128), warps, stages of the tile kernel (benchmarks/linear_sass.py: none spills on
    sm_90): a new (M bucket, N, K) costs their short benchmarks once per process, each config compiled once per
    specialization."""
    space = [(32, 4, 4), (64, 4, 4), (64, 8, 3)]
    return autotune_configs([triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s) for bn, w, s in space])


@triton.autotune(configs=_configs(), key=["MB", "N", "K", "SPLIT"], do_bench=quick_bench)
@triton.jit
def _fp8_gemm(X, W, S, OUT, BIAS, M, N, K, s_xm, s_wn, s_sn, STEPS, MB, SPLIT,
              HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, NATIVE_FP8: tl.constexpr, DOT_F32: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pn = tl.program_id(0)
    pm = tl.program_id(1)
    ps = tl.program_id(2)
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    kr = tl.arange(0, 128)
    mmask = m < M
    nmask = n < N
    w_rows = W + n[:, None].to(tl.int64) * s_wn
    x_rows = X + m[:, None].to(tl.int64) * s_xm
    s_row = S + ((pn * BLOCK_N) // 128) * s_sn  # BLOCK_N divides 128: one scale row per tile
    kb0 = ps * STEPS
    kb1 = tl.minimum(kb0 + STEPS, tl.cdiv(K, 128))
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(kb0, kb1):
        kk = kb * 128 + kr
        kmask = kk < K
        b = tl.load(w_rows + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0)
        x = tl.load(x_rows + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if NATIVE_FP8:
            w = b.to(tl.float8e4nv, bitcast=True)
        else:
            w = e4m3_to_f32(b.to(tl.int32))
        if DOT_F32:  # float32 activations, or the interpreter (whose bf16 dot is not exact): IEEE float32
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:        # bf16 / fp16 tensor cores, float32 accumulation
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
        acc += part * tl.load(s_row + kb)
    store_tile(OUT, BIAS, acc, ps, m, n, M, N, mmask, nmask, PARTIAL, HAS_BIAS)


def _gemv_configs() -> list:
    """BLOCK_N (a divisor of 128), warps, stages of the one-row kernel."""
    space = [(32, 4, 4), (64, 4, 3), (64, 8, 4)]
    return autotune_configs([triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s) for bn, w, s in space])


@triton.autotune(configs=_gemv_configs(), key=["N", "K", "SPLIT"], do_bench=quick_bench)
@triton.jit
def _fp8_gemv(X, W, S, OUT, BIAS, N, K, s_wn, s_sn, STEPS, SPLIT,
              HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, NATIVE_FP8: tl.constexpr, BLOCK_N: tl.constexpr):
    """One activation row (decode at batch 1) on the CUDA cores: each thread keeps float32 products of its
    [BLOCK_N, 128] elements, the block's scale folded into the 128 activations it multiplies, and the row sums are
    taken once after the K loop (no tensor-core operand shuffles, no per-block reductions)."""
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    kr = tl.arange(0, 128)
    nmask = n < N
    w_rows = W + n[:, None].to(tl.int64) * s_wn
    s_row = S + ((pn * BLOCK_N) // 128) * s_sn
    kb0 = ps * STEPS
    kb1 = tl.minimum(kb0 + STEPS, tl.cdiv(K, 128))
    acc = tl.zeros([BLOCK_N, 128], tl.float32)
    for kb in range(kb0, kb1):
        kk = kb * 128 + kr
        kmask = kk < K
        b = tl.load(w_rows + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0)
        if NATIVE_FP8:
            w = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            w = e4m3_to_f32(b.to(tl.int32))
        xs = tl.load(X + kk, mask=kmask, other=0.0).to(tl.float32) * tl.load(s_row + kb)
        acc += w * xs[None, :]
    y = tl.sum(acc, axis=1)
    store_row(OUT, BIAS, y, ps, n, N, nmask, PARTIAL, HAS_BIAS)


def native_fp8(device: torch.device) -> bool:
    """Whether Triton converts float8e4nv on ``device`` itself: NVIDIA compute capability 8.9+ (in hardware) and
    ROCm (Triton's AMD backend: in hardware on CDNA4, emulated before). Elsewhere, and in the interpreter, the
    integer decoding (exact for every code, NaN included)."""
    if device.type != "cuda":
        return False
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _block_m(M: int) -> int:
    """Activation rows per tile: 16 (the smallest tensor-core tile) up to 16 rows, 32 up to 32, else 64."""
    return 16 if M <= 16 else 32 if M <= 32 else 64


def _m_bucket(M: int) -> int:
    """The autotuning key for M: the next power of two up to 128, then 128 (configs tuned once per bucket)."""
    return min(triton.next_power_of_2(max(M, 1)), 128)


def triton_fp8_linear(x2: torch.Tensor, w8: torch.Tensor, scale_inv: torch.Tensor, y: torch.Tensor,
                      bias: torch.Tensor | None, split: int | None = None) -> None:
    """Fill y [M, N] (contiguous, x2's dtype) with x2 [M, K] (contiguous) times the FP8 block weight by the Triton
    kernel; ``split``: slices of K (None: :func:`split_k.choose_split`; tests force values)."""
    M, K = x2.shape
    N = w8.shape[0]
    kb = triton.cdiv(K, FP8_BLOCK)
    block_m = _block_m(M)
    if split is None:
        split = split_k.choose_split(triton.cdiv(N, NOMINAL_BLOCK_N) * triton.cdiv(M, block_m), kb, x2.device,
                                     max_split=split_k.max_split_for(N * K, M, N))
    steps = split_k.steps_per_split(kb, split)
    split = triton.cdiv(kb, steps)  # no empty slice
    out = split_k.partial_buffer(split, M, N, x2.device) if split > 1 else y
    s = scale_inv if scale_inv.dtype == torch.float32 and scale_inv.is_contiguous() else \
        scale_inv.float().contiguous()

    if M == 1:
        _fp8_gemv[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), split)](
            x2, w8, s, out, bias if bias is not None else y, N, K, w8.stride(0), s.stride(0), steps, split,
            HAS_BIAS=bias is not None, PARTIAL=split > 1, NATIVE_FP8=native_fp8(x2.device))
        if split > 1:
            split_k.reduce_partials(out, y, bias)
        return

    def grid(meta):
        return triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, block_m), split

    _fp8_gemm[grid](x2, w8, s, out, bias if bias is not None else y, M, N, K, x2.stride(0), w8.stride(0),
                    s.stride(0), steps, _m_bucket(M), split, HAS_BIAS=bias is not None, PARTIAL=split > 1,
                    NATIVE_FP8=native_fp8(x2.device),
                    DOT_F32=x2.dtype == torch.float32 or interpreting(), BLOCK_M=block_m)
    if split > 1:
        split_k.reduce_partials(out, y, bias)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None, mm_scale: torch.Tensor | None = None,
                     split: int | None = None) -> torch.Tensor:
    """x [..., K] (float32 / bf16 / fp16) times an FP8 block-scaled weight -> [..., N] in x's dtype.

    bf16 x on a GPU whose block-scaled ``scaled_mm`` passed the probe (and N, K multiples of 128) goes through it
    (kernels/gpu/fp8_scaled_mm.py: activation quantized per 1 x 128 block, bias added after the product's
    rounding); everything else through the Triton kernel (activation exact, bias added in float32 before the one
    rounding to x's dtype).

    Args:
        weight: [N, K] float8_e4m3fn (or its uint8 view), on x's device.
        scale_inv: [ceil(N / 128), ceil(K / 128)] float32.
        bias: [N] or None.
        mm_scale: the weight scales in scaled_mm's layout (:func:`fp8_scaled_mm.weight_scale_layout`, made once at
            load), or None (made per call when the scaled_mm path runs).
        split: force the Triton kernel with this many K slices (tests, benchmarks); None chooses.

    Raises:
        ValueError: shapes that do not describe one [N, K] weight with 128 x 128 scale blocks.
    """
    N, K = weight.shape
    if x.shape[-1] != K or scale_inv.shape != (-(-N // FP8_BLOCK), -(-K // FP8_BLOCK)):
        raise ValueError(f"FP8 weight {tuple(weight.shape)} with weight_scale_inv {tuple(scale_inv.shape)} does not "
                         f"match inputs of width {x.shape[-1]} (one float32 scale per 128 x 128 block expected)")
    if split is None and x.dtype == torch.bfloat16 and x.device.type == "cuda":
        from tokenfab.kernels.gpu import fp8_scaled_mm
        if fp8_scaled_mm.applies(x, N, K):
            return fp8_scaled_mm.scaled_mm_linear(x, weight, scale_inv, bias, mm_scale)
    w8 = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    if not w8.is_contiguous():
        w8 = w8.contiguous()
    return launch_linear(x, N, lambda x2, y, _block_m: triton_fp8_linear(x2, w8, scale_inv, y, bias, split))
