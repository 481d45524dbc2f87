"""Triton decodes of the GPU layouts of 4-bit and FP8 expert stacks (kernels/gpu/moe_relayout.py states the layouts)
for the grouped GEMM (kernels/gpu/moe_gemm.py), plus the scalar format decodes it shares (E8M0, E2M1, E4M3).

The layouts put the two inputs that one 32-bit register of a 16-bit MMA operand holds, (k, k + 1), into the two
16-bit halves of one word after one rotation and one mask, so a decode costs about two integer operations and one
packed 16-bit float operation per two weights; the loads need no masks along K (the stacks are padded to whole
512-input tiles). Each 4-bit decode returns one scale group (32 inputs) of BLOCK_N rows, each FP8 decode the SUB
inputs of one K tile (inside one 128-block), exact for every code.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e8m0(s8):
    """E8M0 scale bytes (int32) -> float32 2^(s - 127); 0 -> 2^-127 (subnormal), 255 -> NaN."""
    sc = tl.where(s8 == 0, 5.877471754111438e-39, (s8 << 23).to(tl.float32, bitcast=True))
    return tl.where(s8 == 255, float("nan"), sc)


@triton.jit
def e2m1(c):
    """E2M1 codes 0..15 (int32) -> float32, exact: sign bit 3, exponent bits 1-2 with bias 1, mantissa bit 0
    (0, 0.5, 1, 1.5, 2, 3, 4, 6); OCP Microscaling Formats v1.0, 5.3.3."""
    s = (c & 8) << 28
    mag = c & 7
    normal = (s | ((mag + 252) << 22)).to(tl.float32, bitcast=True)  # exponent e - 1 + 127, mantissa m << 22
    return tl.where(mag < 2, tl.where(mag == 1, (s | (126 << 23)).to(tl.float32, bitcast=True), 0.0), normal)


@triton.jit
def relaid_words(W, e, n, nmask, kq, s_we, s_wn):
    """The 4 re-laid words of group kq // 32 of expert e's rows n: [BLOCK_N, 4] int32, unmasked along K (the
    stack is padded to whole 512-input tiles: kernels/gpu/moe_relayout.py)."""
    wi = kq // 8 + tl.arange(0, 4)
    return tl.load(W + e * s_we + n[:, None].to(tl.int64) * s_wn + wi[None, :], mask=nmask[:, None], other=0)


@triton.jit
def int4_relaid16(W, e, n, nmask, kq, s_we, s_wn, magic, DT: tl.constexpr):
    """Re-laid INT4 inputs kq .. kq + 32 for a 16-bit dot (DT bf16 / fp16) as [BLOCK_N, 32] DT: word j of the
    group holds input 8j + 2i in bits 4i..4i+3 and 8j + 2i + 1 in bits 16 + 4i..19 + 4i, so one shift and one
    mask-and-OR with ``magic`` (128.0 twice: 0x43004300 for bf16; 1024.0 twice, 0x64006400, for fp16; a runtime
    value so that the compiler keeps it in a register rather than rebuilding it for every OR) put two inputs into
    the mantissas of one register's two halves and one packed subtraction of 136 / 1032 gives nibble - 8, exact
    (the Marlin-style decode: Frantar et al., arXiv:2408.11743)."""
    BIAS: tl.constexpr = 136.0 if DT == tl.bfloat16 else 1032.0
    words = relaid_words(W, e, n, nmask, kq, s_we, s_wn)
    v0 = (words & 0x000F000F) | magic
    v1 = ((words >> 4) & 0x000F000F) | magic
    v2 = ((words >> 8) & 0x000F000F) | magic
    v3 = ((words >> 12) & 0x000F000F) | magic
    pairs = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [BN, 4, 2, 2]: word j, pair 2a + b
    vals = tl.join(pairs.to(tl.int16).to(DT, bitcast=True), (pairs >> 16).to(tl.int16).to(DT, bitcast=True)) - BIAS
    return tl.reshape(vals, [n.shape[0], 32])


@triton.jit
def int4_relaid32(W, S, e, n, nmask, kq, s_we, s_wn, s_se, s_sn, SCALE_BF16: tl.constexpr):
    """Re-laid INT4 inputs kq .. kq + 32 as float32 [BLOCK_N, 32] (nibble - 8 from the float32 bits of 2^23 +
    nibble) and the rows' float32 group scales [BLOCK_N], for float32 activations and prefill tiles."""
    words = relaid_words(W, e, n, nmask, kq, s_we, s_wn)
    c0 = words & 0x000F000F
    c1 = (words >> 4) & 0x000F000F
    c2 = (words >> 8) & 0x000F000F
    c3 = (words >> 12) & 0x000F000F
    pairs = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # as int4_relaid16
    codes = tl.join(pairs & 0xF, pairs >> 16)
    vals = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return tl.reshape(vals, [n.shape[0], 32]), group_scales(S, e, n, nmask, kq, s_se, s_sn, SCALE_BF16)


