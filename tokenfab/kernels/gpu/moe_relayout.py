"""The GPU layout of INT4 group-32 routed-expert stacks: a one-time re-layout at load for the grouped GEMM
(kernels/gpu/moe_gemm.py), so that its decode loop turns each 32-bit word into bf16 / fp16 pairs with one shift
and one mask-and-OR per pair, with no masks along K.

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

:func:`relayout_int4` and its inverse :func:`restore_int4` are plain PyTorch (any device): the CPU keeps the
checkpoint layout and its kernels, tests check both directions on CPU.
"""
from __future__ import annotations

import torch

K_ALIGN = 512  # inputs: the GPU layout pads K to a multiple of this
_SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)  # bit offset of input 8w + t, t = 0..7, inside word w (GPU layout)


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
    if in_place and kp == kw * 8:
        for e in range(e_n):
            packed[e] = _words(_nibbles(packed[e], range(0, 32, 4)), _SHIFTS)
        return packed, scale
    out = torch.empty(e_n, n, kp // 8, dtype=torch.int32, device=packed.device)
    out_s = torch.zeros(e_n, n, kp // 32, dtype=scale.dtype, device=scale.device)
    for e in range(e_n):
        codes = torch.full((n, kp), 8, dtype=torch.int32, device=packed.device)  # padding: nibble 8 = value 0
        codes[:, :kw * 8] = _nibbles(packed[e], range(0, 32, 4))
        out[e] = _words(codes, _SHIFTS)
        out_s[e, :, :kw // 4] = scale[e]
    return out, out_s


@torch.no_grad()
def restore_int4(packed: torch.Tensor, scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`relayout_int4` for rows of the GPU layout: packed int32 [..., Kp / 8], scale
    [..., Kp / 32] -> the checkpoint layout of K = ``k`` inputs (int32 [..., k / 8], scale [..., k / 32]), exact."""
    codes = _nibbles(packed, _SHIFTS)[..., :k]
    return _words(codes, range(0, 32, 4)), scale[..., :k // 32].clone()
