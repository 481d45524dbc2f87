"""Read only this rank's slices of a safetensors checkpoint (``safe_open(...).get_slice(name)[start:end]``).

Every rank opens the same files but materializes just what :meth:`ShardPlan.shard_tensor` gives it: whole
replicated tensors, whole owned experts, and ``[start, end)`` of split tensors along their split dim. A rank never
holds the whole model in memory.
"""
from __future__ import annotations

import os
from typing import Iterator

import torch

from tokenfab.loader.safetensors_loader import checkpoint_files
from tokenfab.parallel.shard_plan import ShardPlan

# Row-parallel biases are replicated in the checkpoint but must be added once: ranks > 0 load zeros.
_ROW_PARALLEL_BIAS = (".o_proj.bias", ".down_proj.bias")

# Tests only: a rank listed here raises during load (exercises the launcher's error path).
FAIL_ENV = "TOKENFAB_TEST_FAIL_LOAD_RANK"

# Yielded (this very object) for a tensor no rank reads (MTP layers): the model reports its name as skipped, and
# wrappers of the iterable pass it through as it is (an FP8 weight_scale_inv without its float8 weight is not a
# lone half of a pair: loader/fp8_block_loader.py).
NOT_READ = torch.empty(0)


def iterate_rank_weights(model_dir: str, plan: ShardPlan, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` with the part of each checkpoint tensor that ``rank`` holds.

    Tensors the rank does not hold (other ranks' experts, MTP layers) are not read at all.
    """
    from safetensors import safe_open

    fail = os.environ.get(FAIL_ENV)
    if fail is not None and int(fail) == rank:
        raise RuntimeError(f"injected load failure on rank {rank} ({FAIL_ENV}={fail})")
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                shape = sl.get_shape()
                sh = plan.shard_tensor(name, shape, rank)
                if not sh.owned:
                    if sh.tensor_class == "mtp":
                        yield name, NOT_READ  # the model reports it as skipped; nothing read
                    continue
                if sh.dim is None:
                    t = h.get_tensor(name)
                    if rank > 0 and name.endswith(_ROW_PARALLEL_BIAS):
                        t = torch.zeros_like(t)
                    yield name, t
                    continue
                idx = tuple([slice(None)] * sh.dim + [slice(sh.start, sh.end)])
                yield name, sl[idx]
