"""Per-row state of the logits processors, kept across steps so that a step does batched tensor work only.

Rows are the model runner's persistent rows (``Sequence.row``). Per-sequence work runs at admission only
(:meth:`LogitsProcessorState.admit`: a row's prompt-presence mask, output-token counts, penalty values, bias /
allow / bad-word lists); a step then gathers by row (:meth:`batch`, cached while the batch keeps its rows) and
appends sampled tokens with one scatter (:meth:`record`). A batch where no row uses these parameters costs one
numpy gather and takes the sampler's plain path.

Penalties touch only the tokens a row has seen: besides dense output counts [rows, V] (for lookups) and a prompt
mask, each row keeps the list of its distinct seen tokens (prompt and output, in order of first appearance), so a
step gathers K = sum of those lists' lengths (row, token) pairs and changes K logits
(:func:`~tokenfab.engine.logits_processors.apply_penalties_at`) rather than passing over N x V.

With async scheduling (engine/async_scheduling.py) the penalties also keep dense counts on the logits' device that
advance with each draw (:mod:`tokenfab.engine.draw_time_counts`, :meth:`LogitsProcessorState.use_draw_time_counts`),
so a penalized row's next step needs no id on the host; the host counts above are kept too (recorded at the fill),
so switching back costs nothing.

Structured outputs (a row whose sequence carries a compiled grammar) count as active rows too, so the plain
sampling paths (the fused CPU decode stack's draw included) step aside for them; their matchers and token mask live
in :class:`~tokenfab.engine.grammar_state.GrammarState` (made on the first such admission), applied first.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenfab.engine.draw_time_counts import DrawTimeCounts
from tokenfab.engine.input_staging import to_device
from tokenfab.engine.logits_processors import (allowed_token_mask, apply_allowed_token_ids, apply_bad_words,
                                               apply_logit_bias, apply_min_p, apply_penalties_at)


@dataclass
class ProcessorBatch:
    """Tensors for one batch's rows (N rows; a field is None when no row of the batch uses it).

    ``pen_index`` [n] int64 batch positions with penalties, ``pen_rows`` [n] their persistent rows (numpy),
    ``repetition`` / ``frequency`` / ``presence`` [N] float32 (neutral for rows without penalties); ``bias`` = (row [K], token [K], value [K]); ``allowed`` [N, V] bool
    mask; ``bad`` = (batch row [P], persistent row [P], last token [P], prefix [P, L] numpy int64); ``min_p`` [N]
    float32.
    """

    pen_index: torch.Tensor | None = None
    pen_rows: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    bias: tuple | None = None
    allowed: torch.Tensor | None = None
    bad: tuple | None = None
    min_p: torch.Tensor | None = None
    grammar: tuple | None = None  # (batch positions [G], persistent rows [G]) int64 numpy of rows with a grammar


class LogitsProcessorState:
    """Persistent per-row inputs of the logits processors.

    Args:
        max_num_seqs: number of rows.
        vocab_size: logits width V.
        token_ids: the runner's persistent token array [max_num_seqs, >= max_model_len] int64 numpy (prompt then
            output by row); bad words read the output's last tokens from it.
    """

    def __init__(self, max_num_seqs: int, vocab_size: int, token_ids: np.ndarray):
        self.V = int(vocab_size)
        self.token_ids = token_ids
        n = max_num_seqs
        self.active = np.zeros(n, dtype=bool)  # the row uses any of these parameters
        self.consumes_ids = np.zeros(n, dtype=bool)  # bad words or a grammar: each id feeds the next draw on the host
        self.counting = np.zeros(n, dtype=bool)  # the row has penalties: output counts are kept
        self.any_counting = False
        self.repetition = np.ones(n, dtype=np.float32)
        self.frequency = np.zeros(n, dtype=np.float32)
        self.presence = np.zeros(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.num_prompt = np.zeros(n, dtype=np.int64)
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * n
        self.allowed: list[np.ndarray | None] = [None] * n
        self.bad_words: list[list[list[int]] | None] = [None] * n
        self.output_counts: torch.Tensor | None = None  # [n, V] int32, allocated at the first penalized admission
        self.prompt_mask: torch.Tensor | None = None  # [n, V] bool
        self.seen: np.ndarray | None = None  # [n, token_ids width] int64: distinct tokens of prompt + output by row
        self.num_seen = np.zeros(n, dtype=np.int64)
        self._version = 0
        self._cache: tuple[bytes, int, ProcessorBatch] | None = None
        self._device_cache: tuple[ProcessorBatch, torch.device, ProcessorBatch] | None = None  # _on_device's
        self.has_grammar = np.zeros(n, dtype=bool)  # the row's sequence has a structured-output grammar
        self.grammar = None  # GrammarState (engine/grammar_state.py), made at the first admission with a grammar
        self.draw_counts: DrawTimeCounts | None = None  # async scheduling: counts advanced at the draw

    def use_draw_time_counts(self, device: torch.device | None) -> None:
        """Keep the penalties' counts on ``device`` (the logits'), advanced at each draw
        (:mod:`~tokenfab.engine.draw_time_counts`), from now on; None: back to the host counts alone. Call between
        steps with every drawn id recorded (the rows admitted so far are copied over)."""
        if device is None:
            self.draw_counts = None
            return
        dc = DrawTimeCounts(len(self.active), self.V, device)
        if self.output_counts is not None:  # penalized rows admitted before: their host counts are current
            dc.counts = self.output_counts.to(dc.device, copy=True)  # its own tensor, also on the CPU
            dc.prompt = self.prompt_mask.to(dc.device, copy=True)
        self.draw_counts = dc

    def advance(self, b: ProcessorBatch | None, ids: torch.Tensor) -> None:
        """After a draw of the batch ``b`` (:meth:`batch`), ``ids`` [N] int64 where drawn: its penalized rows'
        counts on the device (draw-time counts only; the host counts follow at :meth:`record`)."""
        if self.draw_counts is not None and b is not None and b.pen_index is not None:
            self.draw_counts.advance(b.pen_rows, ids, b.pen_index)

    # ---- admission: the only per-sequence work --------------------------------------------------------------
    def admit(self, seqs) -> None:
        """Set the rows of newly admitted (or resumed) sequences from their params and token lists."""
        if not seqs:
            return
        for s in seqs:
            self._admit_one(s)
        self.any_counting = bool(self.counting.any())
        self._version += 1

    def _admit_one(self, s) -> None:
        r, p = s.row, s.params
        pen = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        bad = getattr(s, "bad_words_token_ids", None) or None
        gram = getattr(s, "grammar", None) is not None
        self.active[r] = bool(pen or p.min_p > 0.0 or p.logit_bias or p.allowed_token_ids is not None or bad or gram)
        self.consumes_ids[r] = bool(bad or gram)
        self.has_grammar[r] = gram
        if gram and self.grammar is None:
            from tokenfab.engine.grammar_state import GrammarState  # imports xgrammar: only when a grammar comes
            self.grammar = GrammarState(len(self.active), self.V)
        if self.grammar is not None:
            self.grammar.admit(s)  # a matcher that replayed the output so far (preemption, re-runs), or none
        self.counting[r] = pen
        self.repetition[r], self.frequency[r], self.presence[r] = (p.repetition_penalty, p.frequency_penalty,
                                                                   p.presence_penalty)
        self.min_p[r] = p.min_p
        self.num_prompt[r] = s.num_prompt_tokens
        self.bias[r] = None
        if p.logit_bias:
            self.bias[r] = (np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias)),
                            np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias)))
        self.allowed[r] = (np.unique(np.asarray(p.allowed_token_ids, dtype=np.int64))
                           if p.allowed_token_ids is not None else None)
        self.bad_words[r] = bad
        if pen:
            if self.output_counts is None:
                n = len(self.active)
                self.output_counts = torch.zeros(n, self.V, dtype=torch.int32)
                self.prompt_mask = torch.zeros(n, self.V, dtype=torch.bool)
                self.seen = np.zeros((n, self.token_ids.shape[1]), dtype=np.int64)
            ids = np.asarray(s.token_ids, dtype=np.int64)
            npr = s.num_prompt_tokens
            t = torch.from_numpy(ids)
            self.output_counts[r] = torch.bincount(t[npr:], minlength=self.V).to(torch.int32)
            self.prompt_mask[r] = False
            self.prompt_mask[r, t[:npr]] = True
            _, first = np.unique(ids, return_index=True)
            distinct = ids[np.sort(first)]
            self.seen[r, :len(distinct)] = distinct
            self.num_seen[r] = len(distinct)
            if self.draw_counts is not None:
                self.draw_counts.admit(r, ids, npr)

    def record(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Count tokens just appended at ``rows`` [B] (int64 numpy, distinct) for the rows with penalties, and
        advance the grammar matchers of rows with structured outputs."""
        if self.grammar is not None:
            self.grammar.record(rows, tokens)
        if not self.any_counting:
            return
        m = self.counting[rows]
        if m.any():
            r = torch.from_numpy(np.ascontiguousarray(rows[m]))
            t = torch.from_numpy(np.ascontiguousarray(np.asarray(tokens, dtype=np.int64)[m]))
            self.output_counts.index_put_((r, t), torch.ones(len(r), dtype=torch.int32), accumulate=True)
            new = ((self.output_counts[r, t] == 1) & ~self.prompt_mask[r, t]).numpy()  # first sight of the token
            if new.any():
                rn = rows[m][new]
                self.seen[rn, self.num_seen[rn]] = np.asarray(tokens, dtype=np.int64)[m][new]
                self.num_seen[rn] += 1

    # ---- a step ----------------------------------------------------------------------------------------------
    def any_active(self, rows: np.ndarray) -> bool:
        """True when some row of ``rows`` uses these parameters (the plain sampling paths must then step aside)."""
        return bool(self.active[rows].any())

    def any_consuming(self, rows: np.ndarray) -> bool:
        """True when some row of ``rows`` needs the id just drawn on the host before its next draw: bad words (the
        output's last tokens), a grammar (the matcher's state), penalties unless their counts advance at the draw
        (:meth:`use_draw_time_counts`). min_p, logit_bias and allowed_token_ids depend on the row's parameters
        alone."""
        if self.draw_counts is None and self.counting[rows].any():
            return True
        return bool(self.consumes_ids[rows].any())

    def batch(self, rows: np.ndarray) -> ProcessorBatch | None:
        """The processors' tensors for a batch of persistent ``rows`` [N] int64, or None when no row uses them.
        Cached while the rows and their admissions stay the same (steady decoding)."""
        if not self.active[rows].any():
            return None
        key = rows.tobytes()
        c = self._cache
        if c is not None and c[0] == key and c[1] == self._version:
            return c[2]
        b = self._build(rows)
        self._cache = (key, self._version, b)
        return b

    def _build(self, rows: np.ndarray) -> ProcessorBatch:
        N = len(rows)
        b = ProcessorBatch()
        act = np.nonzero(self.active[rows])[0]
        pen = np.nonzero(self.counting[rows])[0]
        if len(pen):
            b.pen_index, b.pen_rows = pen, rows[pen]
            b.repetition = torch.from_numpy(self.repetition[rows])
            b.frequency = torch.from_numpy(self.frequency[rows])
            b.presence = torch.from_numpy(self.presence[rows])
        mp = self.min_p[rows]
        if (mp > 0).any():
            b.min_p = torch.from_numpy(mp)
        gi = np.nonzero(self.has_grammar[rows])[0]
        if len(gi):
            b.grammar = (gi, rows[gi])
        bias_rows = [(i, self.bias[rows[i]]) for i in act if self.bias[rows[i]] is not None]
        if bias_rows:
            b.bias = (torch.from_numpy(np.concatenate([np.full(len(t), i) for i, (t, _) in bias_rows])),
                      torch.from_numpy(np.concatenate([t for _, (t, _) in bias_rows])),
                      torch.from_numpy(np.concatenate([v for _, (_, v) in bias_rows])))
        allow = [(i, self.allowed[rows[i]]) for i in act if self.allowed[rows[i]] is not None]
        if allow:
            b.allowed = allowed_token_mask(
                N, self.V, torch.tensor([i for i, _ in allow], dtype=torch.int64),
                torch.from_numpy(np.concatenate([np.full(len(a), i) for i, a in allow])),
                torch.from_numpy(np.concatenate([a for _, a in allow])))
        pairs = [(i, w) for i in act for w in (self.bad_words[rows[i]] or ())]
        if pairs:
            L = max(len(w) for _, w in pairs) - 1
            prefix = np.full((len(pairs), L), -1, dtype=np.int64)
            for k, (_, w) in enumerate(pairs):
                if len(w) > 1:
                    prefix[k, L - len(w) + 1:] = w[:-1]
            bi = np.array([i for i, _ in pairs], dtype=np.int64)
            b.bad = (bi, rows[bi], torch.tensor([w[-1] for _, w in pairs], dtype=torch.int64), prefix)
        return b

    def apply_verify(self, logits: torch.Tensor, rows: np.ndarray, lengths: np.ndarray, drafts: np.ndarray,
                     temperatures: torch.Tensor) -> torch.Tensor:
        """The processors for speculative verification: ``logits`` [N, K1, V] float32 at the K1 verified positions
        of N rows (persistent ``rows`` [N] int64), where position j follows the last sampled token and drafts
        1..j. ``lengths`` [N] int64: tokens known before the drafts (prompt + output); ``drafts`` [N, K1 - 1] int64
        (only each row's real drafts are ever read for a position verification uses; the drafts also sit in the
        token array at positions lengths .. lengths + K1 - 2, where bad words read them); ``temperatures`` [N]
        float32 (min_p's exponent; greedy rows count as 1).

        Position j gets what the plain sampler would give the same row after accepting drafts 1..j: masks and
        bias unchanged, bad words over the history with those drafts, penalties with the drafts counted as output
        tokens (the output counts themselves change only when tokens are emitted), min_p as ``min_p ** T`` before
        temperature (the sampler's form). Rows with structured outputs are never verified (their matchers see each
        token once). Logits on a GPU stay there (the host state reaches them as in :meth:`apply`). Returns the
        processed logits [N, K1, V] (modified in place)."""
        N, K1, V = logits.shape
        if not self.active[rows].any():
            return logits
        rep = np.repeat(rows, K1)
        b = self._build(rep)
        flat = logits.reshape(N * K1, V)
        lens = (lengths[:, None] + np.arange(K1)[None, :]).reshape(-1)
        pen = b.pen_index
        b.pen_index = None  # penalties below, with the drafts counted
        self.apply(flat, b, lens, cache=False)
        if pen is not None:
            self._verify_penalties(flat, b, pen, rep, drafts, K1)
        if b.min_p is not None:
            t = temperatures.repeat_interleave(K1)
            mp = b.min_p.pow(torch.where(t >= 1e-5, t, torch.ones_like(t)))
            flat = apply_min_p(flat, to_device(mp, flat.device))
        return flat.reshape(N, K1, V)

    def _verify_penalties(self, flat: torch.Tensor, b: ProcessorBatch, pen: np.ndarray, rep: np.ndarray,
                          drafts: np.ndarray, K1: int) -> None:
        """Penalties at the flat verification positions ``pen`` (rows ``rep[pen]``): for position j of row i the
        (token, count) pairs are the row's seen tokens and drafts 1..j, counts = output counts + occurrences among
        those drafts; then :func:`apply_penalties_at` (one call, O(pairs))."""
        V = flat.shape[1]
        prow = rep[pen]
        ns = self.num_seen[prow]
        keep = np.arange(max(int(ns.max()), 1))[None, :] < ns[:, None]
        li, col = np.nonzero(keep)
        base = pen[li] * V + self.seen[prow[li], col]
        i, j = pen // K1, pen % K1
        di, dk = np.nonzero(np.arange(max(K1 - 1, 1))[None, :] < j[:, None])  # drafts 1..j of position pen[di]
        extra = pen[di] * V + drafts[i[di], dk] if len(di) else np.zeros(0, dtype=np.int64)
        keys, extra_n = np.unique(np.concatenate([base, extra]), return_counts=True)
        in_base = np.isin(keys, base)
        extra_n = extra_n - in_base  # occurrences among the drafts (a seen token appears once in base)
        f, tok = keys // V, keys % V
        count = self.output_counts[torch.from_numpy(rep[f]), torch.from_numpy(tok)] + torch.from_numpy(
            extra_n.astype(np.int32))
        put = lambda t: to_device(t, flat.device)  # noqa: E731
        apply_penalties_at(flat, put(torch.from_numpy(f)), put(torch.from_numpy(tok)), put(count), put(b.repetition),
                           put(b.frequency), put(b.presence))

    def apply(self, logits: torch.Tensor, b: ProcessorBatch, lengths: np.ndarray, cache: bool = True) -> torch.Tensor:
        """Allowed-token and bad-word masks, logit bias, then penalties on ``logits`` [N, V] float32 (the batch's
        rows, modified in place where possible); ``lengths`` [N] int64 tokens known per row (prompt + output).
        Returns the processed logits; min-p comes later, after temperature (``b.min_p``). The grammar mask of rows
        with structured outputs comes first (vLLM applies it before its sampler).

        Logits on a GPU stay there: the row state lives on the host, and what a step needs of it (the batch's
        masks, bias and penalty values, cached with the batch; each step's seen-token pairs, their counts and the
        bad words' histories, O(seen tokens)) goes to the device by non-blocking copies; no step reads the device."""
        dev = logits.device
        put = lambda t: to_device(t, dev)  # noqa: E731
        if dev.type != "cpu":
            b = self._on_device(b, dev, cache)
        if b.grammar is not None:
            self.grammar.apply(logits, *b.grammar)
        if b.allowed is not None:
            apply_allowed_token_ids(logits, b.allowed)
        if b.bad is not None:
            bi, br, last, prefix = b.bad
            L = prefix.shape[1]
            pos = lengths[bi][:, None] - L + np.arange(L)[None, :]  # absolute positions of the last L tokens
            hist = np.where(pos >= self.num_prompt[br][:, None],
                            self.token_ids[br[:, None], np.maximum(pos, 0)], -2)
            apply_bad_words(logits, put(torch.from_numpy(bi)), put(last), put(torch.from_numpy(prefix)),
                            put(torch.from_numpy(hist)))
        if b.bias is not None:
            apply_logit_bias(logits, *b.bias)
        if b.pen_index is not None and self.draw_counts is not None:  # dense, from counts advanced at the draw
            self.draw_counts.apply(logits, b.pen_index, b.pen_rows, b.repetition, b.frequency, b.presence)
        elif b.pen_index is not None:  # the K distinct seen (row, token) pairs of the penalized rows
            ns = self.num_seen[b.pen_rows]
            width = int(ns.max())
            keep = np.arange(width)[None, :] < ns[:, None]
            li, col = np.nonzero(keep)
            tok = torch.from_numpy(self.seen[b.pen_rows[li], col])
            count = self.output_counts[torch.from_numpy(b.pen_rows[li]), tok]
            apply_penalties_at(logits, put(torch.from_numpy(b.pen_index[li])), put(tok), put(count), b.repetition,
                               b.frequency, b.presence)
        return logits

    def _on_device(self, b: ProcessorBatch, dev: torch.device, cache: bool = True) -> ProcessorBatch:
        """``b`` with its per-batch tensors on ``dev`` (copied once while the batch stays cached; numpy fields and
        the bad words' host tables stay on the host). ``cache`` False (a verification's one-off batch): copied
        without replacing the plain batch's cached copy."""
        c = self._device_cache
        if c is not None and c[0] is b and c[1] == dev:
            return c[2]
        put = lambda t: to_device(t, dev)  # noqa: E731
        d = ProcessorBatch(pen_index=b.pen_index, pen_rows=b.pen_rows, repetition=put(b.repetition),
                           frequency=put(b.frequency), presence=put(b.presence),
                           bias=None if b.bias is None else tuple(put(t) for t in b.bias), allowed=put(b.allowed),
                           bad=b.bad, min_p=put(b.min_p), grammar=b.grammar)
        if cache:
            self._device_cache = (b, dev, d)
        return d
