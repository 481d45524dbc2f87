"""The on / off settings of the engine's host-device overlap: ``TOKENFAB_ASYNC_OUTPUT`` (engine/output_processor.py)
and ``TOKENFAB_ASYNC_SCHEDULING`` (engine/async_scheduling.py). Each is "auto" (the default: on for CUDA / ROCm
engines, whose steps launch without waiting; off on CPU, where the forward is synchronous and nothing overlaps), "1"
(always: CPU tests of the overlapped paths) or "0" (never)."""
from __future__ import annotations

import os

import torch

from tokenfab.errors import EngineConfigError


def overlap_setting(var: str, device: torch.device | str) -> bool:
    """Whether the setting in environment variable ``var`` is on for an engine on ``device``.

    Raises:
        EngineConfigError: a value other than auto, 1 or 0 (naming the variable and the choices).
    """
    mode = os.environ.get(var, "auto")
    if mode not in ("auto", "0", "1"):
        raise EngineConfigError(f"{var}='{mode}' is not understood; use auto (on for GPU engines, the default), "
                                "1 (always) or 0 (never).")
    return mode == "1" or (mode == "auto" and torch.device(device).type == "cuda")
