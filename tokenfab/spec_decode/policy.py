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
   ``acceptance_ema_decay`` on the previous value; before the first verification 0.6, or 1 with a proposer cost
   (rule 3: optimistic, since learning a means paying the draft's catch-up; the rule still charges that cost, so a
   row is tried at once where drafting can pay at all, and never where even a = 1 loses)). Its draft cap this step is
   the number of positions j = 1..k with a^j > max(min_acceptance_rate, r B / (1 + r B)) (B: running sequences).
3. Step: a speculative step also pays a fixed overhead o (``verify_step_overhead``, in units of c0: logits in
   Python instead of inside the fused stack's call, the verification bookkeeping) plus ``random_row_cost`` per
   row at temperature > 0 (its softmax and draws over the vocabulary, ~0.5 ms per row on the default model,
   where plain steps draw inside the fused call). The step speculates only when the expected tokens beat the
   expected cost: (B + G) / B > 1 + (r C + o + o_r R) / (1 + r B), R = rows at temperature > 0,
   G = sum over rows of sum_{j <= cap} a^j, C = sum of caps. Otherwise it is a plain decode step (fused stack).
   The proposer's own cost (``Proposer.drafting_cost``, spec_decode/drafting_cost.py; None for n-gram lookup, MTP
   and DSpark) joins the right side, in plain steps: ``f`` per drafting forward, shared by the rows (a step whose
   longest cap is kk runs kk of them: a draft model's forwards), and each drafting row's one-time catch-up ``K_i``
   (the draft prefilling the row's prompt, or the tokens of the plain steps since its last draft) spread over the
   row's expected remaining speculative steps M_i = L_i / (1 + g_i) (L_i: tokens the row may still emit, g_i =
   sum_{j <= cap_i} a_i^j): the step speculates with the depth kk in 1..max cap that maximizes
   net(kk) = G / B - (r C + o + o_r R) / (1 + r B) - kk f - sum_i K_i min(1, (1 + g_i) / L_i) (caps cut to kk),
   when net(kk) > 0. Without a proposer cost kk = max cap and this is the rule above.
4. Probes: every ``probe_interval``-th step (a batch-wide counter, so probes share one step) rows capped at 0
   draft one token and the step speculates regardless of rule 3, so a turns back up when the text becomes
   predictable. A probe is charged with the proposer's cost where it has one: it is a plain step when even
   with every draft accepted (a = 1 for every row, caps k) rule 3's best net(kk) is <= 0 (a draft model whose
   forwards or catch-ups cost more than k accepted tokens per row can return). With verify_token_cost =
   verify_step_overhead = random_row_cost = 0 every row drafts k, always (the proposer's cost is not consulted).
5. A step where no row has a draft (no n-gram match) is a plain decode step.
6. The clock (spec_decode/step_timing.py, ``timed_switch_off``, on by default outside the always-draft mode): this
   model leaves out the work of proposers without a cost (MTP, DSpark) and may misjudge the others, so per
   batch-size bucket the decoder also compares measured seconds per row-token of speculative steps with plain
   decode steps and runs plain (with backing-off probes) where speculation has not been paying. With it on, a
   draft model's cost is measured too (its forwards' seconds over the target's plain step's, drafting_cost.py).

