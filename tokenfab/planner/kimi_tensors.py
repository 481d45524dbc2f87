"""Kimi Linear / Kimi K3 lines of the memory plan (``tokenfab plan``): the per-request KDA state.

The checkpoint tensor listing of these models is :func:`tokenfab.model_tensors.kimi_model_tensors` (re-exported
here).
"""
from __future__ import annotations

from tokenfab.model_tensors import kimi_model_tensors  # noqa: F401


def kda_state_bytes_per_rank(mc, plan, kv_dtype_bytes: int) -> list[int]:
    """Per-request KDA state bytes on each rank of ``plan``: the whole request's state
    (:meth:`~tokenfab.config_kimi.KimiConfig.kda_state_bytes_per_request`) times the rank's share of KDA heads
    (conv and recurrent state are both per head); all zeros for a model without KDA layers."""
    if not getattr(mc, "kda_layers", None):
        return [0] * plan.world_size
    total = mc.kda_state_bytes_per_request(kv_dtype_bytes)
    H = max(mc.kda_num_heads, 1)
    kda = getattr(plan, "kda_heads", None) or [(0, H)] * plan.world_size  # KDA heads per rank (own split)
    return [total * (e - s) // H for s, e in kda]


def kda_state_note(mc, plan, kv_dtype_bytes: int, max_num_seqs: int = 1) -> str:
    """One line for the plan: per-request KDA state bytes (all KDA layers; per rank when heads are split) and what
    ``max_num_seqs`` requests reserve on the fullest rank."""
    total = mc.kda_state_bytes_per_request(kv_dtype_bytes)
    per_rank = kda_state_bytes_per_rank(mc, plan, kv_dtype_bytes)
    return (f"KDA state (not per token): {total:,} bytes per request over {len(mc.kda_layers)} KDA layers "
            f"(conv {3 * mc.kda_num_heads * mc.kda_head_dim} ch x {mc.kda_conv_kernel - 1} taps + fp32 "
            f"{mc.kda_num_heads} x {mc.kda_head_dim} x {mc.kda_head_dim} per layer); up to {max(per_rank):,} bytes "
            f"per request on one rank, {max(per_rank) * max_num_seqs:,} bytes reserved there for {max_num_seqs} request(s) "
            f"(--max-num-seqs) before the pool is sized; the per-token KV counts the {len(mc.mla_layers)} MLA layers "
            "only")
