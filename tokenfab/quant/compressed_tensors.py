"""config.json's ``quantization_config`` for compressed-tensors checkpoints, parsed strictly.

Two published weight schemes are run (both on Linear weights, one scale per 32 input values of a row):

* ``pack-quantized`` 4-bit symmetric int, strategy ``group``, group_size 32 (Kimi K2-Thinking): ``int4_group``;
* ``mxfp4-pack-quantized`` (Kimi K3's routed experts): ``mxfp4``.

A Linear is quantized when a config group targets it (``"Linear"``, its name or a ``re:`` regex) and the
``ignore`` list does not name it; names and ``re:`` entries match as compressed-tensors' ``match_name`` does
(exact string, or ``re.match`` of the regex after ``re:``). Anything else (other bit widths, asymmetric or
activation quantization, sparsity, a KV-cache scheme, unknown keys) is refused with a one-line error naming the
field. Source: compressed-tensors ``QuantizationConfig`` / ``QuantizationArgs`` (fields and defaults).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from tokenfab.model_config import ConfigError

WHERE = "config.json: quantization_config"
_TOP_KEYS = {"quant_method", "format", "config_groups", "ignore", "quantization_status", "kv_cache_scheme",
             "global_compression_ratio", "sparsity_config", "version", "transform_config"}
_GROUP_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
_WEIGHT_KEYS = {"num_bits", "type", "symmetric", "strategy", "group_size", "dynamic", "actorder", "block_structure",
                "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}
_FORMATS = {"pack-quantized": "int4_group", "mxfp4-pack-quantized": "mxfp4"}
GROUP_SIZE = 32


@dataclass(frozen=True)
class CompressedTensorsScheme:
    """What a compressed-tensors checkpoint quantizes: ``format`` ("int4_group" or "mxfp4") for the Linears the
    ``targets`` name and ``ignore`` does not, one scale per ``group_size`` (32) values."""

    format: str
    targets: tuple[str, ...]
    ignore: tuple[str, ...]
    group_size: int = GROUP_SIZE

    def quantizes(self, linear_name: str) -> bool:
        """True when the Linear module ``linear_name`` (e.g. ``model.layers.3.mlp.experts.7.gate_proj``) is stored
        quantized: targeted (``"Linear"`` targets every Linear) and not ignored."""
        if any(_matches(linear_name, t) for t in self.ignore):
            return False
        return any(t == "Linear" or _matches(linear_name, t) for t in self.targets)


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' match_name: ``re:`` -> re.match of the rest, else equality."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _fail(field: str, value, supported: str) -> ConfigError:
    return ConfigError(f"{WHERE}.{field} = {value!r} is not supported (supported: {supported}).")


def parse_compressed_tensors(qc: dict) -> CompressedTensorsScheme:
    """Parse a compressed-tensors ``quantization_config`` dict (strictly).

    Raises:
        ConfigError: a field tokenfab does not run, named (e.g. ``quantization_config.config_groups.group_0.
            weights.num_bits = 8``) with what is supported.
    """
    if not isinstance(qc, dict):
        raise ConfigError(f"{WHERE} must be an object, got {type(qc).__name__}.")
    if qc.get("quant_method") != "compressed-tensors":
        raise _fail("quant_method", qc.get("quant_method"), "'compressed-tensors'")
    for k in qc:
        if k not in _TOP_KEYS:
            raise _fail(k, qc[k], "absent (unknown field)")
    for k in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(k):
            raise _fail(k, qc[k], "null")
    status = qc.get("quantization_status")
    if status not in (None, "compressed", "frozen"):
        raise _fail("quantization_status", status, "'compressed'")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _fail("config_groups", groups, "one or more groups")
    top_fmt = qc.get("format")
    formats, targets = set(), []
    for gname, g in groups.items():
        where = f"config_groups.{gname}"
        if not isinstance(g, dict):
            raise _fail(where, g, "an object")
        for k in g:
            if k not in _GROUP_KEYS:
                raise _fail(f"{where}.{k}", g[k], "absent (unknown field)")
        for k in ("input_activations", "output_activations"):
            if g.get(k):
                raise _fail(f"{where}.{k}", g[k], "null (weight-only quantization)")
        fmt = g.get("format") or top_fmt
        if fmt not in _FORMATS:
            raise _fail(f"{where}.format" if g.get("format") else "format", fmt, ", ".join(map(repr, _FORMATS)))
        _check_weights(f"{where}.weights", g.get("weights"), _FORMATS[fmt])
        t = g.get("targets")
        if not isinstance(t, list) or not t or not all(isinstance(x, str) for x in t):
            raise _fail(f"{where}.targets", t, "a list of names, 're:' regexes or 'Linear'")
        formats.add(_FORMATS[fmt])
        targets += t
    if len(formats) != 1:
        raise _fail("config_groups", sorted(formats), "one weight format per checkpoint")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise _fail("ignore", ignore, "a list of names or 're:' regexes")
    for x in ignore:
        if x.startswith("re:"):
            try:
                re.compile(x[3:])
            except re.error as e:
                raise _fail("ignore", x, f"valid regular expressions ({e})") from None
    return CompressedTensorsScheme(formats.pop(), tuple(targets), tuple(ignore))


def _check_weights(where: str, w, fmt: str) -> None:
    """The group's ``weights`` args: int4 needs them (4 bits, int, symmetric, group 32); MXFP4 implies them."""
    if w is None:
        if fmt == "mxfp4":
            return
        raise _fail(where, w, "num_bits 4, type 'int', symmetric, strategy 'group', group_size 32")
    if not isinstance(w, dict):
        raise _fail(where, w, "an object")
    for k in w:
        if k not in _WEIGHT_KEYS:
            raise _fail(f"{where}.{k}", w[k], "absent (unknown field)")
    want = {"num_bits": 4, "type": "int" if fmt == "int4_group" else "float", "symmetric": True,
            "strategy": "group", "group_size": GROUP_SIZE}
    for k, v in want.items():
        if k in w and w[k] != v or (k not in w and fmt == "int4_group" and k != "symmetric"):
            raise _fail(f"{where}.{k}", w.get(k), repr(v))
    if w.get("dynamic"):
        raise _fail(f"{where}.dynamic", w["dynamic"], "false")
    if w.get("actorder") not in (None, False):
        raise _fail(f"{where}.actorder", w["actorder"], "null")
    if w.get("block_structure") is not None:
        raise _fail(f"{where}.block_structure", w["block_structure"], "null")
    sd = w.get("scale_dtype")
    if sd is not None and fmt == "int4_group" and sd not in ("bfloat16", "float16", "torch.bfloat16", "torch.float16"):
        raise _fail(f"{where}.scale_dtype", sd, "bfloat16 or float16")
