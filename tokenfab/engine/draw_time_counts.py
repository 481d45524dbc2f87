"""Penalty counts that advance with the draw, where the logits are: what lets async scheduling run penalized rows.

The host form of the penalties (:class:`~tokenfab.engine.logits_state.LogitsProcessorState`) counts a row's output
tokens when their ids reach the host (``record``), so a step can be scheduled only after its predecessor's ids
arrived. Here each penalized row keeps, on the logits' device, dense output counts [rows, V] int32 and a prompt mask
[rows, V] bool (as vLLM's GPU penalties do): admission writes a row from its token list, every draw adds its ids
to its rows' counts right after the draw (one scatter on the device, ordered before the next step's logits on the
same stream), and a step applies the penalties densely over its penalized rows. A step launched before its
predecessor's ids reached the host thus sees them counted, and no host state depends on them.

The formula is the host form's (:func:`~tokenfab.engine.logits_processors.apply_penalties_at`, vLLM's): for every
token seen in the prompt or the output, repetition r divides a positive logit and multiplies a negative one; then
``frequency * count`` and ``presence * (count > 0)`` are subtracted (counts over the output only). The same float32
operations on the same values, so the tokens and logprobs equal the host form's bit for bit.

Memory: 5 bytes per (row, vocabulary entry), allocated at the first penalized admission (max_num_seqs 256 and a
163,840-entry vocabulary: 210 MB).
"""
from __future__ import annotations

import numpy as np
import torch

from tokenfab.engine.input_staging import to_device


class DrawTimeCounts:
    """Dense output counts and prompt masks of every row on ``device`` (module docstring).

    Args:
        num_rows: persistent rows (max_num_seqs). vocab_size: V. device: the logits' device.
    """

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device):
        self.num_rows, self.V, self.device = int(num_rows), int(vocab_size), torch.device(device)
        self.counts: torch.Tensor | None = None  # [rows, V] int32, made at the first penalized admission
        self.prompt: torch.Tensor | None = None  # [rows, V] bool

    def admit(self, row: int, token_ids: np.ndarray, num_prompt: int) -> None:
        """Row ``row`` from its sequence's token list ``token_ids`` [L] int64 (prompt first, ``num_prompt`` long;
        every id known: admission follows the fill of any step in flight)."""
        if self.counts is None:
            self.counts = torch.zeros(self.num_rows, self.V, dtype=torch.int32, device=self.device)
            self.prompt = torch.zeros(self.num_rows, self.V, dtype=torch.bool, device=self.device)
        t = torch.from_numpy(np.ascontiguousarray(token_ids, dtype=np.int64))
        counts = torch.bincount(t[num_prompt:], minlength=self.V).to(torch.int32)
        prompt = torch.zeros(self.V, dtype=torch.bool)
        prompt[t[:num_prompt]] = True
        self.counts[row].copy_(counts)
        self.prompt[row].copy_(prompt)

    def advance(self, rows: np.ndarray, ids: torch.Tensor, index: np.ndarray) -> None:
        """After a draw: count ``ids`` [N] int64 (on the device, as drawn) at the batch positions ``index`` [n]
        int64 whose persistent rows are ``rows`` [n] int64 (the penalized rows of the batch). No host sync."""
        if self.counts is None or len(index) == 0:
            return
        r = to_device(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)), self.device)
        i = to_device(torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)), self.device)
        self.counts.index_put_((r, ids[i]), torch.ones(len(index), dtype=torch.int32, device=self.device),
                               accumulate=True)

    def apply(self, logits: torch.Tensor, index: np.ndarray, rows: np.ndarray, repetition: torch.Tensor,
              frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
        """The penalties on ``logits`` [N, V] float32 at batch positions ``index`` [n] int64 (persistent ``rows``
        [n] int64), in place; ``repetition`` / ``frequency`` / ``presence`` [N] float32 by batch position (on the
        logits' device). Returns ``logits``."""
        i = to_device(torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)), logits.device)
        r = to_device(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)), logits.device)
        vals = logits[i]
        c = self.counts[r].to(logits.dtype)
        seen = self.prompt[r] | (c > 0)
        rep = repetition.to(logits.dtype)[i].unsqueeze(1)
        vals = torch.where(seen, torch.where(vals > 0, vals / rep, vals * rep), vals)
        vals = vals - frequency.to(logits.dtype)[i].unsqueeze(1) * c
        vals = vals - presence.to(logits.dtype)[i].unsqueeze(1) * (c > 0).to(logits.dtype)
        logits[i] = vals
        return logits
