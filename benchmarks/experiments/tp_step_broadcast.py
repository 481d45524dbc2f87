"""Micro-benchmark of the tensor-parallel per-step batch channel:
``PYTHONPATH=. .venv/bin/python benchmarks/experiments/tp_step_broadcast.py``.

For world sizes 2 and 6 (gloo, CPU): the StepChannel broadcast with the payload inline (one collective) and in a
second broadcast, a pickled-arrays pipe (rank 0's send cost only), and one all-reduce of [T, 64] float32.
"""
import os, sys, time, pickle
import numpy as np, torch, torch.distributed as dist
import torch.multiprocessing as mp
from tokenfab.parallel.worker import StepChannel

def arrays(B, T):
    """One step's scheduling arrays for B sequences and T tokens, as StepChannel.send_step takes them."""
    num_new = np.ones(B, np.int64); num_new[-1] = T - (B - 1)
    num_computed = np.full(B, 100, np.int64)
    bt = np.arange(B * 64, dtype=np.int64).reshape(B, 64)
    return (B - 1, num_new, num_computed, bt, np.arange(T, dtype=np.int64), np.arange(B, dtype=np.int64))

def main(rank, world, port, iters, conns):
    """Rank ``rank`` of ``world``: time each channel over ``iters`` steps; rank 0 prints microseconds per step."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for name, (B, T) in {"decode B=32": (32, 32), "prefill T=1024": (4, 1024)}.items():
        a = arrays(B, T)
        res = {}
        for inline in (2048, 0):
            ch = StepChannel(inline=inline); ch.block_size = 16
            dist.barrier(); t = time.perf_counter()
            for _ in range(iters):
                if rank == 0: ch.send_step(*a)
                else: ch.recv()
            dist.barrier(); res[f"bcast(inline={inline})"] = (time.perf_counter() - t) / iters
        # pipe: rank 0 pickles the arrays to each worker; workers ack via barrier-free recv
        dist.barrier(); t = time.perf_counter()
        for _ in range(iters):
            if rank == 0:
                data = pickle.dumps(a, protocol=5)
                for c in conns: c.send_bytes(data)
            else:
                pickle.loads(conns.recv_bytes())
        dist.barrier(); res["pipe"] = (time.perf_counter() - t) / iters
        x = torch.zeros(T, 64)
        dist.barrier(); t = time.perf_counter()
        for _ in range(iters): dist.all_reduce(x)
        dist.barrier(); res["all_reduce[T,64]"] = (time.perf_counter() - t) / iters
        if rank == 0: print(f"world={world} {name}: " + ", ".join(f"{k} {v*1e6:.0f} us" for k, v in res.items()), flush=True)
    dist.destroy_process_group()

def entry(rank, world, port, iters, conns):
    """Process entry: rank 0 gets every pipe's send end, worker r the receive end of pipe r - 1."""
    main(rank, world, port, iters, conns if rank == 0 else conns[rank - 1][1])

if __name__ == "__main__":
    from tokenfab.parallel.distributed import free_port
    for w in (2, 6):
        pairs = [mp.Pipe(duplex=False) for _ in range(w - 1)]
        # rank0 gets send ends; worker r gets recv end of pair r-1
        send_ends = [p[1] for p in pairs]; recv_pairs = [(None, p[0]) for p in pairs]
        ctx = mp.get_context("spawn")
        port = free_port()
        ps = []
        for r in range(w):
            arg = send_ends if r == 0 else recv_pairs
            p = ctx.Process(target=entry, args=(r, w, port, 300, arg)); p.start(); ps.append(p)
        for p in ps: p.join()
