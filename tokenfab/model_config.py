"""The normalized model description every config dialect parses into: :class:`ModelConfig` and its parts.

:mod:`tokenfab.config` (Llama, Qwen3, DeepSeek-V3 / Kimi-K2) and :mod:`tokenfab.config_kimi` (Kimi Linear / K3)
both build these. Imports flow one way: ``config -> config_kimi -> model_config`` and ``config -> model_config``
(``config.parse_config`` hands Kimi configs to ``config_kimi.parse_kimi_config``); the public names here are
re-exported by :mod:`tokenfab.config`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A checkpoint config we refuse: the message names the field, the value found and what is supported."""


@dataclass
class RopeConfig:
    """Rotary position embedding parameters, normalized from either config dialect.

    ``dim`` is the number of rotated dimensions per head (for MLA: ``qk_rope_head_dim``).
    ``interleave``: DeepSeek-V3's layout, in which rotary pairs are adjacent (x0, x1), (x2, x3) ...; HF's
    ``apply_rotary_pos_emb_interleave`` rotates those pairs and writes the result de-interleaved.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    dim: int = 0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    interleave: bool = False


@dataclass
class ModelConfig:
    """Everything the engine needs to know about a model, with defaults resolved.

    Sizes are counts (heads, experts) or element counts (dimensions); ``max_position_embeddings`` is in tokens.
    """

    architecture: str
    family: str  # "deepseek_v3" | "llama" | "qwen3" | "qwen3_moe"
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # MoE (0 experts means dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "softmax"
    moe_layers: list[int] = field(default_factory=list)
    # MLA (DeepSeek-V3 / Kimi-K2)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_nextn_predict_layers: int = 0
    # FP8 block-scaled weights (quantization_config quant_method fp8): the weight block (rows, columns), else None
    fp8_block_size: tuple[int, int] | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.family == "deepseek_v3"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def kv_cache_entry_dims(self) -> tuple[int, int]:
        """Per-token, per-layer cache row: (number of cached vectors, width of each).

        MLA caches one vector of ``kv_lora_rank + qk_rope_head_dim`` (the compressed latent plus the rope key);
        multi-head attention caches K and V for every KV head: ``2 * num_key_value_heads`` vectors of ``head_dim``.
        """
        if self.is_mla:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_key_value_heads, self.head_dim

    def kv_cache_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes for one token over all layers, e.g. MLA: (kv_lora_rank + qk_rope_head_dim) x layers x bytes."""
        n, w = self.kv_cache_entry_dims()
        return n * w * self.num_hidden_layers * dtype_bytes

    def softmax_scale(self) -> float:
        """Attention softmax scale.

        MHA: head_dim^-0.5. MLA: qk_head_dim^-0.5, times mscale^2 with YaRN, where
        mscale = 0.1 * mscale_all_dim * ln(factor) + 1 (DeepSeek-V3 modeling, ``yarn_get_mscale``; transformers'
        ``yarn_apply_mscale`` applies it only when mscale_all_dim is set and non-zero).
        """
        if not self.is_mla:
            return self.head_dim ** -0.5
        scale = self.qk_head_dim ** -0.5
        r = self.rope
        if r.rope_type != "default" and r.mscale_all_dim:
            m = yarn_get_mscale(r.factor, r.mscale_all_dim)
            scale = scale * m * m
        return scale


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude scale 0.1 * mscale * ln(scale) + 1 (1.0 when scale <= 1). Source: YaRN paper, DeepSeek-V3."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def eos_token_ids(cfg: dict, gen_cfg: dict | None) -> list[int]:
    """End-of-sequence token ids, ``generation_config.json`` first, then ``config.json``, without repeats.

    Each file's ``eos_token_id`` may be one id or a list; ids keep their first-seen order.
    """
    ids: list[int] = []
    for src in (gen_cfg or {}, cfg):
        v = src.get("eos_token_id")
        if v is None:
            continue
        for x in v if isinstance(v, list) else [v]:
            if int(x) not in ids:
                ids.append(int(x))
    return ids
