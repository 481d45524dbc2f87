"""Bounded store of recurrent-state snapshots for prefix caching on hybrid (KDA) models (Kimi Linear, Kimi K3).

The MLA layers of a hybrid model keep per-token latents in paged blocks, which prefix caching shares by block hash
(engine/prefix_cache.py). A KDA layer keeps one fixed-size state per request instead (engine/state_cache.py), which
says nothing about any earlier position. So the state is copied out, whole, at chosen block boundaries, keyed by the
hash of the block that ends there: a later request whose prompt starts with the same blocks restores that copy into
its own state slot and continues from the boundary, while its MLA layers reuse the cached blocks up to it.

A snapshot is only ever taken at the start of a step (``Scheduler.schedule``), of a running sequence whose
``num_computed_tokens`` sits exactly on the boundary: that progress counter advances only after a step ran, so the
slot then holds the state after exactly that many tokens, never the state of a step that failed or never ran
(vLLM's hybrid caching restored state published before its step had written it: garbage after an abort,
vllm-project/vllm#56525). Prefill chunks are cut to end on the boundaries (``PrefixCache.cut_chunk``) so the
sequence does stop there.

Memory: ``capacity`` snapshots, each one request's state in every KDA layer (``KDAStateCache.nbytes_per_slot``
summed over the layers), preallocated; least recently used snapshots are replaced when the store is full.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from tokenfab.engine.state_cache import KDAStateCache


class StateSnapshots:
    """Snapshots of the KDA states of one engine, keyed by block hash (bytes).

    Args:
        caches: the KDA layers' state caches (their ``conv`` [slots, C, K-1] and ``recurrent`` [slots, H, D, D]
            float32 tensors are read and written by slot = scheduler row).
        capacity: most snapshots kept (>= 1).

    Raises:
        ValueError: no cache or capacity < 1.
    """

    def __init__(self, caches: list[KDAStateCache], capacity: int):
        if not caches or capacity < 1:
            raise ValueError(f"StateSnapshots needs KDA state caches and capacity >= 1 (got {len(caches)} caches, "
                             f"capacity {capacity}).")
        self.caches = caches
        self.capacity = capacity
        self.conv = [torch.empty((capacity, *c.conv.shape[1:]), dtype=c.conv.dtype, device=c.conv.device)
                     for c in caches]
        self.recurrent = [torch.empty((capacity, *c.recurrent.shape[1:]), dtype=c.recurrent.dtype,
                                      device=c.recurrent.device) for c in caches]
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()  # hash -> snapshot slot, least recently used first
        self.free_slots = list(range(capacity - 1, -1, -1))
        self.num_saved = self.num_restored = 0

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self.slot_of

    def nbytes(self) -> int:
        """Bytes held by the preallocated snapshot tensors."""
        return sum(t.numel() * t.element_size() for t in self.conv + self.recurrent)

    def longest(self, hashes: list[bytes], num_blocks: int) -> int:
        """The largest j <= ``num_blocks`` such that the state after block j - 1 (hash ``hashes[j - 1]``) has a
        snapshot; 0 when none of the first ``num_blocks`` boundaries has one."""
        for j in range(num_blocks, 0, -1):
            if hashes[j - 1] in self.slot_of:
                return j
        return 0

    def save(self, row: int, key: bytes) -> None:
        """Copy the KDA states of slot ``row`` as the snapshot for ``key`` (kept if one exists already: the
        same hash chain means the same tokens, hence the same state)."""
        if key in self.slot_of:
            self.slot_of.move_to_end(key)
            return
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            _, slot = self.slot_of.popitem(last=False)
        for c, conv, rec in zip(self.caches, self.conv, self.recurrent):
            conv[slot].copy_(c.conv[row])
            rec[slot].copy_(c.recurrent[row])
        self.slot_of[key] = slot
        self.num_saved += 1

    def restore(self, row: int, key: bytes) -> None:
        """Copy the snapshot for ``key`` into state slot ``row`` (the admitted sequence then resumes at the
        boundary).

        Raises:
            KeyError: no snapshot for ``key`` (callers look it up with :meth:`longest` first).
        """
        slot = self.slot_of[key]
        self.slot_of.move_to_end(key)
        for c, conv, rec in zip(self.caches, self.conv, self.recurrent):
            c.conv[row].copy_(conv[slot])
            c.recurrent[row].copy_(rec[slot])
        self.num_restored += 1

    def drop(self, key: bytes) -> None:
        """Forget the snapshot for ``key`` (its block was evicted from the prefix cache); no-op if absent."""
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.free_slots.append(slot)
