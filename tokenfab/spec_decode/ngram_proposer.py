"""N-gram prompt lookup (no model): the tokens that followed the latest earlier occurrence of the sequence's
suffix.

For each row, find the longest n in [prompt_lookup_min, prompt_lookup_max] such that the last n tokens occurred
before (ending at some position e <= len - 2), taking the latest such e among the longest matches, and propose
``tokens[e + 1 : e + 1 + k]`` (fewer when the history ends first). Vectorized over [N, L] with numpy: one pass
per suffix offset (at most prompt_lookup_max passes), no loop over rows or positions. Proposals are one-hot
(q = 1 for the drafted token): ``draft_probs`` is None.
"""
from __future__ import annotations

import numpy as np

from tokenfab.spec_decode.proposer import Proposal, Proposer


def ngram_lookup(tokens: np.ndarray, lengths: np.ndarray, n_min: int, n_max: int, k: int,
                 max_lens: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Batched prompt lookup.

    Args:
        tokens: [N, L] int64 token history per row (entries at or past ``lengths`` are ignored).
        lengths: [N] int64 tokens known per row.
        n_min, n_max: shortest / longest suffix matched (tokens).
        k: most drafts per row.
        max_lens: [N] optional cap on drafts per row.

    Returns:
        (draft_ids [N, k] int64 (0 where unused), draft_lens [N] int64).
    """
    N, L = tokens.shape
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.arange(L)
    valid = ends[None, :] <= lengths[:, None] - 2  # a continuation token exists after the match
    run = valid.copy()
    mlen = np.zeros((N, L), dtype=np.int64)
    r = np.arange(N)
    for i in range(n_max):
        src = ends - i
        shifted = np.where(src[None, :] >= 0, tokens[:, np.maximum(src, 0)], -1)
        tpos = lengths - 1 - i
        target = np.where(tpos >= 0, tokens[r, np.maximum(tpos, 0)], -2)
        run &= (shifted == target[:, None]) & (src[None, :] >= 0)
        if not run.any():
            break
        mlen += run
    score = np.where(mlen >= n_min, mlen * (L + 1) + ends[None, :], -1)
    best = score.argmax(axis=1)
    found = score[r, best] >= 0
    start = best + 1
    n = np.where(found, np.minimum(k, lengths - start), 0)
    if max_lens is not None:
        n = np.minimum(n, np.maximum(max_lens, 0))
    n = np.maximum(n, 0)
    idx = np.minimum(start[:, None] + np.arange(k)[None, :], L - 1)
    drafts = np.where(np.arange(k)[None, :] < n[:, None], tokens[r[:, None], idx], 0)
    return drafts.astype(np.int64), n.astype(np.int64)


class NgramProposer(Proposer):
    """Prompt-lookup drafter (``method: "ngram"``).

    Args:
        num_speculative_tokens: k.
        prompt_lookup_min, prompt_lookup_max: suffix lengths matched (tokens).
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.num_speculative_tokens = num_speculative_tokens
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, seqs, rows, token_ids, lengths, max_lens) -> Proposal:
        L = int(lengths.max()) if len(lengths) else 0
        if L < 2:
            return Proposal.empty(len(rows), self.num_speculative_tokens)
        drafts, n = ngram_lookup(token_ids[rows, :L], lengths, self.n_min, self.n_max, self.num_speculative_tokens,
                                 max_lens)
        return Proposal(drafts, n, None)
