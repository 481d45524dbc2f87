"""GGUF K-quant block types Q4_K, Q5_K and Q6_K: their bytes as published, their values, and tokenfab's tile layout.

A K-quant row is a run of 256-value super-blocks along the input dimension (llama.cpp ``ggml-common.h``
``block_q4_K`` / ``block_q5_K`` / ``block_q6_K``; the values as gguf-py's ``gguf/quants.py`` dequantizes them):

* Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8] (one per 32-value sub-block;
  bytes 0..3 hold sc[0..3] in bits 0..5 and sc[4..7]'s bits 4..5 in bits 6..7, bytes 4..7 the same for m, bytes
  8..11 sc[4..7]'s low 4 bits (low nibble) and m[4..7]'s (high nibble)), 128 bytes of nibbles (byte b of chunk c
  = sub-block 2c element b in the low nibble, sub-block 2c + 1 element b in the high nibble).
  Value of sub-block i element k: ``(d * sc[i]) * q - (dmin * m[i])`` in float32.
* Q5_K (176 bytes): as Q4_K with 32 bytes qh before the nibbles: bit i of qh[k] is bit 4 of sub-block i's element k.
* Q6_K (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales (one per 16 values),
  fp16 d. Element e: half h = e // 128, ql byte 64h + e % 64 (low nibble for (e % 128) < 64, else high), qh byte
  32h + e % 32 bits 2t..2t+1 with t = (e % 128) // 32. Value ``(d * scale[e // 16]) * (q - 32)`` in float32.

Products d * sc and dmin * m are exact in float32 (an 11-bit mantissa times an integer below 2^8), so the float32
values here and gguf's numpy ones are the same bits (the tests compare them with ``gguf.quants.dequantize``).

Tile layout for the CPU kernels (kernels/cpu/csrc/gguf_linear.cpp): rows are regrouped into tiles of 16 output rows;
a tile is K / 256 tile-blocks, one per super-block, each holding the 16 rows' fields with the rows innermost:

* Q4_K (2304 bytes): d [16] fp16 | dmin [16] fp16 | the 12 scale bytes as [12][16] (byte b of all 16 rows
  together) | 8 sub-blocks of nibble words, each the 256-byte Q4 layout of ``gguf_blocks.pack_tiles``.
* Q5_K (2816 bytes): Q4_K's head | 8 sub-blocks of 32 u16 words, word 2j + e bit u = bit 4 of row j at k = 2u + e |
  the 8 nibble sub-blocks.
* Q6_K (3360 bytes): d [16] fp16 | scales [16][16] int8 (scale s of all rows together) | 8 sub-blocks of 2 x 32 u16
  words, word 2j + e of group H bits 2u..2u+1 = bits 4..5 of row j at k = 2 (8H + u) + e | 8 nibble sub-blocks.

Same byte count as the file (16 x the super-block bytes). Only whole rows move; no value is recomputed.
"""
from __future__ import annotations

import torch

TILE = 16
QK_K = 256
SUPER_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float16 (little-endian)."""
    return b.contiguous().view(torch.float16)[..., 0]


def _scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K scale bytes [..., 12] uint8 -> (sc [..., 8], m [..., 8]) uint8 in 0..63."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def fields(raw: torch.Tensor, name: str) -> dict:
    """raw [n, KB * super bytes] uint8 -> the super-blocks' fields, quants in element order:
    d (and dmin) [n, KB, 2] bytes, ``scales`` [n, KB, 12] (Q4_K/Q5_K) or [n, KB, 16] (Q6_K) bytes, ``lo``
    [n, KB, 8, 32] uint8 (bits 0..3 of each quant), ``hi`` [n, KB, 8, 32] uint8 (bit 4, or bits 4..5; None for
    Q4_K)."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, SUPER_BYTES[name])
    kb = b.shape[1]
    if name == "Q6_K":
        ql = b[..., 0:128].reshape(n, kb, 2, 1, 64)
        lo = torch.cat([ql & 0x0F, ql >> 4], dim=3).reshape(n, kb, 8, 32)
        qh = b[..., 128:192].reshape(n, kb, 2, 1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device).reshape(1, 1, 1, 4, 1)
        hi = ((qh >> shifts) & 3).reshape(n, kb, 8, 32)
        return {"d": b[..., 208:210], "scales": b[..., 192:208], "lo": lo, "hi": hi}
    qoff = 16 if name == "Q4_K" else 48
    qs = b[..., qoff:qoff + 128].reshape(n, kb, 4, 1, 32)
    lo = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(n, kb, 8, 32)
    hi = None
    if name == "Q5_K":
        qh = b[..., 16:48].reshape(n, kb, 1, 32)
        hi = (qh >> torch.arange(8, dtype=torch.uint8, device=raw.device).reshape(1, 1, 8, 1)) & 1
    return {"d": b[..., 0:2], "dmin": b[..., 2:4], "scales": b[..., 4:16], "lo": lo, "hi": hi}


