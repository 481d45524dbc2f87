"""Triton kernels for the elementwise glue between the GEMMs on GPUs: RMSNorm with the residual add fused in
(vLLM's ``fused_add_rms_norm``, out of place) and SiLU-GLU. Each replaces a chain of eager PyTorch ops (a norm alone
is a mean, an rsqrt and three multiplies; with its residual add, a separate add pass), one read and one write of
the activations instead of several.

Both round as the PyTorch reference paths they replace (layers/norm.py, layers/activation.py) do, in x's dtype:
RMSNorm: h = x (+ residual, rounded to x's dtype), y = w * round(h * rsqrt(mean(h^2) + eps)) with float32
statistics; SiLU-GLU: round(round(silu(gate)) * up). Checked against those paths in Triton's interpreter on CPU
(tests/test_triton_norm_activation.py); GPU timings come from ``benchmarks/gpu_check.sh``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (w * normed).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [N, hidden] (unit stride along hidden; weight [hidden] of x's dtype). With ``residual``
    [N, hidden]: returns (norm(x + residual), x + residual), the sum rounded to x's dtype first. Outputs are new
    [N, hidden] tensors of x's dtype. One program per row (hidden up to 65,536)."""
    n, hidden = x.shape
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else y
    r = residual if residual is not None else x
    block = triton.next_power_of_2(hidden)
    if n:
        _rms_norm_kernel[(n,)](x, r, weight, y, h, hidden, eps, x.stride(0), r.stride(0), y.stride(0), h.stride(0),
                               HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return (y, h) if residual is not None else y


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
