"""Write a DeepSeek-V3-architecture checkpoint with its routed experts in a compressed-tensors packed format.

Two formats, both one scale per 32 consecutive input values of a row (compressed-tensors' layouts, as
:mod:`tokenfab.quant.int4_group` and :mod:`tokenfab.layers.mxfp4` read them):

* ``int4`` (``pack-quantized``, Kimi K2-Thinking's experts): symmetric group-32 INT4, ``scale = amax / 7`` rounded
  to bf16 (1 for an all-zero group), ``q = clamp(round(W / scale), -8, 7)``; stored as ``weight_packed`` int32
  [out, in / 8] (value k at bits 4 (k % 8), as the nibble q + 8), ``weight_scale`` bf16 [out, in / 32] and
  ``weight_shape`` int64 [2]. Real value: q * scale.
* ``mxfp4`` (``mxfp4-pack-quantized``, Kimi K3's experts): per group the E8M0 exponent
  ``e = floor(log2(amax)) - 2`` (OCP MX v1.0 section 6.3: the group's largest power of two over E2M1's largest,
  2^2), each value W / 2^e rounded to the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6, signed; beyond 6 clamped);
  stored as ``weight_packed`` uint8 [out, in / 2] (even column in the low nibble), ``weight_scale`` uint8
  [out, in / 32] (e + 127) and ``weight_shape``. Real value: E2M1(code) * 2^e.

Only the routed experts (``mlp.experts.<e>.{gate,up,down}_proj``) are quantized: the config's ``ignore`` list names
attention, shared experts, dense MLPs and lm_head, as the published Kimi checkpoints do. The *twin* holds the same
config without quantization_config and every quantized weight replaced by its real value in float32: the model the
packed one computes, as plain weights (the reference it is measured and tested against).
"""
from __future__ import annotations

import os
import re

import torch

from tokenfab.layers.mxfp4 import E2M1_VALUES
from tokenfab.testing.fp8_checkpoint import published_experts, read_tensors, write_quantized_pair

GROUP = 32
FORMATS = ("int4", "mxfp4")
_ROUTED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def quantization_config(fmt: str) -> dict:
    """config.json's compressed-tensors ``quantization_config`` for routed experts in ``fmt`` ("int4" / "mxfp4").

    Raises:
        ValueError: another ``fmt``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: use one of {FORMATS}")
    ct_format = "pack-quantized" if fmt == "int4" else "mxfp4-pack-quantized"
    weights = ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}
               if fmt == "int4" else None)
    group = {"targets": ["Linear"], "input_activations": None, "output_activations": None}
    if weights is None:
        group["format"] = ct_format
    else:
        group["weights"] = weights
    return {"quant_method": "compressed-tensors", "format": ct_format, "quantization_status": "compressed",
            "kv_cache_scheme": None, "config_groups": {"group_0": group},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj$"]}


def quantize_int4_group(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] (in % 32 == 0, any float dtype) -> (weight_packed int32 [out, in / 8], weight_scale bf16
    [out, in / 32], real value float32 [out, in])."""
    out, inp = w.shape
    g = w.float().view(out, inp // GROUP, GROUP)
    amax = g.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 7, torch.ones_like(amax)).bfloat16()
    q = (g / scale.float().unsqueeze(-1)).round().clamp(-8, 7).to(torch.int32).view(out, inp)
    nib = (q + 8).view(out, inp // 8, 8)
    packed = torch.zeros(out, inp // 8, dtype=torch.int32)
    for i in range(8):  # bit 28 of the last nibble: int32 wrap-around is the stored two's complement word
        packed |= nib[..., i] << (4 * i)
    real = (q.view(out, -1, GROUP).float() * scale.float().unsqueeze(-1)).view(out, inp)
    return packed, scale, real


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] (in % 32 == 0, any float dtype) -> (weight_packed uint8 [out, in / 2], weight_scale uint8 E8M0
    [out, in / 32], real value float32 [out, in])."""
    out, inp = w.shape
    g = w.float().view(out, inp // GROUP, GROUP)
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2, torch.full_like(amax, -127))
    e = e.clamp(-127, 127)
    x = g / torch.exp2(e).unsqueeze(-1)
    grid = torch.tensor(E2M1_VALUES[:8])
    mag = (x.abs().unsqueeze(-1) - grid).abs().argmin(-1)  # nearest magnitude (first of a tie: the smaller one)
    codes = (mag | ((x < 0).to(torch.int64) << 3)).to(torch.uint8).view(out, inp)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    real = (torch.tensor(E2M1_VALUES)[codes.long()].view(out, -1, GROUP) * torch.exp2(e).unsqueeze(-1)).view(out, inp)
    return packed, (e + 127).to(torch.uint8), real


def write_packed_experts_checkpoint(src_dir: str, out_dir: str, fmt: str, twin_dir: str | None = None) -> str:
    """Quantize ``src_dir``'s routed experts into ``out_dir`` (one model.safetensors, compressed-tensors layout of
    ``fmt``: "int4" or "mxfp4"); with ``twin_dir`` also write the float32 twin there. Reuses ``out_dir`` when its
    config.json (and the twin's) exists. Returns ``out_dir``.

    Raises:
        ValueError: an unknown ``fmt``, or a checkpoint without routed experts.
    """
    qc = quantization_config(fmt)
    if os.path.isfile(os.path.join(out_dir, "config.json")) and (
            twin_dir is None or os.path.isfile(os.path.join(twin_dir, "config.json"))):
        return out_dir
    quantize = quantize_int4_group if fmt == "int4" else quantize_mxfp4
    packed: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, t in published_experts(read_tensors(src_dir)).items():
        if _ROUTED.match(name):
            base = name[: -len(".weight")]
            wp, ws, real = quantize(t)
            packed[base + ".weight_packed"], packed[base + ".weight_scale"] = wp, ws
            packed[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
            twin[name] = real
        else:
            packed[name] = twin[name] = t.contiguous()
    if len(packed) == len(twin):
        raise ValueError(f"{src_dir}: no routed experts (mlp.experts.<e>.*_proj) to quantize")
    return write_quantized_pair(src_dir, out_dir, twin_dir, packed, twin, qc)