def _join(f: dict, name: str) -> torch.Tensor:
    """Inverse of :func:`fields`: the raw rows [n, KB * super bytes] uint8."""
    lo, hi = f["lo"], f["hi"]
    n, kb = lo.shape[0], lo.shape[1]
    if name == "Q6_K":
        l5 = lo.reshape(n, kb, 2, 2, 64)
        ql = (l5[:, :, :, 0] | (l5[:, :, :, 1] << 4)).reshape(n, kb, 128)
        h5 = hi.reshape(n, kb, 2, 4, 32)
        qh = h5[:, :, :, 0] | (h5[:, :, :, 1] << 2) | (h5[:, :, :, 2] << 4) | (h5[:, :, :, 3] << 6)
        return torch.cat([ql, qh.reshape(n, kb, 64), f["scales"], f["d"]], dim=-1).reshape(n, -1)
    l4 = lo.reshape(n, kb, 4, 2, 32)
    qs = (l4[:, :, :, 0] | (l4[:, :, :, 1] << 4)).reshape(n, kb, 128)
    parts = [f["d"], f["dmin"], f["scales"]]
    if name == "Q5_K":
        qh = torch.zeros(n, kb, 32, dtype=torch.uint8, device=lo.device)
        for i in range(8):
            qh |= hi[:, :, i] << i
        parts.append(qh)
    return torch.cat(parts + [qs], dim=-1).reshape(n, -1)


def dequantize_rows(raw: torch.Tensor, name: str) -> torch.Tensor:
    """K-quant rows raw [n, K / 256 * super bytes] uint8 -> W [n, K] float32, the values of the module docstring
    computed in the order gguf's ``dequantize`` computes them (same bits)."""
    f = fields(raw, name)
    n, kb = f["lo"].shape[0], f["lo"].shape[1]
    d = _f16(f["d"]).float()
    if name == "Q6_K":
        q = (f["lo"] | (f["hi"] << 4)).to(torch.int16) - 32
        ds = (d.unsqueeze(-1) * f["scales"].contiguous().view(torch.int8).float()).unsqueeze(-1)  # [n, KB, 16, 1]
        return (ds * q.reshape(n, kb, 16, 16).float()).reshape(n, -1)
    sc, mn = _scale_min(f["scales"])
    ds = (d.unsqueeze(-1) * sc.float()).unsqueeze(-1)
    dm = (_f16(f["dmin"]).float().unsqueeze(-1) * mn.float()).unsqueeze(-1)
    q = f["lo"] if f["hi"] is None else f["lo"] | (f["hi"] << 4)
    return (ds * q.float() - dm).reshape(n, -1)


def _words(v: torch.Tensor) -> torch.Tensor:
    """int32 word values [...] (0..65535) -> [..., 2] little-endian uint8."""
    return torch.stack([v & 0xFF, v >> 8], dim=-1).to(torch.uint8)


def _nibble_tiles(lo: torch.Tensor, nt: int) -> torch.Tensor:
    """lo [nt*16, KB, 8, 32] -> [nt, KB, 8 * 256] in the Q4 word layout per 32-value sub-block (gguf_blocks)."""
    kb = lo.shape[1]
    qq = lo.reshape(nt, TILE, kb * 8, 4, 4, 2).permute(0, 2, 3, 1, 5, 4)  # [nt, KB8, L, j, e, s]
    w = torch.stack([qq[..., 0] | (qq[..., 1] << 4), qq[..., 2] | (qq[..., 3] << 4)], dim=-1)
    return w.reshape(nt, kb, 8 * 256)


def _nibble_untiles(q: torch.Tensor, nt: int, kb: int) -> torch.Tensor:
    w = q.reshape(nt, kb * 8, 4, TILE, 2, 2)  # [nt, KB8, L, j, e, byte]
    nib = torch.stack([w[..., 0] & 0x0F, w[..., 0] >> 4, w[..., 1] & 0x0F, w[..., 1] >> 4], dim=-1)  # .., e, s
    return nib.permute(0, 3, 1, 2, 5, 4).reshape(nt * TILE, kb, 8, 32)  # [rows, KB8, L, s, e]


def _rows_inner(x: torch.Tensor, nt: int) -> torch.Tensor:
    """[nt*16, KB, F] -> [nt, KB, F, 16] bytes flattened to [nt, KB, F * 16]: field byte f of all 16 rows together."""
    kb, fb = x.shape[1], x.shape[2]
    return x.reshape(nt, TILE, kb, fb).permute(0, 2, 3, 1).reshape(nt, kb, fb * TILE)


def _rows_outer(x: torch.Tensor, nt: int, fb: int) -> torch.Tensor:
    kb = x.shape[1]
    return x.reshape(nt, kb, fb, TILE).permute(0, 3, 1, 2).reshape(nt * TILE, kb, fb)


