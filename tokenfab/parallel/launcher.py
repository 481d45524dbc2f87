"""Start a tensor-parallel engine: rank 0 in the engine process, ranks 1..N-1 as spawned workers (or torchrun).

Order of events (spawn mode, single node):

1. Rank 0 picks a free TCP port and starts N-1 workers (fresh interpreters, ``python -m tokenfab.parallel.worker``;
   no re-import of the user's ``__main__``).
2. Every rank loads only its own shard (no communication needed) and reports ``loaded`` or its traceback on a
   queue. Rank 0 waits for all reports while polling the workers' exit codes, with a deadline; a failed or dead
   rank makes rank 0 stop the others and raise :class:`TensorParallelError` carrying that rank's traceback.
3. All ranks join the process group (gloo on CPU, NCCL/RCCL on GPUs; tcp:// rendezvous on 127.0.0.1). The timeout
   also bounds every later collective.
4. Each step rank 0 broadcasts the batch (:class:`tokenfab.parallel.worker.StepChannel`); a collective that fails
   (a worker died mid-step) is turned into a TensorParallelError naming the rank and its traceback.

Under torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set) nothing is spawned: every process runs the user's
script; rank 0 returns from ``LLM(...)`` as the engine and ranks > 0 serve steps and exit when rank 0 shuts down.

Environment: ``TOKENFAB_TP_TIMEOUT`` (seconds, default 300) bounds loading, rendezvous and each collective.
"""
from __future__ import annotations

import atexit
import copy
import logging
import os
import queue as queue_mod
import time
import weakref

import torch
import torch.distributed as dist

