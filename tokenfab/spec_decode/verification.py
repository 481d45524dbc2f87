"""Which logits a verification step needs: the model runner's one hook for speculative rows."""
from __future__ import annotations

import numpy as np


def verification_rows(spec_lens: np.ndarray, num_new: np.ndarray, sampled_index: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split a step's logit rows between plain sampling and verification.

    Args:
        spec_lens: [B] int64 drafts appended per sequence (0: a plain row).
        num_new: [B] int64 tokens each sequence runs this step (a speculative row: its last sampled token and
            the drafts the token budget left, 1 + k_eff).
        sampled_index: indices of sequences the runner would sample at their last token.

    Returns:
        (sampled_index without speculative rows, their flat-batch token index (last token of each), the flat
        token indices of every token of every speculative row in batch order, [sum(num_new[spec])]).
    """
    cu = np.cumsum(num_new)
    starts = cu - num_new
    spec = spec_lens > 0
    keep = sampled_index[~spec[sampled_index]]
    si = np.nonzero(spec)[0]
    n = num_new[si]
    flat = np.repeat(starts[si], n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    return keep, cu[keep] - 1, flat.astype(np.int64)
