"""``speculative_config`` in vLLM's shape: parsing and strict validation.

Accepted (``LLM(..., speculative_config={...})``, ``tokenfab serve --speculative-config '{...}'``)::

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": k}
    {"method": "mtp", "num_speculative_tokens": k}     (vLLM's older name "deepseek_mtp" is read as "mtp")
    {"method": "dspark", "model": DRAFTER, "num_speculative_tokens": k, "dspark_tap": "partial_sum"}

plus the switch-off knobs (see :mod:`tokenfab.spec_decode.policy`): ``disable_by_batch_size`` (vLLM's name: no
speculation in a step with more running sequences than this), and tokenfab's ``verify_token_cost``,
``min_acceptance_rate``, ``acceptance_ema_decay`` and ``probe_interval`` (per-sequence draft caps from an
acceptance EMA and the verification cost model). As in vLLM, a ``model`` without a method means
``draft_model`` and ``"[ngram]"`` as model means ``ngram``. ``dspark``: a DSpark block drafter on the target's
tapped hidden states (spec_decode/dspark_proposer.py; ``dspark_tap`` optional). ``mtp``: the target
checkpoint's next-token-prediction layers (DeepSeek-V3 / Kimi-K2, spec_decode/mtp_proposer.py). vLLM's ``eagle`` /
``eagle3`` / ``medusa`` are refused by name: not implemented yet.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from tokenfab.errors import EngineConfigError, UnsupportedError

METHODS = ("ngram", "draft_model", "dspark", "mtp")
NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "suffix")
MAX_SPECULATIVE_TOKENS = 32


@dataclass
class SpeculativeConfig:
    """Validated speculative-decoding settings.

    Attributes:
        method: "ngram" (prompt lookup, no model), "draft_model" (a small model with the same vocabulary), "mtp"
            (the target checkpoint's MTP layers) or "dspark".
        num_speculative_tokens: k, draft tokens proposed per sequence and step (1..32).
        prompt_lookup_max / prompt_lookup_min: longest / shortest suffix n-gram matched (ngram only; tokens).
        model: draft checkpoint folder or llama ``.gguf`` file (draft_model only; a file is served packed as
            ``LLM(model=path.gguf)`` serves it).
        disable_by_batch_size: speculate only in steps with at most this many running sequences (None: always).
        min_acceptance_rate: floor of the per-position acceptance a^j a draft must be expected to reach (0..1).
        probe_interval: a sequence capped at 0 drafts drafts one token once every this many of its steps (>= 1).
        acceptance_ema_decay: weight of the previous EMA value per verification (0..1).
        verify_token_cost: cost of one more verified token relative to a step's fixed cost (c1 / c0, >= 0; 0:
            always draft k). See policy.py.
        verify_step_overhead: fixed extra cost of a speculative step relative to a plain step's fixed cost (>= 0).
        random_row_cost: extra cost per row at temperature > 0 in a speculative step, same unit (>= 0).
        timed_switch_off: also speculate at a batch size only while it pays there by the clock (step_timing.py).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None
    min_acceptance_rate: float = 0.0
    probe_interval: int = 8
    acceptance_ema_decay: float = 0.7
    verify_token_cost: float = 0.035
    verify_step_overhead: float = 0.1
    random_row_cost: float = 0.02
    timed_switch_off: bool = True
    dspark_tap: str | None = None  # dspark: "partial_sum" | "attn_res_mixture" (None: the checkpoint's; dspark_config.py)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _int(d: dict, name: str, lo: int, hi: int | None = None, default=None):
    v = d.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise EngineConfigError(f"speculative_config.{name} must be an integer, got {v!r}.")
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise EngineConfigError(f"speculative_config.{name} must be {rng}, got {v}.")
    return v


def _bool(d: dict, name: str, default: bool) -> bool:
    v = d.get(name, default)
    if not isinstance(v, bool):
        raise EngineConfigError(f"speculative_config.{name} must be true or false, got {v!r}.")
    return v


