"""Strict parsing of Kimi Linear (``KimiLinearForCausalLM``) and Kimi K3 (``KimiK3ForConditionalGeneration``)
configs into one :class:`KimiConfig`.

Two dialects of the Kimi Linear layer pattern read to the same model:

* published (Moonshot's ``config.json``): ``linear_attn_config = {num_heads, head_dim, short_conv_kernel_size,
  kda_layers, full_attn_layers, [gate_lower_bound], [use_full_rank_gate]}`` with **1-indexed** layer lists, and
  ``first_k_dense_replace`` / ``moe_layer_freq`` for the MLP pattern;
* transformers 5 (``KimiLinearConfig.save_pretrained``): ``layer_types`` (``"linear_attention"`` /
  ``"full_attention"``), ``mlp_layer_types`` (``"dense"`` / ``"sparse"``), ``linear_num_heads``,
  ``linear_head_dim``, ``linear_conv_kernel_dim``.

Both dialects use Moonshot's MoE names (``num_experts``, ``num_experts_per_token``, ``moe_renormalize``,
``num_expert_group``, ``num_shared_experts``, ``model_max_length``); the DeepSeek-style aliases
(``num_local_experts``/``n_routed_experts``, ``num_experts_per_tok``, ``norm_topk_prob``, ``n_group``,
``n_shared_experts``, ``max_position_embeddings``) are accepted too (transformers' ``attribute_map``).

Kimi K3 nests the text model under ``text_config`` (weights under ``language_model.``) and adds: gated MLA
(``mla_use_output_gate``), block attention residuals (``attn_res_block_size``), latent MoE
(``routed_expert_hidden_size``, ``latent_moe_use_norm``), SiTU-GLU (``hidden_act: "situ"``,
``activation_situ_beta``, ``activation_situ_linear_beta``), the bounded KDA gate (``gate_lower_bound``), the
full-rank KDA output gate (``use_full_rank_gate``) and MXFP4 routed experts (``quantization_config``).

Every error is a :class:`tokenfab.model_config.ConfigError` (also importable from :mod:`tokenfab.config`) naming
the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenfab.model_config import ConfigError, ModelConfig, RopeConfig, eos_token_ids
from tokenfab.models.architectures import ARCHITECTURES

# the hybrid families of models/architectures.py's table: architecture -> family, and their own model_type values
KIMI_ARCHITECTURES = {a.name: a.family for a in ARCHITECTURES.values() if a.hybrid}
KIMI_MODEL_TYPES = {a.model_types[0] for a in ARCHITECTURES.values() if a.hybrid}


@dataclass
class KimiConfig(ModelConfig):
    """A :class:`ModelConfig` for the hybrid KDA + MLA families.

    ``layer_types[i]`` is ``"kda"`` (Kimi Delta Attention, recurrent state) or ``"mla"`` (NoPE MLA, paged latent
    cache); 0-indexed. KDA sizes: ``kda_num_heads`` heads of ``kda_head_dim`` (q, k and v share it), depthwise
    causal conv of ``kda_conv_kernel`` taps. ``weight_prefix`` is stripped from checkpoint names (K3:
    ``"language_model."``).
    """

    layer_types: list[str] = field(default_factory=list)
    kda_num_heads: int = 0
    kda_head_dim: int = 0
    kda_conv_kernel: int = 4
    gate_lower_bound: float | None = None
    use_full_rank_gate: bool = False
    mla_use_output_gate: bool = False
    attn_res_block_size: int | None = None
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    situ_beta: float = 1.0
    situ_linear_beta: float | None = None
    mxfp4_experts: bool = False
    weight_prefix: str = ""

    @property
    def is_mla(self) -> bool:  # MLA layers (NoPE); KDA layers keep no paged cache
        return True

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "mla"]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "kda"]

    def kv_cache_bytes_per_token(self, dtype_bytes: int) -> int:
        """Paged-cache bytes per token: (kv_lora_rank + qk_rope_head_dim) x MLA layers x dtype bytes.

        KDA layers keep no per-token cache (see :meth:`kda_state_bytes_per_request`). A model without MLA layers
        reports ``dtype_bytes`` (a nominal 1-element row) so the block pool bookkeeping still has a size.
        """
        n = (self.kv_lora_rank + self.qk_rope_head_dim) * len(self.mla_layers) * dtype_bytes
        return n if n > 0 else dtype_bytes

    def kda_state_bytes_per_request(self, dtype_bytes: int) -> int:
        """Per-request KDA state over all KDA layers, in bytes.

        Per layer: conv state 3 x (H x D) channels x (kernel - 1) taps in the activation dtype, plus the fp32
        recurrent state H x D x D x 4 bytes (H = kda_num_heads, D = kda_head_dim).
        """
        hd = self.kda_num_heads * self.kda_head_dim
        per_layer = 3 * hd * (self.kda_conv_kernel - 1) * dtype_bytes + self.kda_num_heads * self.kda_head_dim ** 2 * 4
        return per_layer * len(self.kda_layers)

    def softmax_scale(self) -> float:
        """MLA softmax scale qk_head_dim^-0.5 (NoPE MLA: no YaRN mscale; transformers KimiLinearAttention)."""
        return self.qk_head_dim ** -0.5


def _get(cfg: dict, *names, default=None):
    """First present, non-None value among ``names`` (config aliases), else ``default``."""
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def _one_indexed_layers(lac: dict, key: str, num_layers: int, where: str) -> list[int]:
    vals = lac.get(key)
    if not isinstance(vals, list):
        raise ConfigError(f"config.json: '{where}.{key}' must be a list of 1-indexed layer numbers, got {vals!r}.")
    out = []
    for v in vals:
        if not isinstance(v, int) or not 1 <= v <= num_layers:
            raise ConfigError(f"config.json: '{where}.{key}' names layer {v!r}, out of range: layers are 1-indexed "
                              f"1..{num_layers} (num_hidden_layers = {num_layers}).")
        out.append(v - 1)
    return out


def _layer_types(cfg: dict, L: int, where: str) -> tuple[list[str], dict]:
    """Resolve the attention pattern (0-indexed "kda"/"mla") and the KDA sizes from either dialect."""
    lac = cfg.get("linear_attn_config")
    if cfg.get("layer_types") is not None:
        lt = cfg["layer_types"]
        if not isinstance(lt, list) or len(lt) != L:
            raise ConfigError(f"config.json: '{where}layer_types' must list {L} entries (num_hidden_layers), got "
                              f"{len(lt) if isinstance(lt, list) else lt!r}.")
        m = {"linear_attention": "kda", "full_attention": "mla"}
        bad = [x for x in lt if x not in m]
        if bad:
            raise ConfigError(f"config.json: '{where}layer_types' has unsupported entries {sorted(set(map(str, bad)))}; "
                              "supported: linear_attention, full_attention.")
        types = [m[x] for x in lt]
    elif isinstance(lac, dict) and ("kda_layers" in lac or "full_attn_layers" in lac):
        kda = _one_indexed_layers(lac, "kda_layers", L, where + "linear_attn_config")
        full = _one_indexed_layers(lac, "full_attn_layers", L, where + "linear_attn_config")
        both = sorted(set(kda) & set(full))
        if both:
            raise ConfigError(f"config.json: layers {[i + 1 for i in both]} are in both "
                              f"'{where}linear_attn_config.kda_layers' and 'full_attn_layers'.")
        none = [i + 1 for i in range(L) if i not in kda and i not in full]
        if none:
            raise ConfigError(f"config.json: layers {none} (1-indexed) are in neither "
                              f"'{where}linear_attn_config.kda_layers' nor 'full_attn_layers'.")
        types = ["kda" if i in kda else "mla" for i in range(L)]
    else:  # transformers' KimiLinearConfig default pattern
        types = ["mla" if i and i % 4 == 0 else "kda" for i in range(L)]
    lac = lac if isinstance(lac, dict) else {}
    sizes = {
        "num_heads": _get(lac, "num_heads", default=_get(cfg, "linear_num_heads")),
        "head_dim": _get(lac, "head_dim", default=_get(cfg, "linear_head_dim")),
        "kernel": _get(lac, "short_conv_kernel_size", default=_get(cfg, "linear_conv_kernel_dim", default=4)),
        "gate_lower_bound": lac.get("gate_lower_bound"),
        "use_full_rank_gate": bool(lac.get("use_full_rank_gate", False)),
    }
    return types, sizes


def parse_kimi_config(cfg: dict, gen_cfg: dict | None = None) -> KimiConfig:
    """Parse a Kimi Linear or Kimi K3 ``config.json`` dict.

    Raises:
        ConfigError: missing required field (named), a layer index out of range, inconsistent layer lists,
            unsupported activation / router / quantization.
    """
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in KIMI_ARCHITECTURES), None)
    mt = cfg.get("model_type")
    if arch is None:
        arch = next((a.name for a in ARCHITECTURES.values() if a.hybrid and a.model_types[0] == mt), None)
        if arch is None:
            raise ConfigError(f"config.json: architecture {archs} / model_type '{mt}' is not a Kimi Linear / K3 model.")
    family = KIMI_ARCHITECTURES[arch]
    prefix, where, top = "", "", cfg
    if family == "kimi_k3":
        tc = cfg.get("text_config")
        if not isinstance(tc, dict):
            raise ConfigError("config.json: required field 'text_config' is missing (architecture "
                              "KimiK3ForConditionalGeneration keeps its text model there).")
        cfg, prefix, where = tc, "language_model.", "text_config."
        tmt = cfg.get("model_type", "kimi_linear")
        if tmt not in ("kimi_linear", "kimi_k3_text", "kimi_k3"):
            raise ConfigError(f"config.json: text_config.model_type '{tmt}' is not supported (expected kimi_linear).")
    elif mt is not None and mt != "kimi_linear":
        raise ConfigError(f"config.json: model_type '{mt}' does not match architecture {arch} (expected kimi_linear).")
    ctx = f"architecture {arch}"

    def need(*names):
        v = _get(cfg, *names)
        if v is None:
            alts = " (or " + ", ".join(f"'{where}{n}'" for n in names[1:]) + ")" if len(names) > 1 else ""
            raise ConfigError(f"config.json: required field '{where}{names[0]}'{alts} is missing ({ctx}). Add it "
                              "to config.json.")
        return v

    L = int(need("num_hidden_layers"))
    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish", "situ"):
        raise ConfigError(f"config.json: activation '{act}' (field '{where}hidden_act') is not supported; supported: "
                          "silu, swish, situ.")
    types, kda = _layer_types(cfg, L, where)
    eos = eos_token_ids(cfg, gen_cfg)
    if top is not cfg:
        for x in eos_token_ids(top, None):
            if x not in eos:
                eos.append(x)
    mc = KimiConfig(
        architecture=arch, family=family, model_type=mt or family, vocab_size=int(need("vocab_size")),
        hidden_size=hidden, intermediate_size=int(need("intermediate_size")), num_hidden_layers=L,
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(need("qk_nope_head_dim")) + int(need("qk_rope_head_dim")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), hidden_act=act,
        max_position_embeddings=int(need("model_max_length", "max_position_embeddings")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=False,
        rope=RopeConfig(rope_type="default", dim=int(cfg["qk_rope_head_dim"])), eos_token_ids=eos,
        bos_token_id=_get(cfg, "bos_token_id", default=top.get("bos_token_id")), raw=top, layer_types=types,
        weight_prefix=prefix,
    )
    mc.q_lora_rank = cfg.get("q_lora_rank")
    mc.kv_lora_rank = int(need("kv_lora_rank"))
    mc.qk_nope_head_dim = int(cfg["qk_nope_head_dim"])
    mc.qk_rope_head_dim = int(cfg["qk_rope_head_dim"])
    mc.v_head_dim = int(need("v_head_dim"))
    if "kda" in types:
        for k, f in (("num_heads", "linear_attn_config.num_heads' (or 'linear_num_heads"),
                     ("head_dim", "linear_attn_config.head_dim' (or 'linear_head_dim")):
            if kda[k] is None:
                raise ConfigError(f"config.json: required field '{where}{f}') is missing ({ctx}); KDA layers need it.")
    mc.kda_num_heads = int(kda["num_heads"] or 0)
    mc.kda_head_dim = int(kda["head_dim"] or 0)
    mc.kda_conv_kernel = int(kda["kernel"])
    if mc.kda_conv_kernel < 1:
        raise ConfigError(f"config.json: '{where}linear_attn_config.short_conv_kernel_size' must be >= 1.")
    mc.gate_lower_bound = None if kda["gate_lower_bound"] is None else float(kda["gate_lower_bound"])
    mc.use_full_rank_gate = kda["use_full_rank_gate"]
    mc.mla_use_output_gate = bool(cfg.get("mla_use_output_gate", False))
    arb = cfg.get("attn_res_block_size")
    if arb is not None and int(arb) < 1:
        raise ConfigError(f"config.json: '{where}attn_res_block_size' must be >= 1, got {arb}.")
    mc.attn_res_block_size = None if arb is None else int(arb)
    if act == "situ":
        mc.situ_beta = float(_get(cfg, "activation_situ_beta", default=1.0))
        lb = cfg.get("activation_situ_linear_beta")
        mc.situ_linear_beta = None if lb is None else float(lb)
        if mc.situ_beta <= 0 or (mc.situ_linear_beta is not None and mc.situ_linear_beta <= 0):
            raise ConfigError(f"config.json: '{where}activation_situ_beta' / 'activation_situ_linear_beta' must be > 0.")
    # MoE
    mc.num_experts = int(_get(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0)
    if mc.num_experts:
        mc.num_experts_per_tok = int(need("num_experts_per_token", "num_experts_per_tok"))
        mc.moe_intermediate_size = int(need("moe_intermediate_size"))
        mc.n_shared_experts = int(_get(cfg, "num_shared_experts", "n_shared_experts", default=0) or 0)
        mc.routed_scaling_factor = float(cfg.get("routed_scaling_factor", 1.0))
        mc.n_group = int(_get(cfg, "num_expert_group", "n_group", default=1) or 1)
        mc.topk_group = int(cfg.get("topk_group") or 1)
        # Moonshot's router renormalizes the chosen weights only when top_k > 1 (and moe_renormalize): at top_k = 1
        # the single weight stays the raw sigmoid score (renormalizing would make every routed output weight 1).
        mc.norm_topk_prob = (bool(_get(cfg, "moe_renormalize", "norm_topk_prob", default=True))
                             and mc.num_experts_per_tok > 1)
        mc.scoring_func = "sigmoid"
        act_fn = cfg.get("moe_router_activation_func", "sigmoid")
        if act_fn != "sigmoid":
            raise ConfigError(f"config.json: '{where}moe_router_activation_func' '{act_fn}' is not supported "
                              "(supported: sigmoid).")
        if mc.num_experts % mc.n_group:
            raise ConfigError(f"config.json: num_experts {mc.num_experts} is not a multiple of num_expert_group "
                              f"{mc.n_group}.")
        if mc.num_experts_per_tok > mc.num_experts:
            raise ConfigError(f"config.json: '{where}num_experts_per_token' {mc.num_experts_per_tok} exceeds "
                              f"num_experts {mc.num_experts}.")
        mlt = cfg.get("mlp_layer_types")
        if mlt is not None:
            if not isinstance(mlt, list) or len(mlt) != L or any(x not in ("dense", "sparse") for x in mlt):
                raise ConfigError(f"config.json: '{where}mlp_layer_types' must list {L} entries of dense/sparse.")
            mc.moe_layers = [i for i, x in enumerate(mlt) if x == "sparse"]
        else:
            k_dense = int(_get(cfg, "first_k_dense_replace", default=1))
            freq = int(cfg.get("moe_layer_freq") or 1)
            # Moonshot's placement: layer i is MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0
            # (not (i - first_k_dense_replace) % freq, which differs when freq > 1).
            mc.moe_layers = [i for i in range(L) if i >= k_dense and i % freq == 0]
        rehs = cfg.get("routed_expert_hidden_size")
        mc.routed_expert_hidden_size = None if rehs is None else int(rehs)
        mc.latent_moe_use_norm = bool(cfg.get("latent_moe_use_norm", False)) and rehs is not None
    mc.num_nextn_predict_layers = int(cfg.get("num_nextn_predict_layers") or 0)
    qc = top.get("quantization_config") or cfg.get("quantization_config")
    if qc:
        mc.mxfp4_experts = _parse_quant(qc)
    return mc


def _parse_quant(qc: dict) -> bool:
    """Accept compressed-tensors ``mxfp4-pack-quantized`` (routed experts). Returns True when MXFP4 is used."""
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(f"config.json: quantization_config.quant_method '{method}' is not supported for Kimi "
                          "models (supported: compressed-tensors with format mxfp4-pack-quantized).")
    fmts = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()
                                 if isinstance(g, dict)}
    fmts.discard(None)
    bad = fmts - {"mxfp4-pack-quantized"}
    if bad:
        raise ConfigError(f"config.json: quantization_config format {sorted(bad)} is not supported (supported: "
                          "mxfp4-pack-quantized).")
    return True
