"""Verification through the fused CPU decode stack: a row verifying k drafts becomes k + 1 one-token decode rows.

A verification row of sequence s covers positions P .. P + k (its last sampled token and k drafts). Decode row j
of it has query position P + j, context length P + j + 1 and s's block table. The decode stack writes every row's
K/V for a layer before that layer's attention (one fused attention call per layer over all rows), so row j sees
the K/V of positions P .. P + j - 1 written by rows 0 .. j - 1 in the same layer, and nothing past P + j: exactly
the causal attention of a 1 + k-token chunk over the paged context. The verification step thus costs a decode step
over B * (1 + k) rows, whose weight stream is shared by all rows, instead of a module-path prefill (no C++ change:
the stack already takes per-row positions, context lengths and block tables).

Used by the speculative step when every row of the batch is a decode row (plain or verifying, none cut short by
the token budget) whose sampling the rejection sampler reproduces, on a model the stack covers; otherwise the
module path runs (model_runner's verification hook).
"""
from __future__ import annotations

import numpy as np
import torch


def fused_verify_logits(runner, batch) -> torch.Tensor:
    """Logits [sum(num_new), V] float32 at every token of every row of ``batch`` (rows in order, tokens in order),
    computed by ``runner.cpu_decode_stack`` over one-token rows; writes their K/V like any step."""
    n = batch.num_new
    T = int(n.sum())
    starts = np.cumsum(n) - n
    req = np.repeat(np.arange(len(n)), n)
    positions = batch.num_computed[req] + np.arange(T) - starts[req]
    rows = batch.rows[req]
    input_ids = runner.token_ids[rows, positions]
    bt = runner.bm.block_tables[rows]
    slots = runner._slots(bt, np.arange(T), positions)
    if runner._threads is not None:
        runner._apply_thread_policy(False)
    runner.captured = None
    with torch.inference_mode():
        hidden = runner.cpu_decode_stack.run(input_ids, positions, slots, bt, positions + 1)
        if runner.capture is not None:  # the target-hidden-state seam (final states only: no taps here)
            runner._hidden_now = (hidden, None)
            runner.keep_captured(batch.seqs, batch.rows, req, positions)
        return runner.model.compute_logits(hidden).float().cpu()
