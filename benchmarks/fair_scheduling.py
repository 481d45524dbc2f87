"""Fair scheduling: N long prompts arriving together, served under fcfs and fair side by side in one run.

One in-process ``tokenfab serve`` (the default real model, SmolLM2-135M-Instruct, bf16, CPU, the serve defaults:
max_num_batched_tokens 2048, max_num_seqs 16) on a loopback port; ``tokenfab bench serve``'s client (vLLM's metric
definitions) sends ``--num-prompts`` random-token prompts of ``--input-len`` tokens at request rate inf (all arrive
together) with ``--output-len`` output tokens each (ignore_eos, temperature 0). Between runs, while the engine is
idle, the scheduler's policy object is swapped (``engine.scheduler.policy``), so every variant runs on the same
loaded weights, KV pool and threads; the variants are interleaved and repeated (``--repeats``), and the table gives
per-variant medians over the repeats and ratios against fcfs from the same round.

Variants: ``fcfs`` and ``fair:K:C`` (FairPolicy(max_partial_prefills=K, min_prefill_chunk=C)); ``fair:K:C:shortest``
shares the step with the prompts nearest their first token instead of the next ones in arrival order.

``--replay`` runs the real scheduler without a model instead (first-token steps, no timing) at lengths this
machine cannot serve in reasonable time, also with mixed lengths and with short prompts arriving behind the long ones.

Usage::

    python benchmarks/fair_scheduling.py --replay --max-num-batched-tokens 2048 --output-len 64 \\
        --variants fcfs,fair:2:256,fair:4:256,fair:16:16
    python benchmarks/fair_scheduling.py --input-len 2048 --output-len 32 --num-prompts 16 --repeats 2 \\
        --variants fcfs,fair:2:256,fair:16:16

Writes benchmarks/results/<date>-fair-scheduling.{md,json}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_file import unused_stem, write_lines  # noqa: E402

KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "total_token_throughput",
        "output_throughput", "duration")


def parse_variant(text: str):
    """``fcfs`` | ``priority`` | ``fair:K:C`` | ``fair:K:C:shortest`` -> (label, policy factory)."""
    from tokenfab.engine.scheduling_policy import FairPolicy, make_policy
    if text.startswith("fair:"):
        _, k, c, *order = text.split(":")
        return text, lambda bs: FairPolicy(max_partial_prefills=int(k), min_prefill_chunk=int(c), block_size=bs,
                                           shortest_first=order == ["shortest"])
    return text, lambda bs: make_policy(text, block_size=bs)


def replay(policy, prompts: list[tuple[int, int]], output_len: int, budget: int, max_num_seqs: int = 16,
           bs: int = 16) -> dict:
    """Drive the real :class:`Scheduler` with ``policy`` and no model: ``prompts`` are (arrival step, length);
    each step applies the batch as the engine does (a sequence whose tokens are all computed gets one token).
    Pool: large enough that nothing is preempted. Returns the first-token step of each request (1-based: the
    step that produced it) and the step count."""
    from tokenfab.engine.block_manager import BlockManager
    from tokenfab.engine.scheduler import Scheduler
    from tokenfab.engine.sequence import Sequence
    from tokenfab.sampling_params import SamplingParams
    longest = max(n for _, n in prompts) + output_len
    bm = BlockManager(max_num_seqs * (longest // bs + 2), bs, max_num_seqs, longest + bs)
    sched = Scheduler(bm, max_num_seqs, budget, policy)
    pending = sorted(range(len(prompts)), key=lambda i: prompts[i][0])
    first, done, step = {}, 0, 0
    while done < len(prompts):
        while pending and prompts[pending[0]][0] <= step:
            i = pending.pop(0)
            sched.add(Sequence(i, str(i), 0, [1] * prompts[i][1], SamplingParams(max_tokens=output_len), float(step)))
        batch = sched.schedule()
        step += 1
        for seq, n in zip(batch.seqs, batch.num_new.tolist()):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(2)
                first.setdefault(seq.seq_id, step - prompts[seq.seq_id][0])
                if seq.num_output_tokens >= output_len:
                    sched.finish(seq, "length")
                    done += 1
    return {"first_token_steps": [first[i] for i in range(len(prompts))], "steps": step}


def run_replay(args) -> int:
    """The scheduler replay (no model, no timing): first-token steps under each variant for N prompts of
    ``--replay-lengths`` arriving together, and the same with short prompts arriving behind them."""
    import numpy as np
    variants = [parse_variant(v) for v in args.variants.split(",")]
    budget = args.max_num_batched_tokens
    rows = []
    for L in [int(x) for x in args.replay_lengths.split(",")]:
        shapes = {"together": [(0, L)] * args.num_prompts,
                  f"together, lengths x U[0.1, 1.9]": [
                      (0, int(n)) for n in np.random.default_rng(0).integers(L // 10, L * 19 // 10 + 1,
                                                                             args.num_prompts)],
                  "together + 8 short (64) arriving at steps 1-8": [(0, L)] * args.num_prompts
                  + [(k, 64) for k in range(1, 9)],
                  "1 long + 8 short (64) arriving at step 1": [(0, L)] + [(1, 64)] * 8}
        for shape, prompts in shapes.items():
            for label, factory in variants:
                r = replay(factory(16), prompts, args.output_len, budget)
                ft = r["first_token_steps"]
                n_long = 1 if shape.startswith("1 long") else args.num_prompts
                longs, shorts = ft[:n_long], ft[n_long:]
                rows.append({"input_len": L, "shape": shape, "variant": label, "steps": r["steps"],
                             "median_ttft_steps": float(np.median(longs)), "max_ttft_steps": max(longs),
                             "median_short_ttft_steps": float(np.median(shorts)) if shorts else None,
                             "first_token_steps": ft})
    cmd = shlex.join(["python", "benchmarks/fair_scheduling.py", *sys.argv[1:]])
    date = dt.date.today().isoformat()
    stem = unused_stem(os.path.join(args.out, f"{date}-{args.label}-replay"))
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"command": cmd, "max_num_batched_tokens": budget, "output_len": args.output_len,
                   "rows": rows}, f, indent=2)
    lines = [f"# Fair scheduling, scheduler replay: {args.num_prompts} prompts arriving together", "",
             f"Command: `{cmd}`", "",
             f"The real Scheduler and BlockManager driven without a model (no timing, no noise): "
             f"max_num_batched_tokens {budget}, max_num_seqs 16, {args.output_len} output tokens each. TTFT in "
             "steps from arrival to the step that produced the first token (a step costs about the same under "
             "every policy: the same tokens per step).", "",
             "| prompt tokens | arrivals | policy | steps | median TTFT (steps) | max TTFT (steps) | "
             "median TTFT of the short ones |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        short = "" if r["median_short_ttft_steps"] is None else f"{r['median_short_ttft_steps']:g}"
        lines.append(f"| {r['input_len']} | {r['shape']} | {r['variant']} | {r['steps']} | "
                     f"{r['median_ttft_steps']:g} | {r['max_ttft_steps']} | {short} |")
    write_lines(stem + ".md", lines)
    print("\n".join(lines))
    print(f"wrote {stem}.md and {stem}.json")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="Prompt lengths uniform in [L(1-r), L(1+r)] (bench serve's --random-range-ratio); 0: all L.")
    ap.add_argument("--variants", default="fcfs,fair:2:256")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--model", default=None, help="Default: the default model (SmolLM2-135M-Instruct).")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--label", default="fair-scheduling")
    ap.add_argument("--replay", action="store_true",
                    help="Only the scheduler replay (no model): first-token steps per policy, --replay-lengths.")
    ap.add_argument("--replay-lengths", default="2048,4096,8000")
    ap.add_argument("--from-log", default=None,
                    help="Write the result files from the per-run lines of this script's log (a run cut short); "
                         "give the same workload flags as the run.")
    args = ap.parse_args()
    if args.replay:
        return run_replay(args)
    if args.from_log:  # a run cut short: its per-run lines, summarized as the full run would have been
        runs, describe, pool, threads = runs_from_log(args.from_log)
        labels = [v for v in args.variants.split(",")]
        os.makedirs(args.out, exist_ok=True)
        stem = unused_stem(os.path.join(args.out, f"{dt.date.today().isoformat()}-{args.label}"))
        write_results(args, labels, runs, describe, pool, threads, stem)
        return 0

    import torch

    from tokenfab.bench.serve import make_args, run_bench_serve
    from tokenfab.default_model import default_describe, resolve_model
    from tokenfab.engine.engine_config import EngineConfig
    from tokenfab.server.api_server import build_app
    from tokenfab.server.async_engine import AsyncLLM
    from tokenfab.server.launch import ServerHandle

    variants = [parse_variant(v) for v in args.variants.split(",")]
    model = resolve_model(args.model)
    describe = default_describe() if args.model is None else args.model
    bs = 16
    longest = int(args.input_len * (1 + args.range_ratio)) + 1
    max_len = ((longest + args.output_len * 2 + 64 + bs - 1) // bs) * bs
    cfg = EngineConfig(model=model, max_model_len=max_len, max_num_seqs=16,
                       max_num_batched_tokens=args.max_num_batched_tokens, block_size=bs, seed=0)
    llm = AsyncLLM.from_config(cfg)
    llm.start()
    app = build_app(llm, "bench-model", model)
    server = ServerHandle(app, llm)
    engine = llm.engine
    pool_tokens = engine.block_manager.num_blocks * bs
    print(f"[fair] model {describe}; pool {pool_tokens} tokens; threads {torch.get_num_threads()}", flush=True)
    runs = []
    stem = unused_stem(os.path.join(args.out, f"{dt.date.today().isoformat()}-{args.label}"))
    os.makedirs(args.out, exist_ok=True)
    try:
        import httpx
        httpx.post(server.base_url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4},
                   timeout=600.0, trust_env=False)
        for r in range(args.repeats):
            order = variants if r % 2 == 0 else variants[::-1]  # alternate the order between rounds
            for label, factory in order:
                while engine.has_unfinished_requests():
                    time.sleep(0.05)
                engine.scheduler.policy = factory(bs)
                pre0 = engine.scheduler.num_preemptions
                bargs = make_args(base_url=server.base_url, model=model, served_model_name="bench-model",
                                  dataset_name="random", num_prompts=args.num_prompts,
                                  random_input_len=args.input_len, random_output_len=args.output_len,
                                  random_range_ratio=args.range_ratio,
                                  max_concurrency=args.num_prompts, ignore_eos=True, temperature=0.0,
                                  seed=1000 + r, save_result=False, percentile_metrics="ttft,tpot,itl,e2el",
                                  metric_percentiles="50,99", disable_tqdm=True)
                res = run_bench_serve(bargs)
                row = {"round": r, "variant": label, **{k: res.get(k) for k in KEYS},
                       "preemptions": engine.scheduler.num_preemptions - pre0}
                runs.append(row)
                print(f"[fair] round {r} {label}: " + ", ".join(f"{k}={row[k]:.1f}" for k in KEYS
                                                                   if isinstance(row[k], (int, float))), flush=True)
                write_results(args, [v[0] for v in variants], runs, describe, pool_tokens, torch.get_num_threads(),
                              stem)
    finally:
        server.stop()

    write_results(args, [v[0] for v in variants], runs, describe, pool_tokens, torch.get_num_threads(), stem)
    return 0


def write_results(args, labels: list[str], runs: list[dict], describe: str, pool_tokens: int, threads: int,
                  stem: str) -> None:
    """Summarize ``runs`` (medians per variant; ratios against the first variant of the same round, rounds
    without it left out of the ratios) and write ``stem``.md / .json (rewritten after every run)."""
    base = labels[0]
    summary = {}
    for lab in labels:
        rows = [x for x in runs if x["variant"] == lab]
        if not rows:
            continue
        s = {k: statistics.median(x[k] for x in rows) for k in KEYS}
        for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "total_token_throughput"):
            ratios = []
            for x in rows:
                b = next((y for y in runs if y["variant"] == base and y["round"] == x["round"]), None)
                if b is not None:
                    ratios.append(x[k] / b[k])
            s[k + "_ratio"] = statistics.median(ratios) if ratios else float("nan")
        s["preemptions"] = sum(x.get("preemptions", 0) for x in rows)
        s["runs"] = len(rows)
        summary[lab] = s
    cmd = shlex.join(["python", "benchmarks/fair_scheduling.py", *sys.argv[1:]])
    meta = {"command": cmd, "model": describe, "input_len": args.input_len, "output_len": args.output_len,
            "num_prompts": args.num_prompts, "repeats": args.repeats, "range_ratio": args.range_ratio,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": 16, "kv_pool_tokens": pool_tokens,
            "dtype": "bfloat16", "threads": threads, "cpu_count": os.cpu_count(), "date": dt.date.today().isoformat()}
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "summary": summary, "runs": runs}, f, indent=2)
    lengths = (f"{args.input_len} tokens" if not args.range_ratio else
               f"{args.input_len} x [1 - {args.range_ratio:g}, 1 + {args.range_ratio:g}] tokens")
    done = len({x["round"] for x in runs})
    lines = [f"# Fair scheduling: {args.num_prompts} prompts of {lengths} arriving together", "",
             f"Command: `{cmd}`", "",
             f"Model: {describe}, bf16, CPU ({os.cpu_count()} cores, {threads} threads, shared with other jobs), "
             f"max_num_batched_tokens {args.max_num_batched_tokens}, max_num_seqs 16, KV pool {pool_tokens} tokens; "
             f"{args.output_len} output tokens per request (ignore_eos, temperature 0), request rate inf; "
             f"`tokenfab bench serve`'s client against the in-process server. Medians over the rounds run "
             f"({done} of {args.repeats}, interleaved, order alternating); ratios against {base} of the same round "
             "(median over rounds)." + (f" Summarized from the per-run lines of the log of a run cut short "
                                        f"(`--from-log`); the run had the other flags above."
                                        if getattr(args, "from_log", None) else ""), "",
             "| policy | runs | median TTFT (ms) | p99 TTFT (ms) | median TPOT (ms) | p99 TPOT (ms) | total tok/s | "
             "TTFT ratio | p99 TTFT ratio | TPOT ratio | tok/s ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for lab, s in summary.items():
        lines.append(f"| {lab} | {s['runs']} | {s['median_ttft_ms']:.0f} | {s['p99_ttft_ms']:.0f} | "
                     f"{s['median_tpot_ms']:.1f} | {s['p99_tpot_ms']:.1f} | {s['total_token_throughput']:.0f} | "
                     f"{s['median_ttft_ms_ratio']:.2f} | {s['p99_ttft_ms_ratio']:.2f} | "
                     f"{s['median_tpot_ms_ratio']:.2f} | {s['total_token_throughput_ratio']:.3f} |")
    lines += ["", "Per run:", "", "| round | policy | median TTFT | p99 TTFT | median TPOT | total tok/s | duration s |",
              "|---|---|---|---|---|---|---|"]
    for x in runs:
        lines.append(f"| {x['round']} | {x['variant']} | {x['median_ttft_ms']:.0f} | {x['p99_ttft_ms']:.0f} | "
                     f"{x['median_tpot_ms']:.1f} | {x['total_token_throughput']:.0f} | {x['duration']:.1f} |")
    write_lines(stem + ".md", lines)
    print(f"wrote {stem}.md and {stem}.json", flush=True)


def runs_from_log(path: str) -> tuple[list[dict], str, int, int]:
    """The per-run lines (``[fair] round R LABEL: key=value, ...``) and the model line of a log of this script:
    (runs, model description, pool tokens, threads); for a run cut short (``--from-log``)."""
    import re
    runs, describe, pool, threads = [], "", 0, 0
    for line in open(path):
        m = re.match(r"\[fair\] model (.*); pool (\d+) tokens; threads (\d+)", line)
        if m:
            describe, pool, threads = m.group(1), int(m.group(2)), int(m.group(3))
        m = re.match(r"\[fair\] round (\d+) (\S+): (.*)", line)
        if m:
            row = {"round": int(m.group(1)), "variant": m.group(2)}
            for kv in m.group(3).split(", "):
                k, v = kv.split("=")
                row[k] = float(v)
            runs.append(row)
    return runs, describe, pool, threads


if __name__ == "__main__":
    raise SystemExit(main())
