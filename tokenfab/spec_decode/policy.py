"""When to speculate: the switch-off rule.

Speculation costs a verification forward over 1 + k tokens per row instead of 1 (on CPU the module path instead of
the fused decode stack) and pays only when enough drafts are accepted. The rule, per step:

1. Batch: no speculation in a step with more running sequences than ``disable_by_batch_size`` (vLLM's knob;
   large batches are compute-bound enough that extra verified tokens cost about as much as they save). The step
   then runs exactly as without speculation (fused decode stack included).
2. Row: each sequence keeps an exponential moving average of its acceptance rate (accepted / verified drafts per
   verification, weight ``acceptance_ema_decay`` on the previous value; the first verification sets it). A row whose
   EMA is below ``min_acceptance_rate`` does not draft, except once every ``probe_interval`` of its decode steps
   (a probe that lets the EMA recover when the text turns repetitive).
3. A step in which no row has a draft (no n-gram match, all rows paused) runs as a plain decode step.

Rows 2-3 depend on the row's own history only, so a seeded request's tokens do not depend on its batch mates
unless rule 1 switches (a batch above the cap) or the token budget cuts its verification short.
"""
from __future__ import annotations

from tokenfab.spec_decode.config import SpeculativeConfig


class SpecPolicy:
    """Per-sequence acceptance EMA and the batch-size cap (see the module docstring)."""

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self.rows: dict[int, list] = {}  # seq_id -> [ema or None, decode steps since last draft]

    def batch_allows(self, num_running: int) -> bool:
        cap = self.cfg.disable_by_batch_size
        return cap is None or num_running <= cap

    def row_allows(self, seq) -> bool:
        """Whether ``seq`` drafts this step (advances its probe counter when paused)."""
        st = self.rows.get(seq.seq_id)
        if st is None or st[0] is None or st[0] >= self.cfg.min_acceptance_rate:
            return True
        st[1] += 1
        if st[1] >= self.cfg.probe_interval:
            st[1] = 0
            return True
        return False

    def update(self, seqs, num_verified, num_accepted) -> None:
        """Fold one verification per row into its EMA (``num_verified`` / ``num_accepted`` int sequences; rows with
        0 verified drafts are skipped)."""
        a = self.cfg.acceptance_ema_decay
        for s, n, m in zip(seqs, num_verified, num_accepted):
            if n <= 0:
                continue
            rate = m / n
            st = self.rows.setdefault(s.seq_id, [None, 0])
            st[0] = rate if st[0] is None else a * st[0] + (1 - a) * rate

    def ema(self, seq) -> float | None:
        st = self.rows.get(seq.seq_id)
        return None if st is None else st[0]

    def prune(self, live_ids) -> None:
        """Forget finished sequences (called when the table grows)."""
        live = set(live_ids)
        self.rows = {k: v for k, v in self.rows.items() if k in live}
