"""Roll back the KDA recurrent state of speculative verification rows to the last accepted token.

A verification row of a hybrid model (Kimi Linear, Kimi K3) carries 1 + k tokens (its last sampled token and k
drafts) through every KDA layer, which advances the layer's short-conv state and its gated-delta-rule state S past
drafts that may be rejected. After acceptance of ``a`` drafts, the state must be the state after the row's first
``a + 1`` tokens of the step. Unlike paged K/V (rejected rows are simply overwritten later), the state has no
per-position history, so something has to be kept.

Chosen: keep the state before the step and replay the accepted prefix of the recurrence.

* During the verification forward each KDA layer appends to its cache's ``pending`` list
  (:class:`~tokenfab.engine.state_cache.PendingStates`), for the rows marked in ``AttentionMetadata.state_keep``:
  the recurrent state it read before the step (the copy ``KDAStateCache.read`` makes anyway), the short conv's input
  window (old conv state + the step's q | k | v projections) and the per-token recurrence inputs k, v, g, beta
  after the conv, normalization and gate, all of which the layer computes anyway. Cost: references plus one index
  copy of the marked rows; memory about 1x the recurrent state per row and layer, plus (k + 1) * (3HD + H) floats.
* :func:`roll_back` (called once per verification step by ``ModelRunner.roll_back_state``, on every tensor-parallel
  rank) takes, per row, how many of its tokens stay (``a + 1``). Rows that kept everything are left alone (the
  state written by the forward is already right). For the others the conv state is a slice of the kept window, and
  S is recomputed from the saved state by ``a + 1`` steps of :func:`~tokenfab.layers.kda.kda_recurrent_step`,
  vectorized over rows (rows with fewer kept tokens are masked with g = 0, beta = 0, which leaves S unchanged):
  exactly the operations plain decoding runs on the same inputs, so the rolled-back state equals a plain run's up
  to the rounding of the projections. No projection, conv or MLA layer runs again: the replay is a KDA-only,
  recurrence-only "extra short forward" of at most k + 1 tokens.

Not chosen (measured in benchmarks/results/2026-12-01-spec-rollback.md):

* one state snapshot per draft position, picked after sampling: the verification forward would have to
  materialize S after each of its 1 + k tokens (the chunked WY form computes only the final state) and keep them
  until acceptance: (k + 1) x the recurrent state per row and layer (k = 7: 8x; for Kimi Linear 48B, 32 heads of
  128 x 128 float32 = 2 MiB per layer, about 16 MiB per row per layer), versus 1x here. Its step time saves the
  replay but pays 1 + k full state writes per row and layer instead of at most k recurrence steps on rejected
  rows only. Measured on a hidden-512 Kimi Linear (3 KDA layers of 8 x 64): kept per row for k = 7, 709 KiB
  here against 3,504 KiB of snapshots; per layer, materializing the snapshots took 1.2x to 1.9x the replay's
  worst case (kept = k), batch 1 and 16, k = 1, 3, 7.
* chunked kernels emitting intermediate states: the same memory as snapshots, and a kernel change.
"""
from __future__ import annotations

import numpy as np
import torch

from tokenfab.engine.state_cache import KDAStateCache
from tokenfab.layers.kda import kda_recurrent_step


def clear_pending(caches: list[KDAStateCache]) -> None:
    """Forget what the previous step kept (called before every forward)."""
    for c in caches:
        c.pending.clear()


def roll_back(caches: list[KDAStateCache], rows: torch.Tensor, kept: torch.Tensor,
              rows_host: np.ndarray | None = None, kept_host: np.ndarray | None = None) -> int:
    """Restore the state slots of ``rows`` to the state after their first ``kept`` tokens of the last step.

    Args:
        caches: the KDA layers' state caches (each with the ``pending`` entries of the last forward).
        rows: [N] int64 state slots (scheduler rows) of verification rows (any device: moved to the caches' where
            they are read).
        kept: [N] int64 tokens of each row's step that stay in the state, in [0, tokens it ran] (0 restores the
            state before the step, e.g. after a failed step). Rows not in a pending entry, or keeping all their
            tokens, are left as the forward wrote them.
        rows_host, kept_host: the same as int64 numpy arrays (the runner's): entries that carry their rows and
            token counts on the host (PendingStates.rows_host) are then selected and sized without reading the
            device; others read it.

    Returns:
        The number of (layer, row) states rewritten.

    Raises:
        ValueError: ``kept`` outside [0, tokens run] for some row, or ``rows`` and ``kept`` of different lengths.
    """
    if rows.shape != kept.shape:
        raise ValueError(f"roll_back: rows {tuple(rows.shape)} and kept {tuple(kept.shape)} must have one shape.")
    by_host = None if rows_host is None or kept_host is None else dict(zip(np.asarray(rows_host).tolist(),
                                                                             np.asarray(kept_host).tolist()))
    n_done = 0
    for c in caches:
        by_row = None
        for e in c.pending:
            if by_host is not None and e.rows_host is not None and e.num_tokens_host is not None:
                kk_h = np.array([by_host.get(r, -1) for r in e.rows_host.tolist()], dtype=np.int64)
                if (kk_h > e.num_tokens_host).any():
                    raise ValueError("roll_back: kept exceeds the tokens a row ran this step "
                                     f"(kept {kk_h.tolist()}, ran {e.num_tokens_host.tolist()}).")
                sel_h = np.nonzero((kk_h >= 0) & (kk_h < e.num_tokens_host))[0]
                if len(sel_h) == 0:
                    continue
                dev = e.rows.device
                put = (lambda a: torch.from_numpy(a)) if dev.type == "cpu" else \
                    (lambda a: torch.from_numpy(a).to(dev, non_blocking=True))
                sel, kk, steps = put(sel_h), put(kk_h[sel_h]), int(kk_h[sel_h].max())
            else:
                if by_row is None:
                    by_row = torch.full((c.num_slots,), -1, dtype=torch.int64, device=c.recurrent.device)
                    by_row[rows.to(by_row.device)] = kept.to(by_row.device)
                kk = by_row[e.rows]
                if bool((kk > e.num_tokens).any()):
                    raise ValueError("roll_back: kept exceeds the tokens a row ran this step "
                                     f"(kept {kk.tolist()}, ran {e.num_tokens.tolist()}).")
                sel = ((kk >= 0) & (kk < e.num_tokens)).nonzero().squeeze(1)
                if len(sel) == 0:
                    continue
                kk = kk[sel]
                steps = int(kk.max())
            win = e.conv_window[sel]
            km1 = win.shape[2] - e.k.shape[1]  # kernel - 1
            take = (kk.view(-1, 1) + torch.arange(km1, device=kk.device).view(1, -1)).unsqueeze(1)
            conv = win.gather(2, take.expand(len(sel), win.shape[1], km1))
            S = e.state[sel]
            k, v, g, beta = e.k[sel], e.v[sel], e.g[sel], e.beta[sel]
            for j in range(steps):
                m = (kk > j).view(-1, 1, 1)  # rows still replaying; the others: g = 0, beta = 0 (S unchanged)
                _, S = kda_recurrent_step(k[:, j], k[:, j], v[:, j], torch.where(m, g[:, j], 0.0),
                                          torch.where(m.view(-1, 1), beta[:, j], 0.0), S)
            c.write(e.rows[sel], conv, S)
            n_done += len(sel)
        c.pending.clear()
    return n_done
