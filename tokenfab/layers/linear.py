"""Linear layers whose weights come from a checkpoint (no random init: parameters start empty).

On CPU in bfloat16, weights are repacked once after loading, by the backend ``TOKENFAB_CPU_LINEAR`` names:

* ``tokenfab`` (default): tokenfab's VNNI blocks (``kernels/cpu/csrc/vnni_linear.cpp``) when the CPU kernels are built
  with AVX512-BF16, else ``onednn``. Decode-sized inputs (<= 4 rows) run a GEMV that streams the weight at
  22-40 GB/s on the 2-core VM, 0.49-0.78x the time of oneDNN's packed inner product; larger inputs run oneDNN's
  brgemm micro-kernel on the same copy, level with oneDNN at prefill shapes (benchmarks/NOTES.md entry 32).
* ``onednn``: oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) run with
  ``torch.ops.mkldnn._linear_pointwise``, the kernels PyTorch's inductor uses for frozen CPU linears (1.5-2.5x
  faster than ``F.linear`` at decode shapes, NOTES entry 7).
* ``torch``: plain ``F.linear`` (for comparisons).

A weight read in a compressed format (GGUF block types, ...) is instead a :class:`~tokenfab.quant.packed_weight.
PackedWeight` in ``qweight`` (set by the loader through :meth:`Linear.set_qweight`; ``weight`` is then None): it keeps
the compressed bytes and runs its own kernels, chosen once in :meth:`Linear.fuse` (``TOKENFAB_CPU_LINEAR=torch``
selects its plain-PyTorch reference there too).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.kernels import dispatch
from tokenfab.kernels.cpu import isa as cpu_isa
from tokenfab.kernels.cpu.ops import vnni_linear as cpu_vnni
from tokenfab.quant.packed_weight import PackedWeight


BACKENDS = ("tokenfab", "onednn", "torch")


def cpu_linear_backend() -> str:
    """``TOKENFAB_CPU_LINEAR`` (default ``tokenfab``).

    Raises:
        EngineConfigError: any other value (checked when a ModelRunner starts).
    """
    value = os.environ.get("TOKENFAB_CPU_LINEAR", "tokenfab")
    if value not in BACKENDS:
        from tokenfab.errors import EngineConfigError
        raise EngineConfigError(f"TOKENFAB_CPU_LINEAR={value!r} is not a CPU linear backend; use one of "
                                f"{', '.join(BACKENDS)} (or unset it for tokenfab).")
    return value


def _onednn_ok(weight: torch.Tensor) -> bool:
    """oneDNN's packed bf16 linear runs here: it needs AVX512 (BW/VL/DQ) or AVX-NE-CONVERT, which a CPU of the
    ``avx2`` level (``TOKENFAB_CPU_ISA``, kernels/cpu/isa.py) lacks; such a CPU keeps plain ``F.linear``."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and cpu_isa.selected_level() != "avx2"
            and bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)()))


