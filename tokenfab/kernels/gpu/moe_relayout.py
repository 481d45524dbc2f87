"""The GPU layouts of INT4 group-32 and MXFP4 routed-expert stacks: a one-time re-layout at load for the grouped
GEMM (kernels/gpu/moe_gemm.py, its decodes in kernels/gpu/moe_relaid_decode.py), so that the decode loop turns each
32-bit word into bf16 / fp16 pairs with about one rotation and one mask per pair, with no masks along K.

Checkpoint layout (packed_moe.py's docstring): ``packed`` int32 [E, N, K / 8], input k of a row in bits
4 (k % 8) .. +3 of word k / 8 as the unsigned nibble q + 8; ``scale`` [E, N, K / 32] (bf16 / fp16).

GPU layout: K padded with value 0 (nibble 8, scale 0) to Kp, the next multiple of :data:`K_ALIGN` (512: every K
tile the kernel tries divides it, and a scale row of Kp / 32 entries is a multiple of 16); ``packed`` int32
[E, N, Kp / 8], where word w of a row holds inputs 8w + 2i in bits 4i .. 4i + 3 and 8w + 2i + 1 in bits
16 + 4i .. 19 + 4i (i = 0..3): ``(word >> 4i) & 0x000F000F`` holds inputs (8w + 2i, 8w + 2i + 1) in the low and high
16-bit halves, the order of the (k, k + 1) pairs a 16-bit MMA operand register takes (the interleave of Marlin's
INT4 layout, Frantar et al., arXiv:2408.11743, written here independently); ``scale`` [E, N, Kp / 32], same dtype.
Rows stay where they are (N is not padded). The re-layout costs one pass over the stack on the device, one
expert at a time, and the stack's memory grows only by the K padding (none at the model sizes served: 2048,
3584, 7168, 18432 are multiples of 512).

MXFP4 (checkpoint: uint8 [E, N, K / 2], input 2c in the low nibble of byte c; E8M0 scales uint8 [E, N, K / 32]):
K padded likewise (code 0, scale 127), int32 [E, N, Kp / 8] words of 8 inputs each; input 8w + t (pair i = t // 2,
half h = t % 2) has code bit b (0: mantissa, 1-2: exponent, 3: sign) at bit :data:`MXFP4_SOURCE_BITS` [t][b] =
(d + r) % 32 of word w, where d = (6, 7, 8, 15)[b] + 16 h is where that bit sits in a bf16 (bits 6..8 and the
sign bit 15 of each half: the E2M1 value times 2^-126) and r the rotation that brings it there: 0, 4, 10 for pairs
0, 1, 2, and for pair 3 14 (mantissa bit) or 6 (the others). So ``rotr(word, r) & 0x81C081C0`` is pair i's two
inputs as bf16 bits for i < 3 (pair 3: two rotations); no single rotation per pair can place all four pairs (the
translates of {6, 7, 8, 15} do not tile 16 bit positions). Scales keep their bytes; stacks with an E8M0 scale of 0
(2^-127) or 255 (NaN) keep the checkpoint layout (:func:`plain_e8m0`), so the re-laid kernel widens a scale with
one shift.

FP8 block-scaled (checkpoint: uint8 [E, N, K], the e4m3 byte of input k at byte k; float32 scales [E, R, ceil(K /
128)] over 128 x 128 blocks, packed_moe.py): K padded likewise (byte 0: value 0; scale columns to Kp / 128 with
0), and within every 4 bytes the middle two swapped, so int32 word w holds input 4w in byte 0, 4w + 1 in byte 2,
4w + 2 in byte 1 and 4w + 3 in byte 3. Then ``((word << 8) & 0x80008000) | ((word << 4) & 0x07F007F0)`` is the
pair (4w, 4w + 1) and ``(word & 0x80008000) | ((word >> 4) & 0x07F007F0)`` the pair (4w + 2, 4w + 3) as bf16 bits
of the values times 2^-120 (the sign to bit 15 of each half, the 7 exponent / mantissa bits to bits 4..10: the
E4M3 fields placed in bf16's, subnormals included), one packed multiply by 2^120 from exact. The swap is its own
inverse.

:func:`relayout_int4` / :func:`relayout_mxfp4` / :func:`relayout_fp8` and their inverses are plain PyTorch (any
device): the CPU keeps the checkpoint layout and its kernels; tests check both directions on CPU.
"""
from __future__ import annotations

