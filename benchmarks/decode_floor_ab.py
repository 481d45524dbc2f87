"""Side-by-side batch-1 decode floor of kernel variants chosen by environment variables: runs
``benchmarks/decode_floor.py`` once per (round, threads, variant), variants interleaved, each run measuring its own
floor (copy bandwidth sampled between its steps), and tabulates step / floor per variant.

    .venv/bin/python benchmarks/decode_floor_ab.py --model FILE.gguf --threads 1,2 --rounds 3 \\
        --variant before:TOKENFAB_GGUF_PREFETCH=0 --variant after: [--steps 30] [--label smollm2-q4_1]

A variant is ``NAME:VAR=VALUE[,VAR=VALUE...]`` (``NAME:`` alone: the defaults). The machine's load average is
recorded before every run: on a shared machine compare ratios taken in the same round, not absolute times.
Writes <--out, default benchmarks/results>/<date>[-<label>]-decode-floor.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.results_file import write_results  # noqa: E402


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """``NAME:VAR=VALUE,...`` -> (NAME, {VAR: VALUE}). Raises ValueError naming the malformed part."""
    name, sep, rest = spec.partition(":")
    if not sep or not name:
        raise ValueError(f"--variant {spec!r}: expected NAME:VAR=VALUE[,VAR=VALUE...] (or NAME: for the defaults)")
    env = {}
    for kv in filter(None, rest.split(",")):
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise ValueError(f"--variant {spec!r}: {kv!r} is not VAR=VALUE")
        env[k] = v
    return name, env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder or .gguf file (default: the default model)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default: 1,2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of all variants per thread count (default: 3)")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per run (default: 30)")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens (default: 512)")
    ap.add_argument("--variant", action="append", required=True, help="NAME:VAR=VALUE,... (repeat; two or more)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--label", default=None, help="label in the result file names")
    args = ap.parse_args()
    try:
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as e:
        ap.error(str(e))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_floor.py")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for threads in [int(t) for t in args.threads.split(",")]:
            for rnd in range(args.rounds):
                for name, env in variants:
                    out = os.path.join(tmp, f"{threads}-{rnd}-{name}")
                    cmd = [sys.executable, script, "--batch", "1", "--steps", str(args.steps), "--context",
                           str(args.context), "--threads", str(threads), "--out", out]
                    if args.model:
                        cmd += ["--model", args.model]
                    load = os.getloadavg()[0]
                    subprocess.run(cmd, env={**os.environ, **env}, check=True, stdout=subprocess.DEVNULL)
                    res = json.load(open(os.path.join(out, os.listdir(out)[0].rsplit(".", 1)[0] + ".json")))
                    row = res["rows"][0]
                    runs.append({"threads": threads, "round": rnd, "variant": name, "env": env, "load_avg_1m": load,
                                 "step_ms": row["step_ms"], "forward_ms": row["forward_ms"],
                                 "floor_ms": row["floor_ms"], "ratio_to_floor": row["ratio_to_floor"],
                                 "copy_GBps": row["copy_bandwidth_during_steps_GBps"],
                                 "bytes_read": row["bytes_read"]})
                    print(json.dumps(runs[-1]), flush=True)
    date = dt.datetime.now().isoformat(timespec="seconds")
    command = " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    lines = [f"# Batch-1 decode step vs packed-bytes floor, variants side by side ({date})", "", f"`{command}`", "",
             "Each run is one `benchmarks/decode_floor.py --batch 1` process (its floor: the bytes a batch-1 step reads "
             "over the median copy bandwidth sampled between its own steps); variants interleaved within each round.",
             "", "| threads | round | variant | load avg | step ms | floor ms | copy GB/s | step / floor |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['threads']} | {r['round']} | {r['variant']} | {r['load_avg_1m']:.1f} | {r['step_ms']:.2f} | "
              f"{r['floor_ms']:.2f} | {r['copy_GBps']:.1f} | {r['ratio_to_floor']:.2f} |" for r in runs]
    lines += ["", "| threads | variant | median step / floor | best step / floor |", "|---|---|---|---|"]
    summary = []
    for threads in sorted({r["threads"] for r in runs}):
        for name, _ in variants:
            rs = [r["ratio_to_floor"] for r in runs if r["threads"] == threads and r["variant"] == name]
            summary.append({"threads": threads, "variant": name, "median_ratio": statistics.median(rs),
                            "best_ratio": min(rs)})
            lines.append(f"| {threads} | {name} | {statistics.median(rs):.2f} | {min(rs):.2f} |")
    label = f"-{args.label}" if args.label else ""
    write_results(args.out, f"{dt.date.today().isoformat()}{label}-decode-floor",
                  {"date": date, "command": command, "variants": dict(variants), "runs": runs, "summary": summary},
                  lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