def _f16_tiles(b: torch.Tensor, nt: int) -> torch.Tensor:
    """[nt*16, KB, 2] bytes -> [nt, KB, 32]: the 16 rows' fp16 values, row-major."""
    kb = b.shape[1]
    return b.reshape(nt, TILE, kb, 2).transpose(1, 2).reshape(nt, kb, 2 * TILE)


def _f16_untiles(b: torch.Tensor, nt: int) -> torch.Tensor:
    kb = b.shape[1]
    return b.reshape(nt, kb, TILE, 2).transpose(1, 2).reshape(nt * TILE, kb, 2)


def pack_tiles(raw: torch.Tensor, name: str) -> torch.Tensor:
    """K-quant rows raw [n, K / 256 * super bytes] uint8 -> tiles [ceil(n / 16), K / 256, 16 * super bytes] uint8
    (the layout of the module docstring; rows past n padded with zero super-blocks, value 0)."""
    n = raw.shape[0]
    nt = -(-n // TILE)
    raw = torch.nn.functional.pad(raw, (0, 0, 0, nt * TILE - n))
    f = fields(raw, name)
    kb = f["lo"].shape[1]
    parts = [_f16_tiles(f["d"], nt)]
    if name != "Q6_K":
        parts.append(_f16_tiles(f["dmin"], nt))
    parts.append(_rows_inner(f["scales"].contiguous(), nt))
    if name == "Q5_K":  # [rows, KB, 8, 32] -> [nt, KB, 8, j, e, u]
        h = f["hi"].reshape(nt, TILE, kb, 8, 16, 2).permute(0, 2, 3, 1, 5, 4).to(torch.int32)
        word = (h << torch.arange(16, dtype=torch.int32, device=h.device)).sum(-1)
        parts.append(_words(word).reshape(nt, kb, 8 * 64))
    elif name == "Q6_K":  # -> [nt, KB, 8, H, j, e, u]
        h = f["hi"].reshape(nt, TILE, kb, 8, 2, 8, 2).permute(0, 2, 3, 4, 1, 6, 5).to(torch.int32)
        word = (h << (2 * torch.arange(8, dtype=torch.int32, device=h.device))).sum(-1)
        parts.append(_words(word).reshape(nt, kb, 8 * 128))
    parts.append(_nibble_tiles(f["lo"], nt))
    return torch.cat(parts, dim=-1).contiguous()


def unpack_tiles(tiles: torch.Tensor, name: str, n: int, t0: int = 0, t1: int | None = None) -> torch.Tensor:
    """Tiles [t0, t1) of :func:`pack_tiles`'s output -> the K-quant rows they hold, raw [rows, K / 256 * super
    bytes] uint8 (rows past ``n`` dropped): the exact inverse of :func:`pack_tiles`."""
    t1 = tiles.shape[0] if t1 is None else t1
    tl = tiles[t0:t1]
    nt, kb = tl.shape[0], tl.shape[1]
    f: dict = {"d": _f16_untiles(tl[..., 0:32], nt)}
    off = 32
    if name != "Q6_K":
        f["dmin"] = _f16_untiles(tl[..., 32:64], nt)
        off = 64
    sb = 16 if name == "Q6_K" else 12
    f["scales"] = _rows_outer(tl[..., off:off + sb * TILE], nt, sb)
    off += sb * TILE
    f["hi"] = None
    if name == "Q5_K":
        w = tl[..., off:off + 512].reshape(nt, kb, 8, TILE, 2, 2).to(torch.int32)
        word = w[..., 0] | (w[..., 1] << 8)  # [nt, KB, 8, j, e]
        bits = (word.unsqueeze(-1) >> torch.arange(16, dtype=torch.int32, device=word.device)) & 1  # [.., j, e, u]
        f["hi"] = bits.permute(0, 3, 1, 2, 5, 4).reshape(nt * TILE, kb, 8, 32).to(torch.uint8)
        off += 512
    elif name == "Q6_K":
        w = tl[..., off:off + 1024].reshape(nt, kb, 8, 2, TILE, 2, 2).to(torch.int32)
        word = w[..., 0] | (w[..., 1] << 8)  # [nt, KB, 8, H, j, e]
        shifts = 2 * torch.arange(8, dtype=torch.int32, device=word.device)
        bits = (word.unsqueeze(-1) >> shifts) & 3  # [.., H, j, e, u]
        f["hi"] = bits.permute(0, 4, 1, 2, 3, 6, 5).reshape(nt * TILE, kb, 8, 32).to(torch.uint8)
        off += 1024
    f["lo"] = _nibble_untiles(tl[..., off:], nt, kb)
    raw = _join(f, name)
    return raw[:min(n - t0 * TILE, nt * TILE)]
