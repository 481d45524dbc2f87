"""y = x W^T for a GGUF Q8_0 / Q4_0 / Q4_1 weight kept packed, in Triton (CUDA/ROCm); :func:`gguf_linear` also takes
the K-quants Q4_K / Q5_K / Q6_K, whose kernels are kernels/gpu/gguf_kquant_linear.py's.

The kernel reads tokenfab's tile layout (:func:`tokenfab.quant.gguf_blocks.pack_tiles`: tiles of 16 output rows,
each tile-block holding the 16 rows' fp16 scales ``d`` (then Q4_1's minimums ``m``) and their quants for 32 inputs;
tile t's K / 32 tile-blocks are contiguous), so the same bytes serve the CPU kernels and this one and moving a model
to the GPU needs no repacking.

One program computes a [BLOCK_M, 16 * BLOCK_T] output tile (BLOCK_M activation rows x BLOCK_T weight tiles) over one
slice of the K / 32 blocks (split-K at small M, kernels/gpu/split_k.py: enough programs that every SM streams
bytes). Each step of its K loop takes BLOCK_KB consecutive tile-blocks per tile (unrolled), and for each block:
loads the quants as whole words (Q4: the 32-bit words of the layout, each holding 8 nibbles of one row; Q8_0: the
16-bit pairs, each holding 2 int8 quants of one row), extracts the integer quants in registers (Q4_0 minus 8), takes
the 32-wide partial product ``tl.dot(x, q)`` (integers up to 8 bits are exact in bf16 / fp16: tensor cores with
float32 accumulation; IEEE float32 for float32 activations) and adds it times the 16 rows' scales ``d``, loaded
once per block; for Q4_1 also ``m`` times the sum of the block's 32 activations, since
sum_k x_k (d q_k + m) = d sum_k x_k q_k + m sum_k x_k (values of gguf_blocks' module docstring: Q8_0 d * q,
Q4_0 d * (q - 8), Q4_1 d * q + m). For bf16 / fp16 activations a 4-bit quant enters the dot as 128 + q, written
straight into the bits of 128.0 (no int-to-float conversion), and the block's sum of activations (from the tensor
cores, x . ones) times 128 d is taken off per block; tiles of 32+ activation rows instead dequantize the weights in
registers (float32 d q + m rounded once to the activation dtype) and let the dot accumulate, except where the output
is float32 (logits: the exact quants at any row count). One activation row (decode at batch 1) takes a CUDA-core
variant (``_gguf_gemv``: quants made float32 by their bits, 2^23 + q minus 2^23, times d plus m, times x, per-thread
float32 sums reduced once after the K loop). Nothing but registers ever holds dequantized weights. Tile and block
counts, warps and pipeline stages are autotuned per (M bucket, N, K, split, dtypes) on a GPU; the interpreter runs
the first config.

Reference and fallback: :meth:`tokenfab.quant.gguf_weight.GGUFWeight.reference_linear` (tests/test_triton_gguf.py
runs both in Triton's interpreter on CPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenfab.kernels.gpu import split_k
from tokenfab.kernels.gpu.gguf_kquant_linear import KQ_KIND, block_m_for, kquant_launch
from tokenfab.kernels.gpu.split_k import store_row, store_tile
from tokenfab.kernels.gpu.support import autotune_configs, interpreting, launch_linear, quick_bench
from tokenfab.quant.gguf_blocks import TILE, BlockType

_KIND = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}
# the bits of 128.0 whose low mantissa bits take a 4-bit quant q as 128 + q (bf16: 7 mantissa bits, spacing 1 at
# 128; fp16: 10 bits, 0x5800 + 8q); float32 activations use the integers themselves (0)
_MAGIC = {torch.bfloat16: 0x4300, torch.float16: 0x5800}


def _configs() -> list:
    """BLOCK_T (tiles of 16 rows per program), BLOCK_KB (tile-blocks per K step), warps, stages."""
    space = [(2, 2, 4, 4), (4, 2, 4, 4), (4, 1, 4, 6), (8, 2, 8, 3)]
    return autotune_configs([triton.Config({"BLOCK_T": t, "BLOCK_KB": b}, num_warps=w, num_stages=s)
                             for t, b, w, s in space])


@triton.jit
def _block(acc, X, T32, T16, x_rows, mmask, tile_base, tmask, kb, kb1, j, k, KIND: tl.constexpr,
           TBB: tl.constexpr, DOT_F32: tl.constexpr, MAGIC: tl.constexpr, DEQ: tl.constexpr):
    """acc [BLOCK_M, R] plus one tile-block column kb (all tiles of the program): d * (x . q) (+ m sum x), nothing
    when kb >= kb1. DEQ: the weights dequantized in registers (float32 d q + m, rounded to the activation dtype)
    and accumulated by the dot itself: for tiles of 32+ activation rows, where the per-block scaling of the
    [BLOCK_M, R] partial would cost more than scaling the [R, 32] weights."""
    valid = (j * 0 + kb) < kb1  # as vectors: the interpreter cannot mask with a scalar condition
    base = tile_base + kb * (TBB // 2)  # in 16-bit units: the tile-block's first halfword, per row [R] (even)
    lmask = tmask & valid
    kk = kb * 32 + k
    x = tl.load(x_rows + kk[None, :], mask=mmask[:, None] & (kk < kb1 * 32)[None, :], other=0.0)
    d = tl.load(T16 + base + j, mask=lmask, other=0.0).to(tl.float32)
    if KIND == 0:    # Q8_0: halfword 16 + 16 p + j holds row j's quants at k = 2p (low byte), 2p + 1 (high byte)
        p = tl.arange(0, 16)
        h = tl.load(T16 + (base + j)[:, None] + 16 + 16 * p[None, :], mask=lmask[:, None], other=0.0)
        h = h.to(tl.int16, bitcast=True).to(tl.int32)
        sl = 24 - 8 * tl.arange(0, 2)  # e = 0: the low byte, e = 1: the high byte, sign-extended
        w = tl.reshape((h[:, :, None] << sl[None, None, :]) >> 24, (h.shape[0], 32))  # int32, converted below
    else:            # Q4: word 8 (Q4_0) or 16 (Q4_1) + 16 L + j holds row j's nibbles at k = 8L + 2s + e
        L = tl.arange(0, 4)
        qw = 8 if KIND == 1 else 16
        wd = tl.load(T32 + (base // 2 + qw + j)[:, None] + 16 * L[None, :], mask=lmask[:, None], other=0)
        i = tl.arange(0, 8)  # i = 2s + e: bits 16e + 4s
        sh = 16 * (i % 2) + 4 * (i // 2)
        nib = tl.reshape((wd[:, :, None] >> sh[None, None, :]) & 0xF, (wd.shape[0], 32))
        if MAGIC == 0 or DEQ:  # float32 activations, or dequantizing: the integers themselves (Q4_0 minus 8)
            w = (nib - 8 if KIND == 1 else nib).to(tl.float32)
        else:            # bf16 / fp16: 128 + q written straight into the bits (exact; no int-to-float conversion)
            if MAGIC == 0x5800:  # fp16: the quant lands 3 bits up (spacing 1/8 between mantissa steps at 128)
                nib = nib << 3
            w = (nib | MAGIC).to(tl.int16).to(X.dtype.element_ty, bitcast=True)
    if DEQ:
        w = w.to(tl.float32) * d[:, None]
        if KIND == 2:
            w += tl.load(T16 + base + 16 + j, mask=lmask, other=0.0).to(tl.float32)[:, None]
        w = w.to(X.dtype.element_ty)
        if DOT_F32:
            return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        return tl.dot(x, tl.trans(w), acc)
    if DOT_F32:  # float32 activations, or the interpreter (whose bf16 dot is not exact)
        part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        part = tl.dot(x, tl.trans(w.to(X.dtype.element_ty)))
    part = part * d[None, :]
    if KIND != 0:
        if MAGIC != 0:   # the sum of the block's activations, from the tensor cores: x . ones
            ones = tl.full((32, w.shape[0]), 1.0, X.dtype.element_ty)
            if DOT_F32:
                xs = tl.dot(x.to(tl.float32), ones.to(tl.float32), input_precision="ieee")
            else:
                xs = tl.dot(x, ones)
            if KIND == 1:    # d (q - 8) = d (128 + q) - 136 d
                part -= xs * (136.0 * d)[None, :]
            else:            # d q + m = d (128 + q) + (m - 128 d)
                mn = tl.load(T16 + base + 16 + j, mask=lmask, other=0.0).to(tl.float32)
                part += xs * (mn - 128.0 * d)[None, :]
        elif KIND == 2:
            mn = tl.load(T16 + base + 16 + j, mask=lmask, other=0.0).to(tl.float32)
            part += tl.sum(x.to(tl.float32), axis=1)[:, None] * mn[None, :]
    return acc + part


@triton.autotune(configs=_configs(), key=["MB", "N", "KB", "SPLIT"], do_bench=quick_bench)
@triton.jit
def _gguf_gemm(X, T32, T16, OUT, BIAS, M, N, NT, KB, s_xm, STEPS, MB, SPLIT,
               TBB: tl.constexpr, KIND: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
               DOT_F32: tl.constexpr, MAGIC: tl.constexpr, DEQ: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_KB: tl.constexpr):
    pt = tl.program_id(0)
    pm = tl.program_id(1)
    ps = tl.program_id(2)
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < M
    r = tl.arange(0, BLOCK_T * 16)
    t = pt * BLOCK_T + r // 16
    j = r % 16
    tmask = t < NT
    tile_base = t.to(tl.int64) * KB * (TBB // 2)  # first halfword of each row's tile (per row [R])
    k = tl.arange(0, 32)
    x_rows = X + m[:, None].to(tl.int64) * s_xm
    kb0 = ps * STEPS
    kb1 = tl.minimum(kb0 + STEPS, KB)
    acc = tl.zeros([BLOCK_M, BLOCK_T * 16], tl.float32)
    for kbs in range(kb0, kb1, BLOCK_KB):
        for u in tl.static_range(BLOCK_KB):
            acc = _block(acc, X, T32, T16, x_rows, mmask, tile_base, tmask, kbs + u, kb1, j, k, KIND, TBB,
                         DOT_F32, MAGIC, DEQ)
    n = t * 16 + j
    nmask = n < N
    store_tile(OUT, BIAS, acc, ps, m, n, M, N, mmask, nmask, PARTIAL, HAS_BIAS)


def _gemv_configs() -> list:
    """BLOCK_T, BLOCK_KB, warps, stages of the one-row kernel."""
    space = [(4, 2, 4, 4), (2, 4, 4, 3), (4, 4, 8, 3)]
    return autotune_configs([triton.Config({"BLOCK_T": t, "BLOCK_KB": b}, num_warps=w, num_stages=s)
                             for t, b, w, s in space])


@triton.autotune(configs=_gemv_configs(), key=["N", "KB", "SPLIT"], do_bench=quick_bench)
@triton.jit
def _gguf_gemv(X, T32, T16, OUT, BIAS, N, NT, KB, STEPS, SPLIT, TBB: tl.constexpr, KIND: tl.constexpr,
               HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KB: tl.constexpr):
    """One activation row (decode at batch 1) on the CUDA cores: per K step the quants of BLOCK_KB tile-blocks of
    each tile become float32 by their bits (2^23 + q, minus 2^23: exact, no int-to-float conversion), times the
    block's d (plus m; Q4_0: minus 8 d), times the activation, accumulated per thread; row sums once at the end."""
    pt = tl.program_id(0)
    ps = tl.program_id(1)
    r = tl.arange(0, BLOCK_T * 16)
    t = pt * BLOCK_T + r // 16
    j = r % 16
    tmask = t < NT
    tile_base = t.to(tl.int64) * KB * (TBB // 2) + j * 0  # first halfword of each row's tile
    b = tl.arange(0, BLOCK_KB)
    c = tl.arange(0, BLOCK_KB * 32)
    kb0 = ps * STEPS
    kb1 = tl.minimum(kb0 + STEPS, KB)
    acc = tl.zeros([BLOCK_T * 16, BLOCK_KB * 32], tl.float32)
    for kbs in range(kb0, kb1, BLOCK_KB):
        kbv = kbs + b                                          # [BKB] tile-block columns of this step
        bmask = tmask[:, None] & (kbv < kb1)[None, :]          # [R, BKB]
        base = tile_base[:, None] + kbv[None, :].to(tl.int64) * (TBB // 2)  # [R, BKB] halfwords
        d = tl.load(T16 + base + j[:, None], mask=bmask, other=0.0).to(tl.float32)
        if KIND == 0:    # Q8_0: halfword 16 + 16 p + j: row j's quants at k = 2p, 2p + 1
            p = tl.arange(0, 16)
            h = tl.load(T16 + (base + j[:, None])[:, :, None] + 16 + 16 * p[None, None, :],
                        mask=bmask[:, :, None], other=0.0)
            h = h.to(tl.int16, bitcast=True).to(tl.int32)
            e = tl.arange(0, 2)
            u = ((h[:, :, :, None] >> (8 * e)[None, None, None, :]) & 0xFF) ^ 0x80   # q + 128 in 0..255
            q = (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0          # 2^23 + 128
            w3 = tl.reshape(q, (BLOCK_T * 16, BLOCK_KB, 32)) * d[:, :, None]
        else:            # Q4: word qw + 16 L + j: row j's nibbles at k = 8L + 2s + e, bits 16e + 4s
            L = tl.arange(0, 4)
            qw = 8 if KIND == 1 else 16
            wd = tl.load(T32 + (base // 2 + qw + j[:, None])[:, :, None] + 16 * L[None, None, :],
                         mask=bmask[:, :, None], other=0)
            i = tl.arange(0, 8)
            sh = 16 * (i % 2) + 4 * (i // 2)
            nib = (wd[:, :, :, None] >> sh[None, None, None, :]) & 0xF
            q = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0          # 2^23
            q = tl.reshape(q, (BLOCK_T * 16, BLOCK_KB, 32))
            if KIND == 1:
                w3 = q * d[:, :, None] - (8.0 * d)[:, :, None]
            else:
                mn = tl.load(T16 + base + 16 + j[:, None], mask=bmask, other=0.0).to(tl.float32)
                w3 = q * d[:, :, None] + mn[:, :, None]
        kk = kbs * 32 + c
        x = tl.load(X + kk, mask=kk < kb1 * 32, other=0.0).to(tl.float32)
        acc += tl.reshape(w3, (BLOCK_T * 16, BLOCK_KB * 32)) * x[None, :]
    y = tl.sum(acc, axis=1)
    n = t * 16 + j
    nmask = n < N
    store_row(OUT, BIAS, y, ps, n, N, nmask, PARTIAL, HAS_BIAS)


def gguf_linear(x: torch.Tensor, tiles: torch.Tensor, block: BlockType, out_features: int,
                bias: torch.Tensor | None = None, split: int | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., in_features] (float32 / bf16 / fp16) times a packed GGUF weight -> [..., out_features] in
    ``out_dtype`` (default x's dtype; float32: the accumulator unrounded, for logits).

    Args:
        tiles: uint8 [ceil(out / 16), in / block_size, 16 * block_bytes] (:func:`gguf_blocks.pack_tiles`; block_size
            32, or 256 for K-quants), on x's device.
        block: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K.
        bias: [out_features] or None (added in float32 before the one rounding to the output dtype).
        split: slices of K (tests, benchmarks); None: :func:`split_k.choose_split`.

    Raises:
        ValueError: a block type these kernels do not read, or tiles that do not match x's inputs.
    """
    if block.name not in _KIND and block.name not in KQ_KIND:
        raise ValueError(f"the Triton GGUF kernels read {', '.join([*_KIND, *KQ_KIND])}, not {block.name}")
    nt, kb, tbb = tiles.shape
    K = x.shape[-1]
    if kb * block.block_size != K or tbb != block.tile_block_bytes or nt * TILE < out_features:
        raise ValueError(f"GGUF {block.name} tiles {tuple(tiles.shape)} do not hold a [{out_features}, {K}] weight")
    flat = tiles.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    N = out_features
    if block.name in KQ_KIND:
        return launch_linear(x, N, lambda x2, y, _bm: kquant_launch(
            x2, y, flat.view(tiles.shape), block.name, N, bias, split,
            dot_f32=x2.dtype == torch.float32 or interpreting()), out_dtype)
    t32, t16 = flat.view(torch.int32), flat.view(torch.float16)

    def launch(x2: torch.Tensor, y: torch.Tensor, _block_m_default: int) -> None:
        M = x2.shape[0]
        block_m = block_m_for(M)
        # the split assumes the first config's tiles per program (the one that runs untuned)
        bt = (_gguf_gemv if M == 1 else _gguf_gemm).configs[0].kwargs["BLOCK_T"]
        s, steps = split_k.plan(split, triton.cdiv(nt, bt) * triton.cdiv(M, block_m), kb, x2.device, tiles.numel(),
                                M, N)
        out = split_k.partial_buffer(s, M, N, x2.device) if s > 1 else y

        if M == 1:
            _gguf_gemv[lambda meta: (triton.cdiv(nt, meta["BLOCK_T"]), s)](
                x2, t32, t16, out, bias if bias is not None else y, N, nt, kb, steps, s, TBB=tbb,
                KIND=_KIND[block.name], HAS_BIAS=bias is not None, PARTIAL=s > 1)
            if s > 1:
                split_k.reduce_partials(out, y, bias)
            return

        def grid(meta):
            return triton.cdiv(nt, meta["BLOCK_T"]), triton.cdiv(M, block_m), s

        _gguf_gemm[grid](x2, t32, t16, out, bias if bias is not None else y, M, N, nt, kb, x2.stride(0), steps,
                         min(triton.next_power_of_2(M), 128), s, TBB=tbb, KIND=_KIND[block.name],
                         HAS_BIAS=bias is not None, PARTIAL=s > 1,
                         DOT_F32=x2.dtype == torch.float32 or interpreting(), MAGIC=_MAGIC.get(x2.dtype, 0),
                         DEQ=x2.dtype != torch.float32 and block_m >= 32 and y.dtype != torch.float32,
                         BLOCK_M=block_m)
        if s > 1:
            split_k.reduce_partials(out, y, bias)

    return launch_linear(x, N, launch, out_dtype)
