"""The paged KV pool's bookkeeping: fixed-size blocks, per-sequence block tables, a free list.

A token at position p of a sequence lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its flat slot is ``block_id * block_size + offset`` (the slot mapping).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from tokenfab.engine.prefix_cache import PrefixCache, PrefixHit
from tokenfab.engine.sequence import Sequence


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens each.

    ``block_tables`` [max_num_seqs, max_blocks_per_seq] int64 mirrors every running sequence's block table in the
    row the scheduler gave it, so the model runner slices block tables for a batch with one fancy index.

    With prefix caching on (:meth:`enable_prefix_caching`), blocks are reference-counted and shared through a
    :class:`~tokenfab.engine.prefix_cache.PrefixCache`, which then owns the free list (free + cached-unreferenced
    blocks); with it off, the plain free list below is the whole story.

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
        self.prefix_cache: PrefixCache | None = None

    def enable_prefix_caching(self, cache: PrefixCache) -> None:
        """Share blocks through ``cache`` from now on (before any block is allocated).

        Raises:
            RuntimeError: blocks are already allocated, or the cache's pool size differs.
        """
        if len(self.free_blocks) != self.num_blocks or cache.num_blocks != self.num_blocks:
            raise RuntimeError("prefix caching must be enabled on an empty pool of the same size")
        self.prefix_cache = cache

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take (with prefix caching: free plus cached-unreferenced ones)."""
        pc = self.prefix_cache
        return len(self.free_blocks) if pc is None else pc.num_free

    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (the ``kv_cache_usage_perc`` gauge; cached-unreferenced blocks count as
        free, as in vLLM)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def match_prefix(self, seq: Sequence) -> PrefixHit | None:
        """The cached blocks waiting ``seq`` would reuse (prefix_cache.py), or None with prefix caching off or
        when ``seq`` must not read the cache."""
        pc = self.prefix_cache
        return None if pc is None else pc.match(seq)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold ``num_computed_tokens + num_new_tokens`` tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        need = (total + self.block_size - 1) // self.block_size
        return max(0, need - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Whether ``seq`` can get blocks for its next ``num_new_tokens`` (after the cached blocks of ``hit``, which
        may themselves come out of the allocatable pool)."""
        pc = self.prefix_cache
        if pc is None:
            return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)
        if hit is None or not hit.blocks:
            return self.blocks_needed(seq, num_new_tokens) <= pc.num_free
        need = -(-(hit.num_tokens + num_new_tokens) // self.block_size) - len(hit.blocks)
        return need + pc.extra_blocks(hit) <= pc.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> list[int]:
        """Grow ``seq.block_table`` to cover its next ``num_new_tokens``; returns the new block ids. With a
        prefix-cache ``hit`` (an admitted sequence, row assigned), its cached blocks come first and
        ``num_computed_tokens`` starts after them; ``num_new_tokens`` counts from there.

        Raises:
            RuntimeError: not enough free blocks (callers check :meth:`can_allocate` first).
        """
        pc = self.prefix_cache
        if pc is not None:
            if hit is not None:
                pc.acquire(seq, hit)
                k = len(hit.blocks)
                if k:
                    self.block_tables[seq.row, :k] = hit.blocks
            new = pc.take(self.blocks_needed(seq, num_new_tokens))
        else:
            n = self.blocks_needed(seq, num_new_tokens)
            if n > len(self.free_blocks):
                raise RuntimeError(f"KV pool exhausted: need {n} blocks, {len(self.free_blocks)} free")
            new = [self.free_blocks.popleft() for _ in range(n)]
        n = len(new)
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
            if self.prefix_cache is not None:
                self.prefix_cache.release(seq.block_table[keep:])
                seq.num_cached_blocks = min(seq.num_cached_blocks, keep)
            else:
                self.free_blocks.extend(seq.block_table[keep:])
            del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the free list (with prefix caching: register its computed full blocks,
        then drop its references; blocks nobody holds stay cached until evicted)."""
        pc = self.prefix_cache
        if pc is not None:
            pc.commit(seq, snapshot=False)
            pc.release(seq.block_table)
            seq.num_cached_blocks = 0
        else:
            self.free_blocks.extend(seq.block_table)
        seq.block_table = []

    def check_invariants(self, seqs) -> None:
        """Assert the pool's bookkeeping against ``seqs`` (every sequence that may hold blocks): with prefix caching
        the PrefixCache invariants (free + cached + used = total, refcounts = holders); without it, free + held =
        total with no block held twice. Also each running row of ``block_tables`` mirrors its block table.

        Raises:
            AssertionError: an invariant does not hold.
        """
        tables = [s.block_table for s in seqs if s.block_table]
        for s in seqs:
            if s.row >= 0 and s.block_table:
                assert self.block_tables[s.row, :len(s.block_table)].tolist() == s.block_table, "block_tables row"
        if self.prefix_cache is not None:
            self.prefix_cache.check(tables)
            return
        held = [b for t in tables for b in t]
        assert len(set(held)) == len(held), "a block is held twice"
        assert not set(held) & set(self.free_blocks), "a held block is in the free list"
        assert len(held) + len(self.free_blocks) == self.num_blocks, "free + held != total"
