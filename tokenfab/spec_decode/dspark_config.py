"""DSpark drafter checkpoints: the two published config layouts, read strictly into one :class:`DSparkConfig`.

DSpark is DFlash's block-parallel drafter plus a low-rank Markov logit head (and a confidence head). One draft pass
over ``[anchor, mask x (N - 1)]`` (N = ``block_size``, the anchor = the last sampled token, not yet verified) attends
to context built from the target's hidden states, tapped after the target layers ``target_layer_ids`` at every
verified position, concatenated, projected (``fc``) and normalised (``hidden_norm``).

Layouts read (field names as published):

* **speculators** (vllm-project/speculators, ``speculators_model_type: "dspark"`` on the DFlash fields):
  ``block_size``, ``aux_hidden_state_layer_ids``, ``mask_token_id``, ``target_hidden_size``, ``draft_vocab_size``,
  ``transformer_layer_config`` (the draft layers: hidden size, heads, MLA ranks, ``num_hidden_layers``, optional
  ``layer_types`` / ``draft_layer_types`` and ``linear_attn_config`` for KDA layers), ``markov_rank``,
  ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``, ``sample_from_anchor``
  (speculators' DSpark default: true), optional ``aux_hidden_stream``.
* **SpecForge** (sgl-project/SpecForge ``configs/kimi-k3-dspark-5mla.json`` / ``-4kda-1mla.json``,
  architectures ``KimiK3DSpark5MLADraftModel`` / ``KimiK3DSpark4KDA1MLADraftModel``): a flat Qwen3-style config with
  ``block_size`` (7), ``num_target_layers`` (the target's layer count, 93), the MLA fields, ``mla_use_output_gate``,
  ``rope_theta`` / ``rope_interleave``, ``draft_layer_types`` (4KDA+1MLA: kda, kda, mla, kda, kda) with
  ``linear_attn_config``, and ``dflash_config`` holding ``target_layer_ids`` ([11, 23, 47, 71, 83]),
  ``mask_token_id``, ``markov_rank`` (256), ``markov_head_type``, ``enable_confidence_head``,
  ``confidence_head_with_markov``, optional ``sample_from_anchor`` (SpecForge's DFlash convention: false) and
  ``aux_hidden_stream``.

Conventions fixed here (and why):

* ``sample_from_anchor`` true: block slot j predicts the token after slot j, so one pass yields N drafts; false
  (DFlash): slot 0 is the anchor whose successor the target already gives, slots 1..N-1 yield N - 1 drafts.
* The draft MLA layers rotate the ``qk_rope_head_dim`` slice with RoPE (``rope_theta``, adjacent pairs when
  ``rope_interleave``): SpecForge's K3 draft attention applies RoPE although the config carries
  ``mla_use_nope: true`` (that flag describes the target; the trainer rotates regardless), so both layouts rotate.
  The softmax scale is (qk_nope_head_dim + qk_rope_head_dim)^-0.5; q_a / kv_a layernorms use ``rms_norm_eps``.
* The hidden state tapped after a K3 layer (attention residuals make it ambiguous): ``"partial_sum"`` (the raw
  partial-block sum after the layer, what the Inferact K3 drafter and the implicit DFlash stream read; the default)
  or ``"attn_res_mixture"`` (the attention-residual mix the next layer would compute from the completed blocks and
  that sum, with that layer's ``self_attention_res`` pair, or the output mix after the last layer: TorchSpec-trained
  drafters, SGLang). A checkpoint says which with ``aux_hidden_stream`` (``prefix`` / ``attn_res``);
  ``speculative_config.dspark_tap`` overrides it. On targets without attention residuals both are the layer output.
* The confidence head is loaded (its weights validated) and ignored at inference: every block is verified whole.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from tokenfab.errors import EngineConfigError, UnsupportedError

TAPS = ("partial_sum", "attn_res_mixture")
_TAP_ALIASES = {"prefix": "partial_sum", "partial_sum": "partial_sum", "attn_res": "attn_res_mixture",
                "attn_res_mixture": "attn_res_mixture"}
SPECFORGE_ARCHS = {"KimiK3DSpark5MLADraftModel": ["mla"] * 5,
                   "KimiK3DSpark4KDA1MLADraftModel": ["kda", "kda", "mla", "kda", "kda"]}


@dataclass
class DSparkConfig:
    """A DSpark drafter's network and block settings (units: tokens, features).

    Attributes:
        layout: "speculators" or "specforge" (where it was read from).
        block_size: N, query tokens per draft pass ([anchor, mask x (N - 1)]).
        sample_from_anchor: True: N drafts per pass (slot j predicts position p + j + 1); False: N - 1 (slots 1..).
        target_layer_ids: 0-indexed target layers whose output hidden states are tapped, in concatenation order.
        target_hidden_size: width of one tap; fc maps len(target_layer_ids) * target_hidden_size -> hidden_size.
        target_num_layers: the target's layer count the drafter was trained for (None: not stated).
        mask_token_id: id whose target embedding fills the N - 1 mask slots.
        vocab_size: the target's vocabulary (the drafter samples through the target's lm_head).
        layer_types: per draft layer "mla" or "kda".
        aux_hidden_stream: "partial_sum" or "attn_res_mixture" as the checkpoint declares it (see module doc).
        markov_rank: r of the vanilla Markov head (bias = W2 W1[prev token]); 0 = no head.
        enable_confidence_head / confidence_head_with_markov: the confidence head's presence and input width
            (hidden_size + markov_rank when with Markov); loaded, not used at inference.
        other fields: the draft layers' sizes (MLA: heads, q_lora_rank, kv_lora_rank, qk_nope/rope/v head dims,
            output gate; KDA: heads, head_dim, conv kernel, gate lower bound, full-rank gate), RoPE theta/layout.
    """

    layout: str
    block_size: int
    sample_from_anchor: bool
    target_layer_ids: list[int]
    target_hidden_size: int
    mask_token_id: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    rms_norm_eps: float
    layer_types: list[str]
    num_attention_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_use_output_gate: bool = False
    attention_bias: bool = False
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    kda_num_heads: int = 0
    kda_head_dim: int = 0
    kda_conv_kernel: int = 4
    gate_lower_bound: float | None = None
    use_full_rank_gate: bool = False
    markov_rank: int = 0
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    aux_hidden_stream: str = "partial_sum"
    target_num_layers: int | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def num_drafts(self) -> int:
        """Draft tokens one pass yields: N with sample_from_anchor, else N - 1."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    # The attribute names tokenfab's MLA / KDA layer classes read from a model config.
    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "kda"]

    def softmax_scale(self) -> float:
        """MLA softmax scale (qk_nope_head_dim + qk_rope_head_dim)^-0.5 (SpecForge's K3 draft attention)."""
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5


