"""Linear layers whose weights come from a checkpoint (no random init: parameters start empty).

On CPU in bfloat16, weights are repacked once after loading into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and run with ``torch.ops.mkldnn._linear_pointwise``, the kernels
PyTorch's inductor uses for frozen CPU linears: about 1.5-2.5x faster than ``F.linear`` at decode shapes here
(benchmarks/NOTES.md). Set ``TOKENFAB_MKLDNN_LINEAR=0`` to compare against plain ``F.linear``.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    """True when ``weight`` (bf16 on CPU) can use the packed oneDNN linear in this torch build."""
    return (os.environ.get("TOKENFAB_MKLDNN_LINEAR", "1") != "0" and weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16 and weight.dim() == 2 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] bf16 -> opaque oneDNN-blocked tensor for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] bf16 -> [..., out] with a weight packed by :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Module):
    """y = x W^T (+ b). ``weight`` [out_features, in_features], as in nn.Linear and HF checkpoints.

    Parameters are allocated uninitialized (``torch.empty``): the loader fills every one of them or fails.
    After loading, :meth:`fuse` may replace ``weight`` by a packed copy (CPU, bf16); the plain weight is freed.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._packed: torch.Tensor | None = None

    def fuse(self) -> None:
        """Pack the weight for the oneDNN kernel when possible (called once after loading)."""
        # A one-row weight is a vector read directly by its owner (e.g. K3's attention-residual pseudo-query);
        # packing a GEMV of one output gains nothing, so it stays a plain parameter.
        if (self._packed is None and self.weight is not None and self.weight.numel() and self.out_features > 1
                and can_pack(self.weight)):
            self._packed = pack_weight(self.weight)
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return packed_linear(x, self._packed, self.bias)
        return F.linear(x, self.weight, self.bias)
