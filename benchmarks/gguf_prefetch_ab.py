"""Batch-1 decode step of a GGUF model served packed, with the packed GEMV's software prefetch off and on, interleaved
in one process, against the packed-bytes floor measured in the same run.

    .venv/bin/python benchmarks/gguf_prefetch_ab.py [--model FILE.gguf] [--threads 2,1] [--rounds 6] \\
        [--distances 0,2048] [--context 512] [--label smollm2-q4_1]

One sequence with ``--context`` prompt tokens is prefilled, then the same decode step (``CpuDecodeStack``'s one C++
call: forward, LM head, draw) is repeated: per round, one 512 MiB copy (the copy bandwidth, as
benchmarks/decode_floor.py measures it), then 10 steps at each prefetch distance in turn
(``cpu_build.load().gguf_prefetch``; 0 = off, the kernel as it was; the arithmetic is the same, so are the outputs).
Interleaving within one process keeps the variants under the same load on a shared machine; compare the ratios of
one thread count, not absolute times. The floor is decode_floor.py's: (packed weight bytes a batch-1 step reads + KV
bytes attended) / median copy bandwidth of the run. Records the 1-minute load average per thread count.
Writes <--out, default benchmarks/results>/<date>[-<label>]-decode-floor.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.decode_floor import copy_bandwidth, weight_bytes  # noqa: E402
from benchmarks.results_file import write_results  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file served packed (default: the default model)")
    ap.add_argument("--threads", default="2,1", help="comma-separated thread counts (default: 2,1)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of 10 steps per distance (default: 6)")
    ap.add_argument("--distances", default="0,2048", help="prefetch distances in bytes (default: 0,2048)")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens (default: 512)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--label", default=None, help="label in the result file names")
    args = ap.parse_args()
    from tokenfab import LLM, SamplingParams
    from tokenfab.default_model import resolve_model
    from tokenfab.kernels.cpu import build as cpu_build

    ext = cpu_build.load()
    if ext is None or not hasattr(ext, "gguf_prefetch"):
        ap.error(f"the fused CPU kernels with gguf_prefetch are needed ({cpu_build.load_error()})")
    model = args.model or resolve_model(None)
    llm = LLM(model, max_model_len=args.context + 64, max_num_seqs=4, progress=False)
    eng = llm.llm_engine
    runner = eng.runner
    stack = runner.cpu_decode_stack
    if stack is None or stack.vocab_size is None:
        ap.error(f"{model}: its decode steps do not run through the fused C++ decode stack with the LM head")
    captured = {}
    real = stack.run_sample

    def capture(*a):
        captured["args"] = a
        return real(*a)

    stack.run_sample = capture
    eng.add_request("p", None, [(7 * j) % 4000 + 5 for j in range(args.context)],
                    SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(4):
        eng.step()
    a = captured["args"]
    step_args = (*stack._step_tensors(*a[:5]), a[5], a[6])
    raw = stack._stack
    huge = getattr(runner, "hugepage_bytes", 0) > 0
    dense, _, _ = weight_bytes(runner.model)
    kv = eng.model_config.kv_cache_bytes_per_token(eng.dtype.itemsize) * (args.context + 1)
    read = dense + kv
    distances = [int(d) for d in args.distances.split(",")]
    default = ext.gguf_prefetch()
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for _ in range(5):
            raw.forward_sample(*step_args)
        times = {d: [] for d in distances}
        bws = []
        load = os.getloadavg()[0]
        for _ in range(args.rounds):
            bws.append(copy_bandwidth(reps=1, hugepages=huge))
            for d in distances:
                ext.gguf_prefetch(d)
                for _ in range(10):
                    t = time.perf_counter()
                    raw.forward_sample(*step_args)
                    times[d].append(time.perf_counter() - t)
        bw = statistics.median(bws)
        floor = read / bw
        for d in distances:
            med = statistics.median(times[d])
            rows.append({"threads": threads, "prefetch_bytes": d, "step_ms": med * 1e3, "best_ms": min(times[d]) * 1e3,
                         "floor_ms": floor * 1e3, "ratio_to_floor": med / floor, "best_ratio_to_floor": min(times[d]) / floor,
                         "copy_GBps": bw / 1e9, "load_avg_1m": load, "steps": len(times[d])})
            print(rows[-1], flush=True)
    ext.gguf_prefetch(default)
    date = dt.datetime.now().isoformat(timespec="seconds")
    command = " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    mib = 1 << 20
    lines = [f"# Batch-1 packed decode step vs packed-bytes floor, GEMV prefetch off / on ({date})", "", f"`{command}`",
             "", f"Model {os.path.basename(model)}; bytes read per step {read / mib:.1f} MiB (packed weights "
             f"{dense / mib:.1f} MiB, KV {kv / mib:.1f} MiB); copy bandwidth measured between the rounds (read+write, "
             f"{'2 MiB pages' if huge else '4 KiB pages'}).", "",
             "| threads | load avg | prefetch bytes | step ms (median) | best ms | floor ms | copy GB/s | step / floor "
             "| best / floor |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['threads']} | {r['load_avg_1m']:.1f} | {r['prefetch_bytes']} | {r['step_ms']:.2f} | "
              f"{r['best_ms']:.2f} | {r['floor_ms']:.2f} | {r['copy_GBps']:.1f} | {r['ratio_to_floor']:.2f} | "
              f"{r['best_ratio_to_floor']:.2f} |" for r in rows]
    label = f"-{args.label}" if args.label else ""
    write_results(args.out, f"{dt.date.today().isoformat()}{label}-decode-floor",
                  {"date": date, "command": command, "model": model, "bytes_read": read, "weight_bytes": dense,
                   "kv_bytes": kv, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
