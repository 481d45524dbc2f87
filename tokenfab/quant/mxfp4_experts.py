"""MXFP4 expert weights (compressed-tensors ``mxfp4-pack-quantized``; Kimi K3's routed experts), kept packed.

Layout and values: :mod:`tokenfab.layers.mxfp4` (uint8 ``weight_packed`` [out, in / 2], even column in the low
nibble; uint8 E8M0 ``weight_scale`` [out, in / 32], 2^(s - 127)); W = E2M1(code) * 2^(s - 127).
"""
from __future__ import annotations

import torch

from tokenfab.layers.mxfp4 import MXFP4_GROUP, dequantize_mxfp4
from tokenfab.quant.packed_experts import PackedExperts


class Mxfp4Experts(PackedExperts):
    """E experts' W [out, in] in MXFP4 (buffers ``packed`` uint8 [E, out, in / 2], ``scale`` uint8 [E, out,
    in / 32]; on the GPU code path, after :meth:`prepare`, the GPU layout of kernels/gpu/moe_relayout.py,
    :attr:`gpu_layout` True)."""

    format_name = "mxfp4"
    kernel_format = 1  # kExpertsMxfp4 in kernels/cpu/csrc/packed_experts.h
    tile_layout = True

    def __init__(self, num_experts: int, out_features: int, in_features: int):
        super().__init__(num_experts, out_features, in_features)
        self.register_group_buffers("MXFP4", 2, torch.uint8, MXFP4_GROUP, torch.uint8)

    def check_part(self, part: str, t: torch.Tensor, rows: int, name: str) -> torch.Tensor:
        if part == "weight_packed":
            self.check_columns(t, rows, name, part, (torch.uint8,), 2, "uint8", "two E2M1 codes per byte, MXFP4")
            return t
        e8m0 = getattr(torch, "float8_e8m0fnu", None)
        self.check_columns(t, rows, name, "weight_scale", (torch.uint8, e8m0), MXFP4_GROUP, "uint8 (E8M0)",
                           f"one scale per {MXFP4_GROUP}")
        return t if t.dtype == torch.uint8 else t.view(torch.uint8)

    def dequantize_packed(self, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize_mxfp4(packed, scale, torch.float32)

    def prepare(self) -> None:
        """As :meth:`PackedExperts.prepare`; on the GPU code path (CUDA / ROCm buffers with Triton on, or the
        interpreter's ``interpret-gpu-path`` in tests) also re-lay the stack once into the grouped GEMM's layout
        (kernels/gpu/moe_relayout.py; in place where K needs no padding) and set :attr:`gpu_layout`, unless an
        E8M0 scale is 0 or 255 (then the checkpoint layout and its kernel path stay). The CPU keeps the checkpoint
        layout and its kernels."""
        super().prepare()
        from tokenfab.kernels.gpu import support as gpu_support
        if self.gpu_layout or not gpu_support.gpu_path(self.packed):
            return
        from tokenfab.kernels.gpu.moe_relayout import plain_e8m0, relayout_mxfp4
        if plain_e8m0(self.scale):
            self.packed, self.scale = relayout_mxfp4(self.packed, self.scale, in_place=True)
            self.gpu_layout = True

    def dequantize_rows(self, e: int, start: int, end: int) -> torch.Tensor:
        if not self.gpu_layout:
            return super().dequantize_rows(e, start, end)
        from tokenfab.kernels.gpu.moe_relayout import restore_mxfp4
        return dequantize_mxfp4(*restore_mxfp4(self.packed[e, start:end], self.scale[e, start:end],
                                               self.in_features), torch.float32)
