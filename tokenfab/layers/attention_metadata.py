"""Per-step attention metadata: how the flat token batch maps onto sequences and the paged KV pool.

A step's tokens are flattened into one batch of T tokens: decode tokens first (one per sequence), then the prefill
chunks. The model runner builds this once per step with vectorized numpy; every attention layer reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionGroup:
    """Sequences attended together, queries padded to ``q_len``.

    Attributes:
        token_index: [B, q_len] int64 index into the flat batch (T) of each query, or T (a padding row) when the
            sequence has fewer than q_len new tokens.
        query_pos: [B, q_len] int64 absolute position of each query; -1 for padding.
        block_tables: [B, max_blocks] int64 KV-pool block ids of each sequence (0-padded).
        context_lens: [B] int64 tokens in the cache after this step's writes.
        q_len: padded query length (1 for the decode group).
        max_context: tokens to gather per sequence (max_blocks * block_size), >= max(context_lens).
        flat_range: (start, end) when the group's queries are exactly flat-batch rows start..end-1 in [B, q_len]
            order with no padding (always for the decode group; for a prefill group of one sequence), so layers
            can slice instead of gather/scatter; None otherwise.
    """

    token_index: torch.Tensor
    query_pos: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    q_len: int
    max_context: int
    flat_range: tuple[int, int] | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[0])



@dataclass
class AttentionMetadata:
    """Everything attention layers need for one step.

    Attributes:
        slot_mapping: [T] int64 flat KV-pool slot (block_id * block_size + offset) where each token's K/V is written.
        decode: group of sequences with exactly one new token (q_len 1), or None.
        prefill: group of sequences with a prefill chunk (q_len = longest chunk), or None.
        num_tokens: T.
        block_size: tokens per KV block.
        state_rows: [B] int64 scheduler row of each sequence (decode group first, then prefill), the index of its
            recurrent-state slot in hybrid models (engine/state_cache.py); None when not provided.
        state_hold: [B] bool, aligned with ``state_rows``: speculative verification rows whose recurrent states
            the KDA layers hold (do not write) until the commit after acceptance writes the state after the kept
            prefix of this step's tokens (engine/state_commit.py); None when no row needs it.
        state_hold_host: [B] bool numpy, the same rows on the host, ``num_new_host`` [B] int64 numpy, the tokens
            each sequence runs this step, and ``state_rows_host`` [B] int64 numpy, ``state_rows`` on the host: what
            the KDA layers decide by, and the commit selects and checks by, without reading the device (one read
            per layer would drain a GPU's queue); None where not provided.
        state_group: the recurrent-state (KDA) layers' own view of the step when it differs from the attention
            groups: the decode-graph buffers run speculative verification rows of a hybrid model with every token a
            decode row of its own for attention (``decode``) while the KDA layers walk each sequence's tokens in
            order, [B, Q] (engine/cuda_graph_runner.py); ``state_rows`` / ``state_hold`` then align with its B
            rows. None: the KDA layers use ``decode`` and ``prefill``.
    """

    slot_mapping: torch.Tensor
    decode: AttentionGroup | None
    prefill: AttentionGroup | None
    num_tokens: int
    block_size: int
    state_rows: torch.Tensor | None = None
    state_hold: torch.Tensor | None = None
    state_hold_host: np.ndarray | None = None
    num_new_host: np.ndarray | None = None
    state_rows_host: np.ndarray | None = None
    state_group: AttentionGroup | None = None

    def cpu_decode_block(self, x: torch.Tensor, cache: torch.Tensor) -> bool:
        """True when an attention layer may run this step as one fused CPU call (``cpu_decode_blocks.mla_decode`` /
        ``gqa_decode``): a decode-only step (no prefill group) with bf16 activations ``x`` and KV pool ``cache``
        on CPU."""
        return (self.prefill is None and self.decode is not None and x.dtype == torch.bfloat16
                and cache.dtype == torch.bfloat16 and x.device.type == "cpu")
