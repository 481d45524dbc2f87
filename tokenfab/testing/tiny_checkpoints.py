"""Write tiny random checkpoints in real Hugging Face format (config classes, save_pretrained, safetensors).

Used by the tests, the benchmarks and the embedded default model. Weights are random but seeded; the routing
bias ``e_score_correction_bias`` is made non-zero so that biased expert choice is exercised.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

from tokenfab.testing.tokenizer_builder import build_tokenizer

FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3")


def tiny_config_kwargs(family: str, vocab_size: int = 512, **overrides: Any) -> dict:
    """Default tiny sizes for ``family`` (kwargs for the transformers config class), updated by ``overrides``."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
                  initializer_range=0.08)
    if family == "llama":
        kw = dict(common, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif family == "qwen3":
        kw = dict(common, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif family == "qwen3_moe":
        kw = dict(common, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif family == "deepseek_v3":
        kw = dict(common, num_key_value_heads=4, max_position_embeddings=2560, moe_intermediate_size=32, n_routed_experts=8,
                  n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                  routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=48,
                  qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, rope_interleave=True,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                                   "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                   "original_max_position_embeddings": 64})
    else:
        raise ValueError(f"unknown family '{family}'; known: {FAMILIES}")
    kw.update(overrides)
    return kw


def make_hf_config(family: str, **kwargs: Any):
    """The transformers config object for ``family``."""
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config, Qwen3MoeConfig
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig,
           "deepseek_v3": DeepseekV3Config}[family]
    return cls(**kwargs)


def perturb_random_model(model) -> None:
    """Make a freshly initialised transformers model less degenerate, in place (uses torch's global RNG):
    a non-zero ``e_score_correction_bias`` (so biased expert choice is exercised), norm weights moved off 1
    (weights at exactly 1 hide mix-ups between norms) and linear biases (``attention_bias`` / ``mlp_bias``) off 0."""
    import torch
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.05)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("proj.bias"):
                p.add_(torch.randn(p.shape) * 0.1)


def make_tiny_checkpoint(out_dir: str, family: str, *, seed: int = 0, vocab_size: int = 512,
                         max_shard_size: str | None = None, dtype: str = "float32",
                         tokenizer_dir: str | None = None, **overrides: Any) -> str:
    """Create (or reuse, if ``out_dir/config.json`` exists) a random checkpoint of ``family`` in ``out_dir``.

    Args:
        max_shard_size: e.g. "200KB" to force a sharded save with model.safetensors.index.json.
        dtype: "float32" or "bfloat16" for the saved weights.
        tokenizer_dir: copy this tokenizer instead of training one (speeds up test fixtures).
        overrides: config kwargs (see :func:`tiny_config_kwargs`).

    Returns:
        ``out_dir``.
    """
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    kw = tiny_config_kwargs(family, vocab_size=vocab_size, **overrides)
    cfg = make_hf_config(family, **kw)
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # zero-width modules (e.g. DeepSeek's shared MLP at n_shared_experts 0)
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    perturb_random_model(model)
    model = model.to(getattr(torch, dtype))
    os.makedirs(out_dir, exist_ok=True)
    save_kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **save_kw)
    if tokenizer_dir:
        for f in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, f), out_dir)
    else:
        build_tokenizer(out_dir, vocab_size=vocab_size)
    return out_dir


