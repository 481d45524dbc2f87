"""The paged KV pool's bookkeeping: fixed-size blocks, per-sequence block tables, a free list.

A token at position p of a sequence lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its flat slot is ``block_id * block_size + offset`` (the slot mapping).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from tokenfab.engine.sequence import Sequence


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens each.

    ``block_tables`` [max_num_seqs, max_blocks_per_seq] int64 mirrors every running sequence's block table in the
    row the scheduler gave it, so the model runner slices block tables for a batch with one fancy index.

    Raises:
        ValueError: num_blocks or block_size < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int = 1, max_model_len: int = 1):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1 (got {num_blocks}, {block_size}).")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.max_blocks_per_seq = (max_model_len + block_size - 1) // block_size
        self.block_tables = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int64)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (the ``kv_cache_usage_perc`` gauge)."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold ``num_computed_tokens + num_new_tokens`` tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        need = (total + self.block_size - 1) // self.block_size
        return max(0, need - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Grow ``seq.block_table`` to cover its next ``num_new_tokens``; returns the new block ids.

        Raises:
            RuntimeError: not enough free blocks (callers check :meth:`can_allocate` first).
        """
        n = self.blocks_needed(seq, num_new_tokens)
        if n > len(self.free_blocks):
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {len(self.free_blocks)} free")
        new = [self.free_blocks.popleft() for _ in range(n)]
        if new:
            start = len(seq.block_table)
            self.block_tables[seq.row, start:start + n] = new
            seq.block_table.extend(new)
        return new

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Return ``seq``'s blocks past the first ``ceil(num_tokens / block_size)`` to the free list (after
        speculative decoding rejected tokens that had blocks reserved)."""
        keep = (num_tokens + self.block_size - 1) // self.block_size
        if len(seq.block_table) > keep:
            self.free_blocks.extend(seq.block_table[keep:])
            del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the free list."""
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []
