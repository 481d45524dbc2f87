"""The proposer seam: what every drafter returns for a batch of running sequences."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Proposal:
    """Draft tokens for N sequences.

    Attributes:
        draft_ids: [N, k] int64; row i's drafts are ``draft_ids[i, :draft_lens[i]]`` (the rest is padding).
        draft_lens: [N] int64 in [0, k]; 0 = no draft for that row this step.
        draft_probs: [N, k, V] float32, the distribution q each draft token was drawn from (after the request's
            temperature / top-k / top-p), or None when every proposal is deterministic (one-hot q: n-gram lookup,
            greedy draft rows). Rows at temperature 0 are verified greedily and ignore it.
    """

    draft_ids: np.ndarray
    draft_lens: np.ndarray
    draft_probs: torch.Tensor | None = None

    @staticmethod
    def empty(n: int, k: int) -> "Proposal":
        return Proposal(np.zeros((n, k), dtype=np.int64), np.zeros(n, dtype=np.int64), None)


class Proposer:
    """Interface of a drafter.

    ``propose(seqs, rows, token_ids, lengths, max_lens)``: ``seqs`` the N running sequences to draft for (each
    with its last sampled token not yet in the KV cache), ``rows`` [N] their rows in ``token_ids`` (the model
    runner's persistent [rows, max_model_len + 1] int64 token array, prompt and output), ``lengths`` [N] their
    token counts, ``max_lens`` [N] the most drafts each may get (what max_tokens and max_model_len leave).
    Returns a :class:`Proposal` with ``draft_lens <= max_lens``.

    ``on_verified(seqs, num_accepted)``: after verification, how many drafts of each proposed row were accepted
    (int64 [N]; rows not verified this step count 0), so stateful drafters roll back.
    """

    num_speculative_tokens: int

    def propose(self, seqs, rows: np.ndarray, token_ids: np.ndarray, lengths: np.ndarray,
                max_lens: np.ndarray) -> Proposal:
        raise NotImplementedError

    def on_verified(self, seqs, num_accepted: np.ndarray) -> None:
        return None

    def preallocates_kv(self) -> bool:
        """True when proposing writes KV rows (a draft model): the caller reserves the verification blocks first."""
        return False
