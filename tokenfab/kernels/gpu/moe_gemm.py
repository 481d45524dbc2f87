"""The grouped GEMM of the fused routed experts in Triton (CUDA/ROCm): one launch per projection over all experts,
for plain weight stacks and for INT4 group-32, MXFP4 and FP8 block-scaled stacks decoded in registers
(kernels/gpu/packed_moe.py's docstring states the layouts).

Work split. The (token, slot) pairs arrive sorted by expert and padded per expert to BLOCK_M rows
(kernels/gpu/moe.py::align_pairs_fused), so every BLOCK_M-row tile of the sorted list belongs to one expert. One
program computes the [BLOCK_M, BLOCK_N] output tile of one row tile, over one of SPLIT_K consecutive ranges of the
K inputs: decode batches hit few experts with a row or two each, so the programs must come from the N and K axes
for every SM to stream weight bytes. With SPLIT_K > 1 each range writes its own float32 partial, C[s, pair, n],
and the consumer sums the ranges in order s = 0, 1, ... (moe_sum for the down projection): deterministic, no
atomics. Program 0 stores SPLIT_K to ``NSPLIT`` (a device int32), so the consumer learns the autotuner's choice
without a host read. Only the down projection splits (its partials fold into moe_sum, no extra launch); gate|up
finds its programs along N = 2I, thousands of rows in the models served. The grid covers min(worst-case tiles,
pairs) row tiles (every used tile holds a pair); tiles past the used ones return at once, so launch shapes depend
on sizes only (CUDA-graph safe).

Weight tiles. Along K (the memory-contiguous axis) a program loads [BLOCK_N, 32 / per] packed words per 32 inputs
(INT4: 4 int32 words = 16 bytes a row; MXFP4: 16 bytes; FP8: BLOCK_K bytes) and decodes them in registers,
exactly. Each scale is loaded once per (row, group) and applied to the float32 partial product of its group (INT4 /
MXFP4: 32 inputs; FP8: BLOCK_K <= 128 inputs inside one 128-block), so the dot sees the unscaled codes, which are
exact in bf16 / fp16 (integers -8..7, E2M1 and E4M3 values): bf16 / fp16 activations run ``tl.dot`` in their own
dtype on the tensor cores with no weight rounding, float32 activations run it in IEEE float32 (no TF32), so
float32 results are the dequantized twin's to float32 rounding. Plain stacks accumulate ``tl.dot`` over BLOCK_K.
The decodes avoid int-to-float conversions. On decode tiles with 16-bit activations, INT4 nibbles 2j, 2j + 1 go
into the two halves of one register OR'd into the mantissa of 128 (bf16) / 1024 (fp16) and one packed subtraction
gives nibble - 8 (:func:`_int4_tile16`); E2M1 / E4M3 fields are placed into the 16-bit float's fields and one
multiply by a power of two restores the value (:func:`_e2m1_16`, :func:`_e4m3_16`); MXFP4 goes through Triton's
microscaled ``tl.dot_scaled`` (bf16 / fp16 times E2M1 with E8M0 scales over the whole K tile; where this Triton
cannot compile it, the first launch falls back to the E2M1 decode for good). Elsewhere the values are built
as float32 bits (nibbles after shifts and ``tl.interleave``) and cast for the dot.

Re-laid stacks (``relaid``; INT4, MXFP4 and FP8 on a GPU: kernels/gpu/moe_relayout.py lays the bits out once at
load, kernels/gpu/moe_relaid_decode.py decodes them). Each 32-bit word gives a 16-bit MMA operand register's
(k, k + 1) pair with one rotation and one mask (INT4: and an OR with 128 / 1024 and one packed subtraction; MXFP4:
one packed multiply by 2^126 / 2^14; FP8: two pairs a word, two shifts and masks each, one packed multiply by 2^120
/ 2^8), K is padded to whole 512-input tiles so the loads need no K masks, the K tile's group scales of a row are
loaded at once (FP8: one block scale per 128-input sub-tile, K tiles up to 512), and on decode tiles the weights are
the first MMA operand (C^T = W A^T: a 64-row weight tile feeds Hopper's warpgroup MMA from registers, the
activations its second operand from shared memory; where this Triton cannot compile that, the first launch falls
back for good to the float32 decode of the same layout, as prefill tiles use). A static count of the compiled sm_90
loop with bf16 activations (Triton's compiler and ptxas on CPU, ``benchmarks/linear_sass.py --kernels moe``; no GPU
has run it), instructions per weight and thread on decode tiles: INT4 8.8-11.6 in the checkpoint layout, 4.9-5.6
re-laid; MXFP4 7.1-10.9 with dot_scaled, 6.0-6.7 re-laid; FP8 10.0-11.1, 4.2-5.4 re-laid (registers 64-126 re-laid,
no spills). The HBM rate leaves about 4 / 4 / 16 at full bandwidth, so the 4-bit formats may still be bound by
instruction issue rather than bytes (what remains: the group-scale FMA on the float32 partials, the register to
shared memory round trip Triton makes for the weight operand, address and loop work).

Configs. ``triton.autotune`` picks BLOCK_N, BLOCK_K, SPLIT_K, num_warps and num_stages per (row-tile height, pair
count bucket, N, K, projection, format, dtypes) from a small list (:data:`CONFIGS`, pruned per call by
:func:`_prune`): decode tiles (BLOCK_M 16) try narrow N tiles and split-K on the down projection; prefill tiles
(BLOCK_M 64) try wide tiles without split-K; re-laid 4-bit stacks on decode tiles try 64-row N tiles
(:data:`RELAID_DECODE_CONFIGS`). Without tuning (the default in serving) :func:`untuned_config` takes the first of
those that fills the SMs. In Triton's interpreter one fixed config runs (:data:`INTERPRET_CONFIG`; tests set
others). The shapes follow the public designs of mixed-input MoE GEMMs (vLLM's fused_moe tile configs,
Marlin's 16-byte weight loads per thread, OpenAI's triton_kernels split-K for MXFP4 MoE at small batch).
"""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from tokenfab.kernels.gpu.moe_relaid_decode import e2m1 as _e2m1
from tokenfab.kernels.gpu.moe_relaid_decode import e4m3 as _e4m3
from tokenfab.kernels.gpu.moe_relaid_decode import e8m0 as _e8m0
from tokenfab.kernels.gpu.moe_relaid_decode import group_scales
from tokenfab.kernels.gpu.moe_relaid_decode import (fp8_block_scales, fp8_relaid16, fp8_relaid32, int4_relaid16,
                                                     int4_relaid32, mxfp4_relaid16, mxfp4_relaid32, relaid_scales,
                                                     split_col)
