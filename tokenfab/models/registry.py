"""Architecture -> model class, from the table of models/architectures.py (which config parsing reads too)."""
from __future__ import annotations

import importlib

from tokenfab.model_config import ModelConfig
from tokenfab.models.architectures import ARCHITECTURES


def get_model_class(cfg: ModelConfig):
    """The tokenfab model class for ``cfg.family`` (config parsing already refused unknown architectures): the
    class its row of models/architectures.py names, imported on first use."""
    arch = next((a for a in ARCHITECTURES.values() if a.family == cfg.family), None)
    if arch is None:  # pragma: no cover - parse_config guards this
        raise ValueError(f"no model class for family {cfg.family}")
    return getattr(importlib.import_module(arch.module), arch.cls)
