"""How the GPU kernel benchmarks (gpu_kernels.py, gpu_linears.py, gpu_kda.py) time a call: best wall time of
synchronized eager calls, or device time per call of calls replayed from one CUDA graph (as decode steps replay
them: no Python launch latency); off CUDA the eager time (the CPU dry runs, whose times mean nothing)."""
from __future__ import annotations

import time

import torch


def sync(dev: torch.device) -> None:
    """Wait for ``dev``'s queued work (CUDA / ROCm); nothing on the CPU."""
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_us(fn, dev: torch.device, reps: int) -> float:
    """Best wall time of one synchronized call of ``fn`` over ``reps`` calls (after one untimed), microseconds."""
    fn()
    sync(dev)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(dev)
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def time_replayed_us(calls, dev: torch.device, reps: int) -> float:
    """Microseconds per call of ``calls`` (closures over distinct buffers, together larger than L2, so each call
    reads its bytes from HBM): captured back to back in one CUDA graph, the best of ``reps`` replays divided by
    the call count. Off CUDA: :func:`time_us` of the first call."""
    if dev.type != "cuda":
        return time_us(calls[0], dev, reps)
    for fn in calls:  # compiles and tunes outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return time_us(graph.replay, dev, reps) / len(calls)


def time_graph_us(fn, dev: torch.device, reps: int, calls: int = 10) -> tuple[float, str]:
    """Device microseconds per call of ``fn``: ``calls`` calls captured in one CUDA graph, the best of ``reps``
    replays / calls, by CUDA events. Returns (us, how): "graph", or "eager (graph capture failed: ...)" with
    :func:`time_us` when capture raised; off CUDA plain :func:`time_us` and "eager"."""
    if dev.type != "cuda":
        return time_us(fn, dev, reps), "eager"
    fn()
    fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as e:  # noqa: BLE001 - reported in the row, the eager time measured instead
        torch.cuda.synchronize()
        return time_us(fn, dev, reps), f"eager (graph capture failed: {type(e).__name__}: {str(e)[:120]})"
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    del graph
    return best, "graph"
