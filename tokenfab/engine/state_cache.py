"""Per-request recurrent-state slots for linear-attention (KDA) layers of hybrid models (Kimi Linear, Kimi K3).

MLA layers keep their per-token latents in the paged KV pool; a KDA layer keeps a fixed-size state per request
instead, whatever the sequence length:

* ``conv``: [num_slots, 3 * H * D, kernel - 1] in the activation dtype: the last ``kernel - 1`` inputs of the
  depthwise causal short convolution over the concatenated q | k | v projections (oldest first);
* ``recurrent``: [num_slots, H, D_k, D_v] float32: the gated-delta-rule state S (o_t = S_t^T q_t).

Slot = the sequence's scheduler ``row`` (``AttentionMetadata.state_rows``): rows are unique among running sequences,
so requests sharing a batch never touch each other's state. A slot is reset (zeroed) when its sequence runs its
position 0, which covers admission and re-admission after preemption (recompute from scratch); a freed row needs no
clearing because the next sequence in it starts at position 0. Chunked prefill carries the state across steps
because the slot persists while the sequence runs.

With decode graphs (engine/cuda_graph_runner.py) the caches hold one slot more, ``max_num_seqs``, which no
scheduler row names: the padding rows of a padded decode batch run at position 0 (a zero state, nothing read) and
write their state there, never into a real sequence's slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DeferredStates:
    """One KDA layer's group of a step whose speculative verification rows were *held*: the forward computed their
    outputs without writing their states, so that :func:`tokenfab.engine.state_commit.commit` can write the state
    after any prefix of the step's tokens by running the layer's conv and recurrence again over that prefix
    (``layer.commit_rows``). Everything kept is what the forward computed anyway, by reference: no state is copied.

    Attributes:
        layer: the :class:`~tokenfab.layers.kda.KimiDeltaAttention` that ran the group.
        token_index: [B, Q] int64 row of each of the group's tokens in ``qkv`` (padding: row T).
        query_pos: [B, Q] int64 position of each token, -1 at padding (valid tokens first).
        rows: [B] int64 state slots (scheduler rows).
        hold: [B] bool: the rows whose states the forward did not write.
        qkv: [T, 3HD] the step's q | k | v projections (the conv inputs; rows may be strided).
        gates: the layer call's gate inputs (``layers.kda._Gates``: g_raw [T, HD], b_raw [T, H]).
        rows_host, hold_host, tokens_host: ``rows``, ``hold`` and the valid tokens per row as numpy arrays when
            the runner gave them (its steps do), so the commit selects and checks its rows without reading the
            device; None otherwise.
        prepared: set where the layer ran its PyTorch forms: (conv window [B, 3HD, K - 1 + Q] = the conv state
            before the step then the step's inputs, and the recurrence inputs k, v, g [B, Q, H, D], beta [B, Q, H]
            float32), which the commit replays instead of running the conv again; None on the GPU path.
    """

    layer: object
    token_index: torch.Tensor
    query_pos: torch.Tensor
    rows: torch.Tensor
    hold: torch.Tensor
    qkv: torch.Tensor
    gates: object
    rows_host: np.ndarray | None = None
    hold_host: np.ndarray | None = None
    tokens_host: np.ndarray | None = None
    prepared: tuple | None = None


class KDAStateCache:
    """State slots of one KDA layer.

    Args:
        num_slots: rows (max_num_seqs).
        conv_dim: channels of the short convolution (3 * num_heads * head_dim).
        kernel: convolution taps; the conv state keeps ``kernel - 1`` inputs.
        num_heads, head_dim: KDA heads and their (key = value) width.
        dtype: activation dtype of the conv state; the recurrent state is always float32.
    """

    def __init__(self, num_slots: int, conv_dim: int, kernel: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        self.conv = torch.zeros(num_slots, conv_dim, max(kernel - 1, 0), dtype=dtype, device=device)
        self.recurrent = torch.zeros(num_slots, num_heads, head_dim, head_dim, dtype=torch.float32, device=device)
        # the fused decode launch's counters, one per batch row and head, left zero by every launch
        # (kernels/gpu/kda.py ``kda_decode_fused``)
        self.tickets = torch.zeros(num_slots * num_heads, dtype=torch.int32, device=device)
        self.deferred: list[DeferredStates] = []  # this step's held verification rows (engine/state_commit.py)

    @property
    def num_slots(self) -> int:
        return int(self.recurrent.shape[0])

    def nbytes_per_slot(self) -> int:
        """Bytes of one request's state in this layer."""
        return (self.conv[0].numel() * self.conv.element_size()
                + self.recurrent[0].numel() * self.recurrent.element_size())

    def read(self, rows: torch.Tensor, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the states of ``rows`` [B] (int64), zeros where ``fresh`` [B] (bool: the sequence starts at
        position 0 this step). Returns (conv [B, C, K-1], recurrent [B, H, D, D] float32)."""
        f = fresh.view(-1, 1, 1)
        conv = torch.where(f, torch.zeros((), dtype=self.conv.dtype, device=f.device), self.conv[rows])
        rec = torch.where(f.unsqueeze(-1), torch.zeros((), device=f.device), self.recurrent[rows])
        return conv, rec

    def read_conv(self, rows: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """The conv half of :meth:`read`: conv [B, C, K-1] of ``rows``, zeros where ``fresh``."""
        return torch.where(fresh.view(-1, 1, 1), torch.zeros((), dtype=self.conv.dtype, device=fresh.device),
                           self.conv[rows])

    def read_recurrent(self, rows: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """The recurrent half of :meth:`read`: a copy [B, H, D, D] float32 of ``rows``' states, zeros where
        ``fresh``."""
        return torch.where(fresh.view(-1, 1, 1, 1), torch.zeros((), device=fresh.device), self.recurrent[rows])

    def write(self, rows: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Store the states after this step for ``rows`` [B]."""
        self.conv[rows] = conv.to(self.conv.dtype)
        self.recurrent[rows] = recurrent.to(torch.float32)

    def write_recurrent(self, rows: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Store only the recurrent states of ``rows`` [B] (the short-conv kernel writes ``conv`` in place)."""
        self.recurrent[rows] = recurrent.to(torch.float32)

    def write_conv(self, rows: torch.Tensor, conv: torch.Tensor) -> None:
        """Store only the conv states of ``rows`` [B] (the fused recurrent kernel writes ``recurrent`` in place)."""
        self.conv[rows] = conv.to(self.conv.dtype)