def _float(d: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = d.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= float(v) <= hi):
        raise EngineConfigError(f"speculative_config.{name} must be a number in [{lo}, {hi}], got {v!r}.")
    return float(v)


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """dict, JSON text, SpeculativeConfig or None -> SpeculativeConfig or None (None / {} = off).

    Raises:
        EngineConfigError: malformed JSON, an unknown field (named, with the fields the method takes), a missing
            or out-of-range field (named), a draft model folder that does not exist.
        UnsupportedError: a method tokenfab does not run yet (mtp, dspark, eagle ...), by name.
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise EngineConfigError(f"speculative_config: cannot read {value!r} as JSON ({e}); give e.g. "
                                    '\'{"method": "ngram", "num_speculative_tokens": 3}\'.') from None
    if not isinstance(value, dict):
        raise EngineConfigError(f"speculative_config must be a dict (or JSON object), got {type(value).__name__}.")
    if not value:
        return None
    d = dict(value)
    method = d.get("method")
    if method is None:
        if d.get("model") == "[ngram]":
            method = "ngram"
        elif d.get("model") is not None:
            method = "draft_model"
        else:
            raise EngineConfigError("speculative_config.method is missing; use 'ngram', 'draft_model' (with "
                                    "'model': a checkpoint folder or .gguf file), 'mtp' or 'dspark' (with 'model': "
                                    "the drafter's folder).")
    if d.get("model") == "[ngram]":
        d.pop("model")
    if not isinstance(method, str):
        raise EngineConfigError(f"speculative_config.method must be a string, got {method!r}.")
    if method == "deepseek_mtp":  # vLLM's name before "mtp"
        method = d["method"] = "mtp"
    if method in NOT_YET:
        raise UnsupportedError(f"speculative_config.method '{method}' is not implemented yet in tokenfab; use "
                               "'ngram', 'draft_model', 'mtp' or 'dspark'.")
    if method not in METHODS:
        raise EngineConfigError(f"speculative_config.method '{method}' is unknown; use 'ngram', 'draft_model', "
                                "'mtp' or 'dspark'.")
    common = {"method", "num_speculative_tokens", "disable_by_batch_size", "min_acceptance_rate",
              "probe_interval", "acceptance_ema_decay", "verify_token_cost", "verify_step_overhead",
              "random_row_cost", "timed_switch_off"}
    allowed = common | ({"prompt_lookup_max", "prompt_lookup_min"} if method == "ngram" else {"model"})
    if method == "mtp":  # the target checkpoint's own MTP layers (models/deepseek_mtp.py): no model field
        allowed = common
    if method == "dspark":  # a DSpark drafter folder (speculators or SpecForge layout, dspark_config.py)
        allowed = allowed | {"dspark_tap"}
    for name in d:
        if name not in allowed:
            raise EngineConfigError(f"speculative_config has an unknown field '{name}' for method '{method}'; "
                                    f"its fields: {', '.join(sorted(allowed))}.")
    if "num_speculative_tokens" not in d:
        raise EngineConfigError("speculative_config.num_speculative_tokens is missing: how many draft tokens to "
                                f"propose per step (1..{MAX_SPECULATIVE_TOKENS}).")
    k = _int(d, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    cfg = SpeculativeConfig(
        method=method, num_speculative_tokens=k,
        disable_by_batch_size=_int(d, "disable_by_batch_size", 1),
        min_acceptance_rate=_float(d, "min_acceptance_rate", 0.0, 1.0, 0.0),
        probe_interval=_int(d, "probe_interval", 1, None, 8),
        acceptance_ema_decay=_float(d, "acceptance_ema_decay", 0.0, 0.999, 0.7),
        verify_token_cost=_float(d, "verify_token_cost", 0.0, 1e6, 0.035),
        verify_step_overhead=_float(d, "verify_step_overhead", 0.0, 1e6, 0.1),
        random_row_cost=_float(d, "random_row_cost", 0.0, 1e6, 0.02),
        timed_switch_off=_bool(d, "timed_switch_off", True))
    if method == "dspark":
        path = d.get("model")
        if not isinstance(path, str) or not os.path.isfile(os.path.join(path, "config.json")):
            raise EngineConfigError(f"speculative_config.model {path!r} is not a DSpark drafter folder (no "
                                    "config.json); give the drafter's folder (speculators or SpecForge layout).")
        tap = d.get("dspark_tap")
        if tap is not None and not isinstance(tap, str):
            raise EngineConfigError(f"speculative_config.dspark_tap must be a string, got {tap!r}.")
        cfg.model, cfg.dspark_tap = path, tap
    elif method == "ngram":
        hi = _int(d, "prompt_lookup_max", 1, 64)
        lo = _int(d, "prompt_lookup_min", 1, 64)
        if hi is None and lo is None:
            hi, lo = 4, 1  # neither given: match suffixes of 4 down to 1 tokens
        hi = hi if hi is not None else lo
        lo = lo if lo is not None else hi
        if lo > hi:
            raise EngineConfigError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max "
                                    f"({hi}).")
        cfg.prompt_lookup_max, cfg.prompt_lookup_min = hi, lo
    elif method == "mtp":
        pass  # whether the target has MTP layers is checked when the engine builds the proposer (mtp_proposer.py)
    else:
        path = d.get("model")
        if not isinstance(path, str) or not path:
            raise EngineConfigError("speculative_config.model is missing: the draft checkpoint folder for method "
                                    "'draft_model'.")
        gguf = path.lower().endswith(".gguf")
        if not (os.path.isfile(path) if gguf else os.path.isfile(os.path.join(path, "config.json"))):
            raise EngineConfigError(f"speculative_config.model '{path}' is not a checkpoint folder (no "
                                    "config.json) or a .gguf file; give the draft model's folder or .gguf file.")
        cfg.model = path
    return cfg
