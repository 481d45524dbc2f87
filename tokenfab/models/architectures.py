"""The architectures tokenfab runs: one table read by the config parser and by the model registry.

A row maps config.json's ``architectures`` name to its family (:attr:`ModelConfig.family`), the ``model_type``
values that architecture accepts, which parser reads its config (config.py, or config_kimi.py for the hybrid KDA +
MLA Kimi families) and the class that builds it (registry.py). Adding an architecture is one row here; what a
config is checked against and the list an unsupported config is refused with both follow from it. This module
imports nothing from tokenfab, so both config parsing and the registry can read it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """One supported architecture.

    Attributes:
        name: config.json's ``architectures`` entry (transformers' class name).
        family: the tokenfab family (``ModelConfig.family``).
        model_types: config.json ``model_type`` values accepted with it; the first is its own.
        module / cls: where the tokenfab model class lives (registry.py imports it when a model is built).
        hybrid: True for the Kimi Linear / Kimi K3 families (KDA + MLA), parsed by config_kimi.py, which also
            accepts their configs without ``architectures`` (the model_type names the architecture).
    """

    name: str
    family: str
    model_types: tuple[str, ...]
    module: str
    cls: str
    hybrid: bool = False


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("DeepseekV3ForCausalLM", "deepseek_v3", ("deepseek_v3", "kimi_k2"),
                 "tokenfab.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    Architecture("LlamaForCausalLM", "llama", ("llama",), "tokenfab.models.llama", "LlamaForCausalLM"),
    Architecture("Qwen3ForCausalLM", "qwen3", ("qwen3",), "tokenfab.models.qwen3", "Qwen3ForCausalLM"),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", ("qwen3_moe",), "tokenfab.models.qwen3_moe",
                 "Qwen3MoeForCausalLM"),
    Architecture("KimiLinearForCausalLM", "kimi_linear", ("kimi_linear",), "tokenfab.models.kimi_linear",
                 "KimiLinearForCausalLM", hybrid=True),
    Architecture("KimiK3ForConditionalGeneration", "kimi_k3", ("kimi_k3",), "tokenfab.models.kimi_linear",
                 "KimiK3ForConditionalGeneration", hybrid=True),
)}


def architecture_for_model_type(model_type) -> Architecture | None:
    """The architecture whose own model_type (the first of its ``model_types``) or accepted ones include
    ``model_type``, own ones first; None when none does."""
    own = [a for a in ARCHITECTURES.values() if a.model_types[0] == model_type]
    other = [a for a in ARCHITECTURES.values() if model_type in a.model_types]
    return (own or other or [None])[0]


def supported_architectures_text() -> str:
    """Every supported architecture with its model_type values, for error messages:
    ``DeepseekV3ForCausalLM (model_type deepseek_v3 / kimi_k2), LlamaForCausalLM (model_type llama), ...``."""
    return ", ".join(f"{a.name} (model_type {' / '.join(a.model_types)})" for a in ARCHITECTURES.values())
