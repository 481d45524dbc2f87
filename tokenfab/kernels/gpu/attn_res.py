"""Kimi K3's block attention-residual mix in one Triton launch (CUDA/ROCm), replacing the dozen eager ops of
models/kimi_linear.py ``attn_res_mix`` (stack, cast, square, mean, rsqrt, two multiplies, sum, softmax, matmul, cast)
that run twice in every K3 decoder layer.

Per token (one program): the sources V = [blocks..., prefix] (up to :data:`MAX_BLOCKS` completed block sums, read
where they are: no stacked copy), each source's logit sum_d (V_n / rms(V_n))[d] * w[d] with w = norm.weight *
proj.weight (float32, :func:`mix_weight`), the softmax over the sources, and sum_n p_n V_n, all in float32 with one
rounding to the prefix's dtype (arXiv:2603.15031, Moonshot's ``_apply_attn_res``). The sources are read twice (the
logits, then the sum): 2 (N + 1) H elements per token, against the reference's stack, casts and separate passes.

With ``delta`` the launch also does the layer's residual add before the mix (``cur + a``), and with a norm weight
the RMSNorm that the layer applies to the mix next (its input or post-attention norm, layers/norm.py's roundings:
the mix rounded to the prefix's dtype, then w * round(h * rsqrt(mean(h^2) + eps))): one launch fewer each.
Reference and fallback: ``attn_res_mix`` (tests/test_triton_attn_res.py runs both in Triton's interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenfab.kernels.gpu.norm_activation import rms_row

MAX_BLOCKS = 8  # completed blocks one launch reads (K3: 93 layers in blocks of 12 make at most 8)


@triton.jit
def _block(n: tl.constexpr, b0, b1, b2, b3, b4, b5, b6, b7):
    """Base pointer of completed block n (n < 8)."""
    if n == 0:
        return b0
    elif n == 1:
        return b1
    elif n == 2:
        return b2
    elif n == 3:
        return b3
    elif n == 4:
        return b4
    elif n == 5:
        return b5
    elif n == 6:
        return b6
    else:
        return b7


@triton.jit
def _source_row(n: tl.constexpr, xp, b0, b1, b2, b3, b4, b5, b6, b7, N: tl.constexpr, off, mask):
    """Source n's row as float32: completed block n (loaded at ``off``) for n < N, the prefix row ``xp`` (already
    loaded) for n == N."""
    if n == N:
        x = xp
    else:
        x = tl.load(_block(n, b0, b1, b2, b3, b4, b5, b6, b7) + off, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _attn_res_mix_kernel(p_ptr, d_ptr, c_ptr, b0, b1, b2, b3, b4, b5, b6, b7, w_ptr, nw_ptr, y_ptr, H, stride_t, eps,
                         norm_eps, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
                         HAS_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    src = tl.arange(0, NP)
    logits = tl.full([NP], float("-inf"), tl.float32)
    off = t * stride_t + cols
    xp = tl.load(p_ptr + off, mask=mask, other=0.0)
    if HAS_DELTA:  # the prefix is prefix + delta, rounded to its dtype as the eager add, written to c_ptr
        xp = (xp.to(tl.float32) + tl.load(d_ptr + off, mask=mask, other=0.0).to(tl.float32)).to(xp.dtype)
        tl.store(c_ptr + off, xp, mask=mask)
    xp = xp.to(tl.float32)
    for n in tl.static_range(N + 1):
        x = _source_row(n, xp, b0, b1, b2, b3, b4, b5, b6, b7, N, off, mask)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        logits = tl.where(src == n, tl.sum(x * r * w, axis=0), logits)
    e = tl.exp(logits - tl.max(logits, axis=0))
    p = e / tl.sum(e, axis=0)
    acc = tl.zeros([BLOCK], tl.float32)
    for n in tl.static_range(N + 1):
        x = _source_row(n, xp, b0, b1, b2, b3, b4, b5, b6, b7, N, off, mask)
        acc += tl.sum(tl.where(src == n, p, 0.0), axis=0) * x
    y = acc.to(p_ptr.dtype.element_ty)
    if HAS_NORM:  # the layer's next RMSNorm on the rounded mix, as layers/norm.py rounds it
        y = rms_row(y, nw_ptr, cols, mask, H, norm_eps, p_ptr.dtype.element_ty).to(p_ptr.dtype.element_ty)
    tl.store(y_ptr + t * stride_t + cols, y, mask=mask)


def mix_weight(norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """w = norm.weight * proj.weight as float32 [H] (the pseudo-query folded into the norm's weight)."""
    return (norm_weight.float() * proj_weight.reshape(-1).float()).contiguous()


def applies(prefix: torch.Tensor, blocks: list[torch.Tensor], delta: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None) -> bool:
    """Whether :func:`attn_res_mix` takes these sources: 2-D [T, H] tensors of one dtype and shape, contiguous, at
    most MAX_BLOCKS blocks (and ``delta``, when given, like the prefix; ``norm_weight``, when given, [H] of the
    prefix's dtype)."""
    return (prefix.dim() == 2 and prefix.is_contiguous() and len(blocks) <= MAX_BLOCKS
            and all(b.shape == prefix.shape and b.dtype == prefix.dtype and b.is_contiguous()
                    for b in [*blocks, *([] if delta is None else [delta])])
            and (norm_weight is None or (norm_weight.shape == prefix.shape[1:] and norm_weight.dtype == prefix.dtype
                                         and norm_weight.is_contiguous())))


def attn_res_mix(prefix: torch.Tensor, blocks: list[torch.Tensor], w: torch.Tensor, eps: float,
                 delta: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """sum_n p_n V_n over V = [blocks..., prefix], p = softmax_n(sum_d (V_n / rms(V_n))[d] w[d]), float32 inside.

    Args:
        prefix: [T, H] (any float dtype, contiguous); blocks: completed block sums, each like prefix (call where
            :func:`applies`).
        w: float32 [H], :func:`mix_weight`; eps: the norm's epsilon.
        delta: optional [T, H] like prefix: the prefix is then ``prefix + delta`` (the layer's residual add, in the
            prefix's dtype as the eager add rounds it), computed in the same launch.
        norm: optional (weight [H] of the prefix's dtype, eps): the RMSNorm applied to the mix in the same launch
            (the mix rounded to the prefix's dtype first, then layers/norm.py's roundings).

    Returns:
        [T, H] in prefix's dtype, the mix rounded once (or its norm); with ``delta``: (that, the new prefix
        ``prefix + delta``).
    """
    T, H = prefix.shape
    y = torch.empty_like(prefix)
    cur = None if delta is None else torch.empty_like(prefix)
    if T and H:
        ptrs = list(blocks) + [prefix] * (MAX_BLOCKS - len(blocks))
        block = triton.next_power_of_2(H)
        _attn_res_mix_kernel[(T,)](prefix, prefix if delta is None else delta, prefix if cur is None else cur,
                                   *ptrs, w, w if norm is None else norm[0], y, H, prefix.stride(0), float(eps),
                                   1.0 if norm is None else float(norm[1]), N=len(blocks),
                                   NP=triton.next_power_of_2(len(blocks) + 1), BLOCK=block,
                                   HAS_DELTA=delta is not None, HAS_NORM=norm is not None,
                                   num_warps=max(1, min(8, block // 512)))
    return y if delta is None else (y, cur)
