"""The embedded default model: a deterministic generator of a small DeepSeek-V3 / Kimi-K2-architecture checkpoint.

No machine here reaches a model hub, so ``tokenfab generate`` / ``tokenfab demo`` without a model write this
checkpoint on first use into a cache folder (``$TOKENFAB_CACHE`` or ``~/.cache/tokenfab``): MLA attention
(q_lora_rank 384, kv_lora_rank 512, qk_rope_head_dim 64 — the shape vLLM's CPU MLA kernel accepts), 16 routed
experts top-2 in 4 groups (sigmoid routing with a non-zero e_score_correction_bias) plus a shared expert, YaRN
RoPE (factor 4 over 2,048 original positions), about 100M parameters in bfloat16, random seeded weights, a real
byte-level BPE tokenizer with a chat template. Its text is meaningless; its compute and memory traffic are real.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

DEFAULT_MODEL_NAME = "tokenfab-tiny-deepseek-v3"

DEFAULT_MODEL_CONFIG = dict(
    vocab_size=8192, hidden_size=768, intermediate_size=1536, moe_intermediate_size=384, num_hidden_layers=6,
    num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2,
    n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    q_lora_rank=384, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
    max_position_embeddings=8192, rms_norm_eps=1e-6, rope_interleave=True, initializer_range=0.02,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 2048},
)


def cache_dir() -> str:
    """Folder holding generated models: ``$TOKENFAB_CACHE`` or ``~/.cache/tokenfab``."""
    return os.environ.get("TOKENFAB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tokenfab")


def describe() -> str:
    """One line saying what the default model is."""
    c = DEFAULT_MODEL_CONFIG
    return (f"{DEFAULT_MODEL_NAME}: embedded DeepSeek-V3/Kimi-K2-architecture test model (random weights, ~100M params, "
            f"{c['num_hidden_layers']} layers, MLA kv_lora_rank {c['kv_lora_rank']}, {c['n_routed_experts']} experts "
            f"top-{c['num_experts_per_tok']} + {c['n_shared_experts']} shared, YaRN x{c['rope_parameters']['factor']}); "
            "its text is meaningless")


def ensure_default_model(path: str | None = None, quiet: bool = False) -> str:
    """Return the default model's folder, writing it first if absent (about 10 s on 2 cores, ~200 MB).

    The write goes to a temporary folder renamed into place, so a crash never leaves half a checkpoint.
    """
    from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint

    path = path or os.path.join(cache_dir(), "models", DEFAULT_MODEL_NAME)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if not quiet:
        print(f"[tokenfab] writing the embedded default model to {path} (first use only) ...", flush=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        kw = dict(DEFAULT_MODEL_CONFIG)
        vocab = kw.pop("vocab_size")
        make_tiny_checkpoint(tmp, "deepseek_v3", seed=1234, vocab_size=vocab, dtype="bfloat16", **kw)
        # Fields vLLM's DeepSeek loader expects (transformers 5 omits them).
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg.update({"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1,
                    "num_nextn_predict_layers": 0})
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