def can_pack(weight: torch.Tensor) -> bool:
    """True when ``weight`` (bf16 on CPU) can be packed for :func:`packed_linear` under the configured backend."""
    backend = cpu_linear_backend()
    if backend == "torch" or weight.device.type != "cpu":
        return False
    if backend == "tokenfab" and cpu_vnni.vnni_linear_applies(weight):
        return True
    return _onednn_ok(weight)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] bf16 -> the packed copy :func:`packed_linear` runs: tokenfab's VNNI blocks
    [ceil(out / 32), in / 2, 32, 2] (backend ``tokenfab`` where it applies) or oneDNN's opaque blocked tensor."""
    if cpu_linear_backend() == "tokenfab" and cpu_vnni.vnni_linear_applies(weight):
        return cpu_vnni.pack_linear_weight(weight.contiguous())
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., in] bf16 -> [..., out_features] with a weight packed by :func:`pack_weight` (float32 accumulation,
    one rounding to bf16 per output, either backend)."""
    if not packed.is_mkldnn:
        return cpu_vnni.vnni_linear(x, packed, out_features, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


LOGITS_CHUNK_ROWS = 1024  # weight rows converted to float32 at a time by matmul_f32's CPU path (L2-sized chunks)


def matmul_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) -> [..., N] float32, never rounded to bf16 on the way: the float32 sum of
    the exact products of bf16 values (what a bf16 GEMM accumulates before its final rounding).

    Used for logits (CausalLM.compute_logits and every LM head), where a bf16 rounding of the output could make two
    tokens tie (a bf16 logit near 20 has a step of 0.125). Float32 operands: ``F.linear``. CUDA/ROCm: the GEMM's
    float32 output (``torch.mm(..., out_dtype=torch.float32)``, cuBLAS/hipBLASLt) where this torch has it. Elsewhere
    (CPU bf16 without tokenfab's VNNI kernels: oneDNN or torch backends, ``TOKENFAB_CPU_ISA=avx2``): ``weight`` is
    converted LOGITS_CHUNK_ROWS rows at a time (no float32 copy of the whole matrix is kept).
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.linear(x, weight, bias)
    if x.device.type == "cuda" and x.dtype == weight.dtype:
        try:
            y = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
            y = y.reshape(*x.shape[:-1], weight.shape[0])
            return y + bias.float() if bias is not None else y
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    xf = x.float()
    n = weight.shape[0]
    ys = [F.linear(xf, weight[s:s + LOGITS_CHUNK_ROWS].float()) for s in range(0, n, LOGITS_CHUNK_ROWS)]
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
    return y + bias.float() if bias is not None else y


def packed_linear_f32(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., in] bf16 -> [..., n] float32 over tokenfab's VNNI-packed weight (:func:`pack_weight` with the
    ``tokenfab`` backend): the kernel's float32 accumulator, unrounded (the LM head's logits).

    Raises:
        ValueError: ``packed`` is oneDNN's opaque layout, which has no float32 output (keep the plain weight and use
            :func:`matmul_f32`).
    """
    if packed.is_mkldnn:
        raise ValueError("packed_linear_f32 needs tokenfab's VNNI-packed weight, not oneDNN's")
    return cpu_vnni.vnni_linear(x, packed, n, None, out_f32=True)


