"""Tensor-parallel workers: the per-step batch channel and the worker loop (ranks 1..N-1).

Rank 0 (the engine process) schedules, builds the step's arrays, broadcasts them with :class:`StepChannel`, runs
its shard of the forward and samples. Each worker receives the same arrays, runs its shard of the same forward
(the collectives inside the model pair up across ranks), and helps gather the logits to rank 0.

Wire format of one step (gloo broadcasts of int64 CPU tensors from rank 0):

* header [12]: ``kind`` (1 = step, 0 = stop, 2 = state commit), ``B`` sequences, ``d`` decodes, ``T`` tokens,
  ``nblk`` block-table columns sent, ``L`` logit rows, ``R`` (1 when the scheduler rows follow, else 0), ``K`` (1
  when the verification-row flags follow, else 0), ``M`` (1 when rank 0 runs this step through the model's modules
  because it taps layer outputs without decode-graph buffers: the workers must too, not through the fused CPU
  stack), ``V`` (rank 0's decode graphs serve verification steps of V = 1 + k tokens a sequence; 0: none) and ``S``
  (1 while rank 0's decode graphs wait to be captured again: a drafter's layer taps, verification graphs). With
  ``V`` and ``S`` every worker's decode graphs mirror rank 0's before the step runs, so all ranks take the same
  path through the padded buffers and capture at the same step (the captures' warm-up collectives pair up).
  ``P`` (async scheduling, engine/async_scheduling.py: the step's input ids hold placeholders ``-(j + 1)`` for the
  previous step's P drawn ids, 0 when none): those ids follow in a broadcast on the model's own process group
  (device tensors on a GPU: nothing waits for the host), and each worker fills its placeholders from them where
  rank 0 does.
* payload [2B + B*nblk + T + L (+ B) (+ B)]: ``num_new`` [B], ``num_computed`` [B], block tables [B, nblk] (only the
  columns this step needs), ``input_ids`` [T], ``logit_idx`` [L], then, when ``R``, the scheduler ``rows`` [B]: the
  per-request recurrent-state slots of hybrid (KDA) models (tokenfab/engine/state_cache.py), then, when ``K``, the
  ``hold`` flags [B] (0/1) of speculative verification rows whose KDA states wait for the commit.
* a commit (after a speculative verification step of a hybrid model, engine/state_commit.py): header
  (2, ``N``, 0, ...) and payload ``rows`` [N], ``kept`` [N] (inline while it fits).

The header buffer has room for ``inline`` payload values after it: a step that fits is one broadcast; a larger one
sends the payload in a second broadcast.

Positions, slot mapping and the attention groups are recomputed from these on every rank (the same numpy code as
rank 0, :meth:`tokenfab.engine.model_runner.ModelRunner.forward`), which keeps the payload small.
"""
from __future__ import annotations

import os
import pickle
import struct
import sys
import traceback

import numpy as np
import torch
import torch.distributed as dist

STEP, STOP, COMMIT = 1, 0, 2
HEADER = 12


class Commit:
    """A received state commit: ``rows`` [N] and ``kept`` [N] int64 (ModelRunner.commit_state)."""

    def __init__(self, rows: np.ndarray, kept: np.ndarray):
        self.rows, self.kept = rows, kept


