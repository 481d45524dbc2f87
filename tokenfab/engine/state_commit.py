"""Commit the KDA recurrent state of speculative verification rows after acceptance is known.

A verification row of a hybrid model (Kimi Linear, Kimi K3) carries 1 + k tokens (its last sampled token and k
drafts) through every KDA layer. After acceptance of ``a`` drafts, its short-conv state and its gated-delta-rule
state S must be the state after the row's first ``a + 1`` tokens of the step. Unlike paged K/V (rejected rows are
simply overwritten later), the state has no per-position history.

Chosen: *hold, then commit*. During the verification forward the KDA layers compute every token's output as usual
but do not write the states of the rows marked in ``AttentionMetadata.state_hold`` (the short-conv and recurrence
kernels skip the store, the PyTorch forms write the old values back), and each layer appends a
:class:`~tokenfab.engine.state_cache.DeferredStates` entry to its cache: references to what the forward computed
anyway (the step's q | k | v projections, the gate inputs, the group's token rows and positions; on the PyTorch path
also its conv window and recurrence inputs). Then :func:`commit` (called once per verification step by
``ModelRunner.commit_state``, on every tensor-parallel rank) takes, per row, how many of its tokens stay (``a + 1``)
and writes the state after those tokens from the state still in the slot (``KimiDeltaAttention.commit_rows``): the
GPU path runs the short-conv and recurrence kernels again over the kept tokens, the PyTorch path slices the conv
window and replays the kept recurrence steps. Both are the operations plain decoding runs on the same inputs, so the
state equals a plain run's up to the rounding of the projections. No projection, attention or MLP runs again,
nothing is copied, and kept = 0 (a failed step) leaves the state as it was before the step by construction.

Why this shape (and not the alternatives):

* The previous design wrote every state in the forward, kept a copy of each verification row's state from before
  the step with its per-token inputs, and replayed the kept prefix of rejected rows
  (``git log -- tokenfab/engine/state_rollback.py``). The copy is one state per row and layer (K3: 96 heads of
  128 x 128 float32, 6 MiB per row and layer, 27 GiB for 64 rows over 69 layers); the replay was a Python loop of
  about ten launches per token and layer, and its row selection changed every step, so it could not be replayed
  from a CUDA graph. Here the GPU path holds about 96 KiB per token and layer at K3's width (the bf16 projections)
  and the commit is two launches per layer whose shapes depend only on the group: the decode-graph buffers capture it
  as one graph (engine/cuda_graph_runner.py, ``DecodeGraphRunner.commit``). Measured on CPU against
  the previous design (benchmarks/spec_state_commit.py beside ``git show 3a5857f:benchmarks/spec_rollback.py`` run
  on that commit's tree, alternated twice, Kimi Linear hidden 512, the first draft rejected: kept = 1): verified
  step + commit over a plain step in the same run was 1.73-3.12x at batch 16 (k = 1-7) against 1.81-3.26x with the
  roll back, and within noise at batch 1 (1.50-1.62x against 1.35-1.67x); all variants, this design alone:
  benchmarks/results/2026-12-06-spec-state-commit.md. The commit costs what the replay did, and also replays rows
  that kept every token, which the roll back skipped; the forward no longer copies states.
* Its cost on the GPU: each committed row runs its kept tokens' recurrence twice (forward and commit), reading S
  three times instead of twice; the recurrence is bound by the state's bytes, small beside a step's weights.
* One state snapshot per draft position, picked after sampling (vLLM's Mamba / GDN speculative decoding): (k + 1)
  states per row and layer; on CPU materializing them measured 1.2x to 1.9x the replay's time (2026-12-01, the
  roll back's results file, in git history).
"""
from __future__ import annotations

import numpy as np
import torch

from tokenfab.engine.state_cache import DeferredStates, KDAStateCache


def clear_deferred(caches: list[KDAStateCache]) -> None:
    """Forget what the previous step held (called before every forward)."""
    for c in caches:
        c.deferred.clear()


