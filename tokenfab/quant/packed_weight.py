"""The weight-format seam: how a :class:`~tokenfab.layers.linear.Linear` stores and multiplies a compressed weight.

A Linear either holds a plain ``weight`` parameter (bf16 / fp32, optionally repacked for the CPU kernels by
``Linear.fuse``) or a :class:`PackedWeight`: an object that owns the compressed bytes (as buffers, so
``model.to(device)`` moves them) and computes ``x W^T + b`` from them. The format is fixed when the checkpoint is
read (the loader hands the model PackedWeights instead of tensors); which kernel a format runs is decided once, in
:meth:`PackedWeight.prepare` after loading, never per call in the model code. Every format has a plain-PyTorch
reference (:meth:`PackedWeight.dequantize` then ``F.linear``) that its fast path is tested against.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

REFERENCE_ROWS = 1024  # rows dequantized at a time by the PyTorch path (a multiple of FP8's 128-row blocks)


class PackedWeight(nn.Module):
    """A weight W [out_features, in_features] in a compressed format. Subclasses implement :meth:`linear`,
    :meth:`dequantize_rows`, :attr:`nbytes` and, where rows can be joined, :meth:`concat`."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.out_features, self.in_features = int(out_features), int(in_features)

    @property
    def nbytes(self) -> int:
        """Bytes resident for this weight (the compressed data and its scales)."""
        raise NotImplementedError

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x W^T (+ bias): x [..., in_features] -> [..., out_features] in x's dtype (float32 accumulation, one
        rounding per output)."""
        raise NotImplementedError

    def linear_f32(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W^T (+ bias) as float32, never rounded to x's dtype (an LM head's logits). This default runs
        :meth:`reference_linear` unrounded; formats whose kernels can store their float32 accumulator override it."""
        return self.reference_linear(x, bias, out_dtype=torch.float32)

    def reference_linear(self, x: torch.Tensor, bias: torch.Tensor | None,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The plain-PyTorch path every format has: float32 ``F.linear`` over REFERENCE_ROWS dequantized rows at a
        time (never a full-size float copy), + bias in float32, one rounding to ``out_dtype`` (default x's dtype)."""
        xf = x.float()
        ys = [F.linear(xf, self.dequantize_rows(s, min(s + REFERENCE_ROWS, self.out_features)).to(x.device))
              for s in range(0, self.out_features, REFERENCE_ROWS)]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype or x.dtype)

    def dequantize_rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of W as float32 [end - start, in_features], exactly as the format defines them."""
        raise NotImplementedError

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (int64, any shape) of W as an embedding table: ids.shape + [in_features] in ``dtype``, each
        value the format's float32 value rounded once. This default dequantizes one row per id (formats override
        it with a batched kernel)."""
        flat = ids.reshape(-1).tolist()
        rows = [self.dequantize_rows(i, i + 1) for i in flat]
        out = torch.cat(rows) if rows else torch.empty(0, self.in_features)
        return out.to(dtype).reshape(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """All of W as float32 [out_features, in_features] (tests and references; a full-size copy)."""
        return self.dequantize_rows(0, self.out_features)

    def prepare(self) -> None:
        """Choose the fast path for the current device and engine settings (called once by ``Linear.fuse``)."""

    @classmethod
    def concat(cls, weights: Sequence[PackedWeight]) -> PackedWeight | None:
        """One weight over the concatenated rows of ``weights`` (which share in_features), or None when this format
        cannot join them (then the Linears stay separate)."""
        return None

    def extra_repr(self) -> str:
        return f"out_features={self.out_features}, in_features={self.in_features}, nbytes={self.nbytes}"
