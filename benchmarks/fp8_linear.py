"""FP8 block-scaled linears (DeepSeek-V3 layout; kernels/cpu/csrc/fp8_linear.cpp) against tokenfab's bf16 VNNI
linear (kernels/cpu/csrc/vnni_linear.cpp) at the same shapes, side by side, and the resident memory of an FP8
checkpoint against its bf16 twin.

    .venv/bin/python benchmarks/fp8_linear.py [--rows 1,8,64] [--reps 5] [--mb 128] [--no-rss] [--layout rows]

Linears: DeepSeek-V3's MLP shapes 2048 x 7168 (gate / up of a routed expert: 7168 inputs) and 7168 x 2048 (down).
Every format gets enough distinct weights of each shape (``--mb`` MB of its own bytes) that a pass streams them from
memory, as a decode step streams its layers; both run the same bf16 input, alternated pass by pass, best pass of
``--reps``. GB/s counts the bytes each format reads per call (FP8: 1 byte per weight + 4 bytes per 128 x 128 scale;
bf16: 2 bytes), GFLOP/s 2 rows N K per call. ``--layout rows`` keeps the FP8 weights row-major where
``Fp8BlockWeight.prepare`` would re-lay them into the CPU tile layout (A/B runs).

Resident memory: a DeepSeek-V3-shaped checkpoint (4 layers, 2 dense, hidden 1024; random weights) written in the
published FP8 layout and as its bf16 twin (the same values dequantized); each is loaded by ``LLM(dtype=bfloat16)`` in
its own process and the growth of that process's RSS across the load is reported beside the packed weight bytes
(``tokenfab.engine.engine_config.model_weight_bytes``).
Writes <out>/<date>-fp8-linear[-<tag>].{json,md} (default benchmarks/results).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.linear_bench import kernels_ready, run_meta, time_rate_cells  # noqa: E402
from benchmarks.results_file import write_results  # noqa: E402

SHAPES = [(2048, 7168), (7168, 2048)]
FORMATS = ("bf16", "fp8")
RSS_MODEL = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, first_k_dense_replace=2,
                 num_attention_heads=8, num_key_value_heads=8, q_lora_rank=512, kv_lora_rank=256,
                 qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, moe_intermediate_size=256,
                 n_routed_experts=8, n_group=4, topk_group=2)


def random_fp8(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    from tokenfab.testing.fp8_checkpoint import quantize_fp8_block
    return quantize_fp8_block(torch.randn(n, k, generator=g) * 0.02)


def time_shape(n: int, k: int, rows: int, reps: int, mb: float, clock=time.perf_counter) -> dict:
    """Best seconds per call of each format for weight [n, k] and ``rows`` input rows, and bytes per call."""
    from tokenfab.kernels.cpu.ops import vnni_linear as cpu_vnni
    from tokenfab.quant.fp8_block_weight import Fp8BlockWeight
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    runs, nbytes = {}, {}
    base = random_fp8(n, k, g)
    for fmt in FORMATS:
        per = n * k * 2 if fmt == "bf16" else Fp8BlockWeight(*base).nbytes
        count = max(2, int(mb * 1e6 // per)) if rows <= 16 else 2
        if fmt == "bf16":
            ws = [cpu_vnni.pack_linear_weight(torch.randn(n, k, generator=g).bfloat16()) for _ in range(count)]
            runs[fmt] = ((lambda ws: lambda i: cpu_vnni.vnni_linear(x, ws[i], n))(ws), count)
        else:
            ws = [Fp8BlockWeight(base[0].clone(), base[1].clone()) for _ in range(count)]  # prepare() re-lays them
            for w in ws:
                w.prepare()
                assert w._kernel
            runs[fmt] = ((lambda ws: lambda i: ws[i].linear(x, None))(ws), count)
        nbytes[fmt] = per
    best = {f: float("inf") for f in FORMATS}
    for _ in range(reps):
        for f, (fn, count) in runs.items():
            fn(0)
            t = clock()
            for i in range(count):
                fn(i)
            best[f] = min(best[f], (clock() - t) / count)
    return {"n": n, "k": k, "rows": rows, "seconds": best, "bytes": nbytes}


_RSS_CHILD = r"""
import ctypes, gc, json, sys, torch
def rss(field="VmRSS"):
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so RSS counts what is held
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
from tokenfab import LLM
from tokenfab.engine.engine_config import model_weight_bytes
from tokenfab.quant.fp8_block_weight import Fp8BlockWeight
import tokenfab.kernels.cpu.build as ck; ck.load()
before, anon0 = rss(), rss("RssAnon")
llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=256, kv_cache_memory=1 << 20, progress=False)
after, anon1 = rss(), rss("RssAnon")
model = llm.llm_engine.runner.model
packed = sum(m.nbytes for m in model.modules() if isinstance(m, Fp8BlockWeight))
print(json.dumps({"rss_growth": after - before, "rss_after": after, "anon_growth": anon1 - anon0, "weight_bytes": model_weight_bytes(model),
                  "fp8_packed_bytes": packed, "kv_pool_bytes": sum(c.numel() * c.element_size()
                                                                   for c in llm.llm_engine.runner.kv_caches)}))
