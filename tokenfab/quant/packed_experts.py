"""The packed-experts seam: a stack of routed-expert weights kept in a compressed format and multiplied packed.

:class:`~tokenfab.layers.moe.RoutedExperts` holds either bf16 / fp32 stacks (``w13`` [E, 2I, H], ``w2`` [E, H, I])
or two :class:`PackedExperts` (``q13`` for gate|up, ``q2`` for down) with the same row layout. A format subclass
owns its bytes as buffers (so ``model.to(device)`` moves them), fills them from the checkpoint's per-expert
tensors (:meth:`PackedExperts.load_part`), and computes the grouped linear over tokens sorted by expert
(:meth:`PackedExperts.grouped_linear`): the C++ kernel (kernels/cpu/csrc/packed_experts.cpp, AVX512-BF16) where it
runs, INT4 / MXFP4 on CPUs without it the AVX2 kernel (packed_experts_avx2.cpp), else the PyTorch reference, which
dequantizes one expert's rows at a time (``_REFERENCE_ROWS``) to float32 and multiplies in float32, so no full-size
float copy of a stack is made on any path. Formats:
:mod:`tokenfab.quant.int4_group` (compressed-tensors pack-quantized) and :mod:`tokenfab.quant.mxfp4_experts`
(compressed-tensors mxfp4-pack-quantized) on packed_experts.cpp, and :mod:`tokenfab.quant.fp8_block_experts`
(DeepSeek-V3 / Kimi-K2 FP8 block-scaled, on fp8_linear.cpp's grouped kernel), :mod:`tokenfab.quant.gguf_experts`
(a GGUF file's expert stacks in their block types, on the GGUF linear kernels); another adds a subclass and an
entry in :data:`FORMATS`.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.errors import WeightLoadError
from tokenfab.kernels.cpu.ops import packed_experts as cpu_packed_experts

_REFERENCE_ROWS = 1024  # rows of one expert dequantized at a time by the PyTorch path
FORMATS = {"int4_group": "tokenfab.quant.int4_group:Int4GroupExperts",
           "mxfp4": "tokenfab.quant.mxfp4_experts:Mxfp4Experts",
           "fp8_block": "tokenfab.quant.fp8_block_experts:Fp8BlockExperts",
           "gguf": "tokenfab.quant.gguf_experts:GGUFExperts"}


def expert_format(name: str) -> type[PackedExperts]:
    """The :class:`PackedExperts` subclass of format ``name`` (a key of :data:`FORMATS`).

    Raises:
        ValueError: an unknown format name (lists the known ones).
    """
    if name not in FORMATS:
        raise ValueError(f"unknown packed expert format '{name}' (known: {', '.join(FORMATS)})")
    import importlib
    mod, cls = FORMATS[name].split(":")
    return getattr(importlib.import_module(mod), cls)


def _setting() -> str:
    return os.environ.get("TOKENFAB_PACKED_EXPERTS", "").strip().lower()


def check_setting() -> None:
    """Refuse a ``TOKENFAB_PACKED_EXPERTS`` value other than unset / empty, ``torch`` (:func:`kernel_disabled`) and
    ``rows`` (:func:`tiles_disabled`), so a typo is not read as the default (called once when an engine starts).

    Raises:
        EngineConfigError: naming the variable and its values.
    """
    value = _setting()
    if value not in ("", "torch", "rows"):
        from tokenfab.errors import EngineConfigError
        raise EngineConfigError(f"TOKENFAB_PACKED_EXPERTS={value!r} is not a setting; leave it unset (the C++ kernels, "
                                "INT4 / MXFP4 stacks in the CPU tile layout), or use torch (the PyTorch reference "
                                "path) or rows (the kernels on the checkpoint layout).")


def kernel_disabled() -> bool:
    """``TOKENFAB_PACKED_EXPERTS=torch`` forces the PyTorch reference path (tests use it to run the path a CPU
    without AVX512-BF16 takes)."""
    return _setting() == "torch"


def tiles_disabled() -> bool:
    """``TOKENFAB_PACKED_EXPERTS=rows`` keeps INT4 / MXFP4 / FP8 stacks in their checkpoint layout on the CPU kernel
    path (its row kernels; A/B runs and tests) instead of the tile layouts :meth:`PackedExperts.prepare` and
    :meth:`~tokenfab.quant.fp8_block_experts.Fp8BlockExperts.prepare` make."""
    return _setting() == "rows"


TILE_ROWS = 16  # rows per tile of the CPU tile layout (kernels/cpu/csrc/packed_expert_tiles.h)
TILED = 16  # kExpertsTiles: added to the kernel format id while a stack is in the tile layout


class PackedExperts(nn.Module):
    """E expert weights W_e [out_features, in_features] in one packed format.

    Subclasses set :attr:`format_name` and :attr:`kernel_format` (the C++ format id, or None), create the buffers
    ``packed`` and ``scale`` (first dim E, second out_features) and implement :meth:`dequantize_packed` and
    :meth:`check_part`.
    """

    format_name = "?"
    kernel_format: int | None = None
    gpu_layout = False  # True once prepare() re-laid the buffers for the GPU kernels (INT4, MXFP4, FP8)
    cpu_tiles = False  # True once prepare() re-laid whole 16-row tiles for the CPU kernel (:meth:`prepare`)
    tile_layout = False  # formats whose CPU kernel reads the tile layout (INT4, MXFP4)
    checkpoint_parts = ("weight_packed", "weight_scale")  # tensors each expert Linear must provide (the loader)
    graph_safe = True  # False: the GPU path reads routing counts on the host (no CUDA-graph capture; GGUF experts)

    def __init__(self, num_experts: int, out_features: int, in_features: int):
        super().__init__()
        self.num_experts, self.out_features, self.in_features = int(num_experts), int(out_features), int(in_features)
        self._kernel = False
        self._avx2 = False  # packed_experts_avx2 (INT4 / MXFP4 where the AVX512-BF16 kernel does not run; prepare)

    @classmethod
    def for_parts(cls, num_experts: int, part_rows: list[int], in_features: int) -> PackedExperts:
        """A stack whose rows are the checkpoint Linears ``part_rows`` one after another (gate|up: [I, I]; down:
        [H]); formats whose scales are per row need no more than the sum (FP8 block scales keep parts apart)."""
        return cls(num_experts, sum(part_rows), in_features)

    # ---- storage ----------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes resident for the whole stack (packed values and scales)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def register_group_buffers(self, label: str, per_element: int, packed_dtype: torch.dtype, group: int,
                               scale_dtype: torch.dtype) -> None:
        """Register zeroed non-persistent buffers ``packed`` [E, out, in / per_element] of ``packed_dtype`` and
        ``scale`` [E, out, in / group] of ``scale_dtype``. Raises ValueError (``label`` naming the format) unless
        in_features is a multiple of ``group``."""
        e, out_f, in_f = self.num_experts, self.out_features, self.in_features
        if in_f % group:
            raise ValueError(f"{label} experts need in_features divisible by {group}, got {in_f}")
        self.register_buffer("packed", torch.zeros(e, out_f, in_f // per_element, dtype=packed_dtype),
                             persistent=False)
        self.register_buffer("scale", torch.zeros(e, out_f, in_f // group, dtype=scale_dtype), persistent=False)

    def check_columns(self, t: torch.Tensor, rows: int, name: str, part: str, dtypes: tuple, per_column: int,
                      dtype_text: str, note: str) -> None:
        """Raise WeightLoadError (naming ``name``, ``part``, the expected ``dtype_text`` [rows, in / per_column] and
        ``note``) unless ``t``'s dtype is one of ``dtypes`` and each column holds ``per_column`` input values."""
        if t.dtype not in dtypes or t.shape[1] * per_column != self.in_features:
            raise WeightLoadError(f"{name}: {part} {tuple(t.shape)} {t.dtype} is not {dtype_text} "
                                  f"[{rows}, {self.in_features // per_column}] ({note}).")

    def check_part(self, part: str, t: torch.Tensor, rows: int, name: str) -> torch.Tensor:
        """Validate checkpoint tensor ``t`` (``part`` = weight_packed / weight_scale) for ``rows`` rows of one
        expert and return it as this stack's buffer dtype. Raises WeightLoadError naming ``name``."""
        raise NotImplementedError

    def load_part(self, e: int, row0: int, part: str, t: torch.Tensor, name: str) -> None:
        """Copy one checkpoint tensor of expert ``e`` (local index) into rows [row0, row0 + rows) of the stack.

        ``part``: ``weight_packed`` or ``weight_scale`` (copied), ``weight_shape`` (checked: [rows, in_features]).
        The row count comes from the tensor (weight_shape: its first entry).

        Raises:
            WeightLoadError: wrong dtype, shape or weight_shape, named with ``name``.
        """
        if part == "weight_shape":
            shape = [int(v) for v in t.reshape(-1).tolist()]
            if len(shape) != 2 or shape[1] != self.in_features or not 0 < shape[0] <= self.out_features - row0:
                raise WeightLoadError(f"{name}: weight_shape {shape} does not fit this model's expert weight "
                                      f"[{self.out_features - row0 if row0 else self.out_features}, "
                                      f"{self.in_features}] (the shapes come from config.json).")
            return
        if part not in ("weight_packed", "weight_scale"):
            raise WeightLoadError(f"{name}: '{part}' is not a tensor of the {self.format_name} format "
                                  "(weight_packed, weight_scale, weight_shape)")
        rows = t.shape[0] if t.dim() == 2 else -1
        if rows <= 0 or row0 + rows > self.out_features:
            raise WeightLoadError(f"{name}: {part} {tuple(t.shape)} does not fit rows [{row0}, "
                                  f"{self.out_features}) of an expert weight [{self.out_features}, "
                                  f"{self.in_features}].")
        t = self.check_part(part, t, rows, name)
        dst = getattr(self, "packed" if part == "weight_packed" else "scale")
        dst[e, row0:row0 + rows].copy_(t)

    # ---- math -------------------------------------------------------------------------------------------------
    def dequantize_packed(self, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Rows of this format's buffers (packed [r, .], scale [r, in / 32]) -> float32 [r, in_features], exactly
        as the format defines them."""
        raise NotImplementedError

    def dequantize_rows(self, e: int, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of expert ``e`` (local index) as float32 [end - start, in_features]; rows in tiles
        (:attr:`cpu_tiles`) are read back from a copy of their tiles returned to the checkpoint layout."""
        n16 = self.out_features // TILE_ROWS * TILE_ROWS
        if not self.cpu_tiles or start >= n16:
            return self.dequantize_packed(self.packed[e, start:end], self.scale[e, start:end])
        a0 = start // TILE_ROWS * TILE_ROWS
        b0 = max(end, min(n16, -(-end // TILE_ROWS) * TILE_ROWS))  # whole tiles, then any rows past the last one
        p, s = self.packed[e:e + 1, a0:b0].clone(), self.scale[e:e + 1, a0:b0].clone()
        cpu_packed_experts.packed_experts_relayout(self.kernel_format, p, s, False)
        return self.dequantize_packed(p[0, start - a0:end - a0], s[0, start - a0:end - a0])

    def dequantize_expert(self, e: int) -> torch.Tensor:
        """All of W_e as float32 [out_features, in_features] (tests and references; one expert's full copy)."""
        return self.dequantize_rows(e, 0, self.out_features)

    def prepare(self) -> None:
        """Use the C++ kernel when it runs here (CPU buffers, built kernels with AVX512-BF16, not disabled by
        ``TOKENFAB_PACKED_EXPERTS=torch``); called once after loading. For that kernel INT4 / MXFP4 stacks are then
        re-laid once, in place, into the CPU tile layout (every whole 16 rows of an expert; the rows past them stay
        as they are; kernels/cpu/csrc/packed_expert_tiles.h), unless ``TOKENFAB_PACKED_EXPERTS=rows``: about twice
        the streaming rate at one token per expert (benchmarks/NOTES.md 69). :meth:`dequantize_rows` reads either
        layout. Where that kernel does not run (a CPU without AVX512-BF16), INT4 / MXFP4 stacks on the CPU path take
        the AVX2 kernel (``cpu_packed_experts.packed_experts_avx2``) in the checkpoint layout."""
        from tokenfab.kernels.gpu import support as gpu_support
        self._kernel = (self.kernel_format is not None and self.packed.device.type == "cpu" and not kernel_disabled()
                        and cpu_packed_experts.packed_experts_applies())
        self._avx2 = (not self._kernel and self.kernel_format in (0, 1) and not self.cpu_tiles
                      and not self.gpu_layout and self.packed.device.type == "cpu" and not kernel_disabled()
                      and not gpu_support.gpu_path(self.packed) and cpu_packed_experts.packed_experts_avx2_applies())
        if (self._kernel and self.tile_layout and not self.cpu_tiles and not tiles_disabled()
                and self.out_features >= TILE_ROWS and not self.gpu_layout):
            if not gpu_support.applies(self.packed):  # Triton's packed MoE (tests: interpreted) reads other layouts
                cpu_packed_experts.packed_experts_relayout(self.kernel_format, self.packed, self.scale, True)
                self.cpu_tiles = True

    @property
    def kernel_id(self) -> int | None:
        """The C++ kernel's format argument: :attr:`kernel_format`, plus :data:`TILED` while in the tile layout."""
        if self.kernel_format is None:
            return None
        return self.kernel_format + (TILED if self.cpu_tiles else 0)

    def grouped_linear(self, x: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
        """Rows of ``x`` grouped by expert times their expert's W^T.

        Args:
            x: [N, in_features] bf16 or float32, rows sorted by expert: the first counts[0] rows go to local
                expert experts[0], the next counts[1] to experts[1], ... (sum(counts) = N).
            experts, counts: local expert ids and their row counts (same length).

        Returns:
            [N, out_features] in x's dtype: float32 accumulation of exact products, one rounding per output.
        """
        avx2 = self._avx2 and not self.gpu_layout
        if (self._kernel or avx2) and x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu":
            offs = [0]
            for n in counts:
                offs.append(offs[-1] + n)
            ids, offsets = torch.tensor(experts, dtype=torch.int64), torch.tensor(offs, dtype=torch.int64)
            if avx2:
                return self.avx2_linear(x.float(), ids, offsets).to(x.dtype)
            return self.kernel_linear(x, ids, offsets)
        return self.reference_grouped_linear(x, experts, counts)

    def kernel_linear(self, x: torch.Tensor, experts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The C++ grouped linear (:meth:`grouped_linear` when ``_kernel``): experts int64 [A] local ids, offsets
        int64 [A + 1] row offsets into x."""
        return cpu_packed_experts.packed_experts_linear(x, self.kernel_id, self.packed, self.scale, experts, offsets)

    def avx2_linear(self, x: torch.Tensor, experts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The AVX2 grouped linear (:meth:`grouped_linear` when ``_avx2``): x float32 [N, in_features], experts
        int64 [A] local ids, offsets int64 [A + 1] row offsets into x; float32 [N, out_features]."""
        return cpu_packed_experts.packed_experts_avx2(x, self.kernel_format, self.packed, self.scale, experts, offsets)

    def reference_grouped_linear(self, x: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
        """The PyTorch path of :meth:`grouped_linear`: per expert, float32 ``F.linear`` over 1024 dequantized rows
        at a time, one rounding to x's dtype."""
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        b = 0
        for e, n in zip(experts, counts):
            if n:
                xf = x[b:b + n].float()
                for s in range(0, self.out_features, _REFERENCE_ROWS):
                    t = min(s + _REFERENCE_ROWS, self.out_features)
                    y[b:b + n, s:t] = F.linear(xf, self.dequantize_rows(e, s, t).to(x.device)).to(x.dtype)
                b += n
        return y

    def extra_repr(self) -> str:
        return (f"{self.format_name}, experts={self.num_experts}, out_features={self.out_features}, "
                f"in_features={self.in_features}, nbytes={self.nbytes}")
