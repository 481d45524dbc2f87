"""The weight-format seam: how a :class:`~tokenfab.layers.linear.Linear` stores and multiplies a compressed weight.

A Linear either holds a plain ``weight`` parameter (bf16 / fp32, optionally repacked for the CPU kernels by
``Linear.fuse``) or a :class:`PackedWeight`: an object that owns the compressed bytes (as buffers, so
``model.to(device)`` moves them) and computes ``x W^T + b`` from them. The format is fixed when the checkpoint is
read (the loader hands the model PackedWeights instead of tensors); which kernel a format runs is decided once, in
:meth:`PackedWeight.prepare` after loading, never per call in the model code. Every format has a plain-PyTorch
reference (:meth:`PackedWeight.dequantize` then ``F.linear``) that its fast path is tested against.

Where no packed kernel runs a weight on the CPU (kernels not built, ``TOKENFAB_CPU_LINEAR=torch``; GGUF and FP8
have AVX512-BF16 kernels and AVX2 ones, NOTES 84), :meth:`PackedWeight.keep_dense_copy` dequantizes it once into
float32 and the reference path multiplies that copy, while this process's copies total at most
``TOKENFAB_DENSE_FALLBACK_GIB`` (default 4; 0: never), so a packed file costs there what its float32 twin does
instead of a dequantization per call (NOTES 79). Past the budget the remaining weights dequantize REFERENCE_ROWS
rows per call.
"""
from __future__ import annotations

import os
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.kernels import dispatch

REFERENCE_ROWS = 1024  # rows dequantized at a time by the PyTorch path (a multiple of FP8's 128-row blocks)
DENSE_FALLBACK_ENV = "TOKENFAB_DENSE_FALLBACK_GIB"
_DENSE_BYTES = [0]  # float32 copies held by live weights in this process (keep_dense_copy)


def dense_fallback_budget() -> int:
    """``TOKENFAB_DENSE_FALLBACK_GIB`` in bytes (default 4 GiB; 0 turns the float32 copies off).

    Raises:
        EngineConfigError: a value that is not a non-negative number.
    """
    raw = os.environ.get(DENSE_FALLBACK_ENV, "4")
    try:
        gib = float(raw)
    except ValueError:
        gib = -1.0
    if not gib >= 0:
        from tokenfab.errors import EngineConfigError
        raise EngineConfigError(f"{DENSE_FALLBACK_ENV}={raw!r}: use a number of GiB >= 0 (0: no float32 copies of "
                                "packed weights without a kernel).")
    return int(gib * 2 ** 30)


def _release(total: list[int], nbytes: int) -> None:
    total[0] -= nbytes


class PackedWeight(nn.Module):
    """A weight W [out_features, in_features] in a compressed format. Subclasses implement :meth:`linear`,
    :meth:`dequantize_rows`, :attr:`nbytes` and, where rows can be joined, :meth:`concat`."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.out_features, self.in_features = int(out_features), int(in_features)
        self._dense: torch.Tensor | None = None  # float32 [out, in] where keep_dense_copy made one

    def keep_dense_copy(self) -> bool:
        """For a weight no packed kernel runs, whose buffers are on the CPU path (not the GPU code path's): dequantize
        it once into a float32 copy that :meth:`reference_linear` multiplies from then on (the same float32 values
        it dequantizes per call), unless that would take this process's copies past :func:`dense_fallback_budget`.
        Formats call it from :meth:`prepare` where their kernel does not apply. Returns whether a copy is held.

        Raises:
            EngineConfigError: a bad ``TOKENFAB_DENSE_FALLBACK_GIB``.
        """
        if self._dense is not None:
            return True
        first = next(iter(self.buffers()), None)
        if first is None or first.device.type != "cpu" or dispatch.gpu_path(first):
            return False
        nbytes = self.out_features * self.in_features * 4
        if _DENSE_BYTES[0] + nbytes > dense_fallback_budget():
            return False
        self._dense = self.dequantize().contiguous()
        _DENSE_BYTES[0] += nbytes
        weakref.finalize(self, _release, _DENSE_BYTES, nbytes)
        return True

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
        time (or over the float32 copy :meth:`keep_dense_copy` made), + bias in float32, one rounding to
        ``out_dtype`` (default x's dtype)."""
        xf = x.float()
        if self._dense is not None and self._dense.device == x.device:
            y = F.linear(xf, self._dense)
        else:
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
