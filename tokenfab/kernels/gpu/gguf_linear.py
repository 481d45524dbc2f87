"""y = x W^T for a GGUF Q8_0 / Q4_0 / Q4_1 weight kept packed, in Triton (CUDA/ROCm).

The kernel reads tokenfab's tile layout (:func:`tokenfab.quant.gguf_blocks.pack_tiles`: tiles of 16 output rows,
each tile-block holding the 16 rows' fp16 scales ``d`` (then Q4_1's minimums ``m``) and their quants for 32 inputs),
so the same bytes serve the CPU kernels and this one and moving a model to the GPU needs no repacking. One program
computes a [BLOCK_M, 16] output tile (BLOCK_M activation rows x one weight tile): per 32-input block it loads the
16 scales, gathers the 16 x 32 quants from the tile-block, dequantizes them in registers to float32 (the values of
gguf_blocks' module docstring: Q8_0 d * q, Q4_0 d * (q - 8), Q4_1 d * q + m) and accumulates ``tl.dot`` with
``input_precision="ieee"`` (no TF32). Nothing but the tile's registers ever holds dequantized weights.

Reference and fallback: :meth:`tokenfab.quant.gguf_weight.GGUFWeight.reference_linear` (tests/test_triton_gguf.py
runs both in Triton's interpreter on CPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenfab.kernels.gpu.support import launch_linear
from tokenfab.quant import gguf_blocks
from tokenfab.quant.gguf_blocks import TILE, BlockType

_KIND = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}


@triton.jit
def _gguf_gemm(X, T8, T16, Y, BIAS, M, N, KB, s_xm, s_ym,
               TBB: tl.constexpr, KIND: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr):
    t = tl.program_id(0)
    pm = tl.program_id(1)
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < M
    j = tl.arange(0, 16)           # row within the tile
    k = tl.arange(0, 32)           # input within the block
    if KIND == 0:                  # Q8_0: pair p = k // 2 of 32 bytes, byte 2j + e (e = k % 2)
        qoff = 2 * 16
        qbyte = qoff + (k[None, :] // 2) * 32 + 2 * j[:, None] + (k[None, :] % 2)
        shift = tl.zeros([16, 32], tl.int32)
    else:                          # Q4: word 2j + e of group L = k // 8 holds nibble s = (k % 8) // 2
        qoff = (4 if KIND == 2 else 2) * 16
        r = k % 8
        s = r // 2
        qbyte = qoff + 2 * ((k[None, :] // 8) * 32 + 2 * j[:, None] + (r[None, :] % 2)) + s[None, :] // 2
        shift = tl.zeros([16, 32], tl.int32) + 4 * (s[None, :] % 2)
    acc = tl.zeros([BLOCK_M, 16], tl.float32)
    for kb in range(0, KB):
        base = (t.to(tl.int64) * KB + kb) * TBB
        d = tl.load(T16 + base // 2 + j).to(tl.float32)
        raw = tl.load(T8 + base + qbyte).to(tl.int32)
        if KIND == 0:
            q = tl.where(raw >= 128, raw - 256, raw).to(tl.float32)
            w = d[:, None] * q
        else:
            q = ((raw >> shift) & 0xF).to(tl.float32)
            if KIND == 1:
                w = d[:, None] * (q - 8.0)
            else:
                mn = tl.load(T16 + base // 2 + 16 + j).to(tl.float32)
                w = d[:, None] * q + mn[:, None]
        kk = kb * 32 + k
        x = tl.load(X + m[:, None].to(tl.int64) * s_xm + kk[None, :], mask=mmask[:, None], other=0.0)
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    n = t * 16 + j
    nmask = n < N
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None].to(tl.int64) * s_ym + n[None, :], acc.to(Y.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def gguf_linear(x: torch.Tensor, tiles: torch.Tensor, block: BlockType, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in_features] (float32 / bf16 / fp16) times a packed GGUF weight -> [..., out_features] in x's dtype.

    Args:
        tiles: uint8 [ceil(out / 16), in / 32, 16 * block_bytes] (:func:`gguf_blocks.pack_tiles`), on x's device.
        block: Q8_0, Q4_0 or Q4_1.
        bias: [out_features] or None (added in float32 before the one rounding to x's dtype).

    Raises:
        ValueError: a block type this kernel does not read, or tiles that do not match x's inputs.
    """
    if block.name not in _KIND:
        raise ValueError(f"the Triton GGUF kernel reads {', '.join(_KIND)}, not {block.name}")
    nt, kb, tbb = tiles.shape
    K = x.shape[-1]
    if kb * gguf_blocks.BLOCK != K or tbb != block.tile_block_bytes or nt * TILE < out_features:
        raise ValueError(f"GGUF {block.name} tiles {tuple(tiles.shape)} do not hold a [{out_features}, {K}] weight")

    def launch(x2: torch.Tensor, y: torch.Tensor, block_m: int) -> None:
        M = x2.shape[0]
        flat = tiles.reshape(-1)
        _gguf_gemm[(nt, triton.cdiv(M, block_m))](
            x2, flat, flat.view(torch.float16), y, bias if bias is not None else y, M, out_features, kb,
            x2.stride(0), y.stride(0), TBB=tbb, KIND=_KIND[block.name], HAS_BIAS=bias is not None, BLOCK_M=block_m)

    return launch_linear(x, out_features, launch)
