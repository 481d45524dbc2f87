"""Prefix caching: full KV blocks shared between requests by content hash, reference counts, LRU eviction.

A full block (``block_size`` tokens) is named by a hash chained over everything before it::

    h_0 = H(root, tokens[0:bs]),  h_i = H(h_{i-1}, tokens[i*bs:(i+1)*bs]),  root = H(anything that changes the KV)

with ``H`` = BLAKE2b (128-bit digest) and the root keyed by the model's dtype and the block size, so a hash fixes the
block's tokens, every token before them, hence its positions (RoPE / YaRN are functions of the position). Equal
hashes mean equal K/V (or MLA latent) rows, so such blocks are computed once and shared.

Block life cycle (vLLM's design, docs/design/prefix_caching.md there):

* ``ref[b]`` counts the block tables holding block b. A block is *used* (ref > 0), *cached* (ref 0 but its hash is
  still registered: reusable until evicted) or *free* (ref 0, no hash). free + cached + used = num_blocks.
* A block's hash is registered once all its tokens are computed (``commit``: at the start of each step for running
  sequences, and when a sequence finishes or is preempted), never when it is merely allocated, so no request can
  reuse K/V that a step has not written yet (an aborted or failed step publishes nothing).
* Allocation takes free blocks first, then evicts the least recently used cached block (its hash is forgotten).
  Blocks released together go to the LRU end tail-first, so a released chain is evicted from its end.
* A waiting request reuses the longest run of cached blocks at the start of its tokens, except the block holding
  its last token: at least one token is computed, to get the logits it samples from (as vLLM). Requests that ask
  for prompt logprobs do not read the cache (those logprobs come from computing the prompt; as vLLM).

Hybrid models (KDA layers, engine/state_snapshots.py): a hit can only resume where a state snapshot exists, so it
is cut back to the longest boundary with one. Snapshots are taken at the end of the prompt's last full block, every
``snapshot_interval`` blocks, and at a request's *junction* (where its cached-block match ended when that match went
past the last snapshot: the point where it diverged from an earlier request, so the next request with the same
prefix finds a snapshot there; vLLM issue #45238 shows what one snapshot per prompt end loses). Prefill chunks are
cut to end on those boundaries (``cut_chunk``).

Counters (tokens, vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``): each admission that reads the cache adds
its token count to ``queries`` and the tokens it reuses to ``hits``.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from tokenfab.engine.sequence import Sequence
from tokenfab.engine.state_snapshots import StateSnapshots


@dataclass
class PrefixHit:
    """The cached blocks a waiting sequence will reuse: ``blocks`` (ids, in order) cover its first ``num_tokens``
    tokens; ``num_matched`` blocks had a cached hash (more than ``len(blocks)`` when a hybrid model's state
    snapshot limited the hit)."""

    blocks: list[int]
    num_tokens: int
    num_matched: int


class PrefixCache:
    """Block pool with content hashes, reference counts and LRU eviction of unreferenced cached blocks.

    Args:
        num_blocks: blocks in the KV pool.
        block_size: tokens per block.
        kv_key: text of everything that changes the K/V of a block besides its tokens and position (the engine
            passes the model path and dtype); it seeds the hash chain.
        snapshots: the state snapshot store of a hybrid model, or None (attention-only models).
        snapshot_interval: hybrid models: a snapshot boundary every this many blocks (>= 1).

    Raises:
        ValueError: num_blocks, block_size or snapshot_interval < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, kv_key: str = "", snapshots: StateSnapshots | None = None,
                 snapshot_interval: int = 64):
        if num_blocks < 1 or block_size < 1 or snapshot_interval < 1:
            raise ValueError(f"PrefixCache needs num_blocks, block_size and snapshot_interval >= 1 (got {num_blocks}, "
                             f"{block_size}, {snapshot_interval}).")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 with a hash, least recently used first
        self.free: deque[int] = deque(range(num_blocks))  # ref 0, no hash
        self.root = hashlib.blake2b(f"tokenfab-kv|{kv_key}|bs={block_size}".encode(), digest_size=16).digest()
        self.snapshots = snapshots
        self.interval_tokens = snapshot_interval * block_size
        self.queries = self.hits = self.evictions = 0

    # ---- pool ------------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free plus cached-unreferenced (evictable)."""
        return len(self.free) + len(self.evictable)

    def take(self, n: int) -> list[int]:
        """``n`` blocks with ref 1: free ones first, then the least recently used cached ones (evicted: their
        hash, and a state snapshot keyed by it, are forgotten).

        Raises:
            RuntimeError: fewer than ``n`` blocks can be taken.
        """
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {self.num_free} free")
        out = []
        free, ref = self.free, self.ref
        for _ in range(n):
            if free:
                b = free.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                h = self.block_hash[b]
                self.block_hash[b] = None
                del self.cached[h]
                self.evictions += 1
                if self.snapshots is not None:
                    self.snapshots.drop(h)
            ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks``; those reaching 0 become cached (hash registered) or free.
        Released tail-first, so the chain's end is evicted first."""
        ref, bh = self.ref, self.block_hash
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                if bh[b] is not None:
                    self.evictable[b] = None
                else:
                    self.free.append(b)
            elif ref[b] < 0:
                raise RuntimeError(f"block {b} released more often than it was held (refcount {ref[b]})")

    # ---- hashes ----------------------------------------------------------------------------------------------
    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """``seq.block_hashes`` extended to (at least) its first ``num_blocks`` full blocks; returns it."""
        hs, bs = seq.block_hashes, self.block_size
        toks = seq.token_ids
        parent = hs[-1] if hs else self.root
        for i in range(len(hs), num_blocks):
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(array("q", toks[i * bs:(i + 1) * bs]).tobytes())
            parent = h.digest()
            hs.append(parent)
        return hs

    # ---- admission -------------------------------------------------------------------------------------------
    def match(self, seq: Sequence) -> PrefixHit | None:
        """The cached blocks ``seq`` (waiting, nothing computed) can reuse; None when it must not read the cache
        (it asks for prompt logprobs). Hybrid models: cut back to the longest boundary with a state snapshot (and
        ``seq.snapshot_junction`` set where the block match ended, when that is further)."""
        if seq.params.prompt_logprobs is not None:
            return None
        max_blocks = (seq.num_tokens - 1) // self.block_size  # never the block holding the last token
        hs = self.hashes(seq, max_blocks)
        blocks = []
        cached = self.cached
        for i in range(max_blocks):
            b = cached.get(hs[i])
            if b is None:
                break
            blocks.append(b)
        matched = len(blocks)
        if self.snapshots is not None and blocks:
            del blocks[self.snapshots.longest(hs, matched):]
            if matched > len(blocks):  # diverges past the last snapshot: keep one where the match ends
                seq.snapshot_junction = matched * self.block_size
        return PrefixHit(blocks, len(blocks) * self.block_size, matched)

    def extra_blocks(self, hit: PrefixHit) -> int:
        """Blocks a hit takes out of the allocatable pool (its cached-unreferenced blocks)."""
        ref = self.ref
        return sum(1 for b in hit.blocks if ref[b] == 0)

    def acquire(self, seq: Sequence, hit: PrefixHit) -> None:
        """Give ``seq`` (admitted, with its row) the hit's blocks: one more reference each, ``num_computed_tokens``
        set to the hit, the state snapshot restored into its slot (hybrid models), counters advanced."""
        ref = self.ref
        for b in hit.blocks:
            if ref[b] == 0:
                del self.evictable[b]
            ref[b] += 1
        seq.block_table = list(hit.blocks)
        seq.num_computed_tokens = hit.num_tokens
        seq.num_cached_blocks = len(hit.blocks)
        self.queries += seq.num_tokens
        self.hits += hit.num_tokens
        if self.snapshots is not None and hit.blocks:
            self.snapshots.restore(seq.row, seq.block_hashes[len(hit.blocks) - 1])

    # ---- progress --------------------------------------------------------------------------------------------
    def commit(self, seq: Sequence, snapshot: bool) -> None:
        """Register the hashes of ``seq``'s blocks that are full of computed tokens (tokens below
        ``num_computed_tokens``: written by steps that ran). With ``snapshot`` (only at the start of a step, when the
        state slot holds the state after exactly ``num_computed_tokens`` tokens), a hybrid model's state is
        snapshotted when that count is a boundary."""
        bs = self.block_size
        c = seq.num_computed_tokens
        full = min(c // bs, len(seq.block_table))
        if full > seq.num_cached_blocks:
            hs = self.hashes(seq, full)
            cached, bh, table = self.cached, self.block_hash, seq.block_table
            for i in range(seq.num_cached_blocks, full):
                h, b = hs[i], table[i]
                if h not in cached and bh[b] is None:  # a duplicate of a cached block stays unhashed
                    cached[h] = b
                    bh[b] = h
            seq.num_cached_blocks = full
        if snapshot and self.snapshots is not None and c and c % bs == 0 and full == c // bs \
                and self.is_boundary(seq, c) and seq.block_hashes[full - 1] in self.cached:
            self.snapshots.save(seq.row, seq.block_hashes[full - 1])

    def is_boundary(self, seq: Sequence, c: int) -> bool:
        """Hybrid models: whether a state snapshot is kept after ``c`` tokens of ``seq`` (c a multiple of the
        block size)."""
        P, bs = seq.num_prompt_tokens, self.block_size
        return (c % self.interval_tokens == 0 or c == P // bs * bs or c == (P - 1) // bs * bs
                or c == seq.snapshot_junction)

    def cut_chunk(self, seq: Sequence, n: int, start: int | None = None) -> int:
        """Hybrid models: ``n`` shortened so that a prefill chunk starting at ``start`` (default: the sequence's
        ``num_computed_tokens``) ends on the next snapshot boundary instead of crossing it; ``n`` unchanged for
        attention-only models."""
        if self.snapshots is None or n <= 1:
            return n
        c = seq.num_computed_tokens if start is None else start
        bs, P = self.block_size, seq.num_prompt_tokens
        nxt = (c // self.interval_tokens + 1) * self.interval_tokens
        for b in ((P - 1) // bs * bs, P // bs * bs, seq.snapshot_junction):
            if c < b < nxt:
                nxt = b
        return nxt - c if nxt < c + n else n

    # ---- checks ----------------------------------------------------------------------------------------------
    def check(self, tables: list[list[int]]) -> None:
        """Assert the pool's invariants against the block tables of every sequence holding blocks: each block is
        exactly one of free / cached-unreferenced / used, free + cached + used = num_blocks, ``ref[b]`` equals the
        number of tables holding b, no table holds a block twice, hash map and block hashes agree.

        Raises:
            AssertionError: an invariant does not hold (message says which).
        """
        count = [0] * self.num_blocks
        for t in tables:
            assert len(set(t)) == len(t), f"a block table holds a block twice: {t}"
            for b in t:
                count[b] += 1
        assert count == self.ref, "refcounts differ from the number of block tables holding each block"
        free, ev = set(self.free), set(self.evictable)
        used = {b for b in range(self.num_blocks) if self.ref[b] > 0}
        assert len(free) == len(self.free), "a block is twice in the free list"
        assert not (free & ev) and not (free & used) and not (ev & used), "a block is in two states"
        assert len(free) + len(ev) + len(used) == self.num_blocks, "free + cached + used != total"
        assert all(self.block_hash[b] is None for b in free), "a free block keeps a hash"
        assert all(self.block_hash[b] is not None for b in ev), "a cached block lost its hash"
        assert all(self.block_hash[b] == h for h, b in self.cached.items()), "hash map and block hashes differ"
        assert sum(h is not None for h in self.block_hash) == len(self.cached), "a hashed block is not in the map"


def build_prefix_cache(num_blocks: int, block_size: int, kv_key: str, kv_caches: list, max_num_seqs: int,
                       snapshot_interval: int = 64) -> PrefixCache:
    """The engine's PrefixCache: with a state snapshot store of ``2 * max_num_seqs`` snapshots when ``kv_caches``
    holds KDA state caches (hybrid models), none otherwise."""
    from tokenfab.engine.state_cache import KDAStateCache
    states = [c for c in kv_caches if isinstance(c, KDAStateCache)]
    snaps = StateSnapshots(states, 2 * max_num_seqs) if states else None
    return PrefixCache(num_blocks, block_size, kv_key, snaps, snapshot_interval)
