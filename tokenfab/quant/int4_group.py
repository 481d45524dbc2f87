"""INT4 group-quantized expert weights as compressed-tensors ``pack-quantized`` stores them (4-bit symmetric int,
strategy group, group_size 32; Kimi K2-Thinking's routed experts), kept packed.

A Linear weight W [out, in] is stored as
* ``weight_packed`` int32 [out, in / 8]: value k of a row at bits 4 (k % 8) .. 4 (k % 8) + 3 of word k / 8, as the
  unsigned nibble q + 8 of the signed value q in [-8, 7];
* ``weight_scale`` bf16 or fp16 [out, in / 32]: one scale per 32 consecutive values of a row;
* ``weight_shape`` int [2]: [out, in].
W[o, k] = (nibble - 8) * scale[o, k // 32], computed exactly in float32. Source: compressed-tensors
``pack_to_int32`` / ``unpack_from_int32`` (offset 1 << (num_bits - 1), element i at bit i * num_bits) and the
symmetric ``dequantize`` (x_q * scale, no zero point).
"""
from __future__ import annotations

import torch

from tokenfab.errors import WeightLoadError
from tokenfab.quant.packed_experts import PackedExperts

GROUP = 32


def dequantize_int4_group(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed int32 [..., n / 8] and scale (bf16 / fp16 / fp32) [..., n / 32] -> float32 [..., n]."""
    n = packed.shape[-1] * 8
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    q = ((packed.unsqueeze(-1) >> shifts) & 15).reshape(*packed.shape[:-1], n) - 8
    w = q.to(torch.float32).view(*packed.shape[:-1], n // GROUP, GROUP) * scale.to(torch.float32).unsqueeze(-1)
    return w.reshape(*packed.shape[:-1], n)


class Int4GroupExperts(PackedExperts):
    """E experts' W [out, in] in INT4 group-32 (buffers ``packed`` int32 [E, out, in / 8], ``scale`` [E, out,
    in / 32] in the checkpoint's scale dtype: bf16 unless the first scale loaded is fp16; on the GPU code path,
    after :meth:`prepare`, the GPU layout of kernels/gpu/moe_relayout.py, :attr:`gpu_layout` True)."""

    format_name = "int4_group"
    kernel_format = 0  # kExpertsInt4Group in kernels/cpu/csrc/packed_experts.h
    tile_layout = True

    def __init__(self, num_experts: int, out_features: int, in_features: int, scale_dtype=torch.bfloat16):
        super().__init__(num_experts, out_features, in_features)
        self.register_group_buffers(f"INT4 group-{GROUP}", 8, torch.int32, GROUP, scale_dtype)
        self._scale_seen = False

    def check_part(self, part: str, t: torch.Tensor, rows: int, name: str) -> torch.Tensor:
        if part == "weight_packed":
            self.check_columns(t, rows, name, part, (torch.int32,), 8, "int32", "8 nibbles per int32, pack-quantized")
            return t
        self.check_columns(t, rows, name, "weight_scale", (torch.bfloat16, torch.float16), GROUP, "bf16 / fp16",
                           f"one scale per {GROUP} values")
        if t.dtype != self.scale.dtype:
            if self._scale_seen:
                raise WeightLoadError(f"{name}: weight_scale is {t.dtype} but earlier scales of this layer were "
                                      f"{self.scale.dtype}; one scale dtype per checkpoint is supported.")
            self.scale = torch.zeros(self.scale.shape, dtype=t.dtype, device=self.scale.device)
        self._scale_seen = True
        return t

    def dequantize_packed(self, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize_int4_group(packed, scale)

    def prepare(self) -> None:
        """As :meth:`PackedExperts.prepare`; on the GPU code path (CUDA / ROCm buffers with Triton on, or the
        interpreter's ``interpret-gpu-path`` in tests) also re-lay the stack once into the grouped GEMM's layout
        (kernels/gpu/moe_relayout.py; in place where K needs no padding) and set :attr:`gpu_layout`. The CPU keeps
        the checkpoint layout and its kernels."""
        super().prepare()
        from tokenfab.kernels.gpu import support as gpu_support
        if self.gpu_layout or not gpu_support.gpu_path(self.packed):
            return
        from tokenfab.kernels.gpu.moe_relayout import relayout_int4
        self.packed, self.scale = relayout_int4(self.packed, self.scale, in_place=True)
        self.gpu_layout = True

    def dequantize_rows(self, e: int, start: int, end: int) -> torch.Tensor:
        if not self.gpu_layout:
            return super().dequantize_rows(e, start, end)
        from tokenfab.kernels.gpu.moe_relayout import restore_int4
        return dequantize_int4_group(*restore_int4(self.packed[e, start:end], self.scale[e, start:end],
                                                   self.in_features))
