"""The FP8 block-scaled linear through PyTorch's block-scaled ``scaled_mm`` (cuBLASLt FP8 tensor cores), for bf16
activations on GPUs where it works: the speed path of kernels/gpu/fp8_linear.py, chosen by a probe.

DeepSeek-V3's inference recipe (its ``inference/kernel.py``: ``act_quant`` then ``fp8_gemm``): the activation
x [M, K] is quantized per 1 x 128 block, s[m, j] = amax(|x[m, 128j:128j+128]|) / 448 (448 = the largest e4m3fn
value; an all-zero block takes s = 1) and q = e4m3(x / s) (round to nearest even, IEEE division); the weight keeps
its published e4m3 codes and 128 x 128 block scales; then

    y[m, n] = sum_j s[m, j] * scale_inv[n // 128, j] * sum_{k in block j} q[m, k] * weight[n, k]

with float32 accumulation, rounded once to bf16. :func:`quantize_activation` is the small Triton kernel for the first
step; :func:`weight_scale_layout` and :func:`activation_scale_layout` put the scales where
``torch.nn.functional.scaled_mm`` (recipes ``ScalingType.BlockWise1x128`` for the activation and
``ScalingType.BlockWise128x128`` for the weight, ``SwizzleType.NO_SWIZZLE``) reads them, per its checks in
torch/_meta_registrations.py: the activation's [M, K / 128] with strides [1, M] (block-major), the weight's
[L4, N / 128] with strides [1, L4], L4 = K / 128 rounded up to a multiple of 4 (rows past K / 128 unused). The weight
goes in as ``weight.t()`` (column-major [K, N]); N and K must be multiples of 128.

The activation rounding (3 mantissa bits per element, relative 2^-4) is this path's price, so it serves bf16
activations only; float32 / fp16 activations and shapes it does not take stay on the exact Triton kernel.
:func:`scaled_mm_ready` runs a probe once per device (at load: Fp8BlockWeight.prepare; never inside a CUDA-graph
capture) that multiplies a small weight at M = 1 and 5 and compares with the formula above; any exception or
mismatch selects the Triton kernel for good. ``TOKENFAB_FP8_GEMM=triton`` turns this path off (``auto``, the
default, lets the probe decide).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
ENV = "TOKENFAB_FP8_GEMM"
_PROBED: dict[tuple[str, int], str | None] = {}  # (device type, index) -> None (passed) or why it failed


@triton.jit
def _e4m3_code(v):
    """float32 v with |v| <= 448 -> its e4m3fn code (int32), rounded to nearest even, with integer operations:
    normal results keep 3 mantissa bits of v's bits (the carry of the rounding may raise the exponent; bias 127 ->
    7), results below 2^-6 are multiples of 2^-9 (subnormal codes 0..8, 8 being 2^-6's code)."""
    u = v.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    r = a + 0x7FFFF + ((a >> 20) & 1)
    normal = (r >> 20) - (120 << 3)
    t = tl.abs(v) * 512.0
    sub = ((t + 8388608.0) - 8388608.0).to(tl.int32)  # round half to even at 2^23
    return tl.where(a < 0x3C800000, sub, normal) | sign


@triton.jit
def _act_quant(X, Q, S, M, K, s_xm, BLOCK_R: tl.constexpr, SOFT_FP8: tl.constexpr):
    pr = tl.program_id(0)
    kb = tl.program_id(1)
    r = pr * BLOCK_R + tl.arange(0, BLOCK_R)
    k = kb * 128 + tl.arange(0, 128)
    mask = (r < M)[:, None] & (k < K)[None, :]
    x = tl.load(X + r[:, None].to(tl.int64) * s_xm + k[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    s = tl.where(amax > 0, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
    q = tl.div_rn(x, s[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if SOFT_FP8:  # Triton's interpreter (its float8 conversion does not round to nearest)
        qb = _e4m3_code(q).to(tl.uint8)
    else:         # the GPU's conversion (round to nearest even, saturating)
        qb = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(Q + r[:, None].to(tl.int64) * K + k[None, :], qb, mask=mask)
    tl.store(S + kb.to(tl.int64) * M + r, s, mask=r < M)


def quantize_activation(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] (bf16 / fp16 / float32, rows contiguous) -> (q [M, K] float8_e4m3fn, s [M, ceil(K / 128)] float32
    with strides [1, M]) by the 1 x 128 block formula of the module docstring (a partial last block uses its real
    inputs only)."""
    M, K = x2.shape
    kb = triton.cdiv(K, 128)
    q = torch.empty(M, K, dtype=torch.uint8, device=x2.device)
    st = torch.empty(kb, M, dtype=torch.float32, device=x2.device)
    if M:
        block_r = 8
        _act_quant[(triton.cdiv(M, block_r), kb)](x2, q, st, M, K, x2.stride(0), BLOCK_R=block_r,
                                                  SOFT_FP8=x2.device.type != "cuda")
    return q.view(torch.float8_e4m3fn), st.t()


def activation_scale_layout(s: torch.Tensor) -> torch.Tensor:
    """Activation scales [M, KB] in any layout -> the same values with strides [1, M] (scaled_mm's
    BlockWise1x128 operand)."""
    return s.t().contiguous().t()


def weight_scale_layout(scale_inv: torch.Tensor) -> torch.Tensor:
    """Weight scales [N / 128, K / 128] float32 -> [L4, N / 128] with strides [1, L4] (L4 = K / 128 rounded up to a
    multiple of 4, the padding rows 1.0): scaled_mm's BlockWise128x128 operand for ``weight.t()``."""
    nb, kb = scale_inv.shape
    l4 = -(-kb // 4) * 4
    padded = torch.nn.functional.pad(scale_inv.float(), (0, l4 - kb), value=1.0)
    return padded.t()


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None,
                     mm_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] bf16 times the FP8 block weight by ``scaled_mm`` -> [..., N] bf16 (bias, if any, added after the
    product's rounding). N and K multiples of 128; call where :func:`applies`.

    Args:
        weight: [N, K] float8_e4m3fn (or its uint8 view). scale_inv: [N / 128, K / 128] float32.
        mm_scale: :func:`weight_scale_layout` of scale_inv made once, or None (made here).
    """
    F = torch.nn.functional
    N, K = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q, s = quantize_activation(x2)
    w = weight.view(torch.float8_e4m3fn) if weight.dtype != torch.float8_e4m3fn else weight
    sb = mm_scale if mm_scale is not None else weight_scale_layout(scale_inv)
    y = F.scaled_mm(q, w.t(), s, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                    swizzle_a=F.SwizzleType.NO_SWIZZLE, swizzle_b=F.SwizzleType.NO_SWIZZLE,
                    output_dtype=torch.bfloat16)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, N)


def reference(x2: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The formula of the module docstring in float32 from :func:`quantize_activation`'s q and s (the probe's and
    the GPU check's reference): [M, N] float32."""
    N, K = weight.shape
    q, s = quantize_activation(x2)
    xd = q.float() * s.repeat_interleave(128, 1)[:, :K]
    wd = weight.view(torch.float8_e4m3fn).float() * scale_inv.repeat_interleave(128, 0)[:N].repeat_interleave(
        128, 1)[:, :K]
    return xd @ wd.T


def _probe(device: torch.device) -> str | None:
    """None when block-scaled scaled_mm multiplies correctly on ``device``, else why not (one line)."""
    F = torch.nn.functional
    if device.type != "cuda" or torch.version.hip:
        return "not an NVIDIA CUDA device"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "block-scaled FP8 GEMMs need compute capability 9.0+"
    if not (hasattr(F, "scaled_mm") and "BlockWise128x128" in getattr(F, "ScalingType", object).__members__):
        return f"torch {torch.__version__} has no block-scaled torch.nn.functional.scaled_mm"
    try:
        g = torch.Generator(device=device).manual_seed(0)
        N, K = 256, 384  # K / 128 = 3: the weight scales padded to L4 = 4
        w = (torch.randn(N, K, device=device, generator=g) * 0.05).to(torch.float8_e4m3fn)
        s = torch.rand(N // 128, K // 128, device=device, generator=g) + 0.5
        for M in (1, 5):
            x = torch.randn(M, K, device=device, generator=g).to(torch.bfloat16)
            y = scaled_mm_linear(x, w, s, None)
            want = reference(x, w, s)
            err = float((y.float() - want).abs().max() / want.abs().max())
            if not err <= 1e-2:
                return f"scaled_mm differs from the block formula by {err:.2e} (relative) at M = {M}"
        torch.cuda.synchronize(device)
    except Exception as e:  # an unsupported build / GPU raises here: the Triton kernel serves instead
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return None


def probe_result(device: torch.device) -> str | None:
    """The probe's verdict for ``device``, running it once if needed (not while a CUDA graph is being captured:
    then "not probed yet" is returned and nothing is cached): None = scaled_mm serves bf16 FP8 linears here."""
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device()
           if device.type == "cuda" else 0)
    if key not in _PROBED:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return "not probed yet (a CUDA graph is being captured)"
        _PROBED[key] = _probe(device)
    return _PROBED[key]


def scaled_mm_ready(device: torch.device) -> bool:
    """True when :func:`probe_result` passed on ``device`` and ``TOKENFAB_FP8_GEMM`` is not ``triton``.

    Raises:
        ValueError: a ``TOKENFAB_FP8_GEMM`` other than auto / triton.
    """
    mode = os.environ.get(ENV, "auto")
    if mode not in ("auto", "triton"):
        raise ValueError(f"{ENV}={mode!r} is not understood; use auto (block-scaled scaled_mm where its probe "
                         "passes, the default) or triton (always the Triton kernel)")
    return mode == "auto" and probe_result(device) is None


def applies(x: torch.Tensor, N: int, K: int) -> bool:
    """Whether :func:`scaled_mm_linear` serves ``x [.., K]`` times an [N, K] FP8 block weight: bf16 x on a device
    where :func:`scaled_mm_ready`, N and K multiples of 128, at least one row."""
    return (x.dtype == torch.bfloat16 and N % 128 == 0 and K % 128 == 0 and x.numel() > 0
            and scaled_mm_ready(x.device))

