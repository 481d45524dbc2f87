"""Parallel placement: :class:`ShardPlan` maps every sharded dimension to per-rank ``[start, end)`` ranges."""
from tokenfab.parallel.shard_plan import (
    REPLICATED_CLASSES,
    TENSOR_CLASSES,
    ShardPlan,
    TensorRecord,
    TensorShard,
    WeightInventory,
    count_parameters,
    model_tensors,
    split_range,
    weight_bytes_per_rank,
)

__all__ = ["ShardPlan", "TensorShard", "TensorRecord", "WeightInventory", "split_range", "model_tensors",
           "count_parameters", "weight_bytes_per_rank", "TENSOR_CLASSES", "REPLICATED_CLASSES"]