from tokenfab.kernels.gpu import split_k
from tokenfab.kernels.gpu.norm_activation import tanh
from tokenfab.kernels.gpu.support import autotune_enabled, interpreting

DENSE, INT4_GROUP, MXFP4, FP8_BLOCK = -1, 0, 1, 2
SPLIT_MAX_PAIRS = 256  # split-K is tried only up to this many pairs (its float32 partials: splits x pairs x N)


def _cfg(bn: int, bk: int, split: int, warps: int, stages: int) -> triton.Config:
    """One autotune config."""
    return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}, num_warps=warps, num_stages=stages)


# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages). Decode (BLOCK_M 16): N tiles of 64 or 32 rows so that a few
# experts still give hundreds of programs, K tiles of 4-8 scale groups (16 bytes a row per group for the 4-bit
# formats), deep pipelines; the down projection also tries split-K 2 and 4. Prefill (BLOCK_M 64): wide N tiles, no
# split. Few configs on purpose: every config is one more compile per format and projection on a GPU's first call.
DECODE_CONFIGS = [_cfg(64, 128, 1, 4, 4), _cfg(32, 256, 1, 4, 3), _cfg(64, 128, 2, 4, 4), _cfg(32, 128, 4, 4, 4)]
PREFILL_CONFIGS = [_cfg(128, 64, 1, 4, 4), _cfg(128, 128, 1, 8, 3)]
# re-laid 4-bit stacks on decode tiles: the weights are the first MMA operand (Hopper's 64-row warpgroup MMA), so N
# tiles of 64 rows for 4 warps; K tiles of 128 to 512 inputs (the wider tiles amortize the loop over more groups;
# 512 is the layout's K padding)
RELAID_DECODE_CONFIGS = [_cfg(64, 128, 1, 4, 4), _cfg(64, 256, 1, 4, 3), _cfg(64, 512, 1, 4, 3),
                         _cfg(64, 128, 2, 4, 4), _cfg(64, 128, 4, 4, 4)]
CONFIGS = DECODE_CONFIGS + PREFILL_CONFIGS + RELAID_DECODE_CONFIGS
# the config Triton's interpreter runs (one: no autotuning there); tests monkeypatch it to reach other splits / tiles
INTERPRET_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1}


def _prune(configs, named_args, **kwargs):
    """Configs for one call: decode row tiles (BLOCK_M 16) keep DECODE_CONFIGS (re-laid stacks:
    RELAID_DECODE_CONFIGS) whose SPLIT_K fits the output's slices (``split_max``), prefill tiles PREFILL_CONFIGS;
    FP8 in the checkpoint layout keeps BLOCK_K <= 128 (one 128-block per tile). Each kept config is one compile
    per format and projection on a GPU, so the lists stay short."""
    if kwargs["BLOCK_M"] > 16:
        pool = PREFILL_CONFIGS
    elif kwargs.get("RELAID") and kwargs["FMT"] in (INT4_GROUP, MXFP4, FP8_BLOCK):
        pool = RELAID_DECODE_CONFIGS
    else:
        pool = DECODE_CONFIGS
    split_max = named_args["split_max"]
    # K tiles past 128: for FP8 only re-laid (128-input sub-tiles, a block scale each), and where split-K is offered
    # (the decode down projection) it takes their place
    wide_ok = (kwargs["FMT"] != FP8_BLOCK or kwargs.get("RELAID", False)) and split_max == 1
    out = [c for c in configs if any(c is p for p in pool) and c.kwargs["SPLIT_K"] <= split_max
           and (wide_ok or c.kwargs["BLOCK_K"] <= 128)]
    return out or [pool[0]]