@triton.jit
def group_scales(S, e, n, mask, kq, s_se, s_sn, SCALE_BF16: tl.constexpr):
    """The float32 scales [BLOCK_N] of expert e's rows n for the 32-input group holding input kq: bf16 scales
    (stored as int16 bits) widened by a shift, fp16 / float32 ones converted; 0 where ``mask`` is off."""
    sp = S + e * s_se + n * s_sn + kq // 32
    if SCALE_BF16:
        return ((tl.load(sp, mask=mask, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return tl.load(sp, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def split_col(t, j: tl.constexpr, G: tl.constexpr):
    """Column j of t [R, G] (G a power of two) as [R], by halving splits: a choice of registers where each thread
    holds whole rows of t."""
    if G == 1:
        return tl.reshape(t, [t.shape[0]])
    else:
        lo, hi = tl.split(tl.reshape(t, [t.shape[0], G // 2, 2]))  # even and odd columns
        if j % 2 == 0:
            return split_col(lo, j // 2, G // 2)
        else:
            return split_col(hi, j // 2, G // 2)


@triton.jit
def _rotr(x, R: tl.constexpr):
    """x (uint32) rotated right by R bits: bit d of the result is bit (d + R) % 32 of x."""
    return (x >> R) | (x << (32 - R))


@triton.jit
def _mxfp4_pairs(W, e, n, nmask, kq, s_we, s_wn):
    """Re-laid MXFP4 inputs kq .. kq + 32 as bf16 bit pairs [BLOCK_N, 4, 2, 2] int32 (word j, pair 2a + b; input
    8j + 2(2a + b) in the low half, the next in the high half): each E2M1 code's sign in bit 15 of its half and its
    3 magnitude bits in bits 6..8 (the bf16 pattern of the value times 2^-126). Pairs 0, 1, 2 of a word come out of
    one rotation (0, 4, 10 bits) and one mask each, pair 3 out of two (14 bits for the mantissa bit, 6 for the
    others): moe_relayout.MXFP4_SOURCE_BITS."""
    w = relaid_words(W, e, n, nmask, kq, s_we, s_wn).to(tl.uint32, bitcast=True)
    M: tl.constexpr = 0x81C081C0  # bits 6, 7, 8, 15 of both halves
    v0 = w & M
    v1 = _rotr(w, 4) & M
    v2 = _rotr(w, 10) & M
    v3 = (_rotr(w, 14) & 0x00400040) | (_rotr(w, 6) & 0x81808180)
    return tl.join(tl.join(v0, v2), tl.join(v1, v3))


@triton.jit
def mxfp4_relaid16(W, e, n, nmask, kq, s_we, s_wn, DT: tl.constexpr):
    """Re-laid MXFP4 inputs kq .. kq + 32 for a 16-bit dot as [BLOCK_N, 32] DT (bf16 / fp16), exact: the bf16
    bit pairs of :func:`_mxfp4_pairs` times 2^126 (one packed multiply; 0.5 enters as a bf16 subnormal); for fp16
    the magnitudes move 3 bits up into fp16's fields first and the multiply is by 2^14."""
    pairs = _mxfp4_pairs(W, e, n, nmask, kq, s_we, s_wn)
    if DT == tl.bfloat16:
        MULT: tl.constexpr = 8.507059173023462e37
    else:
        pairs = (pairs & 0x80008000) | ((pairs << 3) & 0x0E000E00)  # sign bits kept, magnitudes to bits 9..11
        MULT: tl.constexpr = 16384.0
    vals = tl.join(pairs.to(tl.uint16).to(DT, bitcast=True), (pairs >> 16).to(tl.uint16).to(DT, bitcast=True)) * MULT
    return tl.reshape(vals, [n.shape[0], 32])


@triton.jit
def mxfp4_relaid32(W, S, e, n, nmask, kq, s_we, s_wn, s_se, s_sn):
    """Re-laid MXFP4 inputs kq .. kq + 32 as float32 [BLOCK_N, 32] (each code rebuilt from its bf16 bits and
    decoded by :func:`e2m1`) and the rows' float32 E8M0 scales [BLOCK_N], for float32 activations and prefill."""
    pairs = _mxfp4_pairs(W, e, n, nmask, kq, s_we, s_wn)
    bits = tl.join(pairs & 0xFFFF, (pairs >> 16) & 0xFFFF)
    vals = e2m1(((bits >> 12) & 8) | ((bits >> 6) & 7))
    sc = ((tl.load(S + e * s_se + n * s_sn + kq // 32, mask=nmask, other=127).to(tl.int32) & 0xFF) << 23).to(
        tl.float32, bitcast=True)  # no E8M0 0 or 255 in re-laid stacks
    return tl.reshape(vals, [n.shape[0], 32]), sc


@triton.jit
def relaid_scales(S, e, n, nmask, k0, s_se, s_sn, G: tl.constexpr, FMT: tl.constexpr, SCALE_BF16: tl.constexpr):
    """The G group scales of a K tile starting at input k0 for rows n, loaded at once: float32 [BLOCK_N, G] (INT4:
    bf16 bits widened by a shift, or fp16; MXFP4: the E8M0 byte shifted into float32's exponent)."""
    g = k0 // 32 + tl.arange(0, G)
    raw = tl.load(S + e * s_se + n[:, None] * s_sn + g[None, :], mask=nmask[:, None], other=0)
    if FMT == 1:  # re-laid stacks hold no E8M0 0 or 255 (moe_relayout.plain_e8m0): 2^(s - 127) is s << 23
        sc = ((raw.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)
    elif SCALE_BF16:
        sc = ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        sc = raw.to(tl.float16, bitcast=True).to(tl.float32)
    return sc


@triton.jit
def e4m3(b):
    """E4M3FN codes (int32) -> float32, exact: normal (1 + m / 8) 2^(e - 7) from its float32 bits, subnormal
    m 2^-9, S.1111.111 NaN (OCP 8-bit floating point, 4.1)."""
    s = (b & 0x80) << 24
    e = (b >> 3) & 0xF
    m = b & 7
    normal = (s | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    # subnormal m 2^-9 without an int-to-float conversion: (1 + m / 8) 2^-6 - 2^-6 (exact)
    sub = (s | (121 << 23) | (m << 20)).to(tl.float32, bitcast=True) - (s | (121 << 23)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, sub, normal)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def _fp8_words(W, e, n, nmask, kq, s_we, s_wn, SUB: tl.constexpr):
    """The SUB / 4 re-laid FP8 words of inputs kq .. kq + SUB of expert e's rows n: [BLOCK_N, SUB / 4] int32,
    unmasked along K (padded to whole 512-input tiles)."""
    wi = kq // 4 + tl.arange(0, SUB // 4)
    return tl.load(W + e * s_we + n[:, None].to(tl.int64) * s_wn + wi[None, :], mask=nmask[:, None], other=0)


@triton.jit
def fp8_relaid16(W, e, n, nmask, kq, s_we, s_wn, SUB: tl.constexpr, DT: tl.constexpr):
    """Re-laid FP8 inputs kq .. kq + SUB for a 16-bit dot as [BLOCK_N, SUB] DT (bf16 / fp16), exact: per word the
    pairs (4w, 4w + 1) from bytes 0 and 2 and (4w + 2, 4w + 3) from bytes 1 and 3, each E4M3 code's sign moved to
    bit 15 of its half and its 7 other bits to bits 4..10 (bf16: the value times 2^-120) or 7..13 (fp16: times
    2^-8), then one packed multiply by 2^120 / 2^8 (kernels/gpu/moe_relayout.py; NaN codes are not kept:
    checkpoints hold none)."""
    w = _fp8_words(W, e, n, nmask, kq, s_we, s_wn, SUB).to(tl.uint32, bitcast=True)  # masks past int32's range
    if DT == tl.bfloat16:
        lo = ((w << 8) & 0x80008000) | ((w << 4) & 0x07F007F0)  # inputs 4w, 4w + 1
        hi = (w & 0x80008000) | ((w >> 4) & 0x07F007F0)  # inputs 4w + 2, 4w + 3
        MULT: tl.constexpr = 1.329227995784916e36
    else:
        lo = ((w << 8) & 0x80008000) | ((w << 7) & 0x3F803F80)
        hi = (w & 0x80008000) | ((w >> 1) & 0x3F803F80)
        MULT: tl.constexpr = 256.0
    pairs = tl.join(lo, hi)  # [BN, SUB / 4, 2]: word w, pair p = inputs 4w + 2p, 4w + 2p + 1
    vals = tl.join(pairs.to(tl.uint16).to(DT, bitcast=True), (pairs >> 16).to(tl.uint16).to(DT, bitcast=True)) * MULT
    return tl.reshape(vals, [n.shape[0], SUB])


@triton.jit
def fp8_relaid32(W, e, n, nmask, kq, s_we, s_wn, SUB: tl.constexpr):
    """Re-laid FP8 inputs kq .. kq + SUB as float32 [BLOCK_N, SUB] (each byte decoded by :func:`e4m3`), for float32
    activations and prefill tiles."""
    w = _fp8_words(W, e, n, nmask, kq, s_we, s_wn, SUB)
    x0 = w & 0xFF  # input 4w
    x2 = (w >> 8) & 0xFF  # 4w + 2
    x1 = (w >> 16) & 0xFF  # 4w + 1
    x3 = (w >> 24) & 0xFF  # 4w + 3
    # tl.join's new axis is the last: [w, a, b] = (b == 0 ? join(x0, x2) : join(x1, x3))[w, a] = input 4w + 2a + b
    codes = tl.join(tl.join(x0, x2), tl.join(x1, x3))
    return tl.reshape(e4m3(codes), [n.shape[0], SUB])


@triton.jit
def fp8_block_scales(S, e, n, mask, kq, PART, s_se, s_sn):
    """The float32 128 x 128 block scales [BLOCK_N] of expert e's rows n for the block holding input kq: row n of
    part n // PART uses block row (n // PART) ceil(PART / 128) + (n % PART) // 128; 0 where ``mask`` is off (both
    layouts: the re-laid one pads the scale columns only)."""
    brow = (n // PART) * ((PART + 127) // 128) + (n % PART) // 128
    return tl.load(S + e * s_se + brow * s_sn + kq // 128, mask=mask, other=0.0)
