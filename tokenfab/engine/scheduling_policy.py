"""The scheduling policy: the order in which waiting sequences are admitted, how a step's token budget is split among
prefills, and which running sequence is preempted when the KV pool runs out.

The :class:`~tokenfab.engine.scheduler.Scheduler` runs one loop for every policy (running sequences, then
admissions, under ``max_num_batched_tokens`` / ``max_num_seqs`` / free blocks) and asks its policy at five points:

* :meth:`SchedulingPolicy.enqueue` / :meth:`~SchedulingPolicy.requeue`: where a new / a preempted sequence goes in
  the waiting queue;
* :meth:`~SchedulingPolicy.running_order`: the order the running sequences are given tokens in;
* :meth:`~SchedulingPolicy.plan` then :meth:`~SchedulingPolicy.grant`: how many tokens a sequence gets this step;
* :meth:`~SchedulingPolicy.victim`: which running sequence loses its blocks (preemption by recompute).

Policies (``LLM(scheduling_policy=...)``, ``tokenfab serve --scheduling-policy``):

``fcfs`` (default)
    First come, first served: running sequences in admission order, each takes all its remaining tokens up to the
    budget left; waiting ones are admitted in arrival order (a preempted one goes back to the front); the most
    recently admitted running sequence is preempted. Only the last admitted sequence of a step gets a partial
    (chunked) prefill, so simultaneous long prompts are prefilled one after another.
``fair``
    Running decodes first, every step (each gets its 1 token, or its verification rows); the budget left is split
    equally among up to ``max_partial_prefills`` prefilling sequences: the oldest (so nobody starves), then the
    next in arrival order (or, with ``shortest_first``, those nearest their first token), in chunks rounded to
    whole KV blocks and of at least ``min_prefill_chunk`` tokens (fewer sequences share the step when the budget
    left is smaller); a sequence that needs less than its share gives the rest to the others (water-filling), and
    budget the sharers leave goes to the next prompts in line, so a step is as full as under fcfs. Several long
    prompts make progress at once, and a short prompt arriving while a long one is prefilled starts at once.
    Preemption as fcfs.
``priority``
    As vLLM's: waiting sequences ordered by the request's ``priority`` (lower runs earlier) then arrival; the
    preempted sequence is the running one with the largest (priority, arrival) — the least important, latest
    arrived. Token grants as fcfs. A low-priority request waits as long as higher-priority ones keep arriving.

A request's ``priority`` other than 0 with a policy other than ``priority`` is refused (ValueError naming
``priority``), as vLLM refuses it ("Got priority ... but Priority scheduling is not enabled").

For prompts arriving together, fcfs gives the k-th first token after k prompts' prefill work, which no
reordering of equal-cost steps can beat (k first tokens need k whole prefills), so ``fair`` cannot lower their
median TTFT: it costs some (max_partial_prefills 2: +0-5% in steps; 16: up to +85%) for progress on every prompt,
and it lowers the TTFT of short prompts arriving during long prefills (benchmarks/fair_scheduling.py,
benchmarks/results/2026-12-01-fair-scheduling*.md).
"""
from __future__ import annotations

import bisect
from collections import deque

from tokenfab.engine.sequence import Sequence

SCHEDULING_POLICIES = ("fcfs", "fair", "priority")
DEFAULT_MAX_PARTIAL_PREFILLS = 2  # fair: prefilling sequences sharing one step (benchmarks/fair_scheduling.py)
DEFAULT_MIN_PREFILL_CHUNK = 256  # fair: smallest share in tokens (a whole number of blocks is kept above it)


def remaining(seq: Sequence) -> int:
    """Tokens of ``seq`` not in the KV cache yet (prompt, recomputed output, or 1 + draft tokens)."""
    return seq.num_tokens - seq.num_computed_tokens


def in_decode(seq: Sequence) -> bool:
    """True once ``seq``'s prompt is in the cache: what is left is its new token(s) (or, after a preemption, the
    output tokens it recomputes)."""
    return seq.num_computed_tokens >= seq.num_prompt_tokens


