"""FP8 block-scaled expert weights (DeepSeek-V3 / Kimi-K2 as published: ``weight`` float8_e4m3fn [out, in] and
``weight_scale_inv`` float32 [ceil(out / 128), ceil(in / 128)] per expert Linear), kept packed.

Each expert Linear's real weight is, as for every FP8 Linear of these checkpoints (:mod:`tokenfab.quant.
fp8_block_weight`; DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``)::

    W[r, c] = float32(weight[r, c]) * weight_scale_inv[r // 128, c // 128]

with partial edge blocks where out or in is not a multiple of 128. A stack keeps the bytes as stored, ``packed``
uint8 [E, out, in] (the e4m3 bits), and the scales of its row parts side by side: gate|up rows are two parts of I
rows, each with its own ceil(I / 128) block rows (gate_proj and up_proj are stored and scaled apart, so with I not a
multiple of 128 a block never mixes their rows), down rows one part. ``scale`` float32 [E, parts * ceil(part_rows /
128), ceil(in / 128)]: row r of part p uses block row p * ceil(part_rows / 128) + (r - p * part_rows) // 128. The
resident bytes are exactly the checkpoint's (1 per parameter + 4 per block), what ``tokenfab plan`` counts.

Kernel: ``cpu_fp8.fp8_experts_linear`` (kernels/cpu/csrc/fp8_linear.cpp, AVX512-BF16: the e4m3 bytes converted to
exact bf16 in registers, per 128-input block float32 sums scaled once), which needs in_features a multiple of 32.
Where that kernel runs without AMX, :meth:`~Fp8BlockExperts.prepare` re-lays stacks whose parts are whole 16-row
tiles once, in place, into the CPU tile layout (kernels/cpu/csrc/fp8_tiles.h: per 16 rows and 4 inputs, 64 bytes
holding two vdpbf16ps operands of the 16 rows), so decode segments of up to 16 tokens convert each weight once for
all their tokens and sum 16 rows in the lanes (benchmarks/results/2026-12-07-fp8-expert-tiles);
``TOKENFAB_PACKED_EXPERTS=rows`` keeps the checkpoint layout. On
CPUs without AVX512-BF16 ``cpu_fp8.fp8_experts_avx2`` (fp8_linear_avx2.cpp: e4m3 through fp16 in registers, float32
FMAs on float32 x); else the PyTorch reference of :class:`~tokenfab.quant.packed_experts.PackedExperts` (the formula
above, 1024 rows at a time). Published shapes (hidden 7168, moe_intermediate 2048) have no partial blocks; tokenfab
handles them anyway.
"""
from __future__ import annotations

import torch

from tokenfab.errors import WeightLoadError
from tokenfab.kernels.cpu.ops import fp8_linear as cpu_fp8
from tokenfab.quant.fp8_block_weight import BLOCK, TILE_ROWS, Fp8BlockWeight, untiled_rows
from tokenfab.quant.packed_experts import PackedExperts, kernel_disabled, tiles_disabled


