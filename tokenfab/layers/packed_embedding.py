"""A token embedding whose table stays in a compressed format (a GGUF file's quantized ``token_embd``): lookups
dequantize only the rows asked for, and a tied LM head multiplies the same packed bytes
(:class:`~tokenfab.quant.packed_weight.PackedWeight`), so no full-size float copy of the table is ever resident."""
from __future__ import annotations

import torch
from torch import nn

from tokenfab.quant.packed_weight import PackedWeight


class PackedEmbedding(nn.Module):
    """ids (int64, any shape) -> ids.shape + [embedding_dim] in ``dtype``, from ``qweight`` [num_embeddings,
    embedding_dim] (rows = tokens)."""

    def __init__(self, qweight: PackedWeight, dtype: torch.dtype):
        super().__init__()
        self.qweight = qweight
        self.num_embeddings, self.embedding_dim = qweight.out_features, qweight.in_features
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.embedding(ids, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.dtype}"