logger = logging.getLogger("tokenfab")


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed (load, rendezvous or a step). ``rank`` and ``rank_traceback`` say which/why."""

    def __init__(self, message: str, rank: int | None = None, rank_traceback: str = ""):
        super().__init__(message)
        self.rank, self.rank_traceback = rank, rank_traceback


TP_FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_linear", "kimi_k3")


def _timeout_s() -> float:
    return float(os.environ.get("TOKENFAB_TP_TIMEOUT", "300"))


class WorkerProcess:
    """A worker started as ``python -m tokenfab.parallel.worker FD`` (a fresh interpreter: unlike
    multiprocessing's spawn it never re-imports the user's ``__main__``, so scripts need no main guard).

    Arguments travel pickled on stdin; messages come back on the pipe ``FD`` (see :class:`MessageReader`).
    """

    def __init__(self, rank: int, args: tuple):
        import pickle
        import subprocess
        import sys

        self.rank = rank
        self.read_fd, write_fd = os.pipe()
        env = dict(os.environ)
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.popen = subprocess.Popen([sys.executable, "-m", "tokenfab.parallel.worker", str(write_fd)],
                                      stdin=subprocess.PIPE, pass_fds=(write_fd,), env=env)
        os.close(write_fd)
        self.popen.stdin.write(pickle.dumps(args))
        self.popen.stdin.close()

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        import subprocess
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()


class MessageReader:
    """Rank 0's side of the workers' pipes: ``get(timeout)`` -> (kind, rank, text) or raises queue.Empty."""

    def __init__(self, procs: list[WorkerProcess]):
        self.bufs = {p.read_fd: b"" for p in procs}
        self.ready: list = []

    def get(self, timeout: float):
        import pickle
        import select
        import struct

        deadline = time.monotonic() + timeout
        while not self.ready:
            fds = list(self.bufs)
            left = deadline - time.monotonic()
            if not fds or left <= 0:
                raise queue_mod.Empty
            r, _, _ = select.select(fds, [], [], left)
            for fd in r:
                chunk = os.read(fd, 1 << 16)
                if not chunk:  # the worker closed its end (exited)
                    os.close(fd)
                    del self.bufs[fd]
                    continue
                buf = self.bufs[fd] + chunk
                while len(buf) >= 4:
                    (n,) = struct.unpack("<I", buf[:4])
                    if len(buf) < 4 + n:
                        break
                    self.ready.append(pickle.loads(buf[4:4 + n]))
                    buf = buf[4 + n:]
                self.bufs[fd] = buf
        return self.ready.pop(0)

    def close(self) -> None:
        for fd in list(self.bufs):
            os.close(fd)
        self.bufs.clear()


class TPGroup:
    """Rank 0's handle on the tensor-parallel group: the step channel, the worker processes, shutdown.

    Attributes:
        ctx: rank 0's TPContext; channel: the StepChannel; procs: spawned workers (empty under torchrun).
    """

    def __init__(self, ctx, procs, msg_queue, block_size: int, prev_threads: int | None):
        from tokenfab.parallel.worker import StepChannel

        self.ctx, self.procs, self.msg_queue = ctx, procs, msg_queue
        self.channel = StepChannel(ctx.cpu_group)
        self.channel.block_size = block_size
        self.prev_threads = prev_threads
        self.closed = False
        self.failed_rank: int | None = None

    def attach(self, runner) -> None:
        """Make ``runner`` (rank 0's ModelRunner) broadcast every step to the workers."""
        runner.tp_channel = self.channel

    def execute(self, runner, batch):
        """runner.execute(batch), with a failed worker reported as TensorParallelError (its traceback)."""
        if self.closed:
            raise TensorParallelError("the tensor-parallel group is stopped (a rank failed earlier or the engine "
                                      "was shut down); create a new engine.", self.failed_rank)
        try:
            return runner.execute(batch)
        except Exception as e:  # noqa: BLE001
            err = self.worker_failure(wait_s=5.0)
            if err is not None:
                self.failed_rank = err.rank
                self.close(graceful=False)
                raise err from e
            raise

    def worker_failure(self, wait_s: float = 0.0) -> TensorParallelError | None:
        """The root-cause worker failure, or None when every worker is fine.

        Collects reports for up to ``wait_s`` (less when every worker has already exited). A rank that died without
        a traceback (killed, e.g. by the OOM killer) or whose traceback is not a secondary connection error (peers
        of a dead rank fail with "Connection reset/closed") is preferred over the others.
        """
        deadline = time.monotonic() + wait_s
        errors: list[tuple[int, str]] = []
        while self.msg_queue is not None:
            try:
                kind, rank, text = self.msg_queue.get(timeout=0.05)
                if kind == "error":
                    errors.append((rank, text))
                continue
            except queue_mod.Empty:
                pass
            if time.monotonic() >= deadline or all(p.exitcode is not None for p in self.procs):
                break
        reported = {r for r, _ in errors}
        for p in self.procs:
            if p.exitcode is not None and p.exitcode != 0 and p.rank not in reported:
                return TensorParallelError(f"tensor-parallel rank {p.rank} exited with code {p.exitcode} "
                                           "(killed, or crashed without a Python traceback).", p.rank)
        secondary = ("Connection reset", "Connection closed", "Broken pipe", "closed by peer")
        errors.sort(key=lambda e: any(m in e[1] for m in secondary))
        if errors:
            rank, text = errors[0]
            return TensorParallelError(f"tensor-parallel rank {rank} failed:\n{text}", rank, text)
        return None

    def close(self, graceful: bool = True) -> None:
        """Stop the workers (a stop message when ``graceful``, then join; kill stragglers) and leave the group."""
        if self.closed:
            return
        self.closed = True
        if graceful and dist.is_initialized() and all(p.exitcode is None for p in self.procs):
            try:
                self.channel.send_stop()
            except Exception:  # noqa: BLE001 - a worker already gone: fall through to terminate
                pass
        for p in self.procs:
            p.join(timeout=10 if graceful else 0.5)
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
                p.join(timeout=5)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        if self.prev_threads is not None:
            torch.set_num_threads(self.prev_threads)
        if self.msg_queue is not None:
            self.msg_queue.close()


def _terminate(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.exitcode is None:
            p.kill()
            p.join(timeout=5)


def _note_load_message(msg, loaded: set[int]) -> bool:
    """One worker message while loading: raise TensorParallelError on 'error'; on 'loaded' add the rank, return True."""
    kind, rank, text = msg
    if kind == "error":
        raise TensorParallelError(f"tensor-parallel rank {rank} failed while loading:\n{text}", rank, text)
    if kind == "loaded":
        loaded.add(rank)
        return True
    return False


def _wait_loaded(procs, msg_queue, n_workers: int, timeout_s: float) -> None:
    """Block until every worker reported 'loaded'; raise TensorParallelError on an error, a death or the deadline."""
    loaded: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(loaded) < n_workers:
        try:
            _note_load_message(msg_queue.get(timeout=0.2), loaded)
            continue
        except queue_mod.Empty:
            pass
        for rank, p in enumerate(procs, start=1):
            if p.exitcode is not None and rank not in loaded:
                try:  # its traceback may still be in flight
                    if _note_load_message(msg_queue.get(timeout=2.0), loaded):
                        continue
                except queue_mod.Empty:
                    pass
                raise TensorParallelError(f"tensor-parallel rank {rank} exited with code {p.exitcode} while "
                                          "loading (no traceback reported).", rank)
        if time.monotonic() > deadline:
            missing = sorted(set(range(1, n_workers + 1)) - loaded)
            raise TensorParallelError(f"tensor-parallel ranks {missing} did not finish loading within {timeout_s:.0f}"
                                      " s (TOKENFAB_TP_TIMEOUT).", missing[0])


def load_tensor_parallel(config, progress: bool = True):
    """Start the group for ``config.tensor_parallel_size`` ranks and load rank 0's shard in this process.

    Returns a LoadedModel whose ``tp_group`` is the :class:`TPGroup`. Ranks > 0 under torchrun never return.

    Raises:
        ValueError: tensor_parallel_size < 1.
        TensorParallelError: a rank failed or did not load in time (with its traceback).
    """
    from tokenfab.parallel.distributed import free_port, init_distributed, launched_by_torchrun
    from tokenfab.parallel.worker import build_rank, rank_device, torchrun_worker

    n = config.tensor_parallel_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {n!r}.")
    timeout = _timeout_s()
    from tokenfab.config import load_config
    from tokenfab.errors import UnsupportedError
    family = load_config(config.model).family if os.path.isdir(config.model) else None
    if n > 1 and family is not None and family not in TP_FAMILIES:
        raise UnsupportedError(f"tensor_parallel_size={n}: tensor parallel is implemented for {TP_FAMILIES}, not "
                               f"'{family}' yet; use tensor_parallel_size=1.")
    if launched_by_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if world != n:
            raise ValueError(f"tensor_parallel_size={n} but torchrun started WORLD_SIZE={world} processes; "
                             "make them equal.")
        if rank > 0:
            torchrun_worker(copy.deepcopy(config), rank, world, local_rank, timeout)  # exits the process
        device = rank_device(config, local_rank)
        ctx, loaded = build_rank(copy.deepcopy(config), 0, n, device, progress)
        init_distributed(ctx, device, None, timeout)
        loaded.tp_group = TPGroup(ctx, [], None, config.block_size, None)
        return loaded

    device = rank_device(config, 0)
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs on this node but {torch.cuda.device_count()} "
                         "are visible; use torchrun across nodes (docs/parallel.md).")
    prev_threads = None
    threads = 0
    if device.type == "cpu":  # n processes share the cores: avoid oversubscription
        threads = max(1, (os.cpu_count() or 1) // n)
        prev_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs: list[WorkerProcess] = []
    msg_queue = None
    try:
        for rank in range(1, n):
            procs.append(WorkerProcess(rank, (rank, n, config, init_method, timeout, threads)))
        msg_queue = MessageReader(procs)
        ctx, loaded = build_rank(copy.deepcopy(config), 0, n, device, progress)
        _wait_loaded(procs, msg_queue, n - 1, timeout)
        init_distributed(ctx, device, init_method, timeout)
    except BaseException:
        _terminate(procs)
        if msg_queue is not None:
            msg_queue.close()
        if prev_threads is not None:
            torch.set_num_threads(prev_threads)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    group = TPGroup(ctx, procs, msg_queue, config.block_size, prev_threads)
    _live_groups.add(group)
    loaded.tp_group = group
    return loaded


_live_groups: "weakref.WeakSet[TPGroup]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # pragma: no cover - interpreter exit
    for g in list(_live_groups):
        try:
            g.close(graceful=True)  # stop message first: workers exit quietly
        except Exception:  # noqa: BLE001
            pass
