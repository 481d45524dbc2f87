"""Memory planning: weights per rank, KV bytes per token, the largest KV pool that fits (``tokenfab plan``)."""
from tokenfab.planner.memory_planner import (
    MemoryPlan,
    RankPlan,
    WeightEstimate,
    checkpoint_tensors,
    estimate_weight_bytes,
    kv_bytes_per_token_per_rank,
    kv_dtype_bytes,
    kv_pool_tokens,
    min_devices_that_fit,
    plan_device_sweep,
    plan_memory,
    read_safetensors_header,
    state_bytes_per_rank,
)
from tokenfab.planner.plan_inputs import PlanError, parse_count, parse_reserve, parse_size
from tokenfab.planner.plan_report import render_plan, render_sweep, sweep_rows

__all__ = ["MemoryPlan", "RankPlan", "WeightEstimate", "PlanError", "estimate_weight_bytes", "kv_pool_tokens",
           "kv_bytes_per_token_per_rank", "kv_dtype_bytes", "min_devices_that_fit", "plan_memory", "render_plan",
           "parse_size", "parse_count", "parse_reserve", "read_safetensors_header", "checkpoint_tensors",
           "plan_device_sweep", "render_sweep", "sweep_rows", "state_bytes_per_rank"]
