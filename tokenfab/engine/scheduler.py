"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

Each step: running sequences first, in arrival order (decodes take 1 token; a sequence still in prefill takes its
next chunk), then waiting sequences are admitted while the token budget (``max_num_batched_tokens``), the sequence
limit (``max_num_seqs``) and free KV blocks allow; the last admitted may get a partial (chunked) prefill. When a
running sequence needs a block and none is free, the most recently admitted running sequence is preempted: its
blocks are freed and it goes back to the front of the queue to recompute its tokens later (vLLM's RECOMPUTE).
With prefix caching (engine/prefix_cache.py) an admitted sequence first takes the cached blocks of its prefix and
computes only the rest.
That is the ``fcfs`` scheduling policy; the order of the running and waiting sequences, each sequence's share of the
budget and the preemption victim come from the scheduler's policy (scheduling_policy.py: ``fcfs``, ``fair``,
``priority``).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tokenfab.engine.block_manager import BlockManager
from tokenfab.engine.scheduling_policy import SchedulingPolicy
from tokenfab.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What runs this step.

    ``seqs`` lists decode sequences first (``num_decodes`` of them, one new token each), then prefill chunks.
    ``rows``, ``num_new``, ``num_computed`` are int arrays aligned with ``seqs`` (row in the runner's persistent
    arrays, tokens computed this step, tokens already in the cache). ``admitted`` are sequences that entered the
    running set this step (their token rows must be written); ``preempted`` lost their blocks this step.
    """

    seqs: list[Sequence]
    num_decodes: int
    rows: np.ndarray
    num_new: np.ndarray
    num_computed: np.ndarray
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    spec_lens: np.ndarray | None = None  # [B] draft tokens appended per sequence (speculative decoding), or None

    @property
    def num_tokens(self) -> int:
        return int(self.num_new.sum())

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    """Decides which sequences run each step.

    Args:
        block_manager: the KV pool.
        max_num_seqs: most sequences running at once (rows of the persistent batch).
        max_num_batched_tokens: token budget of one step (decode tokens + prefill chunk tokens).
        policy: the scheduling policy (scheduling_policy.py); default fcfs.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: SchedulingPolicy | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1 "
                             f"(got {max_num_seqs}, {max_num_batched_tokens}).")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_rows: deque[int] = deque(range(max_num_seqs))
        self.num_preemptions = 0
        self.policy = policy if policy is not None else SchedulingPolicy()

    # ---- queue management ------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.policy.enqueue(self.waiting, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and release its blocks and row (works for waiting or running sequences)."""
        seq.status = SequenceStatus.FINISHED
        if seq.finish_reason is None:
            seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.bm.free(seq)
        if seq.row >= 0:
            self.free_rows.append(seq.row)
            seq.row = -1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.requeue(self.waiting, seq)

    @staticmethod
    def _unschedule(seq: Sequence, *lists: list[tuple[Sequence, int]]) -> int:
        """Drop ``seq`` from this step's scheduled (sequence, tokens) lists (a victim given tokens earlier in the
        step, which fcfs never picks); returns the tokens given back to the budget."""
        for lst in lists:
            for j, (s, n) in enumerate(lst):
                if s is seq:
                    del lst[j]
                    return n
        return 0

    # ---- the step decision -----------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        admitted: list[Sequence] = []
        policy = self.policy
        pc = self.bm.prefix_cache
        if pc is not None:  # blocks the last step filled become reusable; hybrid states snapshotted (prefix_cache.py)
            for s in self.running:
                pc.commit(s, snapshot=True)
        policy.plan(self.running, self.waiting, budget, len(self.free_rows))
        for seq in policy.running_order(self.running):
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            n = policy.grant(seq, budget)
            if n <= 0:  # not among this step's prefills (fair)
                continue
            if pc is not None:
                n = pc.cut_chunk(seq, n)  # hybrid models: chunks end on state-snapshot boundaries
            while not self.bm.can_allocate(seq, n):
                victim = policy.victim(self.running)
                budget += self._unschedule(victim, decodes, prefills)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            self.bm.allocate(seq, n)
            (decodes if seq.num_tokens - seq.num_computed_tokens == 1 else prefills).append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and not preempted and self.free_rows:
            seq = self.waiting[0]
            n = policy.grant(seq, budget)
            hit = self.bm.match_prefix(seq) if n > 0 else None  # cached leading blocks (None: caching off)
            if hit is not None:  # only the tokens after the hit are computed
                n = pc.cut_chunk(seq, min(n, seq.num_tokens - hit.num_tokens), hit.num_tokens)
            if n <= 0 or not self.bm.can_allocate(seq, n, hit):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.row = self.free_rows.popleft()
            self.running.append(seq)
            admitted.append(seq)
            self.bm.allocate(seq, n, hit)  # a hit's blocks first; num_computed_tokens starts after them
            (decodes if seq.num_tokens - seq.num_computed_tokens == 1 else prefills).append((seq, n))
            budget -= n
        pairs = decodes + prefills
        seqs = [s for s, _ in pairs]
        return ScheduledBatch(
            seqs=seqs, num_decodes=len(decodes),
            rows=np.fromiter((s.row for s in seqs), dtype=np.int64, count=len(seqs)),
            num_new=np.fromiter((n for _, n in pairs), dtype=np.int64, count=len(seqs)),
            num_computed=np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs)),
            admitted=admitted, preempted=preempted)
