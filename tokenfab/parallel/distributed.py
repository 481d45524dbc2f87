"""Tensor/expert-parallel context: which rank this process is, its :class:`ShardPlan`, and the collectives.

A :class:`TPContext` is created per process before the model is built and is captured by every layer that needs
it (``current_tp()`` at construction time inside :func:`building_with`). Layers keep ``self.tp = None`` when the
world size is 1, so the single-device path runs no collective and makes no extra copy.

Collectives use the default ``torch.distributed`` process group (gloo on CPU, NCCL/RCCL on CUDA/ROCm). Control
traffic (the per-step batch broadcast) always goes over a gloo group on CPU tensors (``ctx.cpu_group``); on CPU
that is the default group itself.
"""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tokenfab.parallel.shard_plan import ShardPlan


@dataclass
class TPContext:
    """One rank's view of the parallel layout.

    Attributes:
        rank: this process's rank in [0, world_size).
        world_size: number of ranks (tensor parallel = expert parallel = world size).
        plan: the per-rank ranges of every sharded dimension.
        cpu_group: gloo group for control messages (None = the default group, used when it is gloo).
    """

    rank: int
    world_size: int
    plan: ShardPlan
    cpu_group: object | None = None
    _initialized: bool = field(default=False, repr=False)

    # --- ranges --------------------------------------------------------------------------------------------
    def r(self, field_name: str) -> tuple[int, int]:
        """This rank's [start, end) of plan field ``field_name`` (heads, kv_heads, intermediate, experts,
        shared_intermediate, vocab)."""
        return getattr(self.plan, field_name)[self.rank]

    def size(self, field_name: str) -> int:
        s, e = self.r(field_name)
        return e - s

    # --- collectives --------------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks in place (every rank gets the same bits) and return it."""
        dist.all_reduce(x)
        return x

    def gather_rows_to_rank0(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Concatenate per-rank column slices along the last dim on rank 0.

        ``x`` [N, V_r] holds columns ``plan.vocab[rank]``; returns [N, total] on rank 0 and an empty tensor on other
        ranks. Slices are padded to the largest one for the gather (uneven vocab splits).
        """
        widths = [e - s for s, e in self.plan.vocab]
        wmax = max(widths)
        if x.shape[-1] < wmax:
            x = torch.nn.functional.pad(x, (0, wmax - x.shape[-1]))
        x = x.contiguous()
        if self.rank == 0:
            bufs = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.gather(x, bufs, dst=0)
            return torch.cat([b[..., :w] for b, w in zip(bufs, widths)], dim=-1)
        dist.gather(x, None, dst=0)
        return x.new_empty(0)


_BUILDING: TPContext | None = None


def current_tp() -> TPContext | None:
    """The context of the model being built (None when building a single-device model)."""
    return _BUILDING


@contextlib.contextmanager
def building_with(ctx: TPContext | None):
    """Within this block, layers built capture ``ctx`` (``current_tp()``)."""
    global _BUILDING
    prev, _BUILDING = _BUILDING, ctx
    try:
        yield
    finally:
        _BUILDING = prev


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for single-node rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: torch.device) -> str:
    """'nccl' for CUDA/ROCm devices (RCCL registers as nccl), 'gloo' otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(ctx: TPContext, device: torch.device, init_method: str | None, timeout_s: float) -> None:
    """Join the process group (all ranks must call this) and create the gloo control group when needed.

    ``init_method`` None means env:// (torchrun sets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE). ``timeout_s`` bounds
    the rendezvous and every later collective, so a dead peer surfaces as an error instead of a hang.
    """
    import datetime

    backend = backend_for(device)
    to = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        kw = dict(backend=backend, rank=ctx.rank, world_size=ctx.world_size, timeout=to)
        if device.type == "cuda":
            kw["device_id"] = device
        dist.init_process_group(init_method=init_method or "env://", **kw)
    elif dist.get_world_size() != ctx.world_size:
        raise ValueError(f"tensor_parallel_size={ctx.world_size} but the existing torch.distributed group has "
                         f"{dist.get_world_size()} ranks; launch with that many processes.")
    ctx.cpu_group = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=to)
    ctx._initialized = True


def launched_by_torchrun() -> bool:
    """True when this process was started by torchrun / torch.distributed.elastic (env:// rendezvous)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                    and "MASTER_ADDR" in os.environ)