class SchedulingPolicy:
    """First come, first served (``fcfs``): the scheduler's behaviour before the policies existed, bit for bit.

    Subclasses override the hooks; every hook is O(number of sequences) Python on sequence objects, once a step.
    """

    name = "fcfs"

    def enqueue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        """Put a new sequence into ``waiting`` (fcfs: at the back)."""
        waiting.append(seq)

    def requeue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        """Put a preempted sequence back into ``waiting`` (fcfs: at the front, it is the oldest)."""
        waiting.appendleft(seq)

    def victim(self, running: list[Sequence]) -> Sequence:
        """The running sequence to preempt when a block is missing (fcfs: the most recently admitted)."""
        return running[-1]

    def running_order(self, running: list[Sequence]) -> list[Sequence]:
        """The running sequences in the order they are given tokens this step (fcfs: admission order)."""
        return list(running)

    def plan(self, running: list[Sequence], waiting: deque[Sequence], budget: int, free_rows: int) -> None:
        """Called once at the start of a step, before any grant (fcfs: nothing to plan)."""

    def grant(self, seq: Sequence, budget: int) -> int:
        """Tokens ``seq`` computes this step given ``budget`` tokens left (0: none this step).
        fcfs: all it has left, up to the budget."""
        return min(remaining(seq), budget)


