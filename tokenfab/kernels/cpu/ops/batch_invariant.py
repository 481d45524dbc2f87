"""Batch-invariant mode (csrc/batch_invariant.cpp): the calling thread's kernels reduce in an order independent of
the number of rows, a row's place among them and the thread count (docs/batch_invariance.md).
"""
from __future__ import annotations

import threading

import torch

from tokenfab.kernels.cpu import build


class batch_invariant:
    """Context manager: the calling thread's kernels run in batch-invariant mode inside it (``on=True``), restored
    on exit; ``on=False`` changes nothing.

    In that mode every kernel reduces in an order independent of the number of rows, a row's place among them and
    the thread count (csrc/batch_invariant.cpp): :func:`vnni_linear` (and everything built on it: the decode blocks,
    the MoE dispatch, the decode stack) runs oneDNN's brgemm tiles for every number of rows instead of switching to
    its GEMV at 4 rows and fewer (brgemm's order per output does not depend on the row count or the row's tile;
    the GEMV's differs from it), :func:`paged_decode_attention` never splits a context across threads, and the
    decode stack's MoE routers run :func:`rowwise_linear_f32`. The flag is per thread (the thread that steps the engine sets
    it), so engines in other threads keep their own mode. Python callers ask :func:`batch_invariant_active`.

    Raises:
        RuntimeError: ``on=True`` without built kernels.
    """

    def __init__(self, on: bool = True):
        self.on = bool(on)
        self._was: bool | None = None

    def __enter__(self) -> "batch_invariant":
        if self.on:
            m = build.load()
            if m is None:
                raise RuntimeError(f"batch-invariant mode needs tokenfab's CPU kernels ({build.load_error()})")
            self._was = m.set_batch_invariant(True)
            _mode.active = True
        return self

    def __exit__(self, *exc) -> None:
        if self._was is not None:
            build.load().set_batch_invariant(self._was)
            _mode.active = self._was
            self._was = None


_mode = threading.local()


def batch_invariant_active() -> bool:
    """True inside :class:`batch_invariant` (``on=True``) on this thread."""
    return getattr(_mode, "active", False)


def rowwise_linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w [E, K]^T in float32 -> [T, E] float32, each output one dot product in a fixed order (16-lane
    partial sums in four chains, one fixed reduction), so a row gets the same bits whatever T is; the routers' GEMM
    in batch-invariant mode (MKL's and oneDNN's GEMMs pick kernels, and so summation orders, by shape).

    Raises:
        RuntimeError: shapes or dtypes outside the above.
    """
    return build.load().rowwise_linear_f32(x, w)
