"""Triton kernels for the elementwise glue between the GEMMs on GPUs: RMSNorm with the residual add fused in
(vLLM's ``fused_add_rms_norm``, out of place), KDA's gated RMSNorm, SiLU-GLU, Kimi K3's SiTU-GLU and RoPE (both
layouts). Each replaces a chain of eager PyTorch ops (a norm alone
is a mean, an rsqrt and three multiplies; with its residual add, a separate add pass), one read and one write of
the activations instead of several.

They round as the PyTorch reference paths they replace (layers/norm.py, layers/activation.py, layers/rotary.py) do,
in x's dtype (RoPE: each product and the sum or difference rounded, cos / sin rounded first):
RMSNorm: h = x (+ residual, rounded to x's dtype), y = w * round(h * rsqrt(mean(h^2) + eps)) with float32
statistics; gated RMSNorm: round(w * x * rsqrt(mean(x^2) + eps) * sigmoid(gate)), all float32 (as
layers/kda.py's GatedRMSNorm); SiLU-GLU: round(round(silu(gate)) * up); SiTU-GLU all float32, rounded once
(models/kimi_moe.py ``situ_glu``). Checked against those paths in Triton's interpreter on CPU
(tests/test_triton_norm_activation.py); GPU timings come from ``benchmarks/gpu_check.sh``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_row(x, w_ptr, cols, mask, n, eps, dt: tl.constexpr):
    """RMSNorm of one loaded row ``x`` ([BLOCK], masked entries 0) with weight ``w_ptr[cols]`` as layers/norm.py
    rounds it: w * round_dt(x * rsqrt(mean(x^2) + eps)), float32 statistics; returned in float32 (the caller
    rounds). Shared by the kernels that norm a row on the way (rope_cache.py, mla_decode_glue.py)."""
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return w * (xf * rstd).to(dt).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, n_cols, eps, stride_x, stride_r, stride_y, stride_h,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the sum in x's dtype, as residual + x rounds
        tl.store(h_ptr + row * stride_h + cols, x, mask=mask)
    tl.store(y_ptr + row * stride_y + cols,
             rms_row(x, w_ptr, cols, mask, n_cols, eps, x.dtype).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [N, hidden] (unit stride along hidden; weight [hidden], x's dtype unless ``out_dtype``). With
    ``residual`` [N, hidden]: returns (norm(x + residual), x + residual), the sum rounded to x's dtype first.
    Outputs are new [N, hidden] tensors of x's dtype; ``out_dtype`` (no residual): the normed row w * h computed in
    float32 and rounded once to it (Kimi K3's latent norm of its float32 expert sum, then cast for the
    up-projection: ``RMSNorm(y).to(dtype)`` in one pass). One program per row (hidden up to 65,536)."""
    n, hidden = x.shape
    y = torch.empty_like(x) if out_dtype is None else torch.empty(n, hidden, dtype=out_dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else y
    r = residual if residual is not None else x
    block = triton.next_power_of_2(hidden)
    if n:
        _rms_norm_kernel[(n,)](x, r, weight, y, h, hidden, eps, x.stride(0), r.stride(0), y.stride(0), h.stride(0),
                               HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return (y, h) if residual is not None else y


@triton.jit
def gated_norm_row(x_row, g_row, w_ptr, y_row, offs, mask, D, eps, VOLATILE: tl.constexpr):
    """KDA's gated output norm of one token's head: (w * x / sqrt(mean(x^2) + eps)) * sigmoid(gate) in float32 over
    the D entries ``offs`` of ``x_row``, rounded once into ``y_row``'s dtype. ``VOLATILE``: x was stored by other
    programs of the same launch (kernels/gpu/kda.py's fused decode), read past the caches."""
    xf = tl.load(x_row + offs, mask=mask, other=0.0, volatile=VOLATILE).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32)
    y = (w * (xf * rstd)) * (1.0 / (1.0 + tl.exp(-g)))
    tl.store(y_row + offs, y.to(y_row.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, y_ptr, D, eps, stride_xt, stride_xh, stride_gt, stride_yt,
                           BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    gated_norm_row(x_ptr + t * stride_xt + h * stride_xh, g_ptr + t * stride_gt + h * D, w_ptr,
                   y_ptr + t * stride_yt + h * D, cols, cols < D, D, eps, False)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA's output norm (layers/kda.py ``GatedRMSNorm``): (w * x / sqrt(mean(x^2) + eps)) * sigmoid(gate) per head,
    all in float32, rounded once to x's dtype.

    Args:
        x: [T, H, D] (unit stride along D); gate: [T, H * D] (unit stride along the last dim; rows may be strided);
            weight: [D] (any float dtype).

    Returns:
        New [T, H * D] of x's dtype. One program per (token, head)."""
    T, H, D = x.shape
    y = torch.empty(T, H * D, dtype=x.dtype, device=x.device)
    if T and H:
        block = triton.next_power_of_2(D)
        _gated_rms_norm_kernel[(T, H)](x, gate, weight, y, D, eps, x.stride(0), x.stride(1), gate.stride(0),
                                       y.stride(0), BLOCK=block, num_warps=max(1, min(4, block // 128)))
    return y


@triton.jit
def _silu_and_mul_kernel(gu_ptr, y_ptr, n_cols, stride_gu, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # silu rounded to the dtype, as F.silu stores it
    tl.store(y_ptr + row * stride_y + cols, (s * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [N, 2I] laid out [gate | up] (unit stride along the last dim) -> new [N, I] of
    gate_up's dtype."""
    n, two_i = gate_up.shape
    inter = two_i // 2
    y = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if n and inter:
        _silu_and_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, y, inter, gate_up.stride(0), y.stride(0),
                                                               BLOCK=block, num_warps=4)
    return y


@triton.jit
def _sigmoid_mul_kernel(x_ptr, g_ptr, y_ptr, n_cols, stride_x, stride_g, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0)
    s = (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(g.dtype).to(tl.float32)  # sigmoid rounded, as torch stores it
    tl.store(y_ptr + row * stride_y + cols, (x.to(tl.float32) * s).to(x.dtype), mask=mask)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) for x, gate [N, C] (unit stride along C, one dtype) -> new [N, C]: the sigmoid rounded to
    the dtype, then the product rounded (as ``x * torch.sigmoid(gate)``), in one launch (K3's gated MLA output)."""
    n, c = x.shape
    y = torch.empty_like(x)
    block = 1024
    if n and c:
        _sigmoid_mul_kernel[(n, triton.cdiv(c, block))](x, gate, y, c, x.stride(0), gate.stride(0), y.stride(0),
                                                        BLOCK=block, num_warps=4)
    return y


@triton.jit
def tanh(x):
    """tanh in float32 from exp (no libdevice call, the same on CUDA, ROCm and the interpreter): sign(x) (1 - e) /
    (1 + e) with e = exp(-2 |x|)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _situ_and_mul_kernel(gu_ptr, y_ptr, n_cols, stride_gu, stride_y, beta, linear_beta, LINEAR: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    a = beta * tanh(gf / beta) * (1.0 / (1.0 + tl.exp(-gf)))
    if LINEAR:
        u = linear_beta * tanh(u / linear_beta)
    tl.store(y_ptr + row * stride_y + cols, (a * u).to(g.dtype), mask=mask)


def situ_and_mul(gate_up: torch.Tensor, beta: float, linear_beta: float | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Kimi K3's SiTU-GLU in one launch: beta tanh(gate / beta) sigmoid(gate) * (linear_beta tanh(up / linear_beta)
    if linear_beta else up), all in float32, rounded once, for gate_up [N, 2I] laid out [gate | up] (unit stride
    along the last dim) -> new [N, I] of gate_up's dtype (models/kimi_moe.py ``situ_glu``, Moonshot's
    ``SituAndMul``), or written into ``out`` ([N, I] of that dtype, unit stride along I, rows may be strided: a
    slice of a wider buffer) and returned."""
    n, two_i = gate_up.shape
    inter = two_i // 2
    if out is not None and (out.shape != (n, inter) or out.dtype != gate_up.dtype or out.stride(-1) != 1):
        raise ValueError(f"situ_and_mul: out {tuple(out.shape)} {out.dtype} is not [{n}, {inter}] "
                         f"{gate_up.dtype} with unit stride along its columns")
    y = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    block = 1024
    if n and inter:
        _situ_and_mul_kernel[(n, triton.cdiv(inter, block))](
            gate_up, y, inter, gate_up.stride(0), y.stride(0), float(beta),
            float(linear_beta) if linear_beta is not None else 1.0, LINEAR=linear_beta is not None, BLOCK=block,
            num_warps=4)
    return y


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, y_ptr, n_heads, half, stride_xt, stride_xh, stride_c,
                 INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    base = x_ptr + t * stride_xt + h * stride_xh
    if INTERLEAVE:  # pairs (2i, 2i + 1), written back as halves (DeepSeek-V3's layout)
        x1 = tl.load(base + 2 * offs, mask=mask, other=0.0)
        x2 = tl.load(base + 2 * offs + 1, mask=mask, other=0.0)
    else:  # halves (rotate_half)
        x1 = tl.load(base + offs, mask=mask, other=0.0)
        x2 = tl.load(base + half + offs, mask=mask, other=0.0)
    p = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + p * stride_c + offs, mask=mask, other=0.0).to(x1.dtype).to(tl.float32)
    s = tl.load(sin_ptr + p * stride_c + offs, mask=mask, other=0.0).to(x1.dtype).to(tl.float32)
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # each product and sum rounded to x's dtype, as the eager x1 * cos - x2 * sin in that dtype is
    r1 = ((a1 * c).to(x1.dtype).to(tl.float32) - (a2 * s).to(x1.dtype).to(tl.float32)).to(x1.dtype)
    r2 = ((a2 * c).to(x1.dtype).to(tl.float32) + (a1 * s).to(x1.dtype).to(tl.float32)).to(x1.dtype)
    out = y_ptr + (t * n_heads + h) * 2 * half
    tl.store(out + offs, r1, mask=mask)
    tl.store(out + half + offs, r2, mask=mask)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         interleave: bool) -> torch.Tensor:
    """Rotary embedding of x [T, heads, dim] (unit stride along dim) at positions [T] (int64) from float32 tables
    cos / sin [P, dim / 2] (rounded to x's dtype first, as transformers does) -> a new contiguous [T, heads, dim] of
    x's dtype. ``interleave``: pairs (2i, 2i + 1) rotated and written as halves (DeepSeek-V3); else halves."""
    T, H, D = x.shape
    y = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T and H:
        _rope_kernel[(T, H)](x, positions, cos, sin, y, H, D // 2, x.stride(0), x.stride(1), cos.stride(0),
                             INTERLEAVE=interleave, BLOCK=triton.next_power_of_2(max(1, D // 2)), num_warps=1)
    return y