class StepChannel:
    """Broadcast of one step's batch from rank 0 to all ranks over the gloo control group.

    A step whose payload fits in ``inline`` int64 values travels in the same broadcast as the header (one
    collective per step; decode steps and small prefill chunks); larger ones take a second broadcast.
    """

    def __init__(self, group=None, inline: int = 2048):
        self.group = group
        self.inline = inline
        self._buf = torch.zeros(HEADER + inline, dtype=torch.int64)

    def send_step(self, d: int, num_new: np.ndarray, num_computed: np.ndarray, bt: np.ndarray,
                  input_ids: np.ndarray, logit_idx: np.ndarray, rows: np.ndarray | None = None,
                  hold: np.ndarray | None = None, modules: bool = False,
                  graphs: tuple[int, bool] = (0, False), source: torch.Tensor | None = None) -> None:
        """Rank 0: publish a step (shapes as in ModelRunner.forward; bt is cut to the blocks the step needs;
        ``rows`` [B] the scheduler rows and ``hold`` [B] bool the verification rows, each sent when given;
        ``modules``: rank 0 runs this step through the modules, not the fused CPU stack; ``graphs``: (V, S) of
        rank 0's decode graphs, ModelRunner.graph_state; ``source``: async scheduling, the previous step's drawn
        ids [P] int64 that the placeholders in ``input_ids`` stand for, broadcast on the default process group
        after the step)."""
        B, T, L = len(num_new), len(input_ids), len(logit_idx)
        ctx_max = int((num_computed + num_new).max()) if B else 0
        nblk = min(bt.shape[1], -(-ctx_max // self.block_size)) if B else 0
        payload = np.concatenate([num_new.astype(np.int64, copy=False), num_computed.astype(np.int64, copy=False),
                                  bt[:, :nblk].reshape(-1), input_ids.astype(np.int64, copy=False),
                                  logit_idx.astype(np.int64, copy=False)]
                                 + ([] if rows is None else [rows.astype(np.int64, copy=False)])
                                 + ([] if hold is None else [hold.astype(np.int64)]))
        buf = self._buf.numpy()
        buf[:HEADER] = (STEP, B, d, T, nblk, L, 0 if rows is None else 1, 0 if hold is None else 1, int(modules),
                        int(graphs[0]), int(graphs[1]), 0 if source is None else len(source))
        n = len(payload)
        if n <= self.inline:
            buf[HEADER:HEADER + n] = payload
            dist.broadcast(self._buf, 0, group=self.group)
        else:
            dist.broadcast(self._buf, 0, group=self.group)
            dist.broadcast(torch.from_numpy(payload), 0, group=self.group)
        if source is not None:  # the model's group: NCCL on GPUs, no host copy of the ids
            dist.broadcast(source.contiguous(), 0)

    def send_commit(self, rows: np.ndarray, kept: np.ndarray) -> None:
        """Rank 0: tell the workers to commit the KDA state of ``rows`` [N] after their first ``kept`` [N] tokens
        of the last step (one broadcast while 2N fits inline)."""
        N = len(rows)
        payload = np.concatenate([rows.astype(np.int64, copy=False), kept.astype(np.int64, copy=False)])
        buf = self._buf.numpy()
        buf[:HEADER] = (COMMIT, N) + (0,) * (HEADER - 2)
        if 2 * N <= self.inline:
            buf[HEADER:HEADER + 2 * N] = payload
            dist.broadcast(self._buf, 0, group=self.group)
        else:
            dist.broadcast(self._buf, 0, group=self.group)
            dist.broadcast(torch.from_numpy(payload), 0, group=self.group)

    def send_stop(self) -> None:
        """Rank 0: tell the workers to leave their loop."""
        self._buf[0] = STOP
        dist.broadcast(self._buf, 0, group=self.group)

    def recv(self):
        """Workers: the next step as (d, num_new, num_computed, bt, input_ids, logit_idx, rows, hold, modules,
        graphs, source), a :class:`Commit`, or None on stop (``rows`` / ``hold`` None when rank 0 sent none;
        ``modules`` bool; ``graphs`` (V, S) and ``source`` (None or [P] int64 on :attr:`device`) as
        :meth:`send_step` takes them)."""
        dist.broadcast(self._buf, 0, group=self.group)
        kind, B, d, T, nblk, L, R, K, M, V, S, P = self._buf[:HEADER].tolist()
        if kind == STOP:
            return None
        if kind == COMMIT:
            if 2 * B <= self.inline:
                p = self._buf.numpy()[HEADER:HEADER + 2 * B].copy()
            else:
                payload = torch.empty(2 * B, dtype=torch.int64)
                dist.broadcast(payload, 0, group=self.group)
                p = payload.numpy()
            return Commit(p[:B], p[B:])
        n = 2 * B + B * nblk + T + L + (B if R else 0) + (B if K else 0)
        if n <= self.inline:
            p = self._buf.numpy()[HEADER:HEADER + n].copy()
        else:
            payload = torch.empty(n, dtype=torch.int64)
            dist.broadcast(payload, 0, group=self.group)
            p = payload.numpy()
        o = 0
        num_new, o = p[o:o + B], o + B
        num_computed, o = p[o:o + B], o + B
        bt, o = p[o:o + B * nblk].reshape(B, nblk), o + B * nblk
        input_ids, o = p[o:o + T], o + T
        logit_idx, o = p[o:o + L], o + L
        rows, o = (p[o:o + B], o + B) if R else (None, o)
        hold = p[o:o + B].astype(bool) if K else None
        source = None
        if P:
            source = torch.empty(P, dtype=torch.int64, device=self.device)
            dist.broadcast(source, 0)
        return d, num_new, num_computed, bt, input_ids, logit_idx, rows, hold, bool(M), (V, bool(S)), source

    block_size = 1  # set by the launcher to the KV block size
    device = torch.device("cpu")  # workers: their model's device, where async scheduling's drawn ids land (serve_steps)


def build_rank(config, rank: int, world_size: int, device: torch.device | None = None, progress: bool = False):
    """Load ``rank``'s shard and size its KV pool exactly as rank 0 does. Returns (TPContext, LoadedModel).

    ``config`` is the user's EngineConfig (a copy is finalized here, giving the same num_kv_blocks on every rank).
    """
    from tokenfab.config import load_config
    from tokenfab.engine.model_loader import load_model
    from tokenfab.parallel.distributed import TPContext
    from tokenfab.parallel.shard_plan import ShardPlan

    mc = load_config(config.model)
    ctx = TPContext(rank, world_size, ShardPlan.for_model(mc, world_size))
    loaded = load_model(config, progress=progress, tp=ctx, device=device)
    return ctx, loaded


def make_runner(config, loaded):
    """A ModelRunner (no sampler) over this rank's shard with the engine's KV-pool size and decode-graph choice
    (``enforce_eager`` as rank 0's: a rank replaying padded graphs beside one that does not would run its
    collectives over a different token count)."""
    from tokenfab.engine.block_manager import BlockManager
    from tokenfab.engine.model_runner import ModelRunner

    config.finalize(loaded.model_config, loaded.dtype)
    bm = BlockManager(config.num_kv_blocks, config.block_size, config.max_num_seqs, config.max_model_len)
    from tokenfab.engine.engine_config import resolve_kv_cache_dtype
    return ModelRunner(loaded.model, bm, config.max_num_seqs, config.max_model_len, loaded.device, loaded.dtype,
                       None, enforce_eager=config.enforce_eager,
                       kv_dtype=resolve_kv_cache_dtype(config.kv_cache_dtype, loaded.dtype))


@torch.inference_mode()
def serve_steps(runner, channel: StepChannel) -> int:
    """Worker loop: receive a step, run the forward (logits go to rank 0 inside compute_logits); until stop.
    Returns the number of steps run."""
    n = 0
    channel.device = runner.device
    while True:
        step = channel.recv()
        if step is None:
            return n
        if isinstance(step, Commit):  # after a verification step of a hybrid model
            runner.commit_state(step.rows, step.kept)
            continue
        *arrays, rows, hold, modules, graphs, source = step
        runner.follow_graphs(*graphs)  # rank 0's verification graphs and pending capture, before the step
        runner.placeholder_source = source  # async scheduling: the previous step's drawn ids (None: no placeholder)
        try:
            runner.forward(*arrays, rows=rows, hold=hold, modules=modules, on_device=True)  # logits unused here
        finally:
            runner.placeholder_source = None
        n += 1


def rank_device(config, local_rank: int) -> torch.device:
    """This rank's device: cuda:local_rank when the engine device resolves to CUDA/ROCm, else cpu."""
    from tokenfab.engine.engine_config import resolve_device

    dev = resolve_device(config.device)
    if dev.type == "cuda":
        return torch.device("cuda", local_rank)
    return dev


class PipeWriter:
    """Worker side of the message pipe to rank 0: length-prefixed pickles of (kind, rank, text)."""

    def __init__(self, fd: int):
        self.fd = fd

    def put(self, msg) -> None:
        data = pickle.dumps(msg)
        os.write(self.fd, struct.pack("<I", len(data)) + data)

    def close(self) -> None:
        os.close(self.fd)


def worker_main(rank: int, world_size: int, config, init_method: str, msg_queue, timeout_s: float,
                threads: int) -> None:
    """Body of a spawned worker (ranks 1..N-1). Reports ("loaded" | "error" | "done", rank, text) on
    ``msg_queue`` (a :class:`PipeWriter`); on any exception the traceback is sent and the process exits with 1."""
    parent = os.getppid()
    try:
        if threads > 0:
            torch.set_num_threads(threads)
        from tokenfab.parallel.distributed import init_distributed

        device = rank_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ctx, loaded = build_rank(config, rank, world_size, device)
        runner = make_runner(config, loaded)
        msg_queue.put(("loaded", rank, ""))
        init_distributed(ctx, device, init_method, timeout_s)
        channel = StepChannel(ctx.cpu_group)
        channel.block_size = config.block_size
        n = serve_steps(runner, channel)
        msg_queue.put(("done", rank, str(n)))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - every failure must reach rank 0
        tb = traceback.format_exc()
        if "closed by peer" in str(e) and os.getppid() != parent:  # rank 0 exited without a stop message
            sys.stderr.write(f"[tokenfab rank {rank}] rank 0 went away; exiting.\n")
            os._exit(1)
        try:
            msg_queue.put(("error", rank, tb))
        finally:
            sys.stderr.write(f"[tokenfab rank {rank}] {tb}")
            sys.stderr.flush()
            os._exit(1)


def torchrun_worker(config, rank: int, world_size: int, local_rank: int, timeout_s: float) -> None:
    """Ranks > 0 under torchrun: load, join env:// rendezvous, serve steps until rank 0 stops, then exit the
    process (user code after ``LLM(...)`` runs on rank 0 only)."""
    from tokenfab.parallel.distributed import init_distributed

    device = rank_device(config, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx, loaded = build_rank(config, rank, world_size, device)
    runner = make_runner(config, loaded)
    init_distributed(ctx, device, None, timeout_s)
    channel = StepChannel(ctx.cpu_group)
    channel.block_size = config.block_size
    serve_steps(runner, channel)
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":  # python -m tokenfab.parallel.worker FD  (arguments pickled on stdin; see launcher)
    _fd = int(sys.argv[1])
    _args = pickle.loads(sys.stdin.buffer.read())
    worker_main(*_args[:4], PipeWriter(_fd), *_args[4:])
    os._exit(0)
