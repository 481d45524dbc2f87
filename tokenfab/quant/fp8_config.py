"""config.json's ``quantization_config`` for FP8 block-scaled checkpoints (DeepSeek-V3 / Kimi-K2 as published), parsed
strictly: every field tokenfab reads must hold the one value it runs, and a wrong one is a one-line ConfigError naming
the field.

Published form (DeepSeek-V3's config.json)::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

``activation_scheme`` "dynamic" means the activations are quantized per token group at run time by FP8 GEMM kernels;
tokenfab runs FP8-A16 (activations stay bf16 / float32), which computes the same products without that rounding.
"""
from __future__ import annotations

from tokenfab.model_config import ConfigError

FP8_BLOCK = (128, 128)  # the weight block tokenfab's kernels run (rows, columns)


def parse_fp8_quantization_config(qc: dict) -> tuple[int, int]:
    """The weight block (rows, columns) of an FP8 ``quantization_config`` (quant_method "fp8").

    Accepted: fmt "e4m3" (float8_e4m3fn weights; absent means e4m3, as transformers' FineGrainedFP8Config),
    activation_scheme "dynamic" (or absent), weight_block_size [128, 128] (or absent: per-tensor FP8 is not run).

    Raises:
        ConfigError: another quant_method, fmt, activation_scheme or weight_block_size, or modules_to_not_convert /
            ignored_layers given (tokenfab reads the published split: embeddings, norms, router and lm_head bf16).
    """
    if not isinstance(qc, dict):
        raise ConfigError(f"config.json: quantization_config must be an object, got {type(qc).__name__}.")
    method = str(qc.get("quant_method", "")).lower()
    if method != "fp8":
        raise ConfigError(f"config.json: quantization_config.quant_method '{qc.get('quant_method')}' is not supported "
                          "(supported: 'fp8' block-scaled, DeepSeek-V3's layout; 'compressed-tensors' for Kimi's MXFP4).")
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ConfigError(f"config.json: quantization_config.fmt '{qc.get('fmt')}' is not supported (supported: "
                          "'e4m3', float8_e4m3fn weights).")
    act = str(qc.get("activation_scheme", "dynamic")).lower()
    if act != "dynamic":
        raise ConfigError(f"config.json: quantization_config.activation_scheme '{qc.get('activation_scheme')}' is "
                          "not supported (supported: 'dynamic'; tokenfab keeps activations in bf16 / float32).")
    block = qc.get("weight_block_size")
    if block is None:
        raise ConfigError("config.json: quantization_config.weight_block_size is missing: per-tensor FP8 is not "
                          "supported (supported: block-scaled [128, 128], DeepSeek-V3's layout).")
    if not isinstance(block, (list, tuple)) or [int(b) if isinstance(b, (int, float)) else b for b in block] != \
            list(FP8_BLOCK):
        raise ConfigError(f"config.json: quantization_config.weight_block_size {block} is not supported "
                          f"(supported: {list(FP8_BLOCK)}).")
    for key in ("modules_to_not_convert", "ignored_layers"):
        if qc.get(key):
            raise ConfigError(f"config.json: quantization_config.{key} is not supported (tokenfab reads the "
                              "published split: every decoder Linear FP8, embeddings / norms / router / lm_head "
                              "unquantized); remove the field.")
    return FP8_BLOCK