def kept_by_row(rows_host: np.ndarray, hold_host: np.ndarray, tokens_host: np.ndarray, rows: np.ndarray,
                kept: np.ndarray) -> np.ndarray:
    """Per row of a held group, the tokens the commit keeps: ``rows_host`` / ``hold_host`` / ``tokens_host`` [B]
    (the group's state slots, held flags and tokens run), ``rows`` / ``kept`` [N] int64 (the commit's). Returns
    [B] int64, -1 for rows not held or not named.

    Raises:
        ValueError: a kept count above the tokens its row ran."""
    table = np.full(int(max(rows_host.max(initial=0), np.asarray(rows).max(initial=0))) + 1, -1, dtype=np.int64)
    table[rows] = kept
    kk = np.where(hold_host, table[rows_host], -1)
    if (kk > tokens_host).any():
        raise ValueError("commit: kept exceeds the tokens a row ran this step "
                         f"(kept {kk.tolist()}, ran {np.asarray(tokens_host).tolist()}).")
    return kk


def _selected(e: DeferredStates, rows: torch.Tensor, kept: torch.Tensor, rows_host: np.ndarray | None,
              kept_host: np.ndarray | None, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(indices [n] into the entry's rows, their kept counts [n], the largest count) of the held rows the commit
    names, on the entry's device; None when it names none. From the host copies when both sides have them (no
    device read).

    Raises:
        ValueError: a kept count above the tokens its row ran."""
    if (rows_host is not None and kept_host is not None and e.rows_host is not None and e.hold_host is not None
            and e.tokens_host is not None):
        kk = kept_by_row(e.rows_host, e.hold_host, e.tokens_host, rows_host, kept_host)
        sel = np.nonzero(kk >= 0)[0]
        if len(sel) == 0:
            return None
        dev = e.rows.device
        put = (lambda a: torch.from_numpy(a)) if dev.type == "cpu" else \
            (lambda a: torch.from_numpy(a).to(dev, non_blocking=True))
        return put(sel), put(kk[sel]), int(kk[sel].max())
    by_row = torch.full((num_slots,), -1, dtype=torch.int64, device=e.rows.device)
    by_row[rows.to(by_row.device)] = kept.to(by_row.device)
    kk = torch.where(e.hold, by_row[e.rows], -1)
    ran = (e.query_pos >= 0).sum(1)
    if bool((kk > ran).any()):
        raise ValueError("commit: kept exceeds the tokens a row ran this step "
                         f"(kept {kk.tolist()}, ran {ran.tolist()}).")
    sel = (kk >= 0).nonzero().squeeze(1)
    if len(sel) == 0:
        return None
    return sel, kk[sel], int(kk[sel].max())


def commit(caches: list[KDAStateCache], rows: torch.Tensor, kept: torch.Tensor,
           rows_host: np.ndarray | None = None, kept_host: np.ndarray | None = None) -> int:
    """Write the state slots of ``rows`` as the states after their first ``kept`` tokens of the last step.

    Args:
        caches: the KDA layers' state caches (each with the ``deferred`` entries of the last forward).
        rows: [N] int64 state slots (scheduler rows) of verification rows (any device).
        kept: [N] int64 tokens of each row's step that stay, in [0, tokens it ran] (0: the state before the step,
            e.g. after a failed step). Rows the forward did not hold, or not named here, are left as they are.
        rows_host, kept_host: the same as int64 numpy arrays (the runner's): entries that carry their rows and
            token counts on the host are then selected and checked without reading the device; others read it.

    Returns:
        The number of (layer, row) states written.

    Raises:
        ValueError: ``kept`` above the tokens run for some row, or ``rows`` and ``kept`` of different lengths
            (nothing is written and the held entries stay, so a corrected call may follow).
    """
    if rows.shape != kept.shape:
        raise ValueError(f"commit: rows {tuple(rows.shape)} and kept {tuple(kept.shape)} must have one shape.")
    rh = None if rows_host is None else np.asarray(rows_host, dtype=np.int64)
    kh = None if kept_host is None else np.asarray(kept_host, dtype=np.int64)
    picks = [(c, e, _selected(e, rows, kept, rh, kh, c.num_slots)) for c in caches for e in c.deferred]
    n_done = 0
    for c, e, picked in picks:  # every count checked above: nothing is written when one is refused
        if picked is not None:
            sel, kk, steps = picked
            e.layer.commit_rows(e, c, sel, kk, steps)
            n_done += len(sel)
    clear_deferred(caches)
    return n_done
