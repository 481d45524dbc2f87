"""A tensor-parallel shard of an FP8 block-scaled weight whose first row or column lies inside a 128-block.

Under tensor parallel a rank holds rows [r0, r1) of W (column-parallel: ``q_b_proj``, ``gate_proj`` / ``up_proj``, the
shared expert's) or columns [c0, c1) (row-parallel: ``o_proj``, ``down_proj``), cut where the shard plan's heads or
intermediate channels end (tokenfab/parallel/shard_plan.py), which need not be a multiple of 128: DeepSeek-V3 at
TP 3 cuts ``q_b_proj`` at 43 x 192 = 8256 rows (64 rows into block 64) and the shared expert's 2048 channels at 683
and 1366. The rank reads the e4m3 rows / columns of its range and every scale row / column of a block that overlaps
it (:meth:`ShardPlan.shard_tensor`; a block cut by two ranks is held by both), so with ``o = r0 % 128`` and
``p = c0 % 128`` (the offsets of the shard's first row / column inside its first block) local element [i, j] is

    W[r0 + i, c0 + j] = float32(q[i, j]) * scale_inv[(i + o) // 128, (j + p) // 128]

The kernels (kernels/cpu/csrc/fp8_linear.cpp, kernels/gpu/fp8_linear.py) index blocks from the weight's row and
column 0, so the shard is stored padded to the block grid: ``o`` rows of zeros before its first row, ``p`` columns of
zeros before its first column and zero columns after its last up to a multiple of 32 (the CPU kernel's input step;
never past the next 128-multiple, so the scale grid is unchanged). :meth:`linear` pads x with the same zero columns
and drops the first ``o`` outputs. A zero weight times a zero input adds an exact zero to its block's sum, so every
output is the same per-block sums of the same exact products, scaled by the same scales, as the unsharded weight's
(up to float32 summation order). The cost: up to 127 extra rows computed for a column-parallel shard, a padded copy
of x for a row-parallel one, and the padding's bytes (at most 127 rows / 158 columns of e4m3).

The PyTorch reference path (:meth:`dequantize_rows`, then ``F.linear``) reads the unpadded element range by the
formula above. A shard with both offsets 0 and rows / columns in it is an ordinary
:class:`~tokenfab.quant.fp8_block_weight.Fp8BlockWeight` (the loader builds this class only for offsets or empty
shards: ranks beyond the number of heads).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tokenfab.kernels import dispatch
from tokenfab.kernels.cpu.ops import fp8_linear as cpu_fp8
from tokenfab.quant.fp8_block_weight import BLOCK, Fp8BlockWeight, scale_shape
from tokenfab.quant.packed_weight import PackedWeight


class Fp8BlockShard(Fp8BlockWeight):
    """Rows or columns of an FP8 block-scaled W whose first row lies ``row_offset`` and first column ``col_offset``
    into their 128-blocks (see the module docstring).

    Args:
        weight: float8_e4m3fn [out, in], the shard's elements (unpadded).
        scale_inv: float32 [ceil((row_offset + out) / 128), ceil((col_offset + in) / 128)]: the scales of every block
            the shard overlaps, the block holding its first element first.
        row_offset, col_offset: 0 <= offset < 128.
        name: the checkpoint name, for error messages.

    ``out_features`` / ``in_features`` are the shard's (unpadded); ``weight`` is the padded e4m3 matrix
    [row_offset + out, K] with K = col_offset + in rounded up to a multiple of 32.

    Raises:
        ValueError: an offset outside [0, 128), wrong dtypes, or a scale shape that does not match (naming ``name``).
    """

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, row_offset: int = 0, col_offset: int = 0,
                 name: str = "weight"):
        ro, co = int(row_offset), int(col_offset)
        if not (0 <= ro < BLOCK and 0 <= co < BLOCK):
            raise ValueError(f"{name}: shard offsets inside the first 128-block must be in [0, 128), got row "
                             f"{row_offset}, column {col_offset}")
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise ValueError(f"{name}: FP8 block weight must be a 2-D float8_e4m3fn tensor, got "
                             f"{str(weight.dtype).removeprefix('torch.')} {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        want = scale_shape(ro + out_features, co + in_features)
        if scale_inv.dim() != 2 or tuple(scale_inv.shape) != want or not scale_inv.is_floating_point():
            raise ValueError(f"{name}_scale_inv: expected a float32 [{want[0]}, {want[1]}] (the 128-blocks a shard "
                             f"of [{out_features}, {in_features}] starting {ro} rows and {co} columns into its first "
                             f"block overlaps), got {str(scale_inv.dtype).removeprefix('torch.')} "
                             f"{tuple(scale_inv.shape)}")
        k_pad = -(-(co + in_features) // 32) * 32
        padded = torch.zeros(ro + out_features, k_pad, dtype=torch.uint8)  # e4m3 byte 0x00 is +0.0
        padded[ro:, co:co + in_features] = weight.view(torch.uint8)
        super().__init__(padded.view(torch.float8_e4m3fn), scale_inv, name)
        self.out_features, self.in_features = int(out_features), int(in_features)
        self.row_offset, self.col_offset = ro, co

    def dequantize_rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of the shard by the formula in the module docstring: float32 [end - start, in]."""
        ro, co, n = self.row_offset, self.col_offset, self.in_features
        a, b = start + ro, end + ro
        q = self.weight[a:b, co:co + n].to(torch.float32)
        b0, b1 = a // BLOCK, -(-b // BLOCK)
        s = self.scale_inv[b0:b1].repeat_interleave(BLOCK, 0)[a - b0 * BLOCK:b - b0 * BLOCK]
        return q * s.repeat_interleave(BLOCK, 1)[:, co:co + n]

    def prepare(self) -> None:
        """The C++ kernel on the padded matrix where :meth:`Fp8BlockWeight.prepare` would choose it (a shard with
        no rows or columns runs no kernel)."""
        from tokenfab.layers.linear import cpu_linear_backend
        on_cpu = (self.weight.device.type == "cpu" and self.out_features > 0 and self.in_features > 0
                  and cpu_linear_backend() != "torch")
        self._kernel = on_cpu and cpu_fp8.fp8_block_linear_applies()
        self._avx2 = (on_cpu and not self._kernel and self.weight.shape[1] % 32 == 0
                      and not dispatch.gpu_path(self.weight) and cpu_fp8.fp8_block_linear_avx2_applies())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.out_features == 0 or self.in_features == 0:  # an empty shard: x W^T is zeros (+ bias)
            y = x.new_zeros(*x.shape[:-1], self.out_features, dtype=torch.float32)
            return (y if bias is None else y + bias.float()).to(x.dtype)
        if not self._kernel_applies(x):
            return self.reference_linear(x, bias)
        ro, co = self.row_offset, self.col_offset
        xp = F.pad(x, (co, self.weight.shape[1] - co - self.in_features))
        bp = F.pad(bias, (ro, 0)) if bias is not None and ro else bias
        y = self._kernel_linear(xp, bp)  # on the padded matrix
        return y[..., ro:].contiguous() if ro else y

    @classmethod
    def concat(cls, weights: Sequence[PackedWeight]) -> None:
        """Shards are not joined (their padding rows would fall between the joined rows): the Linears stay apart."""
        return None

    def extra_repr(self) -> str:
        return (f"fp8 e4m3 block 128x128 shard, row_offset={self.row_offset}, col_offset={self.col_offset}, "
                + PackedWeight.extra_repr(self))