class Linear(nn.Module):
    """y = x W^T (+ b). ``weight`` [out_features, in_features], as in nn.Linear and HF checkpoints.

    Parameters are allocated uninitialized (``torch.empty``): the loader fills every one of them or fails.
    After loading, :meth:`fuse` may replace ``weight`` by a packed copy (CPU, bf16); the plain weight is freed.
    A compressed weight lives in ``qweight`` instead (:meth:`set_qweight`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._packed: torch.Tensor | None = None
        self.qweight: PackedWeight | None = None

    def set_qweight(self, qweight: PackedWeight) -> None:
        """Hold ``qweight`` (a compressed W [out_features, in_features]) instead of the plain ``weight``, which is
        freed.

        Raises:
            ValueError: qweight's shape differs from this Linear's.
        """
        if (qweight.out_features, qweight.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"compressed weight [{qweight.out_features}, {qweight.in_features}] does not fit a "
                             f"Linear [{self.out_features}, {self.in_features}]")
        self.weight = None
        self.qweight = qweight

    @classmethod
    def concat(cls, linears: Sequence[Linear]) -> Linear | None:
        """One Linear over the concatenated output rows of ``linears``, which all read the same input (q|k|v,
        gate|up, ...): each output column is the same dot product as in its source, so one GEMM replaces several.
        The result is packed (:meth:`fuse`) and the sources' weights and biases are freed. Returns None, changing
        nothing, when a source's weight is already gone or only some sources have a bias."""
        first = linears[0]
        has_bias = first.bias is not None
        if any((l.bias is not None) != has_bias for l in linears):
            return None
        if first.qweight is not None:  # compressed: joined by the format, or left separate
            q = type(first.qweight).concat([l.qweight for l in linears]) if all(
                l.qweight is not None for l in linears) else None
            if q is None:
                return None
            fused = cls(first.in_features, q.out_features, False)
            fused.set_qweight(q)
        elif any(l.weight is None for l in linears):
            return None
        else:
            fused = cls(first.in_features, sum(l.out_features for l in linears), has_bias, dtype=first.weight.dtype)
            fused.weight = nn.Parameter(torch.cat([l.weight for l in linears]), requires_grad=False)
        if has_bias:
            fused.bias = nn.Parameter(torch.cat([l.bias for l in linears]), requires_grad=False)
        fused.fuse()
        for l in linears:  # a compressed source's weight is None already (set_qweight), a plain one's qweight too
            l.weight = l.qweight = l.bias = None
        return fused

    @classmethod
    def concat_inputs(cls, linears: Sequence[Linear]) -> Linear | None:
        """One Linear over the concatenated *input* columns of ``linears``, whose outputs are summed (x1 W1^T + x2
        W2^T as [x1 | x2] [W1 | W2]^T): one GEMM over the joined K, its float32 sums rounded once. Plain bias-free
        weights of one dtype and output width only (the GPU path's unpacked weights); the sources' weights are
        freed. Returns None, changing nothing, where they are not."""
        first = linears[0]
        if any(l.qweight is not None or l._packed is not None or l.weight is None or l.bias is not None
               or l.out_features != first.out_features or l.weight.dtype != first.weight.dtype for l in linears):
            return None
        fused = cls(sum(l.in_features for l in linears), first.out_features, False, dtype=first.weight.dtype)
        fused.weight = nn.Parameter(torch.cat([l.weight for l in linears], dim=1), requires_grad=False)
        for l in linears:
            l.weight = None
        return fused

    def fuse(self) -> None:
        """Pack the weight for the configured CPU backend when possible (called once after loading); a compressed
        weight chooses its kernels (:meth:`PackedWeight.prepare`)."""
        if self.qweight is not None:
            self.qweight.prepare()
            return
        # A one-row weight is a vector read directly by its owner (e.g. K3's attention-residual pseudo-query);
        # packing a GEMV of one output gains nothing, so it stays a plain parameter.
        if (self._packed is None and self.weight is not None and self.weight.numel() and self.out_features > 1
                and can_pack(self.weight)):
            self._packed = pack_weight(self.weight)
            self.weight = None

    @property
    def vnni_packed(self) -> torch.Tensor | None:
        """The packed weight when it is tokenfab's VNNI blocks (what the fused C++ blocks take), else None."""
        p = self._packed
        return p if p is not None and not p.is_mkldnn else None

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] float32 from the accumulator, never rounded to bf16 (an LM head's logits)."""
        if self.qweight is not None:
            return self.qweight.linear_f32(x, self.bias)
        if self._packed is not None and not self._packed.is_mkldnn:
            y = packed_linear_f32(x, self._packed, self.out_features)
            return y + self.bias.float() if self.bias is not None else y
        if self._packed is not None:  # oneDNN's blocked layout has no float32 output
            return packed_linear(x, self._packed, self.bias, self.out_features).float()
        return matmul_f32(x, self.weight, self.bias)

    def forward_add_(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` for x [T, in], residual [T, out] (a tensor the caller owns and no one else reads:
        it may be written in place and returned). On the GPU code path with a plain weight and no bias, one GEMM that
        accumulates into ``residual`` (``residual.addmm_(x, W^T)``: cuBLAS / hipBLAS with beta = 1, one launch
        instead of the GEMM and the add; the sum is rounded once); elsewhere the two ops."""
        if (self.qweight is None and self._packed is None and self.bias is None and x.dim() == 2
                and residual.shape == (x.shape[0], self.out_features) and residual.dtype == x.dtype == self.weight.dtype
                and residual.is_contiguous() and dispatch.gpu_path(x)):
            return residual.addmm_(x, self.weight.t())
        return residual + self(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.linear(x, self.bias)
        if self._packed is not None:
            return packed_linear(x, self._packed, self.bias, self.out_features)
        return F.linear(x, self.weight, self.bias)
