"""Fused routed experts over packed expert weights in Triton (CUDA/ROCm): INT4 group-32, MXFP4 and FP8 block-scaled.

The grouped GEMM of :mod:`tokenfab.kernels.gpu.moe_gemm`, the same kernel and flow as plain stacks
(:func:`~tokenfab.kernels.gpu.moe.routed_sum`: (token, slot) pairs sorted by expert and padded per expert to the tile
height; one launch per projection, the second multiplying by the routing weights), with the weight tile decoded in
registers from the packed bytes as the checkpoints store them (compressed-tensors layouts;
tokenfab/quant/int4_group.py and mxfp4_experts.py):

* INT4 group-32 (``pack-quantized``, symmetric): ``packed`` int32 [E, N, K / 8], value k of a row in bits
  4 (k % 8) .. +3 of word k / 8 as the unsigned nibble q + 8; ``scale`` bf16 / fp16 [E, N, K / 32];
  W = (nibble - 8) * scale.
* MXFP4 (``mxfp4-pack-quantized``): ``packed`` uint8 [E, N, K / 2], column 2c in the low nibble of byte c and 2c + 1
  in the high one, each an E2M1 code (sign, 2 exponent bits with bias 1, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6);
  ``scale`` uint8 E8M0 [E, N, K / 32], 2^(s - 127) (255: NaN). OCP Microscaling Formats v1.0, 5.3.3 and 5.4.1.
* On a GPU, INT4, MXFP4 and FP8 stacks are re-laid once at load (kernels/gpu/moe_relayout.py: bits placed for
  two-at-a-time 16-bit decodes, K padded to 512; ``relaid``); the CPU keeps the layouts above.
* FP8 block-scaled (DeepSeek-V3 / Kimi-K2; tokenfab/quant/fp8_block_experts.py): ``packed`` uint8 [E, N, K], the
  float8_e4m3fn bits (sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0: m 2^-9; S.1111.111: NaN);
  ``scale`` float32 [E, (N / PART) ceil(PART / 128), ceil(K / 128)], the rows in parts of PART rows (gate|up: I,
  down: N) each with its own 128 x 128 blocks: W[n, k] = e4m3(byte) * scale[n // PART * ceil(PART / 128)
  + n % PART // 128, k // 128].

bf16 scales are read as their 16 bits and widened by a shift (exact), E8M0 scales by building the float's exponent
field, so nothing depends on bf16 or FP4 support in the Triton build (the interpreter has neither). The codes are
multiplied unscaled (exact in bf16 / fp16) by ``tl.dot`` in the activations' dtype, or in IEEE float32 for float32
activations, and each group's float32 partial is then scaled (moe_gemm.py's docstring). Reference and fallback: the packed-experts format's PyTorch path (tests/test_triton_packed_moe.py
checks both in the interpreter against the formulas written out in the test).
"""
from __future__ import annotations

import torch

from tokenfab.kernels.gpu.moe import routed_sum
from tokenfab.kernels.gpu.moe_relayout import padded_k

INT4_GROUP, MXFP4, FP8_BLOCK = 0, 1, 2
_FORMATS = {"int4_group": INT4_GROUP, "mxfp4": MXFP4, "fp8_block": FP8_BLOCK}


def fused_moe_packed(x: torch.Tensor, fmt: str, p13: torch.Tensor, s13: torch.Tensor, p2: torch.Tensor,
                     s2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, act, start: int = 0,
                     out_dtype: torch.dtype | None = None, plus: torch.Tensor | None = None,
                     relaid: bool | tuple[bool, bool] = False, norm: tuple | None = None,
                     aligned=None) -> torch.Tensor:
    """sum over a token's k routed experts (those in [start, start + E_local)) of weight * expert(x), the experts'
    weights read packed.

    Args:
        x: [T, hidden] (float32 / bf16 / fp16).
        fmt: "int4_group", "mxfp4" or "fp8_block" (the layouts of the module docstring).
        p13, s13: gate|up rows, packed [E_local, 2I, ...] and scales [E_local, 2I, hidden / 32] (FP8: [E_local,
            2 ceil(I / 128), ceil(hidden / 128)], gate and up blocks apart).
        p2, s2: down rows, packed [E_local, hidden, ...] and scales [E_local, hidden, I / 32] (FP8: [E_local,
            ceil(hidden / 128), ceil(I / 128)]).
        weights: [T, k] routing weights (float32 or x's dtype, read as float32); ids: [T, k] int64 global expert ids.
        act: the experts' gated activation as kernels/gpu/moe.py ``fused_moe`` takes it (None: SiLU-GLU,
            ("situ", beta, linear_beta): K3's SiTU-GLU, both in the gate|up GEMM's epilogue; a callable
            [P, 2I] -> [P, I]: its own launch).
        out_dtype: the result's dtype (default x's; K3's latent MoE keeps float32).
        plus: [T, hidden] or None, added in the float32 k-sum (the shared experts' output).
        norm: optional (weight, eps, tickets): the result is the RMSNorm of the float32 sum (moe.py ``moe_sum``).
        relaid: whether the stacks (one flag for both, or (gate|up, down)) are in the GPU layout of
            kernels/gpu/moe_relayout.py: int32 words with K padded to padded_k (INT4 / MXFP4: p13 [E_local, 2I,
            padded_k(hidden) / 8], s13 [E_local, 2I, padded_k(hidden) / 32]; FP8: p13 [E_local, 2I,
            padded_k(hidden) / 4], s13 [E_local, 2 ceil(I / 128), padded_k(hidden) / 128]; p2 and s2 likewise over
            padded_k(I)).
        aligned: optional pairs aligned ahead by the router's launch (moe.py ``Alignment``, ``routed_sum``).

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
    r13, r2 = (relaid, relaid) if isinstance(relaid, bool) else relaid
    rper, group = (4, 128) if fmt == "fp8_block" else (8, 32)  # GPU layout: inputs per int32 word, per scale column
    k13, per13 = (padded_k(hidden), rper) if r13 else (hidden, per)
    k2, per2 = (padded_k(inter), rper) if r2 else (inter, per)
    want13 = want13[:2] + (k13 // group,) if r13 else want13
    want2 = want2[:2] + (k2 // group,) if r2 else want2
    if (p13.shape[2] * per13 != k13 or tuple(s13.shape) != want13 or p2.shape[:2] != (num_local, hidden)
            or p2.shape[2] * per2 != k2 or tuple(s2.shape) != want2):
        raise ValueError(f"fused_moe_packed: {fmt} stacks {tuple(p13.shape)}/{tuple(s13.shape)} and "
                         f"{tuple(p2.shape)}/{tuple(s2.shape)} do not match hidden {hidden}")
    return routed_sum(x, weights, ids, _FORMATS[fmt], p13, s13, p2, s2, act, start, out_dtype, plus, (r13, r2), norm,
                      aligned)
