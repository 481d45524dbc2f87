"""A Linear weight in FP8 block-scaled form (DeepSeek-V3 / Kimi-K2 as published), kept packed and multiplied packed.

Stored as published: ``weight`` float8_e4m3fn [out, in] (1 byte per parameter) and ``weight_scale_inv`` float32
[ceil(out / 128), ceil(in / 128)], the real weight being

    W[r, c] = float32(weight[r, c]) * weight_scale_inv[r // 128, c // 128]

(DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``; vLLM / SGLang block FP8 the same; edge blocks are partial when
out or in is not a multiple of 128). The product is one float32 rounding of an exact e4m3 value times the scale.

Fast path: ``cpu_fp8.fp8_block_linear`` (kernels/cpu/csrc/fp8_linear.cpp) on CPUs whose kernels have AVX512-BF16: a
decode GEMV converting e4m3 to bf16 in registers (every e4m3 value is exact in bf16); with AMX, bf16 x of more than 4
rows converts 16 weight rows at a time into AMX tiles; otherwise more than 16 rows convert 32 weight rows at a time
into a thread-local buffer for oneDNN's brgemm. Without AMX, :meth:`Fp8BlockWeight.prepare` re-lays the weight's
whole 16-row tiles once, in place, into the CPU tile layout (kernels/cpu/csrc/fp8_tiles.h; the rows past the last
whole tile stay row-major): up to 16 rows of x then take the tile GEMV, which converts each weight once for all rows
and sums 16 weight rows in the lanes, more rows brgemm over converted tiles (benchmarks/NOTES.md 97). All sum x q
exactly per 128 inputs in float32 and scale each block's sum once: y = sum_kb s[n, kb] * sum_{k in kb} x_k q_k, the
same real number as sum_k x_k W[n, k] up to float32 rounding. Needs in_features a multiple of 32. CPUs without
AVX512-BF16:
``cpu_fp8.fp8_block_linear_avx2`` (kernels/cpu/csrc/fp8_linear_avx2.cpp: e4m3 converted through fp16 in registers,
float32 FMAs; more than 16 rows on 64-row converted panels and PyTorch's float32 GEMM). Reference / fallback (no
kernels, another device, in_features not a multiple of 32, or ``TOKENFAB_CPU_LINEAR=torch``): a float32 copy within
its budget (PackedWeight.keep_dense_copy), else dequantize 1024 rows at a time by the formula and ``F.linear`` in
float32.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenfab.kernels.cpu.ops import fp8_linear as cpu_fp8
from tokenfab.kernels import dispatch
from tokenfab.quant.fp8_config import FP8_BLOCK
from tokenfab.quant.packed_weight import PackedWeight

BLOCK = FP8_BLOCK[0]
TILE_ROWS = 16  # rows per tile of the CPU tile layout (kernels/cpu/csrc/fp8_tiles.h)


def untiled_rows(w: torch.Tensor, start: int, end: int, n16: int) -> torch.Tensor:
    """Rows [start, end) of e4m3 bytes ``w`` uint8 [n, K] whose first ``n16`` rows are in the CPU tile layout
    (kernels/cpu/csrc/fp8_tiles.h; 0: none), in the checkpoint layout: a view where the rows touch no tile, else a
    copy with the whole tiles holding them returned to the checkpoint layout (exact)."""
    if start >= min(end, n16):
        return w[start:end]
    a0, b0 = start // TILE_ROWS * TILE_ROWS, min(n16, -(-end // TILE_ROWS) * TILE_ROWS)
    t = w[a0:b0].clone()
    cpu_fp8.fp8_tiles_relayout(t, False)
    return torch.cat([t[start - a0:end - a0], w[b0:end]])


def scale_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """Shape of ``weight_scale_inv`` for W [out_features, in_features]: (ceil(out / 128), ceil(in / 128))."""
    return -(-out_features // BLOCK), -(-in_features // BLOCK)


class Fp8BlockWeight(PackedWeight):
    """W [out_features, in_features] as float8_e4m3fn ``weight`` and float32 ``scale_inv`` per 128 x 128 block.

    Args:
        weight: float8_e4m3fn [out, in] (the checkpoint's ``<name>.weight``); after :meth:`prepare` its whole 16-row
            tiles may be in the CPU tile layout (:attr:`cpu_tiles`; :meth:`checkpoint_rows` reads them back).
        scale_inv: float32 [ceil(out / 128), ceil(in / 128)] (``<name>.weight_scale_inv``).
        name: the checkpoint name, for error messages.

    Raises:
        ValueError: wrong dtypes or a scale shape that does not match the weight's (naming ``name``).
    """

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, name: str = "weight"):
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise ValueError(f"{name}: FP8 block weight must be a 2-D float8_e4m3fn tensor, got "
                             f"{str(weight.dtype).removeprefix('torch.')} {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        want = scale_shape(out_features, in_features)
        if scale_inv.dim() != 2 or tuple(scale_inv.shape) != want or not scale_inv.is_floating_point():
            raise ValueError(f"{name}_scale_inv: expected a float32 [{want[0]}, {want[1]}] (ceil(out / 128), "
                             f"ceil(in / 128)) for weight [{out_features}, {in_features}], got "
                             f"{str(scale_inv.dtype).removeprefix('torch.')} {tuple(scale_inv.shape)}")
        super().__init__(out_features, in_features)
        self.register_buffer("weight", weight.contiguous(), persistent=False)
        self.register_buffer("scale_inv", scale_inv.to(torch.float32).contiguous(), persistent=False)
        self._kernel = False
        self.cpu_tiles = False  # whole 16-row tiles of ``weight`` in the CPU tile layout (prepare)
        self._avx2 = False  # cpu_fp8.fp8_block_linear_avx2 (CPUs without AVX512-BF16; prepare)
        self._mm_scale: torch.Tensor | None = None  # scale_inv in scaled_mm's layout (GPU, set by prepare)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + 4 * self.scale_inv.numel()

    tile_layout = True  # prepare() may re-lay the weight into the CPU tile layout (benchmarks/fp8_linear.py
    # --layout rows turns it off for A/B runs)

    def checkpoint_rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of the e4m3 matrix in the checkpoint's layout (float8_e4m3fn [end - start, in]): a view,
        or where they lie in tiles (:attr:`cpu_tiles`) a copy of those tiles returned to the checkpoint layout."""
        n16 = self.out_features // TILE_ROWS * TILE_ROWS if self.cpu_tiles else 0
        return untiled_rows(self.weight.view(torch.uint8), start, end, n16).view(torch.float8_e4m3fn)

    def dequantize_rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of W by the published formula: float32 [end - start, in_features]."""
        q = self.checkpoint_rows(start, end).to(torch.float32)
        b0, b1 = start // BLOCK, -(-end // BLOCK)
        s = self.scale_inv[b0:b1].repeat_interleave(BLOCK, 0)[start - b0 * BLOCK:end - b0 * BLOCK]
        return q * s.repeat_interleave(BLOCK, 1)[:, :self.in_features]

    def prepare(self) -> None:
        """Use the C++ kernel when it runs here: CPU tensors, in_features a multiple of 32, built kernels with
        AVX512-BF16 and a CPU linear backend other than ``torch`` (``TOKENFAB_CPU_LINEAR``). On a GPU: run the
        block-scaled scaled_mm probe once per device and, where it passed, keep the scales in its layout
        (:func:`tokenfab.kernels.dispatch.fp8_block_prepare`). With the C++ kernel on a CPU without AMX
        (``cpu_fp8.fp8_tiles_preferred``), :attr:`tile_layout` and no Triton kernel taking the weight, re-lay the weight's whole 16-row tiles once, in
        place, into the CPU tile layout and set :attr:`cpu_tiles` (``weight`` is the tensor given to the
        constructor, so its holder sees the new layout: the loader hands over a copy). A CPU without AVX512-BF16
        takes the AVX2 kernel where it is built; with neither, a float32 copy within the budget
        (:meth:`~tokenfab.quant.packed_weight.PackedWeight.keep_dense_copy`)."""
        from tokenfab.kernels.gpu import support as gpu_support
        from tokenfab.layers.linear import cpu_linear_backend
        on_cpu = self.weight.device.type == "cpu" and self.in_features % 32 == 0 and cpu_linear_backend() != "torch"
        self._kernel = on_cpu and cpu_fp8.fp8_block_linear_applies()
        self._avx2 = (on_cpu and not self._kernel and not dispatch.gpu_path(self.weight)
                      and cpu_fp8.fp8_block_linear_avx2_applies())
        n16 = self.out_features // TILE_ROWS * TILE_ROWS
        if (self._kernel and self.tile_layout and not self.cpu_tiles and n16 and not gpu_support.applies(self.weight)
                and cpu_fp8.fp8_tiles_preferred()):  # (Triton's FP8 linear, interpreted on CPU tensors: row-major)
            cpu_fp8.fp8_tiles_relayout(self.weight.view(torch.uint8)[:n16], True)
            self.cpu_tiles = True
        self._mm_scale = dispatch.fp8_block_prepare(self.weight, self.scale_inv)
        if not self._kernel and not self._avx2:
            self.keep_dense_copy()  # no packed kernel on this CPU: a float32 copy within the budget

    def _kernel_applies(self, x: torch.Tensor) -> bool:
        """A kernel (C++ on CPU, Triton on CUDA/ROCm) computes ``x W^T`` here; else the PyTorch reference does."""
        return dispatch.fp8_block_linear_applies(x, self._kernel, self._avx2)

    def _kernel_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [.., K] @ weight^T`` on the stored e4m3 matrix and scales by the kernel that applies (K = the stored
        matrix's columns; call only where :meth:`_kernel_applies`)."""
        ms = self._mm_scale if self._mm_scale is not None and self._mm_scale.device == x.device else None
        return dispatch.fp8_block_linear(x, self.weight, self.scale_inv, bias, self._kernel, mm_scale=ms,
                                         cpu_avx2=self._avx2, cpu_tiled=self.cpu_tiles)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._kernel_applies(x):
            return self._kernel_linear(x, bias)
        return self.reference_linear(x, bias)

    @classmethod
    def concat(cls, weights: Sequence[PackedWeight]) -> Fp8BlockWeight | None:
        """Rows of several FP8 weights with the same in_features joined (q_a|kv_a, gate|up) when every weight but
        the last has a whole number of 128-row blocks (so the scale rows stay aligned); None otherwise (also for
        tensor-parallel shards stored padded, :class:`~tokenfab.quant.fp8_block_shard.Fp8BlockShard`)."""
        first = weights[0]
        if not all(type(w) is Fp8BlockWeight and w.in_features == first.in_features for w in weights):
            return None
        if any(w.out_features % BLOCK for w in weights[:-1]) or any(w.cpu_tiles != first.cpu_tiles for w in weights):
            return None
        # tiles stay whole: every weight but the last has whole 128-row blocks, so the joined tiles line up
        out = cls(torch.cat([w.weight for w in weights]), torch.cat([w.scale_inv for w in weights]))
        out._kernel, out._avx2, out.cpu_tiles = first._kernel, first._avx2, first.cpu_tiles
        return out

    def extra_repr(self) -> str:
        return "fp8 e4m3 block 128x128, " + super().extra_repr()