def _fail(where: str, msg: str) -> EngineConfigError:
    return EngineConfigError(f"DSpark drafter config.json: '{where}' {msg}")


def _req(d: dict, name: str, where: str, kind=int, lo: int | None = None):
    if name not in d or d[name] is None:
        raise _fail(where + name, "is missing; the published layout requires it.")
    return _typed(d, name, where, kind, lo)


def _opt(d: dict, name: str, where: str, kind, default, lo: int | None = None):
    if name not in d or d[name] is None:
        return default
    return _typed(d, name, where, kind, lo)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# kind -> (does a value have it, what the error says it must be, conversion of an accepted value or None)
_KINDS = {
    bool: (lambda v: isinstance(v, bool), "true or false", None),
    int: (_is_int, "an integer", None),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number", float),
    str: (lambda v: isinstance(v, str), "a string", None),
    list: (lambda v: isinstance(v, list) and bool(v) and all(_is_int(x) for x in v),
           "a non-empty list of integers", list),
    dict: (lambda v: isinstance(v, dict), "an object", None),
}


def _typed(d: dict, name: str, where: str, kind, lo):
    v = d[name]
    if kind not in _KINDS:
        raise AssertionError(kind)
    ok, what, convert = _KINDS[kind]
    if not ok(v):
        raise _fail(where + name, f"must be {what}, got {v!r}.")
    if kind is int and lo is not None and v < lo:
        raise _fail(where + name, f"must be >= {lo}, got {v}.")
    return convert(v) if convert is not None else v


