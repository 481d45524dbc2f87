"""Write a checkpoint in DeepSeek-V3's published FP8 block-scaled layout from a plain (float32 / bf16) one.

Every decoder Linear weight (attention projections, dense / shared / routed expert MLPs) is quantized per 128 x 128
block as DeepSeek's ``fp8_cast`` inverse: ``scale_inv = amax(|W_block|) / 448`` (448 = e4m3fn's largest finite value;
1 for an all-zero block) and ``weight = (W / scale_inv).to(float8_e4m3fn)`` (round to nearest even), stored as
``<name>.weight`` float8_e4m3fn [out, in] and ``<name>.weight_scale_inv`` float32 [ceil(out / 128), ceil(in / 128)];
edge blocks are partial. Embeddings, norms, the router (``mlp.gate``, ``e_score_correction_bias``) and lm_head stay
as they are. config.json gains DeepSeek-V3's ``quantization_config``. Routed experts stored stacked (transformers'
``mlp.experts.gate_up_proj`` / ``down_proj``, as tiny_checkpoints.add_mtp_layers writes an MTP layer) are written
per expert first, as DeepSeek-V3 publishes every layer's, its MTP layer's included.

:func:`write_fp8_checkpoint` can also write the *dequantized twin*: the same config without quantization_config and
every quantized weight replaced by ``weight.float() * scale_inv`` (the published formula) in float32, i.e. the real
numbers the FP8 model holds, as plain weights (the reference the packed model is tested against).
"""
from __future__ import annotations

import json
import os
import re
import shutil

import torch

FP8_MAX = 448.0
BLOCK = 128
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}
_QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|"
                        r"o_proj)|mlp\.(gate_proj|up_proj|down_proj)|mlp\.shared_experts\.(gate|up|down)_proj|"
                        r"mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$")


def is_fp8_quantized(name: str) -> bool:
    """True for the checkpoint weights DeepSeek-V3 publishes in FP8 (decoder Linears; not the router ``mlp.gate``)."""
    return _QUANTIZED.match(name) is not None


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] (any float dtype) -> (float8_e4m3fn [out, in], float32 scale_inv [ceil(out/128), ceil(in/128)])
    with scale_inv = amax / 448 per block (1 where the block is all zero)."""
    wf = w.float()
    n, k = wf.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK)
    padded[:n, :k] = wf.abs()
    amax = padded.view(nb, BLOCK, kb, BLOCK).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (wf / full).to(torch.float8_e4m3fn), scale


_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")


def published_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with transformers' stacked routed experts (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj`` [E, H, I], e.g. the MTP layers of tiny_checkpoints.add_mtp_layers) split into the
    published per-expert Linears ``mlp.experts.<e>.{gate,up,down}_proj.weight``, which DeepSeek-V3 ships in FP8."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _STACKED.match(name)
        if m is None or t.dim() != 3:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if m.group(2) == "down_proj":
                out[f"{m.group(1)}{e}.down_proj.weight"] = t[e].contiguous()
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{m.group(1)}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{m.group(1)}{e}.up_proj.weight"] = up.contiguous()
    return out


def read_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``folder`` (sorted by file name), by name."""
    from safetensors.torch import load_file
    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def copy_side_files(src: str, dst: str) -> dict:
    """Copy ``src``'s files other than weights, config.json and the shard index into ``dst`` (created); return
    ``src``'s config.json as a dict (the caller writes its own)."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(os.path.join(src, f), dst)
    with open(os.path.join(src, "config.json")) as fh:
        return json.load(fh)


def write_fp8_checkpoint(src_dir: str, out_dir: str, twin_dir: str | None = None) -> str:
    """Quantize checkpoint ``src_dir`` into ``out_dir`` (published FP8 layout, one model.safetensors); with
    ``twin_dir`` also write the dequantized twin there. Reuses ``out_dir`` when its config.json exists.
    Returns ``out_dir``."""
    if os.path.isfile(os.path.join(out_dir, "config.json")) and (
            twin_dir is None or os.path.isfile(os.path.join(twin_dir, "config.json"))):
        return out_dir
    tensors = published_experts(read_tensors(src_dir))
    fp8: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if is_fp8_quantized(name):
            q, s = quantize_fp8_block(t)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            full = s.repeat_interleave(BLOCK, 0)[:q.shape[0]].repeat_interleave(BLOCK, 1)[:, :q.shape[1]]
            twin[name] = q.float() * full
        else:
            fp8[name] = twin[name] = t.contiguous()
    return write_quantized_pair(src_dir, out_dir, twin_dir, fp8, twin, QUANTIZATION_CONFIG)


def write_quantized_pair(src_dir: str, out_dir: str, twin_dir: str | None, packed: dict[str, torch.Tensor],
                         twin: dict[str, torch.Tensor], quantization_config: dict) -> str:
    """Write ``packed`` tensors into ``out_dir`` (``src_dir``'s side files, its config.json plus
    ``quantization_config``) and, with ``twin_dir``, the float32 ``twin`` tensors there (its config.json as float32,
    no quantization_config); one model.safetensors each. Returns ``out_dir``."""
    from safetensors.torch import save_file
    cfg = copy_side_files(src_dir, out_dir)
    save_file(packed, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(dict(cfg, quantization_config=quantization_config), fh, indent=2)
    if twin_dir is not None:
        copy_side_files(src_dir, twin_dir)
        save_file(twin, os.path.join(twin_dir, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(twin_dir, "config.json"), "w") as fh:
            json.dump(dict(cfg, torch_dtype="float32", dtype="float32"), fh, indent=2)
    return out_dir