"""


def rss_rows(tmp: str) -> dict:
    """Load the FP8 checkpoint and its bf16 twin, each in a fresh process; RSS growth and weight bytes of each."""
    from tokenfab.testing.fp8_checkpoint import write_fp8_checkpoint
    from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
    src = make_tiny_checkpoint(os.path.join(tmp, "src"), "deepseek_v3", dtype="bfloat16", **RSS_MODEL)
    fp8, twin = os.path.join(tmp, "fp8"), os.path.join(tmp, "twin")
    write_fp8_checkpoint(src, fp8, twin)
    from safetensors.torch import load_file, save_file  # the twin as bf16, as a bf16 checkpoint would be published
    path = os.path.join(twin, "model.safetensors")
    save_file({k: v.bfloat16() for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    cfg_path = os.path.join(twin, "config.json")
    cfg = dict(json.load(open(cfg_path)), torch_dtype="bfloat16", dtype="bfloat16")
    json.dump(cfg, open(cfg_path, "w"))
    out = {}
    for key, path in (("fp8", fp8), ("bf16", twin)):
        res = subprocess.run([sys.executable, "-c", _RSS_CHILD, path], capture_output=True, text=True, check=True,
                             env=dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..")))
        out[key] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,64", help="input rows per call, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="passes per format (best is kept; default 5)")
    ap.add_argument("--mb", type=float, default=128, help="MB of distinct weights per format and shape (GEMV)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the linears (default: torch's)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: perf_counter; cpu: this thread's CPU time (with --threads 1: robust on a shared, "
                         "oversubscribed machine, where wall time mostly measures the other processes)")
    ap.add_argument("--no-rss", action="store_true", help="skip the resident-memory comparison")
    ap.add_argument("--layout", choices=["auto", "rows"], default="auto",
                    help="rows: FP8 weights stay row-major (no CPU tile layout); auto: as prepare() chooses")
    ap.add_argument("--tag", default="", help="suffix of the result files' name")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"), help="output folder")
    args = ap.parse_args()
    from tokenfab.kernels.cpu.ops import fp8_linear as cpu_fp8
    if not kernels_ready(cpu_fp8.fp8_block_linear_applies(), "the FP8 and VNNI linears need"):
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.layout == "rows":
        from tokenfab.quant.fp8_block_weight import Fp8BlockWeight
        Fp8BlockWeight.tile_layout = False
    threads = torch.get_num_threads()
    rows_list = [int(r) for r in args.rows.split(",") if r]
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        print("--clock cpu needs --threads 1 (one thread's CPU time)", file=sys.stderr)
        return 2
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    results = [time_shape(n, k, rows, args.reps, args.mb, clock) for rows in rows_list for n, k in SHAPES]
    date = dt.date.today().isoformat()
    meta = run_meta(date, "benchmarks/fp8_linear.py", threads, clock=args.clock)
    lines = [f"# FP8 block-scaled linears vs the bf16 VNNI linear ({date})", "",
             f"Command: `{meta['command']}`; {threads} threads; torch {torch.__version__}; clock {args.clock}. Both "
             "formats alternated pass by pass in one run, best of the passes; the machine is shared, so read the "
             "ratios.", "",
             "| rows | weight [N, K] | bf16 µs | bf16 | fp8 µs | fp8 | fp8 time ×bf16 |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        n, k, rows, s = r["n"], r["k"], r["rows"], r["seconds"]
        cells = time_rate_cells(r, FORMATS, 16)
        lines.append(f"| {rows} | {n} x {k} | " + " | ".join(cells) + f" | {s['fp8'] / s['bf16']:.2f} |")
    rss = None
    if not args.no_rss:
        with tempfile.TemporaryDirectory() as tmp:
            rss = rss_rows(tmp)
        lines += ["", "Resident memory after loading (DeepSeek-V3 shape " + json.dumps(RSS_MODEL) + "; routed experts "
                  "and kv_b_proj are dequantized to bf16 at load, every other decoder linear stays FP8):", "",
                  "| checkpoint | RSS growth over the load (MB) | anonymous RSS growth (MB) | RSS after loading (MB) | "
                  "weight bytes held (MB) | of which FP8 packed (MB) | KV pool (MB) |", "|---|---:|---:|---:|---:|---:|---:|"]
        for key in ("fp8", "bf16"):
            v = rss[key]
            lines.append(f"| {key} | {v['rss_growth'] / 1e6:.1f} | {v['anon_growth'] / 1e6:.1f} | {v['rss_after'] / 1e6:.1f} | "
                         f"{v['weight_bytes'] / 1e6:.1f} | {v['fp8_packed_bytes'] / 1e6:.1f} | "
                         f"{v['kv_pool_bytes'] / 1e6:.1f} |")
        lines.append(f"\nfp8 / bf16: RSS growth {rss['fp8']['rss_growth'] / rss['bf16']['rss_growth']:.2f}, anonymous "
                     f"RSS growth {rss['fp8']['anon_growth'] / rss['bf16']['anon_growth']:.2f}, weight bytes "
                     f"{rss['fp8']['weight_bytes'] / rss['bf16']['weight_bytes']:.2f}. RSS is read after gc and "
                     "malloc_trim; the growth also holds the engine's own buffers (kernels' scratch, tokenizer, step "
                     "state), the same in both.")
    name = f"{date}-fp8-linear" + (f"-{args.tag}" if args.tag else "")
    write_results(args.out, name, {"meta": meta, "results": results, "rss": rss, "layout": args.layout}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