class FairPolicy(SchedulingPolicy):
    """``fair``: decodes first, then the budget left split equally among up to ``max_partial_prefills`` prefills.

    Args:
        max_partial_prefills: most prefilling sequences given tokens in one step (>= 1; 1 is fcfs's one-at-a-time
            prefill with decodes given their tokens first).
        min_prefill_chunk: smallest share in tokens (>= 1): with ``P`` tokens left after the decodes, at most
            ``max(1, P // min_prefill_chunk)`` prefills share the step.
        block_size: KV block size; shares are rounded down to whole blocks (except the last one, which takes what
            is left), so chunks end on block boundaries.
        shortest_first: besides the oldest, share the step with the prefills nearest their first token (True:
            short prompts behind queued long ones start at once, the long ones wait longer for rows) or with the
            next ones in arrival order (False, default).

    Raises:
        ValueError: a knob below 1.
    """

    name = "fair"

    def __init__(self, max_partial_prefills: int = DEFAULT_MAX_PARTIAL_PREFILLS,
                 min_prefill_chunk: int = DEFAULT_MIN_PREFILL_CHUNK, block_size: int = 16,
                 shortest_first: bool = False):
        for k, v in (("max_partial_prefills", max_partial_prefills), ("min_prefill_chunk", min_prefill_chunk),
                     ("block_size", block_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"fair scheduling: {k} must be an integer >= 1, got {v!r}.")
        self.max_partial_prefills = max_partial_prefills
        self.min_prefill_chunk = min_prefill_chunk
        self.block_size = block_size
        self.shortest_first = bool(shortest_first)
        self._grants: dict[int, int] = {}  # id(seq) -> prefill tokens planned this step

    def running_order(self, running: list[Sequence]) -> list[Sequence]:
        """Decoding sequences first (so no decode waits behind a prefill chunk), then prefilling ones, each group
        in admission order."""
        return [s for s in running if in_decode(s)] + [s for s in running if not in_decode(s)]

    def plan(self, running: list[Sequence], waiting: deque[Sequence], budget: int, free_rows: int) -> None:
        """Choose this step's prefill sharers and split the budget left after the decodes among them.

        Sharers: the oldest prefilling or waiting sequence (by arrival, so nobody starves), then, up to
        ``max_partial_prefills``, the next in arrival order (running prefills first), or with ``shortest_first``
        those nearest their first token (fewest tokens left); waiting ones only while rows are free. Shares by water-filling: in increasing
        need, each takes ``min(need, left // k)`` with ``k`` sharers still unserved, rounded down to whole blocks
        except for the last sharer. Budget the sharers leave goes to the next candidates in the same order (the
        step is never left part-empty while prompts wait). The chosen waiting sequences are moved to the front
        of ``waiting``, in grant order, for the scheduler to admit.
        """
        self._grants = {}
        left = budget - sum(remaining(s) for s in running if in_decode(s))
        if left <= 0:
            return
        cap = min(self.max_partial_prefills, max(1, left // self.min_prefill_chunk))
        pool = [s for s in running if not in_decode(s)] + list(waiting)
        if not pool:
            return
        is_waiting = {id(s) for s in waiting}
        oldest = min(pool, key=lambda s: (s.arrival_time, s.seq_id))
        rest = [s for s in pool if s is not oldest]
        if self.shortest_first:
            rest.sort(key=remaining)  # stable: ties keep running-then-arrival order
        order = [s for s in [oldest] + rest]
        chosen, rows = [], free_rows
        for s in order:  # every candidate the step could serve, in preference order
            if id(s) in is_waiting:
                if rows <= 0:
                    continue
                rows -= 1
            chosen.append(s)
        sharers = chosen[:cap]
        bs = self.block_size
        m = len(sharers)
        for j, s in enumerate(sorted(sharers, key=remaining)):
            k = m - j
            share = left // k
            if k > 1 and share >= bs:
                share -= share % bs
            g = min(remaining(s), share)
            self._grants[id(s)] = g
            left -= g
        for s in chosen[cap:]:  # what the sharers leave goes to the next in line
            if left <= 0:
                break
            g = min(remaining(s), left)
            self._grants[id(s)] = g
            left -= g
        admit = [s for s in chosen if id(s) in is_waiting and self._grants.get(id(s), 0) > 0]
        if admit and any(a is not b for a, b in zip(admit, waiting)):
            ids = {id(s) for s in admit}
            others = [s for s in waiting if id(s) not in ids]
            waiting.clear()
            waiting.extend(admit + others)

    def grant(self, seq: Sequence, budget: int) -> int:
        """A decoding sequence: all it has left (up to the budget); a prefilling one: its planned share (0 when
        it is not among this step's sharers)."""
        if in_decode(seq):
            return min(remaining(seq), budget)
        return min(self._grants.get(id(seq), 0), remaining(seq), budget)


class PriorityPolicy(SchedulingPolicy):
    """``priority``: waiting sequences kept sorted by (priority, arrival time, sequence id); the victim of a
    preemption is the running sequence with the largest such key. Grants as fcfs."""

    name = "priority"

    @staticmethod
    def key(seq: Sequence) -> tuple:
        """Sort key: lower priority value first, then earlier arrival, then the order requests were added."""
        return (seq.priority, seq.arrival_time, seq.seq_id)

    def enqueue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        keys = [self.key(s) for s in waiting]
        waiting.insert(bisect.bisect_right(keys, self.key(seq)), seq)

    def requeue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        self.enqueue(waiting, seq)

    def victim(self, running: list[Sequence]) -> Sequence:
        return max(running, key=self.key)


def make_policy(name: str, block_size: int = 16, **knobs) -> SchedulingPolicy:
    """The policy called ``name`` (``"fcfs"``, ``"fair"``, ``"priority"``); ``knobs`` go to :class:`FairPolicy`
    (``max_partial_prefills``, ``min_prefill_chunk``).

    Raises:
        ValueError: an unknown name (the message lists the known ones), or knobs for a policy without any.
    """
    if name == "fair":
        return FairPolicy(block_size=block_size, **knobs)
    if knobs:
        raise ValueError(f"scheduling_policy '{name}' takes no settings (got {sorted(knobs)}); only 'fair' has "
                         "max_partial_prefills and min_prefill_chunk.")
    if name == "fcfs":
        return SchedulingPolicy()
    if name == "priority":
        return PriorityPolicy()
    raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; got {name!r}.")


def check_priority(priority, policy: str) -> int:
    """Validate a request's ``priority`` for the engine's scheduling ``policy``; returns it as an int.

    Any integer is accepted under ``priority`` (lower runs earlier, negative allowed, as vLLM's); other policies
    accept only 0 (the default), as vLLM refuses a non-zero priority when priority scheduling is off.

    Raises:
        InvalidRequestError (a ValueError, ``param`` "priority"): not an integer (bools and floats included), or
            non-zero under a policy other than ``priority``.
    """
    from tokenfab.errors import InvalidRequestError
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequestError(f"priority must be an integer (lower runs earlier), got {priority!r}.", "priority")
    if priority != 0 and policy != "priority":
        raise InvalidRequestError(f"priority {priority}: priority scheduling is not enabled (scheduling_policy is "
                                  f"'{policy}'); start the engine with scheduling_policy='priority' "
                                  "(--scheduling-policy priority) or send priority 0.", "priority")
    return priority
