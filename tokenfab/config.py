"""Strict parsing of a Hugging Face checkpoint's ``config.json`` into one normalized :class:`ModelConfig`.

Both config dialects found in real checkpoints read to the same values:

* transformers 4.x style: ``rope_scaling`` with ``type`` or ``rope_type`` and ``rope_theta`` at top level (the
  published DeepSeek-V3 and Kimi-K2 ``config.json`` files);
* transformers 5.x style: ``rope_parameters`` (holding ``rope_theta``) and ``rope_interleave``.

Anything we cannot run exactly is refused with :class:`ConfigError`, which names the field and what is supported.
"""
from __future__ import annotations

import json
import os
from typing import Any

from tokenfab.config_kimi import KIMI_ARCHITECTURES, KIMI_MODEL_TYPES, parse_kimi_config
from tokenfab.model_config import ConfigError, ModelConfig, RopeConfig, eos_token_ids, yarn_get_mscale
from tokenfab.models.architectures import ARCHITECTURES, architecture_for_model_type, supported_architectures_text

__all__ = ["ConfigError", "ModelConfig", "RopeConfig", "yarn_get_mscale", "parse_config", "load_config",
           "SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "SUPPORTED_ACTIVATIONS", "read_json_file"]

# architectures config.py parses (the hybrid Kimi families go to config_kimi.py), from models/architectures.py's table
SUPPORTED_ARCHITECTURES = {a.name: a.family for a in ARCHITECTURES.values() if not a.hybrid}
# model_type values accepted for each family (kimi_k2 is a DeepSeek-V3 architecture with its own model_type).
_MODEL_TYPES = {a.family: set(a.model_types) for a in ARCHITECTURES.values() if not a.hybrid}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "swish")


def _req(cfg: dict, key: str, ctx: str):
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"config.json: required field '{key}' is missing ({ctx}). Add it to config.json.")
    return cfg[key]