def add_mtp_layers(ckpt_dir: str, num_layers: int = 1, *, seed: int = 0, own_head: bool = False,
                   own_embed: bool = False) -> str:
    """Give a DeepSeek-V3 checkpoint written by :func:`make_tiny_checkpoint` ``num_layers`` random
    next-token-prediction (MTP) layers in DeepSeek-V3's published layout, in place (no-op when
    ``model-mtp.safetensors`` exists; transformers writes ``num_nextn_predict_layers: 1`` but no such layer):
    ``model.layers.{L + i}.`` (L = num_hidden_layers) ``enorm``, ``hnorm``, ``eh_proj`` [hidden, 2 * hidden],
    ``shared_head.norm``, the decoder block of layer index L + i (MLA attention, MoE or dense MLP as that index
    gets from ``first_k_dense_replace``; transformers' initialisation of a deeper model, perturbed), and with
    ``own_head`` / ``own_embed`` the layer's own ``shared_head.head`` / ``embed_tokens`` (random, unlike the
    target's; published checkpoints store copies of the target's). transformers builds no MTP layers, so they go to
    ``model-mtp.safetensors`` (added to the index when there is one), in the checkpoint's stored dtype, and
    config.json gets ``num_nextn_predict_layers``.

    Returns:
        ``ckpt_dir``.
    """
    import json

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_path = os.path.join(ckpt_dir, "config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    if os.path.isfile(os.path.join(ckpt_dir, "model-mtp.safetensors")):
        return ckpt_dir
    hf = AutoConfig.from_pretrained(ckpt_dir)
    L, H, V = hf.num_hidden_layers, hf.hidden_size, hf.vocab_size
    hf.num_hidden_layers = L + num_layers
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
        deep = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    perturb_random_model(deep)
    sd = deep.state_dict()
    std = float(getattr(hf, "initializer_range", 0.02))
    out: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        p = f"model.layers.{L + i}."
        out.update({k: v for k, v in sd.items() if k.startswith(p)})
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            out[f"{p}{norm}.weight"] = 1.0 + 0.1 * torch.randn(H)
        out[p + "eh_proj.weight"] = std * torch.randn(H, 2 * H)
        if own_head:
            out[p + "shared_head.head.weight"] = std * torch.randn(V, H)
        if own_embed:
            out[p + "embed_tokens.weight"] = std * torch.randn(V, H)
    first = sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".safetensors"))[0]
    with safe_open(os.path.join(ckpt_dir, first), framework="pt") as h:  # the checkpoint's stored dtype
        stored = h.get_tensor(next(iter(h.keys()))).dtype
    save_file({k: (v.to(stored) if v.is_floating_point() else v).contiguous() for k, v in out.items()},
              os.path.join(ckpt_dir, "model-mtp.safetensors"), metadata={"format": "pt"})
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            idx = json.load(f)
        idx["weight_map"].update({k: "model-mtp.safetensors" for k in out})
        with open(index, "w") as f:
            json.dump(idx, f, indent=2)
    raw["num_nextn_predict_layers"] = num_layers
    with open(cfg_path, "w") as f:
        json.dump(raw, f, indent=2)
    return ckpt_dir


def perfect_mtp_pair(src: str, dst: str) -> str:
    """Copy the MTP checkpoint ``src`` (single-file, from :func:`add_mtp_layers`) to ``dst`` as a pair whose
    target is a pure bigram model and whose MTP layer predicts it exactly (a perfect drafter for tests and the
    upper-bound benchmark).

    Every attention and MLP output projection is zeroed (o_proj, down_proj, the experts' down projections), so the
    target's final hidden state at t is norm(embed(x_t)) and its greedy next token g(x_t) = argmax
    lm_head(norm(embed(x_t))). The MTP layer gets eh_proj = [I | 0], enorm = 1, a zero block and shared_head.norm
    = the target's final norm: its output at t is rms(embed(x_{t+1})), so its logits are the target's at x_{t+1}
    and every draft, chained or not, is the target's greedy token (up to exact ties).

    Returns:
        ``dst``.
    """
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)

    def zeroed(name):
        return name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj"))

    main = load_file(os.path.join(dst, "model.safetensors"))
    save_file({k: torch.zeros_like(v) if zeroed(k) else v for k, v in main.items()},
              os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    mtp = load_file(os.path.join(dst, "model-mtp.safetensors"))
    for k, v in mtp.items():
        if zeroed(k):
            mtp[k] = torch.zeros_like(v)
        elif k.endswith("eh_proj.weight"):
            H = v.shape[0]
            mtp[k] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1).to(v.dtype)
        elif k.endswith("enorm.weight"):
            mtp[k] = torch.ones_like(v)
        elif k.endswith("shared_head.norm.weight"):
            mtp[k] = main["model.norm.weight"].clone()
    save_file(mtp, os.path.join(dst, "model-mtp.safetensors"), metadata={"format": "pt"})
    return dst
