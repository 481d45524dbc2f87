"""GGUF block types Q8_0, Q4_0 and Q4_1 (and the K-quants Q4_K, Q5_K, Q6_K of gguf_kquants.py): their bytes as published, their values, and tokenfab's tile layout.

A GGUF weight W [n, K] (K a multiple of 32) is stored row by row, each row K / 32 blocks of 32 consecutive inputs
(ggml's ``block_q8_0`` / ``block_q4_0`` / ``block_q4_1``, llama.cpp ``ggml-common.h``; gguf-py ``gguf/quants.py``):

* Q8_0 (34 bytes): fp16 d, 32 int8 q; value d * q.
* Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles; value (q - 8) * d.
* Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; value q * d + m.

Nibbles: byte j (0..15) of a block holds element j in its low nibble and element j + 16 in its high nibble.
The values are computed in float32 as gguf's ``dequantize`` does (d * q is exact in float32, so Q4_1 rounds once).

For the CPU kernels (kernels/cpu/csrc/gguf_linear.cpp) the rows are regrouped at load into tiles of 16 output rows
(:func:`pack_tiles`): tile t is K / 32 tile-blocks, each holding the 16 rows' d (then m) as fp16 and their quants
in the order one ``vdpbf16ps`` operand needs them (see the .cpp header). The byte count per weight is the GGUF
one (rows past n padded to a multiple of 16 with zero blocks).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenfab.quant import gguf_kquants

BLOCK = 32   # weights per GGUF block along the input dimension
TILE = 16    # output rows per tile of the packed layout


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type: name, ggml type id, bytes per block in the file, whether it has a minimum, weights per
    block (32, or 256 for the K-quants of :mod:`tokenfab.quant.gguf_kquants`)."""
    name: str
    ggml_type: int
    block_bytes: int
    has_min: bool
    block_size: int = BLOCK  # weights per block along the input dimension (256 for the K-quants' super-blocks)

    @property
    def quant_bytes(self) -> int:
        """Bytes of quants per block (16 for 4-bit, 32 for 8-bit)."""
        return self.block_bytes - (4 if self.has_min else 2)

    @property
    def tile_block_bytes(self) -> int:
        """Bytes of one tile-block of the packed layout: 16 rows' scales (and minimums) and quants."""
        return TILE * self.block_bytes


Q8_0 = BlockType("Q8_0", 8, 34, False)
Q4_0 = BlockType("Q4_0", 2, 18, False)
Q4_1 = BlockType("Q4_1", 3, 20, True)
Q4_K = BlockType("Q4_K", 12, 144, True, 256)
Q5_K = BlockType("Q5_K", 13, 176, True, 256)
Q6_K = BlockType("Q6_K", 14, 210, False, 256)
BLOCK_TYPES = {t.name: t for t in (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)}
BY_GGML_TYPE = {t.ggml_type: t for t in BLOCK_TYPES.values()}


def block_type(name_or_id) -> BlockType:
    """The :class:`BlockType` for a name ("Q4_1"), a ggml type id (3) or a ``gguf.GGMLQuantizationType``.

    Raises:
        ValueError: a type tokenfab does not keep packed (the message lists the supported ones).
    """
    key = getattr(name_or_id, "name", name_or_id)
    bt = BLOCK_TYPES.get(key) if isinstance(key, str) else BY_GGML_TYPE.get(int(key))
    if bt is None:
        raise ValueError(f"GGUF tensor type {key!r} is not executed packed by tokenfab; packed types: "
                         f"{', '.join(BLOCK_TYPES)}")
    return bt