def _parse_rope(cfg: dict, dim: int, family: str) -> RopeConfig:
    """Read rope settings from ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (4.x)."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    merged: dict[str, Any] = {}
    if isinstance(scaling, dict):
        merged.update(scaling)
    if isinstance(params, dict):
        if any(isinstance(v, dict) for v in params.values()):
            raise ConfigError("config.json: per-layer-type 'rope_parameters' are not supported "
                              "(supported: one rope_parameters dict for all layers).")
        merged.update(params)
    theta = merged.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        theta = 10000.0
    rtype = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"config.json: rope type '{rtype}' (rope_scaling.type / rope_parameters.rope_type) is not "
                          f"supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}.")
    rope = RopeConfig(rope_type=rtype, theta=float(theta), dim=dim)
    if rtype != "default":
        if merged.get("factor") is None:
            raise ConfigError(f"config.json: rope type '{rtype}' needs 'factor' in rope_scaling/rope_parameters.")
        rope.factor = float(merged["factor"])
    if rtype in ("yarn", "llama3"):
        omax = merged.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        if omax is None:
            omax = cfg.get("max_position_embeddings")
        if omax is None:
            raise ConfigError("config.json: rope 'original_max_position_embeddings' is missing for "
                              f"rope type '{rtype}'.")
        rope.original_max_position_embeddings = int(omax)
    if rtype == "yarn":
        rope.beta_fast = float(merged.get("beta_fast") or 32)
        rope.beta_slow = float(merged.get("beta_slow") or 1)
        rope.mscale = merged.get("mscale")
        rope.mscale_all_dim = merged.get("mscale_all_dim")
        rope.attention_factor = merged.get("attention_factor")
        rope.truncate = bool(merged.get("truncate", True))
    if rtype == "llama3":
        for k in ("low_freq_factor", "high_freq_factor"):
            if merged.get(k) is None:
                raise ConfigError(f"config.json: rope type 'llama3' needs '{k}'.")
        rope.low_freq_factor = float(merged["low_freq_factor"])
        rope.high_freq_factor = float(merged["high_freq_factor"])
    if family == "deepseek_v3":
        # transformers 5 writes rope_interleave; 4.x DeepSeek/Kimi checkpoints always use the interleaved layout.
        rope.interleave = bool(cfg.get("rope_interleave", True))
    return rope


def parse_config(cfg: dict, gen_cfg: dict | None = None) -> ModelConfig:
    """Turn a config.json dict into a :class:`ModelConfig`.

    Raises:
        ConfigError: unknown architecture / model_type, unsupported rope type or activation, a missing field.
    """
    archs = cfg.get("architectures") or []
    if any(a in KIMI_ARCHITECTURES for a in archs) or (not archs and cfg.get("model_type") in KIMI_MODEL_TYPES):
        return parse_kimi_config(cfg, gen_cfg)  # Kimi Linear / Kimi K3 (hybrid KDA + MLA): tokenfab/config_kimi.py
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not archs:
        mt = cfg.get("model_type")
        guess = architecture_for_model_type(mt)
        fix = (f'add "architectures": ["{guess.name}"] (the architecture of model_type \'{mt}\')' if guess is not None
               else 'add "architectures": [...] naming one of the supported')
        raise ConfigError(f"config.json: field 'architectures' is missing (tokenfab builds the model class it names); "
                          f"{fix}. Supported: {supported_architectures_text()}.")
    if arch is None:
        raise ConfigError(f"config.json: architecture '{archs[0]}' (field 'architectures') is not supported; "
                          f"supported: {supported_architectures_text()}.")
    family = SUPPORTED_ARCHITECTURES[arch]
    model_type = cfg.get("model_type", family)
    if model_type not in _MODEL_TYPES[family]:
        raise ConfigError(f"config.json: model_type '{model_type}' does not match architecture {arch}; "
                          f"expected one of {sorted(_MODEL_TYPES[family])}.")
    act = cfg.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"config.json: activation '{act}' (field 'hidden_act') is not supported; supported: "
                          f"{', '.join(SUPPORTED_ACTIVATIONS)}.")
    if cfg.get("use_sliding_window"):
        raise ConfigError("config.json: 'use_sliding_window': true is not supported (set it to false).")
    ctx = f"architecture {arch}"
    hidden = int(_req(cfg, "hidden_size", ctx))
    heads = int(_req(cfg, "num_attention_heads", ctx))
    layers = int(_req(cfg, "num_hidden_layers", ctx))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if family == "deepseek_v3":
        head_dim = int(_req(cfg, "qk_nope_head_dim", ctx)) + int(_req(cfg, "qk_rope_head_dim", ctx))
    else:
        head_dim = int(cfg.get("head_dim") or hidden // heads)
    mc = ModelConfig(
        architecture=arch, family=family, model_type=model_type,
        vocab_size=int(_req(cfg, "vocab_size", ctx)), hidden_size=hidden,
        intermediate_size=int(_req(cfg, "intermediate_size", ctx)), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), hidden_act=act,
        max_position_embeddings=int(_req(cfg, "max_position_embeddings", ctx)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
        rope=RopeConfig(), eos_token_ids=eos_token_ids(cfg, gen_cfg), bos_token_id=cfg.get("bos_token_id"), raw=cfg,
    )
    if family != "deepseek_v3" and heads % kv_heads:
        raise ConfigError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                          f"{kv_heads}.")
    if family == "deepseek_v3":
        mc.q_lora_rank = cfg.get("q_lora_rank")
        mc.kv_lora_rank = int(_req(cfg, "kv_lora_rank", ctx))
        mc.qk_nope_head_dim = int(cfg["qk_nope_head_dim"])
        mc.qk_rope_head_dim = int(cfg["qk_rope_head_dim"])
        mc.v_head_dim = int(_req(cfg, "v_head_dim", ctx))
        mc.num_experts = int(cfg.get("n_routed_experts") or 0)
        mc.num_nextn_predict_layers = int(cfg.get("num_nextn_predict_layers") or 0)
        if mc.num_experts:
            mc.num_experts_per_tok = int(_req(cfg, "num_experts_per_tok", ctx))
            mc.moe_intermediate_size = int(_req(cfg, "moe_intermediate_size", ctx))
            mc.n_shared_experts = int(cfg.get("n_shared_experts") or 0)
            mc.routed_scaling_factor = float(cfg.get("routed_scaling_factor", 1.0))
            mc.n_group = int(cfg.get("n_group") or 1)
            mc.topk_group = int(cfg.get("topk_group") or 1)
            mc.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))
            scoring = cfg.get("scoring_func", "sigmoid")
            if scoring != "sigmoid":
                raise ConfigError(f"config.json: scoring_func '{scoring}' is not supported for DeepSeek-V3 "
                                  "(supported: sigmoid).")
            topk_method = cfg.get("topk_method", "noaux_tc")
            if topk_method != "noaux_tc":
                raise ConfigError(f"config.json: topk_method '{topk_method}' is not supported (supported: noaux_tc).")
            mc.scoring_func = "sigmoid"
            if mc.num_experts % mc.n_group:
                raise ConfigError(f"config.json: n_routed_experts {mc.num_experts} is not a multiple of n_group "
                                  f"{mc.n_group}.")
            k_dense = int(cfg.get("first_k_dense_replace") or 0)
            freq = int(cfg.get("moe_layer_freq") or 1)
            mc.moe_layers = [i for i in range(layers) if i >= k_dense and i % freq == 0]
        rope_dim = mc.qk_rope_head_dim
    elif family == "qwen3_moe":
        mc.num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if not mc.num_experts:
            raise ConfigError("config.json: required field 'num_experts' (or 'num_local_experts') is missing "
                              f"({ctx}). Add it to config.json.")
        mc.num_experts_per_tok = int(_req(cfg, "num_experts_per_tok", ctx))
        mc.moe_intermediate_size = int(_req(cfg, "moe_intermediate_size", ctx))
        mc.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
        step = int(cfg.get("decoder_sparse_step") or 1)
        only = set(cfg.get("mlp_only_layers") or [])
        mc.moe_layers = [i for i in range(layers) if i not in only and mc.num_experts > 0 and (i + 1) % step == 0]
        rope_dim = head_dim
    else:
        rope_dim = int(head_dim * float(cfg.get("partial_rotary_factor", 1.0)))
    mc.rope = _parse_rope(cfg, rope_dim, family)
    qc = cfg.get("quantization_config")
    if qc and str((qc if isinstance(qc, dict) else {}).get("quant_method", "")).lower() != "compressed-tensors":
        from tokenfab.quant.fp8_config import parse_fp8_quantization_config  # strict: a wrong field is named
        mc.fp8_block_size = parse_fp8_quantization_config(qc)
    return mc


def load_config(model_dir: str) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` when present) from a checkpoint folder, or from a
    ``config.json`` path (its folder is searched for generation_config.json), or the metadata of a ``.gguf`` file
    (tokenfab.loader.gguf_packed.gguf_config).

    Raises:
        FileNotFoundError: the folder or its config.json does not exist.
        ConfigError: config.json or generation_config.json is not valid JSON (:func:`read_json_file`), or see
            :func:`parse_config`.
    """
    if model_dir.lower().endswith(".gguf"):  # a llama.cpp file: its metadata is the config
        from tokenfab.loader.gguf_packed import gguf_config
        return parse_config(gguf_config(model_dir))
    if os.path.isfile(model_dir):
        path, model_dir = model_dir, os.path.dirname(model_dir) or "."
    else:
        path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json at '{model_dir}': pass a Hugging Face checkpoint folder or a "
                                "config.json file.")
    cfg = read_json_file(path)
    gen = None
    gpath = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gpath):
        gen = read_json_file(gpath)
    return parse_config(cfg, gen)


def read_json_file(path: str) -> dict:
    """The JSON object in the file ``path`` (a checkpoint's config.json, generation_config.json).

    Raises:
        ConfigError: the file is not valid JSON (naming the file, line, column and what the parser expected there)
            or its top level is not an object.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}. Fix the file "
                          "(or restore it from the checkpoint's source).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level is a JSON {type(data).__name__}, not an object ({{...}}); fix the "
                          "file (or restore it from the checkpoint's source).")
    return data
