"""Fused routed experts over packed expert weights in Triton (CUDA/ROCm): INT4 group-32, MXFP4 and FP8 block-scaled.

The same grouped-GEMM design as :mod:`tokenfab.kernels.gpu.moe` ((token, slot) pairs sorted by expert and padded
per expert to the tile height by :func:`~tokenfab.kernels.gpu.moe.align_pairs`; one launch per projection, the
second multiplying by the routing weights), with the weight tile decoded in registers from the packed bytes as the
checkpoints store them (compressed-tensors layouts; tokenfab/quant/int4_group.py and mxfp4_experts.py):

* INT4 group-32 (``pack-quantized``, symmetric): ``packed`` int32 [E, N, K / 8], value k of a row in bits
  4 (k % 8) .. +3 of word k / 8 as the unsigned nibble q + 8; ``scale`` bf16 / fp16 [E, N, K / 32];
  W = (nibble - 8) * scale.
* MXFP4 (``mxfp4-pack-quantized``): ``packed`` uint8 [E, N, K / 2], column 2c in the low nibble of byte c and 2c + 1
  in the high one, each an E2M1 code (sign, 2 exponent bits with bias 1, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6);
  ``scale`` uint8 E8M0 [E, N, K / 32], 2^(s - 127) (255: NaN). OCP Microscaling Formats v1.0, 5.3.3 and 5.4.1.
* FP8 block-scaled (DeepSeek-V3 / Kimi-K2; tokenfab/quant/fp8_block_experts.py): ``packed`` uint8 [E, N, K], the
  float8_e4m3fn bits (sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0: m 2^-9; S.1111.111: NaN);
  ``scale`` float32 [E, (N / PART) ceil(PART / 128), ceil(K / 128)], the rows in parts of PART rows (gate|up: I,
  down: N) each with its own 128 x 128 blocks: W[n, k] = e4m3(byte) * scale[n // PART * ceil(PART / 128)
  + n % PART // 128, k // 128].

bf16 scales are read as their 16 bits and widened by a shift (exact), E8M0 scales by building the float's exponent
field, so nothing depends on bf16 or FP4 support in the Triton build (the interpreter has neither). ``tl.dot`` runs
in IEEE float32. Reference and fallback: the packed-experts format's PyTorch path (tests/test_triton_packed_moe.py
checks both in the interpreter against the formulas written out in the test).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenfab.kernels.gpu.moe import _tiles, align_pairs

INT4_GROUP, MXFP4, FP8_BLOCK = 0, 1, 2
_FORMATS = {"int4_group": INT4_GROUP, "mxfp4": MXFP4, "fp8_block": FP8_BLOCK}


@triton.jit
def _decode_tile(P, S, e, n, kk, mask, s_pe, s_pn, s_se, s_sn, PART, FMT: tl.constexpr, SCALE_BF16: tl.constexpr):
    """W[e, n, kk] float32 for a [BLOCK_K, BLOCK_N] tile (kk rows, n columns)."""
    if FMT == 2:  # e4m3 bits; normal values as (1 + m / 8) * 2^(e - 7) with 2^(e - 7) built from its float32 bits
        byte = tl.load(P + e * s_pe + n[None, :] * s_pn + kk[:, None], mask=mask, other=0).to(tl.int32)
        ex = (byte >> 3) & 15
        man = (byte & 7).to(tl.float32)
        pow2 = ((tl.maximum(ex, 1) + 120) << 23).to(tl.float32, bitcast=True)
        mag = tl.where(ex == 0, man * 0.001953125, (1.0 + man * 0.125) * pow2)
        mag = tl.where((byte & 0x7F) == 0x7F, float("nan"), mag)
        val = tl.where((byte & 0x80) != 0, -mag, mag)
        brow = (n // PART) * ((PART + 127) // 128) + (n % PART) // 128
        sc = tl.load(S + e * s_se + brow[None, :] * s_sn + kk[:, None] // 128, mask=mask, other=0.0)
        return val * sc
    g = kk[:, None] // 32
    if SCALE_BF16:
        bits = tl.load(S + e * s_se + n[None, :] * s_sn + g, mask=mask, other=0).to(tl.int32) & 0xFFFF
        sc = (bits << 16).to(tl.float32, bitcast=True)
    elif FMT == 1:
        s8 = tl.load(S + e * s_se + n[None, :] * s_sn + g, mask=mask, other=127).to(tl.int32)
        sc = tl.where(s8 == 0, 5.877471754111438e-39, (s8 << 23).to(tl.float32, bitcast=True))  # 2^-127: subnormal
        sc = tl.where(s8 == 255, float("nan"), sc)
    else:
        sc = tl.load(S + e * s_se + n[None, :] * s_sn + g, mask=mask, other=0.0).to(tl.float32)
    if FMT == 0:
        word = tl.load(P + e * s_pe + n[None, :] * s_pn + kk[:, None] // 8, mask=mask, other=0)
        nib = (word >> (4 * (kk[:, None] % 8))) & 0xF
        return (nib - 8).to(tl.float32) * sc
    byte = tl.load(P + e * s_pe + n[None, :] * s_pn + kk[:, None] // 2, mask=mask, other=0).to(tl.int32)
    code = (byte >> (4 * (kk[:, None] % 2))) & 0xF
    ex = (code >> 1) & 3
    man = (code & 1).to(tl.float32)
    mag = tl.where(ex == 0, 0.5 * man, (1.0 + 0.5 * man) * (1 << tl.maximum(ex - 1, 0)).to(tl.float32))
    return tl.where((code >> 3) == 1, -mag, mag) * sc


@triton.jit
def _packed_moe_gemm(A, P, S, C, SORTED, EXPERT_OF_BLOCK, NUM_POST, TOPW,
                     N, K, num_pairs, s_am, s_pe, s_pn, s_se, s_sn, s_cm, PART,
                     A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, FMT: tl.constexpr,
                     SCALE_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    bm = pid // num_n
    bn = pid % num_n
    if bm * BLOCK_M >= tl.load(NUM_POST):
        return
    e = tl.load(EXPERT_OF_BLOCK + bm).to(tl.int64)
    if e < 0:
        return
    rows = bm * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SORTED + rows)
    pmask = pair < num_pairs
    a_row = (pair // A_ROW_DIV).to(tl.int64)
    n = bn * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        a = tl.load(A + a_row[:, None] * s_am + kk[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0)
        w = _decode_tile(P, S, e, n, kk, kmask[:, None] & nmask[None, :], s_pe, s_pn, s_se, s_sn, PART, FMT,
                         SCALE_BF16)
        acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
    if MUL_WEIGHT:
        acc = acc * tl.load(TOPW + pair, mask=pmask, other=0.0)[:, None]
    tl.store(C + pair.to(tl.int64)[:, None] * s_cm + n[None, :], acc.to(C.dtype.element_ty),
             mask=pmask[:, None] & nmask[None, :])


def _launch(a, packed, scale, fmt, out, sorted_pairs, expert_of_block, num_post, topw, N, K, M, tiles_m,
            a_row_div, mul_weight, part=1):
    bf16 = scale.dtype == torch.bfloat16
    s = scale.view(torch.int16) if bf16 else scale
    block_m, bn, bk = _tiles(M, N, K)
    _packed_moe_gemm[(tiles_m * triton.cdiv(N, bn),)](
        a, packed, s, out, sorted_pairs, expert_of_block, num_post, topw,
        N, K, M, a.stride(0), packed.stride(0), packed.stride(1), s.stride(0), s.stride(1), out.stride(0), part,
        A_ROW_DIV=a_row_div, MUL_WEIGHT=mul_weight, FMT=fmt, SCALE_BF16=bf16, BLOCK_M=block_m, BLOCK_N=bn,
        BLOCK_K=bk)


def fused_moe_packed(x: torch.Tensor, fmt: str, p13: torch.Tensor, s13: torch.Tensor, p2: torch.Tensor,
                     s2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, act, start: int = 0,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """sum over a token's k routed experts (those in [start, start + E_local)) of weight * expert(x), the experts'
    weights read packed.

    Args:
        x: [T, hidden] (float32 / bf16 / fp16).
        fmt: "int4_group", "mxfp4" or "fp8_block" (the layouts of the module docstring).
        p13, s13: gate|up rows, packed [E_local, 2I, ...] and scales [E_local, 2I, hidden / 32] (FP8: [E_local,
            2 ceil(I / 128), ceil(hidden / 128)], gate and up blocks apart).
        p2, s2: down rows, packed [E_local, hidden, ...] and scales [E_local, hidden, I / 32] (FP8: [E_local,
            ceil(hidden / 128), ceil(I / 128)]).
        weights: [T, k] float32 routing weights; ids: [T, k] int64 global expert ids.
        act: the experts' gated activation, [P, 2I] -> [P, I] (SiLU-GLU; K3's SiTU).
        out_dtype: the result's dtype (default x's; K3's latent MoE keeps float32).

    Returns:
        [T, hidden] (pairs routed to other ranks contribute zero; the k-sum is in float32).

    Raises:
        ValueError: an unknown format, or packed / scale shapes that do not match x and each other.
    """
    if fmt not in _FORMATS:
        raise ValueError(f"fused_moe_packed: unknown format '{fmt}' (known: {', '.join(_FORMATS)})")
    T, hidden = x.shape
    num_local, two_i = p13.shape[0], p13.shape[1]
    inter = two_i // 2
    per = {"int4_group": 8, "mxfp4": 2, "fp8_block": 1}[fmt]
    if fmt == "fp8_block":
        cb = lambda v: -(-v // 128)  # noqa: E731  (128-blocks, the last partial)
        want13, want2 = (num_local, 2 * cb(inter), cb(hidden)), (num_local, cb(hidden), cb(inter))
    else:
        want13, want2 = (num_local, two_i, hidden // 32), (num_local, hidden, inter // 32)
    if (p13.shape[2] * per != hidden or tuple(s13.shape) != want13 or p2.shape[:2] != (num_local, hidden)
            or p2.shape[2] * per != inter or tuple(s2.shape) != want2):
        raise ValueError(f"fused_moe_packed: {fmt} stacks {tuple(p13.shape)}/{tuple(s13.shape)} and "
                         f"{tuple(p2.shape)}/{tuple(s2.shape)} do not match hidden {hidden}")
    k = ids.shape[1]
    M = T * k
    block_m = _tiles(M, two_i, hidden)[0]
    sorted_pairs, expert_of_block, num_post = align_pairs(ids, start, num_local, block_m)
    tiles_m = sorted_pairs.numel() // block_m
    topw = weights.reshape(-1).float().contiguous()
    x = x.contiguous()
    f = _FORMATS[fmt]
    h13 = torch.empty(M, two_i, dtype=x.dtype, device=x.device)
    _launch(x, p13, s13, f, h13, sorted_pairs, expert_of_block, num_post, topw, two_i, hidden, M, tiles_m, k, False,
            inter)
    h = act(h13)
    out_pairs = torch.zeros(M, hidden, dtype=torch.float32, device=x.device)
    _launch(h, p2, s2, f, out_pairs, sorted_pairs, expert_of_block, num_post, topw, hidden, inter, M, tiles_m, 1,
            True, hidden)
    return out_pairs.view(T, k, hidden).sum(1).to(out_dtype or x.dtype)
