"""Architecture name -> model class."""
from __future__ import annotations

from tokenfab.config import ModelConfig


def get_model_class(cfg: ModelConfig):
    """The tokenfab model class for ``cfg.family`` (config parsing already refused unknown architectures)."""
    if cfg.family == "llama":
        from tokenfab.models.llama import LlamaForCausalLM as cls
    elif cfg.family == "qwen3":
        from tokenfab.models.qwen3 import Qwen3ForCausalLM as cls
    elif cfg.family == "qwen3_moe":
        from tokenfab.models.qwen3_moe import Qwen3MoeForCausalLM as cls
    elif cfg.family == "deepseek_v3":
        from tokenfab.models.deepseek_v3 import DeepseekV3ForCausalLM as cls
    elif cfg.family == "kimi_linear":
        from tokenfab.models.kimi_linear import KimiLinearForCausalLM as cls
    elif cfg.family == "kimi_k3":
        from tokenfab.models.kimi_linear import KimiK3ForConditionalGeneration as cls
    else:  # pragma: no cover - parse_config guards this
        raise ValueError(f"no model class for family {cfg.family}")
    return cls
