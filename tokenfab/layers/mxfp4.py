"""MXFP4 (OCP Microscaling FP4) dequantisation, as stored by compressed-tensors ``mxfp4-pack-quantized``.

A weight [out, in] is stored as
* ``weight_packed`` uint8 [out, in / 2]: two FP4 E2M1 codes per byte, the **low nibble** holding the even column
  and the high nibble the odd one;
* ``weight_scale`` uint8 [out, in / 32]: one E8M0 scale per 32 consecutive values of a row, value 2^(s - 127)
  (s = 255 is NaN in the OCP spec).

E2M1 (sign, 2 exponent bits, 1 mantissa bit, bias 1) codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 the
same values negated. Sources: OCP Microscaling Formats (MX) v1.0 spec, sections 5.3.3 (E2M1) and 5.4.1 (E8M0);
compressed-tensors ``pack_fp4_to_uint8`` (low nibble first).
"""
from __future__ import annotations

import torch

MXFP4_GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                     name: str = "weight") -> torch.Tensor:
    """packed uint8 [..., n/2] and scale uint8 [..., n/32] -> weight [..., n] in ``dtype``.

    Computed exactly in float32 (every E2M1 value times a power of two is representable unless it over/underflows).

    Raises:
        ValueError: wrong dtypes or shapes that do not describe the same n (names ``name``).
    """
    if packed.dtype != torch.uint8 or scale.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
        raise ValueError(f"{name}: MXFP4 needs uint8 weight_packed and uint8 (E8M0) weight_scale, got "
                         f"{packed.dtype} / {scale.dtype}.")
    if scale.dtype != torch.uint8:
        scale = scale.view(torch.uint8)
    n = packed.shape[-1] * 2
    if packed.shape[:-1] != scale.shape[:-1] or scale.shape[-1] * MXFP4_GROUP != n:
        raise ValueError(f"{name}: MXFP4 weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} "
                         f"do not match (expected scale [..., {n // MXFP4_GROUP}] for {n} columns, one E8M0 scale per "
                         f"{MXFP4_GROUP} values).")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*packed.shape[:-1], n)
    vals = lut[codes]
    s = torch.exp2(scale.to(torch.float32) - 127.0)
    s = torch.where(scale == 255, torch.tensor(float("nan"), device=s.device), s)
    w = vals.view(*packed.shape[:-1], n // MXFP4_GROUP, MXFP4_GROUP) * s.unsqueeze(-1)
    return w.reshape(*packed.shape[:-1], n).to(dtype)
