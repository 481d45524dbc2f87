"""Shared pieces of the speculative-decoding tests (test_spec_decode.py, test_spec_mtp.py, test_spec_state_commit.py):
an n-gram config that drafts k every step, prompts with repeats, a random drafter and the token histograms the
distribution tests compare.

Import with ``from spec_helpers import ...`` (tests/ is on the path).
"""
from __future__ import annotations

import numpy as np

from tokenfab.spec_decode.proposer import Proposal, Proposer

# always draft k (the cost rule is tested on its own, in test_spec_decode.py)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "verify_token_cost": 0.0, "verify_step_overhead": 0.0, "random_row_cost": 0.0}


def spec_prompts(n: int = 4) -> list[dict]:
    """Mixed lengths (7 .. 34 tokens) with repeats, so n-gram lookup finds matches."""
    base = [11, 23, 37, 41, 53, 67, 79, 83, 97, 101, 113, 127]
    return [{"prompt_token_ids": (base[: 3 + i] * 8)[: 7 + 9 * i]} for i in range(n)]


def token_ids(outs) -> list[list[int]]:
    """The generated token ids of each RequestOutput."""
    return [o.outputs[0].token_ids for o in outs]


class RandomProposer(Proposer):
    """A bad drafter: uniformly random tokens (one-hot proposals)."""

    def __init__(self, k, V, seed=0):
        self.num_speculative_tokens, self.V = k, V
        self.rng = np.random.default_rng(seed)

    def propose(self, seqs, rows, token_ids, lengths, max_lens):
        d = self.rng.integers(0, self.V, size=(len(seqs), self.num_speculative_tokens))
        return Proposal(d.astype(np.int64), np.minimum(self.num_speculative_tokens, max_lens).astype(np.int64))


def token_hist(outs, pos: int, V: int) -> np.ndarray:
    """The empirical distribution over ``V`` values of output token ``pos`` across ``outs``."""
    h = np.zeros(V)
    for o in outs:
        h[o.outputs[0].token_ids[pos]] += 1
    return h / h.sum()
