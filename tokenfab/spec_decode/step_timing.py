"""The measured switch-off: speculate at a batch size only while it has been paying there, by the clock.

The cost rule of :mod:`tokenfab.spec_decode.policy` models the verification's cost and the cost a proposer declares
(a draft model's forwards and catch-ups, spec_decode/drafting_cost.py), but not the work of the others (an MTP
layer, a DSpark pass), and a declared cost can be off (a draft's forwards can cost several plain steps at batch 16,
benchmarks/results/2026-12-01-spec-decode-draft-model.md). So the speculative step also keeps, per batch-size
bucket (1, 2, 4, 8, ...: the running sequences rounded up to a power of two), two exponential moving averages of
wall time:

* ``plain``: seconds of a plain decode step (one token per row);
* ``spec``: seconds of a speculative step (propose + verify + accept) per token emitted per row, i.e. the step's
  time x rows / tokens emitted: what one "row-token" cost, comparable to ``plain``. The proposer's one-time
  catch-up (``Proposer.last_catch_up_s``: a draft model prefilling a prompt) is left out: the cost rule charges it,
  spread over the row's remaining steps, and counted here it would switch a bucket off for the steps after it.

A bucket whose ``spec`` exceeds ``plain`` x (1 + ``MARGIN``) is off: its steps run plain, except a probe every
``interval`` steps that speculates to refresh ``spec``; each probe that confirms the bucket off doubles the interval
(from ``probe_interval`` up to ``MAX_PROBE_INTERVAL``), one that finds it paying again resets it. While a bucket
speculates, one step in ``PLAIN_SAMPLE_INTERVAL`` runs plain to keep ``plain`` current (the first step at a bucket
is plain too). This is what vLLM and SGLang users get from tuning ``disable_by_batch_size`` by hand, measured
online; ``timed_switch_off: false`` turns it off (then, as with every cost set to 0, the tokens a seeded request
gets do not depend on timing).
"""
from __future__ import annotations

MARGIN = 0.05
EMA_DECAY = 0.7
MAX_PROBE_INTERVAL = 512
PLAIN_SAMPLE_INTERVAL = 32


def ema(old: float | None, v: float) -> float:
    """The exponential moving average after observing ``v``: ``v`` itself first, then weight ``EMA_DECAY`` on
    ``old``."""
    return v if old is None else EMA_DECAY * old + (1.0 - EMA_DECAY) * v


def bucket(batch_size: int) -> int:
    """The running-sequence count rounded up to a power of two (>= 1)."""
    return 1 << max(int(batch_size) - 1, 0).bit_length()


class StepTiming:
    """Per-bucket wall-time EMAs and the on/off decision (module docstring).

    Args:
        probe_interval: steps between probes of a bucket that is off, at first (doubles per confirming probe).
    """

    def __init__(self, probe_interval: int):
        self.base_interval = max(1, int(probe_interval))
        self.plain: dict[int, float] = {}
        self.spec: dict[int, float] = {}
        self._interval: dict[int, int] = {}
        self._since: dict[int, int] = {}
        self._since_plain: dict[int, int] = {}

    @staticmethod
    def _ema(table: dict[int, float], b: int, v: float) -> None:
        table[b] = ema(table.get(b), v)

    def record_plain(self, batch_size: int, seconds: float) -> None:
        """A plain decode step of ``batch_size`` rows took ``seconds``."""
        b = bucket(batch_size)
        self._ema(self.plain, b, seconds)
        self._since_plain[b] = 0

    def record_spec(self, batch_size: int, seconds: float, tokens: int) -> None:
        """A speculative step over ``batch_size`` rows took ``seconds`` and emitted ``tokens`` (all rows)."""
        if tokens <= 0:
            return
        b = bucket(batch_size)
        was_off = self.is_off(b)
        self._ema(self.spec, b, seconds * batch_size / tokens)
        if was_off:  # this was a probe: back off while it confirms, start over when it pays again
            self._interval[b] = (min(2 * self._interval.get(b, self.base_interval), MAX_PROBE_INTERVAL)
                                 if self.is_off(b) else self.base_interval)

    def is_off(self, b: int) -> bool:
        p, s = self.plain.get(b), self.spec.get(b)
        return p is not None and s is not None and s > p * (1.0 + MARGIN)

    def wants_plain(self, batch_size: int) -> bool:
        """True when this step should run plain: the bucket is off (and this is not a probe step), or a plain
        sample is due (none yet at this bucket, or every PLAIN_SAMPLE_INTERVAL steps). Counts the step."""
        b = bucket(batch_size)
        n = self._since_plain.get(b)
        if n is None or n >= PLAIN_SAMPLE_INTERVAL:
            return True
        self._since_plain[b] = n + 1
        if not self.is_off(b):
            return False
        k = self._since.get(b, 0) + 1
        if k >= self._interval.get(b, self.base_interval):
            self._since[b] = 0
            return False  # a probe
        self._since[b] = k
        return True