def untuned_config(fmt: int, block_m: int, relaid: bool, split_max: int, tiles_m: int, N: int,
                   sms: int) -> triton.Config:
    """The config a call runs without tuning (``TOKENFAB_TRITON_AUTOTUNE`` off, the default): of the configs the
    tuner would try for it (:func:`_prune`, in order), the first whose grid gives every SM / CU two programs
    (``tiles_m`` x ceil(N / BLOCK_N) x SPLIT_K >= 2 ``sms``: the linears' rule, kernels/gpu/split_k.py), else the
    one giving the most programs (the earliest of those). A decode batch hits few experts, so the first config
    alone leaves SMs short of loads in flight (Qwen3-30B-A3B at batch 1: 8 experts x 2048 / 64 = 256 programs of
    the down projection on an H100's 132 SMs, one or two each; 304 CUs on an MI300X); narrower N tiles or split-K
    give more. Sizes only: CUDA-graph safe."""
    cands = _prune(CONFIGS, {"split_max": split_max}, FMT=fmt, BLOCK_M=block_m, RELAID=relaid)

    def programs(c):
        return tiles_m * triton.cdiv(N, c.kwargs["BLOCK_N"]) * c.kwargs["SPLIT_K"]
    for c in cands:
        if programs(c) >= 2 * sms:
            return c
    return max(cands, key=programs)


@triton.jit
def _e2m1_16(c, DT: tl.constexpr):
    """E2M1 codes (int32) -> DT (bf16 / fp16) exactly, without float32: the sign bit and the 3 magnitude bits placed
    in DT's sign / exponent / mantissa fields give the value times 2^-126 (bf16) or 2^-14 (fp16), subnormal for
    0.5, and one packed multiply by 2^126 / 2^14 restores it."""
    if DT == tl.bfloat16:
        bits = ((c & 8) << 12) | ((c & 7) << 6)
        MULT: tl.constexpr = 8.507059173023462e37
    else:
        bits = ((c & 8) << 12) | ((c & 7) << 9)
        MULT: tl.constexpr = 16384.0
    return bits.to(tl.int16).to(DT, bitcast=True) * MULT


@triton.jit
def _e4m3_16(b, DT: tl.constexpr):
    """E4M3FN codes (int32) -> DT (bf16 / fp16) exactly, as :func:`_e2m1_16`: fields placed give the value times
    2^-120 (bf16) or 2^-8 (fp16), subnormals included, and a multiply by 2^120 / 2^8 restores it (NaN codes are
    not kept: checkpoints hold none)."""
    if DT == tl.bfloat16:
        bits = ((b & 0x80) << 8) | ((b & 0x7F) << 4)
        MULT: tl.constexpr = 1.329227995784916e36
    else:
        bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        MULT: tl.constexpr = 256.0
    return bits.to(tl.int16).to(DT, bitcast=True) * MULT


@triton.jit
def _unpack_nibbles(words, PER: tl.constexpr):
    """[R, C] words holding PER 4-bit codes each, code j in bits 4j..4j+3 -> [R, C * PER] int32 codes in K order."""
    if PER == 2:
        w = words.to(tl.int32)
        codes = tl.interleave(w & 0xF, (w >> 4) & 0xF)
    else:
        n0 = words & 0xF
        n1 = (words >> 4) & 0xF
        n2 = (words >> 8) & 0xF
        n3 = (words >> 12) & 0xF
        n4 = (words >> 16) & 0xF
        n5 = (words >> 20) & 0xF
        n6 = (words >> 24) & 0xF
        n7 = (words >> 28) & 0xF
        # interleave(a, b) alternates along the last axis: position 4c + 2d + f of a word gets nibble f + 2d + 4c
        codes = tl.interleave(tl.interleave(tl.interleave(n0, n4), tl.interleave(n2, n6)),
                              tl.interleave(tl.interleave(n1, n5), tl.interleave(n3, n7)))
    return codes


