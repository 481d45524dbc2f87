"""Kimi Linear / Kimi K3 lines of the memory plan (``tokenfab plan``): the per-request KDA state.

The checkpoint tensor listing of these models is :func:`tokenfab.model_tensors.kimi_model_tensors` (re-exported
here).
"""
from __future__ import annotations

from tokenfab.model_tensors import kimi_model_tensors  # noqa: F401


def kda_state_note(mc, plan, kv_dtype_bytes: int) -> str:
    """One line for the plan: per-request KDA state bytes (all KDA layers; per rank when heads are split)."""
    total = mc.kda_state_bytes_per_request(kv_dtype_bytes)
    H = max(mc.kda_num_heads, 1)
    kda = getattr(plan, "kda_heads", None) or [(0, H)] * plan.world_size  # KDA heads per rank (own split)
    per_rank = [total * (e - s) // H for s, e in kda]
    return (f"KDA state (not per token): {total:,} bytes per request over {len(mc.kda_layers)} KDA layers "
            f"(conv {3 * mc.kda_num_heads * mc.kda_head_dim} ch x {mc.kda_conv_kernel - 1} taps + fp32 "
            f"{mc.kda_num_heads} x {mc.kda_head_dim} x {mc.kda_head_dim} per layer); up to {max(per_rank):,} bytes "
            f"per request on one rank; the per-token KV counts the {len(mc.mla_layers)} MLA layers only")
