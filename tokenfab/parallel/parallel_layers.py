"""Layers that change shape or add a collective under tensor parallelism.

Convention for decoder layers (tokenfab/models/llama.py ``DecoderLayer``): attention and MLP/MoE modules built
under a :class:`TPContext` return *partial sums* ``[T, hidden]`` (their last projection is row-parallel: this rank's
input columns only) and the decoder layer all-reduces each once. Row-parallel biases are loaded on rank 0 only
(other ranks hold zeros, see :func:`tokenfab.parallel.sharded_loading.iterate_rank_weights`), so the sum adds
them exactly once. Column-parallel layers are plain :class:`tokenfab.layers.linear.Linear` built with this rank's
output rows. New model families follow the same convention.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.layers.linear import matmul_f32
from tokenfab.parallel.distributed import TPContext


class _VocabRows(nn.Module):
    """Rows ``[v0, v1)`` of a vocabulary-by-hidden weight on this rank: ``weight`` [v1 - v0, hidden]."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.v0, self.v1 = tp.r("vocab")
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(self.v1 - self.v0, hidden), requires_grad=False)


class VocabParallelEmbedding(_VocabRows):
    """Embedding rows ``[v0, v1)`` of the vocabulary on this rank; ids outside give zeros, then an all-reduce.

    ``weight`` [v1 - v0, hidden] (checkpoint name unchanged: ``model.embed_tokens.weight``, sliced on dim 0).
    input_ids [T] int64 -> [T, hidden], identical on every rank.
    """

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.v0
        outside = (local < 0) | (local >= self.v1 - self.v0)
        h = F.embedding(local.masked_fill(outside, 0), self.weight) if self.weight.shape[0] else \
            self.weight.new_zeros(input_ids.shape[0], self.weight.shape[1])
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(h)


class ParallelLMHead(_VocabRows):
    """lm_head rows ``[v0, v1)``: local logits [N, v1 - v0], gathered to rank 0 as [N, vocab].

    Other ranks get an empty tensor back (only rank 0 samples). ``weight`` [v1 - v0, hidden].
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = matmul_f32(hidden, self.weight)  # float32 from the accumulator, as compute_logits
        return self.tp.gather_rows_to_rank0(local, self.vocab_size)