At batch 1 the threshold is ~0.03 (speculation almost always pays); at batch 16 ~0.36 (a = 0.43 drafts one
token, a = 0.67 two, a = 0.1 none). A draft model with f = 0.37 (SmolLM2-135M's own Q4_1 as draft, the
weight-bytes prior) at a = 0.9 nets 1.38 plain steps per step at batch 1 with k = 4 (1.14 while spreading its
300-token prompt's catch-up over 64 tokens to go), and at batch 16 loses at every depth while its rows' 300-token
prompts are still to catch up with 64 tokens to go (best net -1.07, and -1.02 at a = 1: probes there are plain
steps too); tests/test_spec_policy.py::test_policy_charges_the_proposers_cost_hand_worked works these cases.
The rules depend on the rows' histories, B, the step count and, with ``timed_switch_off`` (rule 6 and the
proposer's measured cost), the clock: a seeded request reproduces its tokens when it runs in the same workload
(the same batch mates) with ``timed_switch_off: false`` (the proposer's cost is then its prior), and always when the
costs are set to 0.
"""
from __future__ import annotations

import math

import numpy as np

from tokenfab.spec_decode.config import SpeculativeConfig
from tokenfab.spec_decode.drafting_cost import DraftingCost

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

    def draft_caps(self, seqs, batch_size: int, cost: DraftingCost | None = None,
                   remaining: np.ndarray | None = None) -> np.ndarray:
        """Most drafts per row this step (int64 [N], 0..k): all zeros when the step should not speculate.

        ``cost``: the proposer's own cost (rules 3 and 4; None: free); ``remaining`` [N]: tokens each row may still
        emit (L_i, spreading a catch-up; None: a catch-up is charged whole to this step)."""
        cfg = self.cfg
        k = cfg.num_speculative_tokens
        if (cfg.verify_token_cost == 0.0 and cfg.verify_step_overhead == 0.0 and cfg.random_row_cost == 0.0
                and cfg.min_acceptance_rate == 0.0):
            return np.full(len(seqs), k, dtype=np.int64)
        thr = self.threshold(batch_size)
        prior = PRIOR_ACCEPTANCE if cost is None else 1.0
        a = np.fromiter((prior if self.rows.get(s.seq_id, [None])[0] is None
                         else self.rows[s.seq_id][0] for s in seqs), dtype=np.float64, count=len(seqs))
        with np.errstate(divide="ignore", invalid="ignore"):
            c = np.where(a >= 1.0, k, np.where((a <= thr) | (a <= 0.0), 0,
                                               np.ceil(np.log(max(thr, 1e-300)) / np.log(np.clip(a, 1e-300, 1 - 1e-12)))
                                               - 1))
        caps = np.clip(np.nan_to_num(c), 0, k).astype(np.int64)
        if thr <= 0.0:
            caps[:] = k
        n_rand = sum(1 for s in seqs if s.params.temperature >= 1e-5)
        self.steps_since_probe += 1
        if self.steps_since_probe >= cfg.probe_interval:  # a probe step: everyone drafts, at least one token
            self.steps_since_probe = 0
            if cost is not None and self.best_depth(np.ones(len(seqs)), np.full(len(seqs), k, dtype=np.int64),
                                                    batch_size, n_rand, cost, remaining)[1] <= 0.0:
                return np.zeros(len(seqs), dtype=np.int64)  # charged: it cannot pay even if every draft is accepted
            return np.maximum(caps, 1)
        kk, net = self.best_depth(a, caps, batch_size, n_rand, cost, remaining)
        if net <= 0.0:
            return np.zeros(len(seqs), dtype=np.int64)
        return np.minimum(caps, kk)

    def best_depth(self, a: np.ndarray, caps: np.ndarray, batch_size: int, n_rand: int,
                   cost: DraftingCost | None = None, remaining: np.ndarray | None = None) -> tuple[int, float]:
        """Rule 3: the drafting depth kk (1..max cap) maximizing net(kk), and that net in plain steps (> 0: the
        step pays). ``a`` [N] float64 acceptance per position, ``caps`` [N] int64 per-row caps, ``n_rand`` rows
        at temperature > 0. (0, 0.0) when no row may draft."""
        cfg = self.cfg
        kmax = int(caps.max()) if len(caps) else 0
        if kmax <= 0:
            return 0, 0.0
        B = max(batch_size, 1)
        r = cfg.verify_token_cost
        j = np.arange(1, kmax + 1)
        cum = np.concatenate([np.zeros((len(a), 1)), np.cumsum(a[:, None] ** j[None, :], axis=1)], axis=1)
        depth = np.minimum(caps[:, None], j[None, :])  # [N, kk]: row i's drafts at depth kk
        g = np.take_along_axis(cum, depth, axis=1)  # [N, kk]: expected accepted drafts of row i
        verify = (r * depth.sum(axis=0) + cfg.verify_step_overhead + cfg.random_row_cost * n_rand) / (1.0 + r * B)
        net = g.sum(axis=0) / B - verify
        if cost is not None:  # K_i / M_i, M_i = L_i / (1 + g_i) steps (at least 1: never more than K_i)
            spread = (np.ones_like(g) if remaining is None else
                      np.minimum((1.0 + g) / np.maximum(np.asarray(remaining, dtype=np.float64), 1.0)[:, None], 1.0))
            catch = ((depth > 0) * np.asarray(cost.catch_up, dtype=np.float64)[:, None] * spread).sum(axis=0)
            net = net - j * cost.forward - catch
        best = int(np.argmax(net))
        return best + 1, float(net[best])

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
