"""Per-head bf16 matmuls on VNNI-paired weights (csrc/head_gemm.cpp): MLA's absorbed decode products q_nope W_UK and
o_lat W_UV.
"""
from __future__ import annotations

import torch

from tokenfab.kernels.cpu import build
from tokenfab.kernels.cpu.ops import support


def pack_head_weights(w: torch.Tensor) -> torch.Tensor:
    """Per-head weights w [G, K, N] (K even) -> the VNNI pair layout [G, K / 2, Np, 2] of :func:`head_gemm_`, N
    zero-padded to Np, the next multiple of 16."""
    G, K, N = w.shape
    w = torch.nn.functional.pad(w, (0, -N % 16))
    return w.reshape(G, K // 2, 2, w.shape[2]).transpose(2, 3).contiguous()


def head_gemm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when :func:`head_gemm_` runs for activations like ``x`` and per-head weights ``w`` [G, K, N]: built
    kernels with AVX512-BF16 dot products, bf16 CPU tensors and K even."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and w.shape[1] % 2 == 0 and support.has_bf16_dot())


def head_gemm_(x: torch.Tensor, w_packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[b, g, :] = x[b, g, :] @ W_g for every head g: MLA's absorbed-decode matmuls (q_nope W_UK, o_lat W_UV).

    Args:
        x: [B, G, K] bf16, last dim contiguous (any other strides).
        w_packed: :func:`pack_head_weights` of W [G, K, N] (N padded to a multiple of 16 there; only N are written).
        out: [B, G, N] bf16, last dim contiguous (may be a column slice of a wider buffer); written in place.

    Returns ``out``. Float32 accumulation, one bf16 rounding per output, as a bf16 ``torch.bmm`` stores.

    Raises:
        RuntimeError: shapes or dtypes outside the above, or kernels without AVX512-BF16 (check
            :func:`head_gemm_applies` first).
    """
    build.load().head_gemm_(x, w_packed, out)
    return out
