"""y = x W^T for a GGUF K-quant weight (Q4_K, Q5_K, Q6_K) kept packed, in Triton (CUDA/ROCm).

The kernels read tokenfab's K-quant tile layout (:func:`tokenfab.quant.gguf_kquants.pack_tiles`, offsets in its
module docstring): tiles of 16 output rows, one tile-block per 256-input super-block with the 16 rows' fields rows
innermost, so the CPU kernels and these read the same bytes and moving a model to the GPU needs no repacking.

The K loop walks the 32-input sub-blocks (8 per super-block; a K slice of split-K may start or end inside a
super-block). For each sub-block and row, :func:`_kq_decode` loads the row's 4 words of nibbles (16 bytes, the Q4
word layout of ``gguf_blocks.pack_tiles``: word 16 L + j holds row j's quants at k = 8 L + 2 s + e in bits
16 e + 4 s), ORs in the high bits (Q5_K: one word per row, bit 16 e + u for k = 2 u + e; Q6_K: word 16 H + j, bits
16 e + 2 u for k = 16 H + 2 u + e), and turns the header into the sub-block's float32 factors, with the values of
gguf's ``dequantize`` (llama.cpp ``dequantize_row_q4_K`` / ``q5_K`` / ``q6_K``):

* Q4_K / Q5_K: value = a q - b with a = d sc and b = dmin m, the 6-bit sc and m of sub-block i unpacked from the
  12 scale bytes (for i < 4: byte i and i + 4, low 6 bits; else the low / high nibble of byte i + 4 with the top 2
  bits of bytes i - 4 / i). d sc and dmin m are exact in float32 (11-bit mantissas times integers below 64).
* Q6_K: value = a_h (q - 32), a_h = d scale[2 i + h] for the sub-block's half h (inputs 16 h .. 16 h + 15).

One activation row (decode at batch 1, :func:`_kq_gemv`): the values in float32 on the CUDA cores (quants made
float32 by their bits, 2^23 + q minus 2^23), times x, per-thread sums reduced once after the loop. Rows 2 .. 16
(:func:`_kq_gemm`): the quants enter the tensor cores exactly, as 128 + q written into the bits of 128.0 (bf16; fp16
q << 3 under 128.0's bits; float32 activations: q itself), each row tile's 32-wide partial is scaled by the rows'
a once (Q6_K: one dot per half, the other half's activations zeroed) and the offset taken off with the activation
sums (from the tensor cores too, x . ones, already in the accumulator's layout):
sum_k x_k (a q_k - b) = a sum_k x_k (128 + q_k) - (128 a + b) sum_k x_k. Tiles of 32+ rows dequantize the
weights in registers (float32 values rounded once to the activation dtype) and let the dot accumulate, except where
the output is float32 (logits: the exact quants at any row count, no weight rounding). Split-K at
small M, deterministic, as the Q8_0 / Q4 kernels (kernels/gpu/split_k.py). Nothing but registers ever holds
dequantized weights.

Reference and fallback: :meth:`tokenfab.quant.gguf_weight.GGUFWeight.reference_linear` (tests/test_triton_gguf.py
runs both in Triton's interpreter on CPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenfab.kernels.gpu import split_k
from tokenfab.kernels.gpu.split_k import store_row, store_tile
from tokenfab.kernels.gpu.support import autotune_configs, quick_bench

KQ_KIND = {"Q4_K": 3, "Q5_K": 4, "Q6_K": 5}
SUB = 32         # inputs per sub-block: the K loop's step
PER_SUPER = 8    # sub-blocks per 256-input super-block


@triton.jit
def _kq_decode(T8, T16, T32, bb, i, j, mask, KIND: tl.constexpr):
    """Sub-block ``i`` (0..7, [1 or R, B]; the tile kernel: B = 1) of the super-blocks whose tile-blocks start at byte ``bb`` ([R, B]
    int64), rows ``j`` ([R], 0..15 inside the tile): returns (q [R, B, 4, 8] int32, the quants of k = 8 L + c in
    element order once reshaped; a, b, a2 [R, B] float32): value = a q - b (Q4_K / Q5_K; a2 = a) or a_h (q - 32)
    with a_h = a for k < 16 and a2 from k = 16 (Q6_K; b = 0)."""
    L = tl.arange(0, 4)
    c = tl.arange(0, 8)                          # c = 2 s + e
    sh = 16 * (c % 2) + 4 * (c // 2)
    if KIND == 5:
        qoff = 1312
    elif KIND == 4:
        qoff = 768
    else:
        qoff = 256
    w = tl.load(T32 + ((bb + qoff + 256 * i) // 4 + j[:, None])[:, :, None] + 16 * L[None, None, :],
                mask=mask[:, :, None], other=0)
    q = (w[:, :, :, None] >> sh[None, None, None, :]) & 0xF
    if KIND == 4:    # Q5_K: bit 4 of k = 8 L + 2 s + e is bit 16 e + 4 L + s of the row's word
        hw = tl.load(T32 + (bb + 256 + 64 * i) // 4 + j[:, None], mask=mask, other=0)
        hsh = 16 * (c % 2)[None, :] + 4 * L[:, None] + (c // 2)[None, :]
        q = q | (((hw[:, :, None, None] >> hsh[None, None, :, :]) & 1) << 4)
    if KIND == 5:    # Q6_K: bits 4..5 of k = 16 H + 2 u + e are bits 16 e + 2 u of word 16 H + j
        hw = tl.load(T32 + ((bb + 288 + 128 * i) // 4 + j[:, None])[:, :, None] + 16 * (L // 2)[None, None, :],
                     mask=mask[:, :, None], other=0)
        hsh = 16 * (c % 2)[None, :] + 2 * (4 * (L % 2)[:, None] + (c // 2)[None, :])
        q = q | (((hw[:, :, :, None] >> hsh[None, None, :, :]) & 3) << 4)
        d = tl.load(T16 + bb // 2 + j[:, None], mask=mask, other=0.0).to(tl.float32)
        s0 = tl.load(T8 + bb + 32 + 32 * i + j[:, None], mask=mask, other=0).to(tl.int8, bitcast=True)
        s1 = tl.load(T8 + bb + 48 + 32 * i + j[:, None], mask=mask, other=0).to(tl.int8, bitcast=True)
        a = d * s0.to(tl.float32)
        a2 = d * s1.to(tl.float32)
        b = a * 0.0
    else:
        d = tl.load(T16 + bb // 2 + j[:, None], mask=mask, other=0.0).to(tl.float32)
        dm = tl.load(T16 + bb // 2 + 16 + j[:, None], mask=mask, other=0.0).to(tl.float32)
        i4 = i % 4
        A = tl.load(T8 + bb + 64 + 16 * i4 + j[:, None], mask=mask, other=0).to(tl.int32)
        B = tl.load(T8 + bb + 128 + 16 * i4 + j[:, None], mask=mask, other=0).to(tl.int32)
        C = tl.load(T8 + bb + 192 + 16 * i4 + j[:, None], mask=mask, other=0).to(tl.int32)
        low = i < 4
        sc = tl.where(low, A & 63, (C & 15) | ((A >> 6) << 4))
        mn = tl.where(low, B & 63, (C >> 4) | ((B >> 6) << 4))
        a = d * sc.to(tl.float32)
        b = dm * mn.to(tl.float32)
        a2 = a
    return q, a, b, a2


@triton.jit
def _as_float(q):
    """int32 quants 0..63 -> float32, by their bits (2^23 + q minus 2^23: exact, no int-to-float conversion)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _kq_tile(acc, X, T8, T16, T32, x_rows, mmask, tile_base, tmask, sb, kb1, j, k, TBB: tl.constexpr,
             KIND: tl.constexpr, DOT_F32: tl.constexpr, MAGIC: tl.constexpr, DEQ: tl.constexpr,
             R: tl.constexpr):
    """acc [BLOCK_M, R] plus sub-block ``sb``'s partial product for R weight rows; nothing when sb >= kb1."""
    valid = (j * 0 + sb) < kb1                   # as vectors: the interpreter cannot mask with a scalar condition
    q4, a, b, a2 = _kq_decode(T8, T16, T32, (tile_base + (sb // 8) * TBB)[:, None], (j * 0 + sb % 8)[:, None], j,
                              (tmask & valid)[:, None], KIND)
    q = tl.reshape(q4, (R, 32))
    a = tl.reshape(a, (R,))
    b = tl.reshape(b, (R,))
    a2 = tl.reshape(a2, (R,))
    kk = sb * 32 + k
    x = tl.load(x_rows + kk[None, :], mask=mmask[:, None] & (kk < kb1 * 32)[None, :], other=0.0)
    if DEQ:          # 32+ rows: the values rounded once to the activation dtype, accumulated by the dot
        qf = _as_float(q)
        if KIND == 5:
            w = (qf - 32.0) * tl.where((k < 16)[None, :], a[:, None], a2[:, None])
        else:
            w = qf * a[:, None] - b[:, None]
        w = w.to(X.dtype.element_ty)
        if DOT_F32:  # the interpreter: the rounded values in a float32 dot
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    else:
        if MAGIC == 0:   # float32 activations: the quants themselves
            w = _as_float(q)
            off = 0.0
        else:            # 16-bit: 128 + q in the bits of 128.0 (exact; fp16: 3 bits up)
            if MAGIC == 0x5800:
                q = q << 3
            w = (q | MAGIC).to(tl.int16).to(X.dtype.element_ty, bitcast=True)
            off = 128.0
        if DOT_F32:      # float32 activations, or the interpreter (whose bf16 dot is not exact)
            xd = x.to(tl.float32)
            wt = tl.trans(w.to(tl.float32))
        else:
            xd = x
            wt = tl.trans(w)
        if KIND == 5:    # one dot per half: the other half's activations zeroed
            h0 = (k < 16)[None, :]
            x0 = tl.where(h0, xd, 0.0).to(xd.dtype)
            x1 = tl.where(h0, 0.0, xd).to(xd.dtype)
            if DOT_F32:
                p0 = tl.dot(x0, wt, input_precision="ieee")
                p1 = tl.dot(x1, wt, input_precision="ieee")
            else:
                p0 = tl.dot(x0, wt)
                p1 = tl.dot(x1, wt)
            ones = tl.full((32, R), 1.0, xd.dtype)  # the halves' activation sums from the tensor cores, in the
            if DOT_F32:                               # accumulator's layout (no cross-thread reduction)
                xs0 = tl.dot(x0, ones, input_precision="ieee")
                xs1 = tl.dot(x1, ones, input_precision="ieee")
            else:
                xs0 = tl.dot(x0, ones)
                xs1 = tl.dot(x1, ones)
            acc += (p0 - (off + 32.0) * xs0) * a[None, :] + (p1 - (off + 32.0) * xs1) * a2[None, :]
        else:
            if DOT_F32:
                p = tl.dot(xd, wt, input_precision="ieee")
            else:
                p = tl.dot(xd, wt)
            ones = tl.full((32, R), 1.0, xd.dtype)  # the activation sum from the tensor cores (as p's layout)
            if DOT_F32:
                xs = tl.dot(xd, ones, input_precision="ieee")
            else:
                xs = tl.dot(xd, ones)
            acc += p * a[None, :] - xs * (off * a + b)[None, :]
    return acc


def _gemm_configs() -> list:
    """BLOCK_T (tiles of 16 rows per program), BLOCK_KB (sub-blocks per K step, unrolled), warps, stages."""
    space = [(4, 2, 4, 4), (2, 2, 4, 4), (4, 1, 4, 6), (8, 2, 8, 3)]
    return autotune_configs([triton.Config({"BLOCK_T": t, "BLOCK_KB": b}, num_warps=w, num_stages=s)
                             for t, b, w, s in space])


@triton.autotune(configs=_gemm_configs(), key=["MB", "N", "KS", "SPLIT"], do_bench=quick_bench)
@triton.jit
def _kq_gemm(X, T8, T16, T32, OUT, BIAS, M, N, NT, KB, s_xm, STEPS, MB, KS, SPLIT,
             TBB: tl.constexpr, KIND: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
             DOT_F32: tl.constexpr, MAGIC: tl.constexpr, DEQ: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_T: tl.constexpr, BLOCK_KB: tl.constexpr):
    """[BLOCK_M, 16 BLOCK_T] output tiles over sub-blocks [STEPS ps, STEPS (ps + 1)) of the KS = K / 32."""
    pt = tl.program_id(0)
    pm = tl.program_id(1)
    ps = tl.program_id(2)
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < M
    r = tl.arange(0, BLOCK_T * 16)
    t = pt * BLOCK_T + r // 16
    j = r % 16
    tmask = t < NT
    tile_base = t.to(tl.int64) * KB * TBB        # first byte of each row's tile [R]
    k = tl.arange(0, 32)
    x_rows = X + m[:, None].to(tl.int64) * s_xm
    kb0 = ps * STEPS
    kb1 = tl.minimum(kb0 + STEPS, KS)
    acc = tl.zeros([BLOCK_M, BLOCK_T * 16], tl.float32)
    for sbs in range(kb0, kb1, BLOCK_KB):
        for u in tl.static_range(BLOCK_KB):
            acc = _kq_tile(acc, X, T8, T16, T32, x_rows, mmask, tile_base, tmask, sbs + u, kb1, j, k, TBB, KIND,
                           DOT_F32, MAGIC, DEQ, BLOCK_T * 16)
    n = t * 16 + j
    nmask = n < N
    store_tile(OUT, BIAS, acc, ps, m, n, M, N, mmask, nmask, PARTIAL, HAS_BIAS)


def _gemv_configs() -> list:
    """BLOCK_T, BLOCK_KB (sub-blocks per K step), warps, stages of the one-row kernel."""
    space = [(4, 2, 4, 4), (2, 4, 4, 3), (4, 4, 8, 3), (8, 2, 8, 3)]
    return autotune_configs([triton.Config({"BLOCK_T": t, "BLOCK_KB": b}, num_warps=w, num_stages=s)
                             for t, b, w, s in space])


@triton.autotune(configs=_gemv_configs(), key=["N", "KS", "SPLIT"], do_bench=quick_bench)
@triton.jit
def _kq_gemv(X, T8, T16, T32, OUT, BIAS, N, NT, KB, STEPS, KS, SPLIT, TBB: tl.constexpr, KIND: tl.constexpr,
             HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KB: tl.constexpr):
    """One activation row on the CUDA cores: per K step BLOCK_KB sub-blocks of each tile decoded to float32 values,
    times the activations, accumulated per thread; row sums once at the end."""
    pt = tl.program_id(0)
    ps = tl.program_id(1)
    r = tl.arange(0, BLOCK_T * 16)
    t = pt * BLOCK_T + r // 16
    j = r % 16
    tmask = t < NT
    tile_base = t.to(tl.int64) * KB * TBB
    b_ = tl.arange(0, BLOCK_KB)
    c = tl.arange(0, BLOCK_KB * 32)
    L = tl.arange(0, 4)
    kb0 = ps * STEPS
    kb1 = tl.minimum(kb0 + STEPS, KS)
    acc = tl.zeros([BLOCK_T * 16, BLOCK_KB * 32], tl.float32)
    for kbs in range(kb0, kb1, BLOCK_KB):
        sb = kbs + b_                                           # [BKB] sub-blocks of this step
        bmask = tmask[:, None] & (sb < kb1)[None, :]            # [R, BKB]
        bb = tile_base[:, None] + (sb // 8)[None, :].to(tl.int64) * TBB
        q, a, b, a2 = _kq_decode(T8, T16, T32, bb, (sb % 8)[None, :], j, bmask, KIND)
        qf = _as_float(q)                                       # [R, BKB, 4, 8]
        if KIND == 5:
            ah = tl.where((L < 2)[None, None, :], a[:, :, None], a2[:, :, None])
            w = (qf - 32.0) * ah[:, :, :, None]
        else:
            w = qf * a[:, :, None, None] - b[:, :, None, None]
        kk = kbs * 32 + c
        x = tl.load(X + kk, mask=kk < kb1 * 32, other=0.0).to(tl.float32)
        acc += tl.reshape(w, (BLOCK_T * 16, BLOCK_KB * 32)) * x[None, :]
    y = tl.sum(acc, axis=1)
    n = t * 16 + j
    nmask = n < N
    store_row(OUT, BIAS, y, ps, n, N, nmask, PARTIAL, HAS_BIAS)


def block_m_for(M: int) -> int:
    """Activation rows per tile of the GGUF kernels: 16 (the smallest tensor-core tile) up to 16 rows, 32 up to 32,
    else 64."""
    return 16 if M <= 16 else 32 if M <= 32 else 64


_MAGIC = {torch.bfloat16: 0x4300, torch.float16: 0x5800}


def kquant_launch(x2: torch.Tensor, y: torch.Tensor, tiles: torch.Tensor, name: str, N: int,
                  bias: torch.Tensor | None, split: int | None, dot_f32: bool) -> None:
    """y [M, N] (x2's rows times the K-quant weight, + bias; y float32 or x2's dtype) from x2 [M, K] contiguous.

    Args:
        tiles: uint8 [ceil(N / 16), K / 256, 16 * super-block bytes] (:func:`tokenfab.quant.gguf_kquants.pack_tiles`)
            on x2's device, contiguous.
        name: Q4_K, Q5_K or Q6_K.
        split: slices of K (tests, benchmarks); None: :func:`split_k.choose_split` over the K / 32 sub-blocks.
        dot_f32: float32 dots (float32 activations, or Triton's interpreter, which has no exact bf16 dot).
    """
    nt, kbs, tbb = tiles.shape
    M = x2.shape[0]
    ks = kbs * PER_SUPER
    t8 = tiles.reshape(-1)
    t16, t32 = t8.view(torch.float16), t8.view(torch.int32)
    block_m = block_m_for(M)
    # the split assumes the first config's tiles per program (the one that runs untuned)
    bt = (_kq_gemv if M == 1 else _kq_gemm).configs[0].kwargs["BLOCK_T"]
    s, steps = split_k.plan(split, triton.cdiv(nt, bt) * triton.cdiv(M, block_m), ks, x2.device, tiles.numel(), M, N)
    out = split_k.partial_buffer(s, M, N, x2.device) if s > 1 else y
    b = bias if bias is not None else y
    if M == 1:
        _kq_gemv[lambda meta: (triton.cdiv(nt, meta["BLOCK_T"]), s)](
            x2, t8, t16, t32, out, b, N, nt, kbs, steps, ks, s, TBB=tbb, KIND=KQ_KIND[name],
            HAS_BIAS=bias is not None, PARTIAL=s > 1)
    else:
        def grid(meta):
            return triton.cdiv(nt, meta["BLOCK_T"]), triton.cdiv(M, block_m), s

        _kq_gemm[grid](x2, t8, t16, t32, out, b, M, N, nt, kbs, x2.stride(0), steps,
                       min(triton.next_power_of_2(M), 128), ks, s, TBB=tbb, KIND=KQ_KIND[name],
                       HAS_BIAS=bias is not None, PARTIAL=s > 1, DOT_F32=dot_f32, MAGIC=_MAGIC.get(x2.dtype, 0),
                       DEQ=x2.dtype != torch.float32 and block_m >= 32 and y.dtype != torch.float32,
                       BLOCK_M=block_m)
    if s > 1:
        split_k.reduce_partials(out, y, bias)