import torch

K_ALIGN = 512  # inputs: the GPU layout pads K to a multiple of this
_CHUNK_WEIGHTS = 1 << 25  # weights re-laid per pass (bounds the temporaries; fewer, larger passes at load)
_SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)  # bit offset of input 8w + t, t = 0..7, inside word w (GPU layout)
_BF16_BITS = (6, 7, 8, 15)  # where E2M1 bits 0..3 sit in a bf16 holding the value times 2^-126
_MXFP4_ROTATION = ((0,) * 4, (4,) * 4, (10,) * 4, (14, 6, 6, 6))  # [pair][bit]: rotation that brings the bit home
# [t][b]: bit of a word holding bit b of input t's E2M1 code (module docstring)
MXFP4_SOURCE_BITS = tuple(tuple((_BF16_BITS[b] + 16 * (t % 2) + _MXFP4_ROTATION[t // 2][b]) % 32 for b in range(4))
                          for t in range(8))


def padded_k(k: int) -> int:
    """K padded to whole :data:`K_ALIGN` tiles (the GPU layout's row length in inputs)."""
    return -(-k // K_ALIGN) * K_ALIGN


def _nibbles(words: torch.Tensor, shifts) -> torch.Tensor:
    """int32 words [..., W] -> int32 codes [..., W * 8], code t of word w at bit shifts[t]."""
    sh = torch.tensor(shifts, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> sh) & 0xF).flatten(-2)


def _words(codes: torch.Tensor, shifts) -> torch.Tensor:
    """int32 codes 0..15 [..., W * 8] -> int32 words [..., W], code t of word w at bit shifts[t] (wrapping into the
    sign bit as two's complement)."""
    sh = torch.tensor(shifts, dtype=torch.int64, device=codes.device)
    acc = (codes.reshape(*codes.shape[:-1], -1, 8).to(torch.int64) << sh).sum(-1)
    return torch.where(acc >= 2 ** 31, acc - 2 ** 32, acc).to(torch.int32)


@torch.no_grad()
def relayout_int4(packed: torch.Tensor, scale: torch.Tensor, in_place: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint layout -> the GPU layout (module docstring), on the tensors' device, one expert at a time.

    Args:
        packed: int32 [E, N, K / 8]; scale: [E, N, K / 32] (any dtype; K a multiple of 32).
        in_place: where K needs no padding, rewrite ``packed`` expert by expert and return it with ``scale``
            itself (no second copy of the stack); otherwise new tensors either way.

    Returns:
        (packed int32 [E, N, Kp / 8], scale [E, N, Kp / 32] of scale's dtype); Kp = padded_k(K).

    Raises:
        ValueError: shapes that do not describe one K (scale columns * 4 != packed words).
    """
    e_n, n, kw = packed.shape
    if packed.dtype != torch.int32 or tuple(scale.shape) != (e_n, n, kw // 4) or kw % 4:
        raise ValueError(f"relayout_int4: packed {tuple(packed.shape)} {packed.dtype} and scale "
                         f"{tuple(scale.shape)} are not an INT4 group-32 stack")
    kp = padded_k(kw * 8)
    step = max(1, _CHUNK_WEIGHTS // max(n * kp, 1))  # experts per pass: about 12 bytes of temporaries a weight
    if in_place and kp == kw * 8:
        for e in range(0, e_n, step):
            packed[e:e + step] = _words(_nibbles(packed[e:e + step], range(0, 32, 4)), _SHIFTS)
        return packed, scale
    out = torch.empty(e_n, n, kp // 8, dtype=torch.int32, device=packed.device)
    out_s = torch.zeros(e_n, n, kp // 32, dtype=scale.dtype, device=scale.device)
    for e in range(0, e_n, step):
        codes = torch.full((min(step, e_n - e), n, kp), 8, dtype=torch.int32, device=packed.device)  # pad: value 0
        codes[..., :kw * 8] = _nibbles(packed[e:e + step], range(0, 32, 4))
        out[e:e + step] = _words(codes, _SHIFTS)
    out_s[..., :kw // 4] = scale
    return out, out_s


@torch.no_grad()
def restore_int4(packed: torch.Tensor, scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`relayout_int4` for rows of the GPU layout: packed int32 [..., Kp / 8], scale
    [..., Kp / 32] -> the checkpoint layout of K = ``k`` inputs (int32 [..., k / 8], scale [..., k / 32]), exact."""
    codes = _nibbles(packed, _SHIFTS)[..., :k]
    return _words(codes, range(0, 32, 4)), scale[..., :k // 32].clone()


def _pack_bits(codes: torch.Tensor, where) -> torch.Tensor:
    """int32 codes 0..15 [..., W * 8] -> int32 words [..., W]: bit b of code t of a word at bit where[t][b]."""
    pos = torch.tensor(where, dtype=torch.int64, device=codes.device)  # [8, 4]
    b = torch.arange(4, device=codes.device)
    bits = (codes.reshape(*codes.shape[:-1], -1, 8, 1).to(torch.int64) >> b) & 1
    acc = (bits << pos).sum((-1, -2))
    return torch.where(acc >= 2 ** 31, acc - 2 ** 32, acc).to(torch.int32)


def _unpack_bits(words: torch.Tensor, where) -> torch.Tensor:
    """The inverse of :func:`_pack_bits`: int32 words [..., W] -> int32 codes [..., W * 8]."""
    pos = torch.tensor(where, dtype=torch.int64, device=words.device)
    bits = (words.to(torch.int64).reshape(*words.shape, 1, 1) >> pos) & 1  # [..., W, 8, 4]
    return (bits << torch.arange(4, device=words.device)).sum(-1).flatten(-2).to(torch.int32)


def plain_e8m0(scale: torch.Tensor) -> bool:
    """Whether E8M0 scales (uint8) avoid 0 and 255, so each widens to float32 with one shift (a host read: load
    time only)."""
    return not bool(((scale == 0) | (scale == 255)).any())


@torch.no_grad()
def relayout_mxfp4(packed: torch.Tensor, scale: torch.Tensor, in_place: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP4 checkpoint layout -> the GPU layout (module docstring), one expert at a time (rows in chunks).

    Args:
        packed: uint8 [E, N, K / 2]; scale: uint8 [E, N, K / 32] (K a multiple of 32).
        in_place: where K needs no padding, rewrite ``packed``'s bytes and return them viewed as int32, with
            ``scale`` itself.

    Returns:
        (int32 [E, N, Kp / 8], uint8 [E, N, Kp / 32]); Kp = padded_k(K).

    Raises:
        ValueError: shapes or dtypes that are not an MXFP4 stack.
    """
    e_n, n, kb = packed.shape
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8 or tuple(scale.shape) != (e_n, n, kb // 16) \
            or kb % 16:
        raise ValueError(f"relayout_mxfp4: packed {tuple(packed.shape)} {packed.dtype} and scale "
                         f"{tuple(scale.shape)} {scale.dtype} are not an MXFP4 stack")
    kp = padded_k(kb * 2)
    if in_place and kp == kb * 2 and packed.is_contiguous():
        out, out_s = packed.view(torch.int32), scale
    else:
        out = torch.empty(e_n, n, kp // 8, dtype=torch.int32, device=packed.device)
        out_s = torch.full((e_n, n, kp // 32), 127, dtype=torch.uint8, device=scale.device)
        out_s[..., :kb // 16] = scale
    for e in range(e_n):
        for r0 in range(0, n, 1024):
            rows = packed[e, r0:r0 + 1024].to(torch.int32)
            codes = torch.zeros(rows.shape[0], kp, dtype=torch.int32, device=packed.device)  # padding: code 0
            codes[:, :kb * 2] = torch.stack([rows & 0xF, rows >> 4], -1).flatten(-2)
            out[e, r0:r0 + 1024] = _pack_bits(codes, MXFP4_SOURCE_BITS)
    return out, out_s


@torch.no_grad()
def restore_mxfp4(packed: torch.Tensor, scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`relayout_mxfp4` for rows of the GPU layout: int32 [..., Kp / 8], uint8 [..., Kp / 32]
    -> uint8 [..., k / 2], uint8 [..., k / 32] (the checkpoint layout of K = ``k`` inputs), exact."""
    codes = _unpack_bits(packed, MXFP4_SOURCE_BITS)[..., :k]
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8), scale[..., :k // 32].clone()


_FP8_SWAP = (0, 2, 1, 3)  # byte j of a GPU-layout word holds input 4w + _FP8_SWAP[j] (its own inverse)


@torch.no_grad()
def relayout_fp8(packed: torch.Tensor, scale: torch.Tensor, in_place: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 block-scaled checkpoint layout -> the GPU layout (module docstring), one expert at a time.

    Args:
        packed: uint8 [E, N, K] (e4m3 bytes); scale: float32 [E, R, ceil(K / 128)] (R block rows).
        in_place: where K needs no padding (a multiple of 512) and ``packed`` is contiguous, swap its bytes in place
            and return them viewed as int32, with ``scale`` itself.

    Returns:
        (int32 [E, N, Kp / 4], float32 [E, R, Kp / 128]); Kp = padded_k(K).

    Raises:
        ValueError: shapes or dtypes that are not an FP8 block-scaled stack.
    """
    e_n, n, k = packed.shape
    if packed.dtype != torch.uint8 or scale.dim() != 3 or scale.shape[0] != e_n or scale.shape[2] != -(-k // 128):
        raise ValueError(f"relayout_fp8: packed {tuple(packed.shape)} {packed.dtype} and scale "
                         f"{tuple(scale.shape)} are not an FP8 block-scaled stack")
    kp = padded_k(k)
    swap = torch.tensor(_FP8_SWAP, device=packed.device)
    if in_place and kp == k and packed.is_contiguous():
        for e in range(e_n):
            quads = packed[e].view(n, k // 4, 4)
            quads.copy_(quads.index_select(2, swap))
        return packed.view(torch.int32), scale
    out = torch.zeros(e_n, n, kp, dtype=torch.uint8, device=packed.device)
    out_s = torch.zeros(e_n, scale.shape[1], kp // 128, dtype=scale.dtype, device=scale.device)
    out_s[..., :scale.shape[2]] = scale
    for e in range(e_n):
        out[e, :, :k] = packed[e]
        quads = out[e].view(n, kp // 4, 4)
        quads.copy_(quads.index_select(2, swap))
    return out.view(torch.int32), out_s


@torch.no_grad()
def restore_fp8(packed: torch.Tensor, scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`relayout_fp8` for rows of the GPU layout: int32 [..., Kp / 4], float32 [..., Kp / 128]
    -> uint8 [..., k], float32 [..., ceil(k / 128)] (the checkpoint layout), exact."""
    quads = packed.contiguous().view(torch.uint8).view(*packed.shape, 4)
    swap = torch.tensor(_FP8_SWAP, device=packed.device)
    return quads.index_select(-1, swap).flatten(-2)[..., :k].clone(), scale[..., :-(-k // 128)].clone()