def _layer_types(d: dict, where: str, n: int, default: list[str] | None) -> list[str]:
    """Draft layer kinds from ``draft_layer_types`` (kda / mla) or ``layer_types`` (full_attention / mla ->
    mla, linear_attention / kda -> kda); default all MLA."""
    names = {"mla": "mla", "full_attention": "mla", "kda": "kda", "linear_attention": "kda"}
    for key in ("draft_layer_types", "layer_types"):
        lt = d.get(key)
        if lt is None:
            continue
        if not isinstance(lt, list) or len(lt) != n or any(x not in names for x in lt):
            raise _fail(where + key, f"must list {n} entries (num_hidden_layers) of kda / mla (or full_attention / "
                        f"linear_attention), got {lt!r}.")
        return [names[x] for x in lt]
    return list(default) if default is not None else ["mla"] * n


def _layer_fields(cfg: DSparkConfig, d: dict, where: str) -> None:
    """MLA / KDA sizes and RoPE of the draft layers from a layer config dict ``d`` (SpecForge: the top level;
    speculators: ``transformer_layer_config``)."""
    act = _opt(d, "hidden_act", where, str, "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedError(f"DSpark drafter config.json: '{where}hidden_act' '{act}' is not supported "
                               "(the published drafters use silu).")
    if "mla" in cfg.layer_types:
        cfg.num_attention_heads = _req(d, "num_attention_heads", where, int, 1)
        cfg.q_lora_rank = _opt(d, "q_lora_rank", where, int, None, 1)
        cfg.kv_lora_rank = _req(d, "kv_lora_rank", where, int, 1)
        cfg.qk_nope_head_dim = _req(d, "qk_nope_head_dim", where, int, 1)
        cfg.qk_rope_head_dim = _req(d, "qk_rope_head_dim", where, int, 0)
        if cfg.qk_rope_head_dim % 2:
            raise _fail(where + "qk_rope_head_dim", f"must be even (RoPE rotates pairs), got {cfg.qk_rope_head_dim}.")
        cfg.v_head_dim = _req(d, "v_head_dim", where, int, 1)
        cfg.mla_use_output_gate = _opt(d, "mla_use_output_gate", where, bool, False)
        cfg.attention_bias = _opt(d, "attention_bias", where, bool, False)
        scaling = d.get("rope_scaling")
        if scaling not in (None, {}) and (not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get(
                "type", "default")) != "default"):
            raise UnsupportedError(f"DSpark drafter config.json: '{where}rope_scaling' {scaling!r} is not supported "
                                   "(the published K3 drafters use plain RoPE: rope_scaling null).")
        rp = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
        cfg.rope_theta = float(rp.get("rope_theta", _opt(d, "rope_theta", where, float, 10000.0)))
        cfg.rope_interleave = _opt(d, "rope_interleave", where, bool, True)
    if "kda" in cfg.layer_types:
        lac = _req(d, "linear_attn_config", where, dict)
        w = where + "linear_attn_config."
        cfg.kda_num_heads = _req(lac, "num_heads", w, int, 1)
        cfg.kda_head_dim = _req(lac, "head_dim", w, int, 1)
        cfg.kda_conv_kernel = _opt(lac, "short_conv_kernel_size", w, int, 4, 1)
        cfg.gate_lower_bound = _opt(lac, "gate_lower_bound", w, float, None)
        cfg.use_full_rank_gate = _opt(lac, "use_full_rank_gate", w, bool, False)


def _heads(cfg: DSparkConfig, d: dict, where: str) -> None:
    """Markov / confidence head fields and the tap stream from dict ``d``."""
    cfg.markov_rank = _opt(d, "markov_rank", where, int, 0, 0)
    mht = _opt(d, "markov_head_type", where, str, "vanilla")
    if cfg.markov_rank and mht.lower() != "vanilla":
        raise UnsupportedError(f"DSpark drafter config.json: '{where}markov_head_type' '{mht}' is not supported; "
                               "tokenfab runs the vanilla Markov head (the published K3 drafters').")
    cfg.enable_confidence_head = _opt(d, "enable_confidence_head", where, bool, False)
    cfg.confidence_head_with_markov = _opt(d, "confidence_head_with_markov", where, bool, False)
    if cfg.enable_confidence_head and cfg.confidence_head_with_markov and not cfg.markov_rank:
        raise _fail(where + "confidence_head_with_markov", "is true but markov_rank is 0 (no Markov head).")
    s = _opt(d, "aux_hidden_stream", where, str, "prefix").lower()
    if s not in _TAP_ALIASES:
        raise _fail(where + "aux_hidden_stream", f"'{s}' is unknown; use prefix or attn_res.")
    cfg.aux_hidden_stream = _TAP_ALIASES[s]
    if _opt(d, "fc_norm", where, bool, False):
        raise UnsupportedError(f"DSpark drafter config.json: '{where}fc_norm' (a norm per tap before fc) is not "
                               "supported yet.")