def _fields(raw: torch.Tensor, bt: BlockType) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """raw [n, K / 32 * block_bytes] uint8 -> (d [n, KB] fp16, m [n, KB] fp16 or None, q [n, KB, 32]: uint8 0..15
    for Q4, int8 for Q8_0), q in element order."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, bt.block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0] if bt.has_min else None
    qs = blocks[..., (4 if bt.has_min else 2):].contiguous()
    if bt is Q8_0:
        q = qs.view(torch.int8)
    else:
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # elements 0..15 low nibbles, 16..31 high nibbles
    return d, m, q


def dequantize_rows(raw: torch.Tensor, bt: BlockType) -> torch.Tensor:
    """GGUF rows raw [n, K / 32 * block_bytes] uint8 -> W [n, K] float32 (the values of the module docstring;
    K-quants: :func:`tokenfab.quant.gguf_kquants.dequantize_rows`)."""
    if bt.block_size != BLOCK:
        return gguf_kquants.dequantize_rows(raw, bt.name)
    d, m, q = _fields(raw, bt)
    d = d.float().unsqueeze(-1)
    if bt is Q8_0:
        w = d * q.float()
    elif bt is Q4_0:
        w = d * (q.to(torch.int8) - 8).float()
    else:
        w = d * q.float() + m.float().unsqueeze(-1)
    return w.reshape(raw.shape[0], -1)


def pack_tiles(raw: torch.Tensor, bt: BlockType) -> torch.Tensor:
    """GGUF rows raw [n, K / 32 * block_bytes] uint8 -> tiles [ceil(n / 16), K / 32, 16 * block_bytes] uint8.

    Tile-block (t, kb): fp16 d of rows 16t..16t+15, then (Q4_1) their fp16 m, then the quants: for Q4 four groups of
    32 little-endian u16 words, word 2j + e of group L holding in nibble s the quant of row j at k = 8L + 2s + e; for
    Q8_0 sixteen pairs of 32 bytes, byte 2j + e of pair p the quant of row j at k = 2p + e. K-quants: tiles
    [ceil(n / 16), K / 256, 16 * block_bytes] (:func:`tokenfab.quant.gguf_kquants.pack_tiles`).
    """
    if bt.block_size != BLOCK:
        return gguf_kquants.pack_tiles(raw, bt.name)
    n = raw.shape[0]
    nt = -(-n // TILE)
    raw = torch.nn.functional.pad(raw, (0, 0, 0, nt * TILE - n))  # zero blocks: value 0 for every type
    d, m, q = _fields(raw, bt)
    kb = d.shape[1]

    def tile_scales(s: torch.Tensor) -> torch.Tensor:  # [nt*16, KB] fp16 -> [nt, KB, 32] bytes
        return s.reshape(nt, TILE, kb).transpose(1, 2).contiguous().view(torch.uint8)

    parts = [tile_scales(d)] + ([tile_scales(m)] if bt.has_min else [])
    if bt is Q8_0:
        qq = q.view(torch.uint8).reshape(nt, TILE, kb, 16, 2).permute(0, 2, 3, 1, 4)  # [nt, KB, p, j, e]
        parts.append(qq.reshape(nt, kb, 16 * TILE * 2))
    else:
        qq = q.reshape(nt, TILE, kb, 4, 4, 2).permute(0, 2, 3, 1, 5, 4)  # [nt, KB, L, j, e, s]
        lo = qq[..., 0] | (qq[..., 1] << 4)   # bits 0..7 of the word: nibbles s = 0, 1
        hi = qq[..., 2] | (qq[..., 3] << 4)   # bits 8..15: nibbles s = 2, 3
        parts.append(torch.stack([lo, hi], dim=-1).reshape(nt, kb, 4 * 32 * 2))
    return torch.cat(parts, dim=-1).contiguous()


def unpack_tiles(tiles: torch.Tensor, bt: BlockType, n: int, t0: int = 0, t1: int | None = None) -> torch.Tensor:
    """Tiles [t0, t1) of :func:`pack_tiles`'s output -> the GGUF rows they hold, raw [rows, K / 32 * block_bytes]
    uint8 (rows past ``n`` dropped): the exact inverse of :func:`pack_tiles`."""
    if bt.block_size != BLOCK:
        return gguf_kquants.unpack_tiles(tiles, bt.name, n, t0, t1)
    t1 = tiles.shape[0] if t1 is None else t1
    tl = tiles[t0:t1]
    nt, kb = tl.shape[0], tl.shape[1]

    def scales(off: int) -> torch.Tensor:  # -> [nt*16, KB, 2] bytes
        return tl[..., off:off + 2 * TILE].reshape(nt, kb, TILE, 2).transpose(1, 2).reshape(nt * TILE, kb, 2)

    head = [scales(0)] + ([scales(2 * TILE)] if bt.has_min else [])
    qoff = (4 if bt.has_min else 2) * TILE
    if bt is Q8_0:
        q = tl[..., qoff:].reshape(nt, kb, 16, TILE, 2).permute(0, 3, 1, 2, 4).reshape(nt * TILE, kb, 32)
        qs = q
    else:
        w = tl[..., qoff:].reshape(nt, kb, 4, TILE, 2, 2)  # [nt, KB, L, j, e, byte]
        nib = torch.stack([w[..., 0] & 0x0F, w[..., 0] >> 4, w[..., 1] & 0x0F, w[..., 1] >> 4], dim=-1)  # .., e, s
        q = nib.permute(0, 3, 1, 2, 5, 4).reshape(nt * TILE, kb, 32)  # [rows, KB, L, s, e] -> element order
        qs = q[..., :16] | (q[..., 16:] << 4)
    raw = torch.cat(head + [qs], dim=-1).reshape(nt * TILE, kb * bt.block_bytes)
    rows = min(n - t0 * TILE, nt * TILE)
    return raw[:rows]