class Fp8BlockExperts(PackedExperts):
    """E experts' W [out_features, in_features] as e4m3 bytes ``packed`` uint8 [E, out, in] and float32 ``scale``
    [E, parts * ceil(part_rows / 128), ceil(in / 128)] (``parts`` = out_features / part_rows); after :meth:`prepare`
    ``packed`` may be in the CPU tile layout (:attr:`cpu_tiles`) or the GPU grouped GEMM's (:attr:`gpu_layout`).

    Args:
        num_experts, out_features, in_features: the stack's shape.
        part_rows: rows of each separately scaled part (gate|up: the intermediate size; default: out_features).

    Raises:
        ValueError: part_rows that does not divide out_features.
    """

    format_name = "fp8_block"
    kernel_format = 2  # runs cpu_fp8.fp8_experts_linear, not packed_experts_linear
    checkpoint_parts = ("weight",)  # <expert>.{gate,up,down}_proj.weight (+ weight_scale_inv, paired by the loader)

    def __init__(self, num_experts: int, out_features: int, in_features: int, part_rows: int | None = None):
        super().__init__(num_experts, out_features, in_features)
        self.part_rows = int(part_rows or out_features)
        if self.part_rows <= 0 or out_features % self.part_rows:
            raise ValueError(f"FP8 expert stack: part_rows {part_rows} does not divide out_features {out_features}")
        self.parts = out_features // self.part_rows
        self.block_rows = -(-self.part_rows // BLOCK)  # scale rows per part
        self.register_buffer("packed", torch.zeros(num_experts, out_features, in_features, dtype=torch.uint8),
                             persistent=False)
        self.register_buffer("scale", torch.zeros(num_experts, self.parts * self.block_rows,
                                                  -(-in_features // BLOCK), dtype=torch.float32), persistent=False)

    @classmethod
    def for_parts(cls, num_experts: int, part_rows: list[int], in_features: int) -> Fp8BlockExperts:
        """A stack whose rows are ``part_rows`` parts scaled apart (all the same size: gate|up [I, I])."""
        if len(set(part_rows)) != 1:
            raise ValueError(f"FP8 expert stack: parts of different sizes {part_rows}")
        return cls(num_experts, sum(part_rows), in_features, part_rows[0])

    def load_part(self, e: int, row0: int, part: str, t, name: str) -> None:
        """Copy one expert Linear's FP8 weight (an :class:`~tokenfab.quant.fp8_block_weight.Fp8BlockWeight` from
        the FP8 loader, ``part`` "weight") into rows [row0, row0 + part_rows) of local expert ``e`` and its scales
        into that part's block rows.

        Raises:
            WeightLoadError: not an FP8 block weight, or a shape that is not [part_rows, in_features] at a part
                boundary (named with ``name``).
        """
        if part != "weight" or not isinstance(t, Fp8BlockWeight):
            raise WeightLoadError(f"{name}: expected a float8_e4m3fn weight with its weight_scale_inv (FP8 "
                                  f"block-scaled experts), got {type(t).__name__} for '{part}'")
        if (t.out_features, t.in_features) != (self.part_rows, self.in_features) or row0 % self.part_rows:
            raise WeightLoadError(f"{name}: checkpoint {(t.out_features, t.in_features)} vs model "
                                  f"{(self.part_rows, self.in_features)} (the shapes come from config.json)")
        p = row0 // self.part_rows
        self.packed[e, row0:row0 + self.part_rows].copy_(t.weight.view(torch.uint8))
        self.scale[e, p * self.block_rows:(p + 1) * self.block_rows].copy_(t.scale_inv)

    def check_part(self, part: str, t: torch.Tensor, rows: int, name: str) -> torch.Tensor:
        raise WeightLoadError(f"{name}: '{part}' is not a tensor of FP8 block-scaled experts (weight, "
                              "weight_scale_inv)")

    def dequantize_rows(self, e: int, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of expert ``e`` by the published formula, each part's rows with that part's scales:
        float32 [end - start, in_features] (rows in the CPU tile layout read from a copy of their tiles returned to
        the checkpoint layout)."""
        r = torch.arange(start, end, device=self.packed.device)
        brow = (r // self.part_rows) * self.block_rows + (r % self.part_rows) // BLOCK
        bcol = torch.arange(self.in_features, device=self.packed.device) // BLOCK
        q = untiled_rows(self.packed[e], start, end, self.out_features if self.cpu_tiles else 0)
        scale = self.scale[e]
        if self.gpu_layout:  # back to the checkpoint's bytes and scale columns (exact)
            from tokenfab.kernels.gpu.moe_relayout import restore_fp8
            q, scale = restore_fp8(q, scale, self.in_features)
        return q.view(torch.float8_e4m3fn).to(torch.float32) * scale[brow[:, None], bcol[None, :]]

    def prepare(self) -> None:
        """Use ``fp8_experts_linear`` when it runs here: CPU buffers, in_features a multiple of 32, built kernels
        with AVX512-BF16, not disabled by ``TOKENFAB_PACKED_EXPERTS=torch`` nor by ``TOKENFAB_CPU_LINEAR=torch``
        (which sends the FP8 checkpoint's other Linears to the PyTorch path too); where that kernel does not run
        (a CPU without AVX512-BF16) the AVX2 kernel ``cpu_fp8.fp8_experts_avx2`` under the same conditions. On the
        GPU code path (CUDA / ROCm buffers with Triton on, or the interpreter's ``interpret-gpu-path`` in tests)
        re-lay the stack once into the grouped GEMM's layout instead (kernels/gpu/moe_relayout.relayout_fp8: in
        place where in_features is a multiple of 512) and set :attr:`gpu_layout`. With that C++ kernel on a CPU
        without AMX (``cpu_fp8.fp8_tiles_preferred``), part_rows a multiple of 16, not
        ``TOKENFAB_PACKED_EXPERTS=rows`` and no Triton kernel taking the buffers (Triton's packed MoE reads the
        checkpoint layout; tests interpret it on CPU tensors), re-lay the stack once, in place, into the CPU tile
        layout (``cpu_fp8.fp8_tiles_relayout``) and set :attr:`cpu_tiles`; :meth:`dequantize_rows` reads either
        layout."""
        from tokenfab.kernels.gpu import support as gpu_support
        from tokenfab.layers.linear import cpu_linear_backend
        cpu = (self.packed.device.type == "cpu" and self.in_features % 32 == 0 and not kernel_disabled()
               and cpu_linear_backend() != "torch")
        gpu_path = gpu_support.gpu_path(self.packed)
        self._kernel = cpu and cpu_fp8.fp8_experts_applies()
        self._avx2 = (cpu and not self._kernel and not self.gpu_layout and not gpu_path
                      and cpu_fp8.fp8_block_linear_avx2_applies())
        if (self._kernel and not self.cpu_tiles and not self.gpu_layout and not gpu_support.applies(self.packed)
                and not tiles_disabled() and self.part_rows % TILE_ROWS == 0 and cpu_fp8.fp8_tiles_preferred()):
            cpu_fp8.fp8_tiles_relayout(self.packed, True)
            self.cpu_tiles = True
        if self.gpu_layout or not gpu_path:
            return
        from tokenfab.kernels.gpu.moe_relayout import relayout_fp8
        self.packed, self.scale = relayout_fp8(self.packed, self.scale, in_place=True)
        self.gpu_layout, self._kernel = True, False

    def kernel_linear(self, x: torch.Tensor, experts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return cpu_fp8.fp8_experts_linear(x, self.packed, self.scale, experts, offsets, self.part_rows,
                                          self.cpu_tiles)

    def avx2_linear(self, x: torch.Tensor, experts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return cpu_fp8.fp8_experts_avx2(x, self.packed, self.scale, experts, offsets, self.part_rows)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, part_rows={self.part_rows}, e4m3 block 128x128"