def _read_speculators(raw: dict) -> DSparkConfig:
    mt = raw.get("speculators_model_type")
    if mt != "dspark":
        raise _fail("speculators_model_type", f"must be 'dspark' for method 'dspark', got {mt!r}.")
    tl = _req(raw, "transformer_layer_config", "", dict)
    w = "transformer_layer_config."
    n = _req(tl, "num_hidden_layers", w, int, 1)
    vocab = _req(tl, "vocab_size", w, int, 1)
    dv = _opt(raw, "draft_vocab_size", "", int, vocab, 1)
    if dv != vocab:
        raise UnsupportedError(f"DSpark drafter config.json: 'draft_vocab_size' ({dv}) differs from "
                               f"transformer_layer_config.vocab_size ({vocab}); pruned draft vocabularies (d2t / t2d "
                               "maps) are not supported: the drafter samples through the target's lm_head.")
    ids = _req(raw, "aux_hidden_state_layer_ids", "", list)
    hidden = _req(tl, "hidden_size", w, int, 1)
    cfg = DSparkConfig(
        layout="speculators", block_size=_req(raw, "block_size", "", int, 1),
        sample_from_anchor=_opt(raw, "sample_from_anchor", "", bool, True), target_layer_ids=ids,
        target_hidden_size=_opt(raw, "target_hidden_size", "", int, hidden, 1),
        mask_token_id=_req(raw, "mask_token_id", "", int, 0), vocab_size=vocab, hidden_size=hidden,
        intermediate_size=_req(tl, "intermediate_size", w, int, 1),
        rms_norm_eps=_opt(tl, "rms_norm_eps", w, float, 1e-6), layer_types=_layer_types(tl, w, n, None), raw=raw)
    _layer_fields(cfg, tl, w)
    _heads(cfg, raw, "")
    vc = (raw.get("speculators_config") or {}).get("verifier") if isinstance(raw.get("speculators_config"),
                                                                            dict) else None
    if isinstance(vc, dict) and isinstance(vc.get("num_hidden_layers"), int):
        cfg.target_num_layers = vc["num_hidden_layers"]
    return cfg


def _read_specforge(raw: dict) -> DSparkConfig:
    archs = raw.get("architectures")
    arch = next((a for a in archs if a in SPECFORGE_ARCHS), None) if isinstance(archs, list) else None
    if arch is None:
        raise _fail("architectures", f"{archs!r} names no DSpark drafter; expected one of "
                    f"{sorted(SPECFORGE_ARCHS)} (SpecForge layout) or a speculators config "
                    "(speculators_model_type: dspark).")
    dc = _req(raw, "dflash_config", "", dict)
    n = _req(raw, "num_hidden_layers", "", int, 1)
    types = _layer_types(raw, "", n, SPECFORGE_ARCHS[arch])
    if types != SPECFORGE_ARCHS[arch]:
        raise _fail("draft_layer_types", f"{types} does not match architecture {arch} "
                    f"({SPECFORGE_ARCHS[arch]}).")
    cfg = DSparkConfig(
        layout="specforge", block_size=_req(raw, "block_size", "", int, 1),
        sample_from_anchor=_opt(dc, "sample_from_anchor", "dflash_config.", bool, False),
        target_layer_ids=_req(dc, "target_layer_ids", "dflash_config.", list),
        target_hidden_size=_opt(raw, "target_hidden_size", "", int, None, 1) or _req(raw, "hidden_size", "", int, 1),
        mask_token_id=_req(dc, "mask_token_id", "dflash_config.", int, 0),
        vocab_size=_req(raw, "vocab_size", "", int, 1), hidden_size=_req(raw, "hidden_size", "", int, 1),
        intermediate_size=_req(raw, "intermediate_size", "", int, 1),
        rms_norm_eps=_opt(raw, "rms_norm_eps", "", float, 1e-6), layer_types=types, raw=raw)
    cfg.target_num_layers = _opt(raw, "num_target_layers", "", int, None, 1)
    _layer_fields(cfg, raw, "")
    _heads(cfg, dc, "dflash_config.")
    return cfg


