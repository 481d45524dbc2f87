"""Per-row grammar matchers of structured-output requests and their batched token mask.

Rows are the model runner's persistent rows (``Sequence.row``), as in logits_state.py, which owns one
:class:`GrammarState` (made when the first sequence with a grammar is admitted). Each such sequence carries its
``xgrammar.CompiledGrammar`` (``Sequence.grammar``, set by ``LLMEngine.add_request``); its row holds an
``xgrammar.GrammarMatcher`` (the automaton's state after the sequence's output so far):

- admission (:meth:`admit`, also after preemption by recompute and for failure isolation's re-runs): a fresh
  matcher replays the sequence's output tokens, so the state always equals "the output so far" whatever happened
  to the row in between;
- a step (:meth:`apply`): the next-token bitmasks of the batch's grammar rows are filled in one
  ``BatchGrammarMatcher.batch_fill_next_token_bitmask`` call (C++, threads over rows) into a [N, ceil(V / 32)]
  int32 buffer, and one ``apply_token_bitmask_inplace`` call sets every disallowed logit of those rows to -inf;
  rows without a grammar are not touched;
- accepted tokens (:meth:`record`, from ``ModelRunner.write_tokens`` after output processing) advance the
  batch's matchers in one ``batch_accept_token`` call.

Termination: the compiled grammar allows the model's EOS ids only where the grammar accepts the output (and only
them once nothing can follow), so a constrained sequence stops exactly when its output is complete. After a
matcher accepted EOS (terminated: the sequence keeps going only under ``ignore_eos``) or refused a token (possible
only when another mask, such as min_tokens forbidding EOS, left the grammar nothing), the row is no longer masked.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from tokenfab.structured_output.compiler import import_xgrammar

logger = logging.getLogger("tokenfab")


class GrammarState:
    """Grammar matchers by persistent row.

    Args:
        max_num_seqs: number of rows.
        vocab_size: logits width V.
    """

    def __init__(self, max_num_seqs: int, vocab_size: int):
        self.xgr = import_xgrammar()
        self.V = int(vocab_size)
        self.matchers: list = [None] * max_num_seqs
        self.on = np.zeros(max_num_seqs, dtype=bool)  # the row's next token is constrained
        self._bitmask = self.xgr.allocate_token_bitmask(max_num_seqs, self.V)  # [rows, ceil(V / 32)] int32
        self._batch = self.xgr.BatchGrammarMatcher(max_threads=max(1, min(4, torch.get_num_threads())))

    def admit(self, seq) -> None:
        """Give ``seq``'s row a matcher for ``seq.grammar`` that has accepted its output so far (None: clear)."""
        r = seq.row
        g = getattr(seq, "grammar", None)
        if g is None:
            self.matchers[r], self.on[r] = None, False
            return
        m = self.xgr.GrammarMatcher(g)
        ok = True
        for t in seq.output_token_ids:  # admission only: a new sequence has none, a preempted one replays its own
            if m.is_terminated() or not m.accept_token(int(t)):
                ok = False
                break
        self.matchers[r] = m
        self.on[r] = ok and not m.is_terminated()

    def clear(self, row: int) -> None:
        """The row's sequence has no grammar."""
        self.matchers[row], self.on[row] = None, False

    def apply(self, logits: torch.Tensor, index: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """Mask (-inf, in place) the tokens each grammar row of ``logits`` [N, V] float32 cannot take next.

        Args:
            index: [G] int64 batch positions of rows admitted with a grammar.
            rows: [G] int64 their persistent rows.
        Returns ``logits``."""
        live = self.on[rows]
        if not live.all():
            index, rows = index[live], rows[live]
        if not len(index):
            return logits
        N = logits.shape[0]
        bm = self._bitmask[:N]
        idx = index.tolist()
        self._batch.batch_fill_next_token_bitmask([self.matchers[r] for r in rows.tolist()], bm, indices=idx)
        if logits.device.type != "cpu":  # xgrammar fills on CPU; its GPU kernel applies on the logits' device
            bm = bm.to(logits.device, non_blocking=True)
        self.xgr.apply_token_bitmask_inplace(logits, bm, vocab_size=min(self.V, logits.shape[-1]), indices=idx)
        return logits

    def record(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Advance the matchers of the grammar rows among ``rows`` [B] int64 by the tokens just appended there."""
        m = self.on[rows]
        if not m.any():
            return
        gr = rows[m]
        toks = np.asarray(tokens, dtype=np.int64)[m]
        matchers = [self.matchers[r] for r in gr.tolist()]
        ok = np.asarray(self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, toks.tolist()), dtype=bool)
        if not ok.all():
            bad = gr[~ok]
            logger.warning("structured output: %d row(s) sampled a token their grammar refuses (another mask left "
                           "the grammar no token); those rows continue unconstrained", len(bad))
            self.on[bad] = False
        done = np.fromiter((mt.is_terminated() for mt in matchers), dtype=bool, count=len(matchers))
        if done.any():
            self.on[gr[done]] = False
