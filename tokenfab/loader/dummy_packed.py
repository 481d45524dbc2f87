"""``load_format="dummy"`` for checkpoints published packed: the packed tensors a real load would keep, at their real
shapes and dtypes, filled on the device with seeded random codes, so a GPU run measures the packed kernels at real
model shapes without checkpoint files (benchmarks/gpu_shapes.py's ``dsv3`` with FP8, ``k3`` with MXFP4 experts).

What a real load keeps packed, and so what is built here:

* FP8 block-scaled checkpoints (config.json's ``quantization_config`` fp8; DeepSeek-V3 / Kimi-K2 as published):
  every Linear of the decoder layers but the router ``mlp.gate`` and MLA's ``kv_b_proj`` (dequantized at load by
  the real loader, loader/fp8_block_loader.py) gets an :class:`~tokenfab.quant.fp8_block_weight.Fp8BlockWeight`:
  e4m3 codes of N(0, 1) draws, every ``weight_scale_inv`` block 0.02 (weights ~N(0, 0.02), as the unquantized
  dummy weights); the routed experts get FP8 expert stacks filled the same way.
* Routed experts kept packed (compressed-tensors INT4 group-32 / MXFP4, Kimi's MXFP4): uniformly random codes (every
  INT4 nibble and E2M1 code is a value; their RMS is 4.6 and 2.9) with constant scales that make the weights' RMS
  about 0.02: INT4 scale 0.0043, MXFP4 E8M0 scale 120 (2^-7).

The stacks are built on the meta device (no host memory: K3's 896 MXFP4 experts are 16 GB) and each buffer is
replaced by a tensor on the target device, filled there expert by expert (bounded temporary memory). Each tensor's
generator is seeded from (seed, its name), as loader/dummy_weights.py does, so values depend only on the seed,
name, shape and device. Kernel speed does not depend on the values; only finite, bounded activations matter.
"""
from __future__ import annotations

import zlib

import torch
from torch import nn

INT4_SCALE = 0.0043  # RMS of (q - 8) for uniform nibbles: sqrt(21.5) = 4.64; 0.02 / 4.64
MXFP4_SCALE_E8M0 = 120  # 2^(120 - 127) = 2^-7; RMS of uniform E2M1 codes: sqrt(68.5 / 8) = 2.93 -> ~0.023
FP8_SCALE = 0.02  # e4m3 codes of N(0, 1) draws times 0.02


def _generator(device: torch.device, seed: int, name: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % 2 ** 63)


def fp8_dummy_target(name: str) -> bool:
    """Whether Linear ``name`` (a module name) is stored FP8 in a published FP8 block-scaled checkpoint and kept
    packed by the real loader: a decoder-layer Linear other than the router ``mlp.gate`` and ``kv_b_proj``."""
    return (name.startswith("model.layers.") and not name.endswith(".mlp.gate")
            and not name.endswith(".self_attn.kv_b_proj"))


@torch.no_grad()
def e4m3_normal(shape: tuple[int, ...], device: torch.device, g: torch.Generator, rows: int = 4096) -> torch.Tensor:
    """float8_e4m3fn codes of N(0, 1) draws, [shape], drawn ``rows`` rows of the first dim at a time (float32
    temporaries of at most rows x the other dims)."""
    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    flat = out.view(shape[0], -1)
    for r0 in range(0, shape[0], rows):
        r1 = min(shape[0], r0 + rows)
        flat[r0:r1] = torch.randn(r1 - r0, flat.shape[1], device=device, generator=g).to(torch.float8_e4m3fn)
    return out


@torch.no_grad()
def dummy_fp8_weight(out_features: int, in_features: int, device: torch.device, seed: int, name: str):
    """An :class:`~tokenfab.quant.fp8_block_weight.Fp8BlockWeight` [out_features, in_features] on ``device``: e4m3
    codes of N(0, 1) draws, every block scale :data:`FP8_SCALE`."""
    from tokenfab.quant.fp8_block_weight import Fp8BlockWeight, scale_shape
    w = e4m3_normal((out_features, in_features), device, _generator(device, seed, name))
    return Fp8BlockWeight(w, torch.full(scale_shape(out_features, in_features), FP8_SCALE, device=device), name)


@torch.no_grad()
def _fill_stack(stack, device: torch.device, seed: int, name: str) -> None:
    """Replace ``stack``'s ``packed`` / ``scale`` buffers (meta or CPU) by tensors on ``device`` of the same shapes
    and dtypes, filled by the module docstring's rule for its format, one expert at a time."""
    packed, scale = stack.packed, stack.scale
    g = _generator(device, seed, f"{name}.packed")
    new_packed = torch.empty(packed.shape, dtype=packed.dtype, device=device)
    for e in range(packed.shape[0]):
        if stack.format_name == "fp8_block":
            new_packed[e] = e4m3_normal(tuple(packed.shape[1:]), device, g).view(torch.uint8)
        elif packed.dtype == torch.int32:  # INT4: eight nibbles per word, all 32 bits random
            new_packed[e] = torch.randint(-2 ** 31, 2 ** 31, packed.shape[1:], dtype=torch.int32, device=device,
                                          generator=g)
        else:  # MXFP4: two E2M1 codes per byte
            new_packed[e] = torch.randint(0, 256, packed.shape[1:], dtype=torch.uint8, device=device, generator=g)
    fill = {"fp8_block": FP8_SCALE, "int4_group": INT4_SCALE, "mxfp4": MXFP4_SCALE_E8M0}[stack.format_name]
    stack.packed = new_packed
    stack.scale = torch.full(scale.shape, fill, dtype=scale.dtype, device=device)


def build_dummy_packed(model: nn.Module, mc, device: torch.device, seed: int = 0) -> list[str]:
    """Before :func:`~tokenfab.loader.dummy_weights.fill_dummy_weights`: give ``model`` the packed weights a real
    load of its checkpoint format would keep (module docstring), on ``device``; a model with none is left as built.

    Args:
        model: a freshly built CausalLM (routed experts still unallocated: moe.deferred_expert_storage).
        mc: its parsed config (``fp8_block_size`` set for an FP8 block-scaled checkpoint).

    Returns:
        The names filled: Linear weights (``<module>.weight``) and expert stacks (``<module>.q13`` / ``q2``).
    """
    from tokenfab.layers.linear import Linear
    from tokenfab.layers.moe import RoutedExperts
    filled = []
    if getattr(mc, "fp8_block_size", None) is not None:
        for name, lin in model.named_modules():
            if isinstance(lin, Linear) and lin.weight is not None and fp8_dummy_target(name):
                lin.set_qweight(dummy_fp8_weight(lin.out_features, lin.in_features, device, seed, f"{name}.weight"))
                filled.append(f"{name}.weight")
    with torch.device("meta"):  # the stacks' zero-filled buffers would be host memory of the model's full size
        model.pack_expert_stacks()
    for name, mod in model.named_modules():
        if isinstance(mod, RoutedExperts) and mod.q13 is not None:
            for part in ("q13", "q2"):
                _fill_stack(getattr(mod, part), device, seed, f"{name}.{part}")
                filled.append(f"{name}.{part}")
    return filled