def parse_dspark_config(raw: dict) -> DSparkConfig:
    """A drafter ``config.json`` dict (either layout) -> :class:`DSparkConfig`.

    Raises:
        EngineConfigError: a missing, mistyped or out-of-range field, named with its path (e.g.
            ``'dflash_config.mask_token_id' is missing``), or settings that contradict each other.
        UnsupportedError: a published option tokenfab does not run (gated / rnn Markov heads, pruned draft vocabulary,
            scaled RoPE, per-tap fc norms), by field.
    """
    if not isinstance(raw, dict):
        raise EngineConfigError("DSpark drafter config.json must hold a JSON object.")
    cfg = _read_speculators(raw) if "speculators_model_type" in raw else _read_specforge(raw)
    if cfg.block_size < 2 and not cfg.sample_from_anchor:
        raise _fail("block_size", f"must be >= 2 without sample_from_anchor (slot 0 is the anchor), got "
                    f"{cfg.block_size}.")
    ids = cfg.target_layer_ids
    where = "aux_hidden_state_layer_ids" if cfg.layout == "speculators" else "dflash_config.target_layer_ids"
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise _fail(where, f"must be distinct 0-indexed layer ids, got {ids}.")
    if cfg.target_num_layers is not None and max(ids) >= cfg.target_num_layers:
        raise _fail(where, f"names layer {max(ids)}, out of range for a {cfg.target_num_layers}-layer target.")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise _fail("mask_token_id", f"{cfg.mask_token_id} is outside the vocabulary [0, {cfg.vocab_size}).")
    return cfg


def load_dspark_config(path: str) -> DSparkConfig:
    """Read ``path``/config.json (a DSpark drafter folder) with :func:`parse_dspark_config`.

    Raises:
        EngineConfigError: no folder / config.json, unreadable JSON, or a field error (named).
    """
    fn = os.path.join(path, "config.json")
    if not os.path.isfile(fn):
        raise EngineConfigError(f"speculative_config.model '{path}' is not a DSpark drafter folder (no config.json).")
    try:
        with open(fn) as f:
            raw = json.load(f)
    except ValueError as e:
        raise EngineConfigError(f"DSpark drafter {fn}: not valid JSON ({e}).") from None
    return parse_dspark_config(raw)


def resolve_tap(cfg: DSparkConfig, override: str | None) -> str:
    """The tap to use: ``speculative_config.dspark_tap`` when given, else the checkpoint's ``aux_hidden_stream``.

    Raises:
        EngineConfigError: an override that is not one of :data:`TAPS` (or the checkpoint aliases prefix / attn_res).
    """
    if override is None:
        return cfg.aux_hidden_stream
    if override not in _TAP_ALIASES:
        raise EngineConfigError(f"speculative_config.dspark_tap '{override}' is unknown; use one of "
                                f"{', '.join(TAPS)}.")
    return _TAP_ALIASES[override]


def check_against_target(cfg: DSparkConfig, target_cfg) -> None:
    """Refuse a drafter that does not fit the loaded target (each message names the field).

    Raises:
        EngineConfigError: vocabulary, tap width or tapped layer range mismatch.
    """
    if cfg.vocab_size != target_cfg.vocab_size:
        raise EngineConfigError(f"DSpark drafter vocab_size ({cfg.vocab_size}) differs from the target's "
                                f"({target_cfg.vocab_size}); the drafter samples through the target's lm_head.")
    if cfg.target_hidden_size != target_cfg.hidden_size:
        raise EngineConfigError(f"DSpark drafter target_hidden_size ({cfg.target_hidden_size}) differs from the "
                                f"target's hidden_size ({target_cfg.hidden_size}).")
    L = target_cfg.num_hidden_layers
    if max(cfg.target_layer_ids) >= L:
        raise EngineConfigError(f"DSpark drafter target layer ids {cfg.target_layer_ids} go past the target's "
                                f"{L} layers (0-indexed).")
    if cfg.target_num_layers is not None and cfg.target_num_layers != L:
        raise EngineConfigError(f"DSpark drafter was trained for a {cfg.target_num_layers}-layer target "
                                f"(num_target_layers) but the target has {L} layers.")