@triton.jit
def _packed4_tile(W, S, e, n, nmask, kq, K, s_we, s_wn, s_se, s_sn, FMT: tl.constexpr, SCALE_BF16: tl.constexpr,
                  SUB: tl.constexpr, DT: tl.constexpr):
    """INT4 group-32 (FMT 0) or MXFP4 (FMT 1) inputs kq .. kq + SUB (one group) of expert e's rows n: the unscaled
    values [BLOCK_N, SUB] (float32; MXFP4 for a 16-bit dot: DT) and the rows' float32 group scales [BLOCK_N]."""
    PER: tl.constexpr = 8 if FMT == 0 else 2
    wi = kq // PER + tl.arange(0, SUB // PER)
    words = tl.load(W + e * s_we + n[:, None].to(tl.int64) * s_wn + wi[None, :],
                    mask=nmask[:, None] & (wi < K // PER)[None, :], other=0)
    code = _unpack_nibbles(words, PER)
    sp = S + e * s_se + n * s_sn + kq // 32
    gmask = nmask & ((kq + tl.zeros_like(n)) < K)  # rows that exist, in a group that does
    if SCALE_BF16:  # bf16 bits widened by a shift: no bf16 arithmetic needed
        sc = ((tl.load(sp, mask=gmask, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    elif FMT == 1:
        sc = _e8m0(tl.load(sp, mask=gmask, other=127).to(tl.int32))
    else:
        sc = tl.load(sp, mask=gmask, other=0.0).to(tl.float32)
    if FMT == 0:  # 2^23 + nibble from the float32 bits, minus 2^23 + 8: exactly nibble - 8
        val = (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    elif DT == tl.float32:
        val = _e2m1(code)
    else:
        val = _e2m1_16(code, DT)
    return val, sc


@triton.jit
def _int4_tile16(W, S, e, n, nmask, kq, K, s_we, s_wn, s_se, s_sn, SCALE_BF16: tl.constexpr, DT: tl.constexpr):
    """INT4 inputs kq .. kq + 32 (one group) of expert e's rows n for a 16-bit dot (DT bf16 / fp16), decoded two
    at a time: nibbles 2j and 2j + 1 of a word moved into the two 16-bit halves of one register, OR'd into the
    mantissas of 128 (bf16) or 1024 (fp16), minus 136 / 1032 (one packed subtraction): nibble - 8, exact, already
    in the (k, k + 1) pairs a 16-bit MMA operand register holds. Returns [BLOCK_N, 32] in DT and the rows' float32
    scales [BLOCK_N] as :func:`_packed4_tile`."""
    if DT == tl.bfloat16:
        MAGIC: tl.constexpr = 0x43004300
        BIAS: tl.constexpr = 136.0
    else:
        MAGIC: tl.constexpr = 0x64006400
        BIAS: tl.constexpr = 1032.0
    wi = kq // 8 + tl.arange(0, 4)
    words = tl.load(W + e * s_we + n[:, None].to(tl.int64) * s_wn + wi[None, :],
                    mask=nmask[:, None] & (wi < K // 8)[None, :], other=0)
    v0 = (words & 0xF) | ((words << 12) & 0xF0000) | MAGIC  # inputs 0, 1 of the word in the two halves
    v1 = ((words >> 8) & 0xF) | ((words << 4) & 0xF0000) | MAGIC  # 2, 3
    v2 = ((words >> 16) & 0xF) | ((words >> 4) & 0xF0000) | MAGIC  # 4, 5
    v3 = ((words >> 24) & 0xF) | ((words >> 12) & 0xF0000) | MAGIC  # 6, 7
    pairs = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [BN, 4, 2, 2]: word w, pair 2c + d
    vals = tl.join(pairs.to(tl.int16).to(DT, bitcast=True), (pairs >> 16).to(tl.int16).to(DT, bitcast=True)) - BIAS
    gmask = nmask & ((kq + tl.zeros_like(n)) < K)
    return tl.reshape(vals, [n.shape[0], 32]), group_scales(S, e, n, gmask, kq, s_se, s_sn, SCALE_BF16)


@triton.jit
def _fp8_tile(W, S, e, n, nmask, kq, K, s_we, s_wn, s_se, s_sn, PART, SUB: tl.constexpr, DT: tl.constexpr):
    """FP8 block-scaled inputs kq .. kq + SUB (inside one 128-block) of expert e's rows n: the E4M3 values in DT
    (float32, bf16 or fp16) [BLOCK_N, SUB] and the rows' float32 block scales [BLOCK_N]."""
    kk = kq + tl.arange(0, SUB)
    b = tl.load(W + e * s_we + n[:, None].to(tl.int64) * s_wn + kk[None, :],
                mask=nmask[:, None] & (kk < K)[None, :], other=0).to(tl.int32)
    gmask = nmask & ((kq + tl.zeros_like(n)) < K)
    sc = fp8_block_scales(S, e, n, gmask, kq, PART, s_se, s_sn)
    if DT == tl.float32:
        val = _e4m3(b)
    else:
        val = _e4m3_16(b, DT)
    return val, sc


GLU_NONE, GLU_SILU, GLU_SITU, GLU_SITU_LINEAR = 0, 1, 2, 3  # the gate|up GEMM's epilogue activations


@triton.jit
def _glu(g, u, GLU: tl.constexpr, beta, lbeta, DT: tl.constexpr):
    """The gated activation of gate / up accumulators (float32, one shape), each first rounded to DT as the GEMM's
    stored output is: GLU_SILU round(silu(g)) * u (layers/activation.py ``silu_and_mul``), GLU_SITU[_LINEAR]
    beta tanh(g / beta) sigmoid(g) * u (u -> lbeta tanh(u / lbeta) with _LINEAR), in float32 (the separate
    kernels' math, kernels/gpu/norm_activation.py); returned in float32 (the store rounds once)."""
    g = g.to(DT).to(tl.float32)
    u = u.to(DT).to(tl.float32)
    if GLU == 1:
        out = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32) * u
    else:
        if GLU == 3:
            u = lbeta * tanh(u / lbeta)
        out = beta * tanh(g / beta) * (1.0 / (1.0 + tl.exp(-g))) * u
    return out


# sizes that change with the batch are not specialized on (value 1, divisibility by 16): one compile per config
@triton.jit(do_not_specialize=["num_pairs", "a_row_div", "s_cs", "m_bucket", "split_max", "magic"])
def _grouped_gemm(A, W, S, C, NSPLIT, SORTED, EXPERT_OF_BLOCK, NUM_POST, TOPW,
                  N, K, num_pairs, a_row_div, s_am, s_we, s_wn, s_wk, s_se, s_sn, s_cs, s_cm, PART, m_bucket,
                  split_max, MUL_WEIGHT: tl.constexpr, FMT: tl.constexpr, SCALE_BF16: tl.constexpr,
                  IEEE: tl.constexpr, MX_SCALED: tl.constexpr, GLU: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, RELAID: tl.constexpr = False,
                  RELAID_SWAP: tl.constexpr = True, magic=0, beta=1.0, lbeta=1.0):
    """C[s, pair, n] = sum over this split's k of A[pair // a_row_div, k] W_e[n, k] (times TOPW[pair] when
    MUL_WEIGHT) for the [BLOCK_M, BLOCK_N] tile of one row tile; FMT: DENSE (-1) or packed_moe.py's 0 / 1 / 2.
    GLU (no split; GLU_* codes): W_e holds [gate | up] rows (2N); the program's BLOCK_N weight rows interleave
    gate row j and up row N + j for BLOCK_N / 2 outputs j (every format reads rows by index, so the weights keep
    their layout), and its epilogue pairs the two columns (a reshape and split of the accumulator) and stores the
    gated activation of the rounded gate and up in C's dtype, as the separate kernels round it
    (kernels/gpu/norm_activation.py): SiLU round(round(silu(gate)) * up), SiTU beta tanh(gate / beta)
    sigmoid(gate) * (lbeta tanh(up / lbeta) with GLU_SITU_LINEAR, else up) rounded once."""
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(NSPLIT, SPLIT_K)
    sk = pid % SPLIT_K
    t = pid // SPLIT_K
    OUT_N: tl.constexpr = BLOCK_N // 2 if GLU else BLOCK_N  # outputs per program
    num_n = tl.cdiv(N, OUT_N)
    bn = t % num_n
    bm = t // num_n
    if bm * BLOCK_M >= tl.load(NUM_POST):
        return
    e = tl.load(EXPERT_OF_BLOCK + bm).to(tl.int64)
    if e < 0:
        return
    pair = tl.load(SORTED + bm * BLOCK_M + tl.arange(0, BLOCK_M))
    pmask = pair < num_pairs
    a_rows = A + (pair // a_row_div).to(tl.int64)[:, None] * s_am
    if GLU:  # weight rows gate j, up N + j, ... for this program's outputs j
        c = tl.arange(0, BLOCK_N)
        n = bn * OUT_N + c // 2 + (c % 2) * N
        nmask = bn * OUT_N + c // 2 < N
    else:
        n = bn * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = sk * k_per
    k_hi = tl.minimum(K, k_lo + k_per)
    # the decodes' output dtype: the 16-bit activations' own on decode tiles, float32 (then cast) elsewhere: the
    # 16-bit INT4 decode feeding Hopper's 64-row MMA crashes a Triton pass (TritonGPUOptimizeDotOperands, 3.9)
    DT: tl.constexpr = A.dtype.element_ty if (not IEEE and BLOCK_M <= 16) else tl.float32
    # MXFP4 on decode tiles with 16-bit activations: Triton's own microscaled dot over the whole K tile
    MX: tl.constexpr = MX_SCALED and FMT == 1 and DT != tl.float32 and not RELAID
    # inputs per scale group in a tile: 32 (4-bit), the tile (MXFP4's dot_scaled, FP8 up to its 128-block)
    if (FMT == 0 or FMT == 1) and not MX:
        SUB: tl.constexpr = 32
    elif FMT == 2 and BLOCK_K > 128:  # re-laid FP8 only (_prune): 128-input sub-tiles, a scale each
        SUB: tl.constexpr = 128
    else:
        SUB: tl.constexpr = BLOCK_K
    # re-laid 4-bit stacks on decode tiles: the weights are the MMA's first operand (acc is C^T [BLOCK_N, BLOCK_M])
    SWAP: tl.constexpr = RELAID and RELAID_SWAP and FMT >= 0 and DT != tl.float32
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if SWAP and FMT != 2:  # the K tile's group scales of each row at once: [BLOCK_N, BLOCK_K / 32] float32
            scs = relaid_scales(S, e, n, nmask, k0, s_se, s_sn, BLOCK_K // 32, FMT, SCALE_BF16)
        for j in tl.static_range(BLOCK_K // SUB):
            kq = k0 + j * SUB
            kk = kq + tl.arange(0, SUB)
            a = tl.load(a_rows + kk[None, :], mask=pmask[:, None] & (kk < K)[None, :], other=0.0)
            if MX:  # W^T tile [SUB / 2, BLOCK_N] of packed bytes, E8M0 scales [BLOCK_N, SUB / 32]
                kb = kq // 2 + tl.arange(0, SUB // 2)
                wq = tl.load(W + e * s_we + n[None, :].to(tl.int64) * s_wn + kb[:, None],
                             mask=nmask[None, :] & (kb < K // 2)[:, None], other=0)
                g = kq // 32 + tl.arange(0, SUB // 32)
                s8 = tl.load(S + e * s_se + n[:, None] * s_sn + g[None, :],
                             mask=nmask[:, None] & (g < K // 32)[None, :], other=127)
                if DT == tl.bfloat16:
                    acc = tl.dot_scaled(a, None, "bf16", wq, s8, "e2m1", acc)
                else:
                    acc = tl.dot_scaled(a, None, "fp16", wq, s8, "e2m1", acc)
            elif FMT < 0:
                w = tl.load(W + e * s_we + n[:, None].to(tl.int64) * s_wn + kk[None, :] * s_wk,
                            mask=nmask[:, None] & (kk < K)[None, :], other=0.0)
                if IEEE:
                    acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
            else:
                if FMT == 2 and RELAID:  # the tile inside one 128-block: one scale per row
                    if SWAP:
                        w = fp8_relaid16(W, e, n, nmask, kq, s_we, s_wn, SUB, DT)
                    else:
                        w = fp8_relaid32(W, e, n, nmask, kq, s_we, s_wn, SUB)
                    sc = fp8_block_scales(S, e, n, nmask, kq, PART, s_se, s_sn)
                elif FMT == 2:
                    w, sc = _fp8_tile(W, S, e, n, nmask, kq, K, s_we, s_wn, s_se, s_sn, PART, SUB, DT)
                elif SWAP:
                    if FMT == 0:
                        w = int4_relaid16(W, e, n, nmask, kq, s_we, s_wn, magic, DT)
                    else:
                        w = mxfp4_relaid16(W, e, n, nmask, kq, s_we, s_wn, DT)
                    sc = split_col(scs, j, BLOCK_K // SUB)
                elif RELAID and FMT == 0:
                    w, sc = int4_relaid32(W, S, e, n, nmask, kq, s_we, s_wn, s_se, s_sn, SCALE_BF16)
                elif RELAID:
                    w, sc = mxfp4_relaid32(W, S, e, n, nmask, kq, s_we, s_wn, s_se, s_sn)
                elif FMT == 0 and DT != tl.float32:
                    w, sc = _int4_tile16(W, S, e, n, nmask, kq, K, s_we, s_wn, s_se, s_sn, SCALE_BF16, DT)
                else:
                    w, sc = _packed4_tile(W, S, e, n, nmask, kq, K, s_we, s_wn, s_se, s_sn, FMT, SCALE_BF16, SUB,
                                          DT)
                if SWAP:
                    acc += tl.dot(w, tl.trans(a)) * sc[:, None]
                else:
                    if IEEE:
                        part = tl.dot(a.to(tl.float32), tl.trans(w), input_precision="ieee")
                    else:  # the codes are exact in bf16 / fp16
                        part = tl.dot(a, tl.trans(w.to(a.dtype)))
                    acc += part * sc[None, :]
    if GLU:  # pair each output's gate and up columns; the tile narrows to its OUT_N outputs
        if SWAP:
            g, u = tl.split(tl.permute(tl.reshape(acc, (OUT_N, 2, BLOCK_M)), (0, 2, 1)))
        else:
            g, u = tl.split(tl.reshape(acc, (BLOCK_M, OUT_N, 2)))
        acc = _glu(g, u, GLU, beta, lbeta, C.dtype.element_ty)
        n = bn * OUT_N + tl.arange(0, OUT_N)
        nmask = n < N
    if SWAP:
        if MUL_WEIGHT:
            acc = acc * tl.load(TOPW + pair, mask=pmask, other=0.0).to(tl.float32)[None, :]
        tl.store(C + sk * s_cs + pair.to(tl.int64)[None, :] * s_cm + n[:, None], acc.to(C.dtype.element_ty),
                 mask=pmask[None, :] & nmask[:, None])
    else:
        if MUL_WEIGHT:
            acc = acc * tl.load(TOPW + pair, mask=pmask, other=0.0).to(tl.float32)[:, None]
        tl.store(C + sk * s_cs + pair.to(tl.int64)[:, None] * s_cm + n[None, :], acc.to(C.dtype.element_ty),
                 mask=pmask[:, None] & nmask[None, :])


def _autotuned():
    """``_grouped_gemm`` under ``triton.autotune`` with short benchmark runs where this Triton lets us choose them
    (a GPU check tunes dozens of keys within its time budget)."""
    kw = {}
    params = inspect.signature(triton.autotune).parameters
    if "do_bench" in params:
        def bench(fn, quantiles=None, **_):
            return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)
        kw["do_bench"] = bench
    elif "warmup" in params:
        kw.update(warmup=5, rep=20)
    return triton.autotune(CONFIGS, key=["m_bucket", "N", "K", "split_max", "MUL_WEIGHT", "FMT", "GLU", "BLOCK_M",
                                         "RELAID"],
                           prune_configs_by={"early_config_prune": _prune}, **kw)(_grouped_gemm)


_TUNED = _autotuned()
# whether MXFP4 decode tiles use tl.dot_scaled (off for good after a compile failure on this Triton)
_MX_SCALED = [hasattr(tl, "dot_scaled")]
# whether re-laid decode tiles use the 16-bit decodes with the weights as the first MMA operand (off for good after
# a compile failure on this Triton: then they decode to float32 and cast, as prefill tiles do)
_RELAID_SWAP = [True]


def block_m_for(num_pairs: int, num_local: int) -> int:
    """Row-tile height for ``num_pairs`` (token, slot) pairs over ``num_local`` experts: 16 while the experts
    average at most 16 pairs (decode; the tensor cores' smallest M), else 64."""
    return 16 if num_pairs <= 16 * max(num_local, 1) else 64


def split_slots(num_pairs: int, block_m: int, down: bool) -> int:
    """How many float32 partial slices the output of one projection needs: the largest SPLIT_K the configs may
    pick for it (split-K on the decode down projection only, up to SPLIT_MAX_PAIRS pairs; in the interpreter,
    INTERPRET_CONFIG's)."""
    if interpreting():
        return INTERPRET_CONFIG["SPLIT_K"] if down else 1
    if not down or block_m > 16 or num_pairs > SPLIT_MAX_PAIRS:
        return 1
    return max(c.kwargs["SPLIT_K"] for c in DECODE_CONFIGS)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, fmt: int, out: torch.Tensor,
                 nsplit: torch.Tensor, pairs: tuple, N: int, K: int, a_row_div: int, mul_weight: bool, part: int,
                 block_m: int, relaid: bool = False, glu: int = GLU_NONE, beta: float = 1.0,
                 lbeta: float = 1.0) -> None:
    """One launch over all row tiles: out[s, pair, :N] = partial s of a[pair // a_row_div] @ W_e^T over the K
    inputs (times the pair's routing weight when ``mul_weight``).

    Args:
        a: [rows, K] float32 / bf16 / fp16, unit stride along K.
        w, scale: DENSE: w [E, N, K] at its strides, scale None; packed: as packed_moe.py's docstring (scale of
            INT4 as bf16 or fp16, MXFP4 uint8, FP8 float32).
        out: [S, pairs, N] (or [pairs, N] when the caller allows no split: S = 1), rows unit-stride; S >= the
            largest SPLIT_K the configs may pick (:func:`split_slots`); float32 unless S == 1.
        nsplit: [1] int32, receives the SPLIT_K used (slices 0 .. SPLIT_K - 1 of ``out`` are written).
        pairs: (sorted_pairs, expert_of_block, num_post, routing weights [pairs] float32-readable, num_pairs).
        part: FP8 rows per block part (gate|up: I, down: N); block_m: the row-tile height of the alignment.
        relaid: ``w`` / ``scale`` are the GPU layout of kernels/gpu/moe_relayout.py (K padded to Kp, a multiple
            of 512; INT4 / MXFP4: int32 [E, N, Kp / 8] and [E, N, Kp / 32]; FP8: int32 [E, N, Kp / 4] and float32
            [E, R, Kp / 128]) instead of the checkpoint's.
        glu: a GLU_* code: stacks of [gate | up] rows (2N of them, any format), ``out`` [pairs, N] (no split) of
            a's dtype receives the gated activation of the pair's gate|up row (the activation in the epilogue, one
            launch fewer): SiLU-GLU, or SiTU-GLU with ``beta`` (and ``lbeta`` for GLU_SITU_LINEAR).

    Raises:
        ValueError: ``glu`` with a split output.
    """
    if glu and out.dim() == 3:
        raise ValueError("grouped_gemm: the gated-activation epilogue takes an unsplit output")
    sorted_pairs, expert_of_block, num_post, topw, M = pairs
    tiles_m = min(sorted_pairs.numel() // block_m, M)  # every used row tile holds a pair
    if tiles_m == 0:
        return
    if scale is None:
        s, bf16, s_se, s_sn, s_wk = w, False, 0, 0, w.stride(2)
    else:
        bf16 = scale.dtype == torch.bfloat16
        s = scale.view(torch.int16) if bf16 else scale
        s_se, s_sn, s_wk = s.stride(0), s.stride(1), 1
    slots = out.shape[0] if out.dim() == 3 else 1
    s_cs, s_cm = (out.stride(0), out.stride(1)) if out.dim() == 3 else (0, out.stride(0))
    m_bucket = min(triton.next_power_of_2(max(M, 1)), 4096)
    args = (a, w, s, out, nsplit, sorted_pairs, expert_of_block, num_post, topw, N, K, M, a_row_div, a.stride(0),
            w.stride(0), w.stride(1), s_wk, s_se, s_sn, s_cs, s_cm, part, m_bucket, slots)
    per_n = 2 if glu else 1  # with the epilogue each program's BLOCK_N weight rows give BLOCK_N / 2 outputs
    # Triton's interpreter handles bf16 tiles wrongly (numpy has no bf16): there bf16 runs take the float32 path on
    # the same values (bf16 activations and codes are exact in float32); fp16 runs the 16-bit path as on a GPU
    ieee = a.dtype == torch.float32 or (interpreting() and a.dtype == torch.bfloat16)
    relaid = relaid and fmt in (INT4_GROUP, MXFP4, FP8_BLOCK)
    meta = dict(MUL_WEIGHT=mul_weight, FMT=fmt, SCALE_BF16=bf16, IEEE=ieee, MX_SCALED=_MX_SCALED[0], GLU=glu,
                BLOCK_M=block_m, RELAID=relaid, RELAID_SWAP=_RELAID_SWAP[0],
                magic=0x43004300 if a.dtype == torch.bfloat16 else 0x64006400, beta=float(beta), lbeta=float(lbeta))
    if interpreting():  # one config; splits past the output's slices and checkpoint-layout FP8 K tiles past 128 capped
        cfg = dict(INTERPRET_CONFIG, SPLIT_K=min(INTERPRET_CONFIG["SPLIT_K"], slots))
        if fmt == FP8_BLOCK and not relaid:
            cfg["BLOCK_K"] = min(cfg["BLOCK_K"], 128)
        grid = (tiles_m * triton.cdiv(N * per_n, cfg["BLOCK_N"]) * cfg["SPLIT_K"],)

        def launch(**kw):
            _grouped_gemm[grid](*args, **kw, **cfg)
    elif not autotune_enabled():  # untuned (support.autotune_enabled): a config that fills the SMs
        first = untuned_config(fmt, block_m, relaid, slots, tiles_m, N * per_n, split_k.sm_count(a.device))
        grid = (tiles_m * triton.cdiv(N * per_n, first.kwargs["BLOCK_N"]) * first.kwargs["SPLIT_K"],)

        def launch(**kw):
            _grouped_gemm[grid](*args, **kw, **first.kwargs, num_warps=first.num_warps, num_stages=first.num_stages)
    else:
        def launch(**kw):
            _TUNED[lambda c: (tiles_m * triton.cdiv(N * per_n, c["BLOCK_N"]) * c["SPLIT_K"],)](*args, **kw)
    # the one choice a failed first compile turns off for good: re-laid stacks' swapped 16-bit path, else (a Triton
    # without tl.dot_scaled(bf16, e2m1 with scales)) MXFP4's dot_scaled for our own E2M1 decode
    key, flag = ("RELAID_SWAP", _RELAID_SWAP) if relaid else ("MX_SCALED", _MX_SCALED)
    if not meta[key] or (key == "MX_SCALED" and fmt != MXFP4):
        launch(**meta)
        return
    try:
        launch(**meta)
    except Exception as err:
        if isinstance(err, torch.cuda.OutOfMemoryError):
            raise
        flag[0] = False
        launch(**dict(meta, **{key: False}))
