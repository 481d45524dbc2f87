"""When and how much to speculate: the switch-off rule.

Verifying costs about ``c0 + c1 * R`` per step for R verified tokens (every row's last token and its drafts):
a fixed part (weights streamed once per step, Python, sampling) and a part per token. On the default CPU model
(benchmarks/results/2026-12-01-spec-decode-*.md) c0 ~ 29 ms and c1 ~ 1.0 ms: ``verify_token_cost`` = c1 / c0
~ 0.035. A plain step of B rows yields B tokens for c0 + c1 B. Drafting one more token at position j of a row
whose drafts are accepted with probability a (each given the previous ones) adds c1 of cost and a^j expected
tokens, so it raises throughput when a^j > c1 B / (c0 + c1 B) = r B / (1 + r B) (r = verify_token_cost). Per step:

1. Batch: no speculation with more running sequences than ``disable_by_batch_size`` (vLLM's knob; None: no cap).
2. Row: each sequence keeps an exponential moving average a of its acceptance probability per draft position
   (per verification: accepted / positions examined = m / min(m + 1, k), the geometric model's estimate; weight
   ``acceptance_ema_decay`` on the previous value; 0.6 before the first verification). Its draft cap this step is
   the number of positions j = 1..k with a^j > max(min_acceptance_rate, r B / (1 + r B)) (B: running sequences).
3. Step: a speculative step also pays a fixed overhead o (``verify_step_overhead``, in units of c0: logits in
   Python instead of inside the fused stack's call, the verification bookkeeping) plus ``random_row_cost`` per
   row at temperature > 0 (its softmax and draws over the vocabulary, ~0.5 ms per row on the default model,
   where plain steps draw inside the fused call). The step speculates only when the expected tokens beat the
   expected cost: (B + G) / B > 1 + (r C + o + o_r R) / (1 + r B), R = rows at temperature > 0,
   G = sum over rows of sum_{j <= cap} a^j, C = sum of caps. Otherwise it is a plain decode step (fused stack).
4. Probes: every ``probe_interval``-th step (a batch-wide counter, so probes share one step) rows capped at 0
   draft one token and the step speculates regardless of rule 3, so a turns back up when the text becomes
   predictable. With verify_token_cost = verify_step_overhead = random_row_cost = 0 every row drafts k, always.
5. A step where no row has a draft (no n-gram match) is a plain decode step.
6. The clock (spec_decode/step_timing.py, ``timed_switch_off``, on by default outside the always-draft mode): this
   model leaves out the proposer's own work, so per batch-size bucket the decoder also compares measured seconds per
   row-token of speculative steps with plain decode steps and runs plain (with backing-off probes) where
   speculation has not been paying.

At batch 1 the threshold is ~0.03 (speculation almost always pays); at batch 16 ~0.36 (a = 0.43 drafts one
token, a = 0.67 two, a = 0.1 none). The rules depend on the rows' histories, B and the step count: a seeded
request reproduces its tokens when it runs in the same workload (the same batch mates), and always when the
costs are set to 0.
"""
from __future__ import annotations

import math

import numpy as np

from tokenfab.spec_decode.config import SpeculativeConfig

PRIOR_ACCEPTANCE = 0.6


class SpecPolicy:
    """Per-sequence acceptance EMA, the batch-size cap and the cost-based draft caps (module docstring)."""

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self.rows: dict[int, list] = {}  # seq_id -> [ema or None, unused]
        self.steps_since_probe = 0

    def batch_allows(self, num_running: int) -> bool:
        cap = self.cfg.disable_by_batch_size
        return cap is None or num_running <= cap

    def threshold(self, batch_size: int) -> float:
        """Smallest a^j worth drafting at this batch size."""
        rb = self.cfg.verify_token_cost * batch_size
        return max(self.cfg.min_acceptance_rate, rb / (1.0 + rb))

    def draft_caps(self, seqs, batch_size: int) -> np.ndarray:
        """Most drafts per row this step (int64 [N], 0..k): all zeros when the step should not speculate."""
        cfg = self.cfg
        k = cfg.num_speculative_tokens
        if (cfg.verify_token_cost == 0.0 and cfg.verify_step_overhead == 0.0 and cfg.random_row_cost == 0.0
                and cfg.min_acceptance_rate == 0.0):
            return np.full(len(seqs), k, dtype=np.int64)
        thr = self.threshold(batch_size)
        a = np.fromiter((PRIOR_ACCEPTANCE if self.rows.get(s.seq_id, [None])[0] is None
                         else self.rows[s.seq_id][0] for s in seqs), dtype=np.float64, count=len(seqs))
        with np.errstate(divide="ignore", invalid="ignore"):
            c = np.where(a >= 1.0, k, np.where((a <= thr) | (a <= 0.0), 0,
                                               np.ceil(np.log(max(thr, 1e-300)) / np.log(np.clip(a, 1e-300, 1 - 1e-12)))
                                               - 1))
        caps = np.clip(np.nan_to_num(c), 0, k).astype(np.int64)
        if thr <= 0.0:
            caps[:] = k
        self.steps_since_probe += 1
        if self.steps_since_probe >= cfg.probe_interval:  # a probe step: everyone drafts, at least one token
            self.steps_since_probe = 0
            return np.maximum(caps, 1)
        B = max(batch_size, 1)
        j = np.arange(1, k + 1)
        gain = float(np.where(j[None, :] <= caps[:, None], a[:, None] ** j[None, :], 0.0).sum())
        r = cfg.verify_token_cost
        n_rand = sum(1 for s in seqs if s.params.temperature >= 1e-5)
        cost = (r * float(caps.sum()) + cfg.verify_step_overhead + cfg.random_row_cost * n_rand) / (1.0 + r * B)
        if (B + gain) / B <= 1.0 + cost:
            return np.zeros(len(seqs), dtype=np.int64)
        return caps

    def update(self, seqs, num_verified, num_accepted) -> None:
        """Fold one verification per row into its EMA (rows with 0 verified drafts are skipped)."""
        d = self.cfg.acceptance_ema_decay
        for s, n, m in zip(seqs, num_verified, num_accepted):
            if n <= 0:
                continue
            rate = m / min(m + 1, n)
            st = self.rows.setdefault(s.seq_id, [None, 0])
            st[0] = rate if st[0] is None else d * st[0] + (1 - d) * rate

    def ema(self, seq) -> float | None:
        st = self.rows.get(seq.seq_id)
        return None if st is None else st[0]

    def prune(self, live_ids) -> None:
        """Forget finished sequences (called when the table grows)."""
        live = set(live_ids)
        self.rows = {k: v for k, v in self.rows.items() if k in live}
