"""``tokenfab demo``: serve a model and benchmark it end to end, offline, in a few minutes on a laptop CPU.

What it does:

1. takes ``--model`` or the embedded default model (written on first use; no network) and prints what it is;
2. starts ``tokenfab serve`` as a subprocess on a free 127.0.0.1 port and waits for ``/health``;
3. runs ``bench serve`` (random dataset, ``ignore_eos``) in the shape of the published 8K-in / 1K-out runs scaled
   to this machine (default 64 prompts, at most 16 in flight, 512 tokens in / 128 out), once at temperature 0 and
   once at 1.0, printing both result blocks;
4. writes a run folder (default ``runs/demo-<timestamp>/``): ``config.json`` (resolved settings and commands),
   ``environment.json`` (python, torch, transformers, CPU model, cores), the two raw result JSONs,
   ``summary.md`` (both result tables), ``server.log``, and, when :mod:`tokenfab.cost.report` is installed, the
   cost report under ``report/``;
5. stops the server (SIGINT, then SIGTERM / SIGKILL if it hangs).

Flags scale the workload up (``--num-prompts``, ``--input-len``, ``--output-len``, ``--max-concurrency``).
Heavy imports happen inside :func:`run_demo`.
"""
from __future__ import annotations

import argparse
import os

DEFAULT_TEMPERATURES = "0,1.0"

# Rows of the summary table: (label, result key, format). Times in ms, throughputs in tokens or requests per s.
SUMMARY_ROWS = [
    ("Successful requests", "completed", "d"), ("Failed requests", "failed", "d"),
    ("Benchmark duration (s)", "duration", ".2f"), ("Total input tokens", "total_input_tokens", "d"),
    ("Total generated tokens", "total_output_tokens", "d"), ("Request throughput (req/s)", "request_throughput", ".2f"),
    ("Output token throughput (tok/s)", "output_throughput", ".2f"),
    ("Total token throughput (tok/s)", "total_token_throughput", ".2f"),
    ("Peak output token throughput (tok/s)", "max_output_tokens_per_s", ".2f"),
    ("Mean TTFT (ms)", "mean_ttft_ms", ".2f"), ("Median TTFT (ms)", "median_ttft_ms", ".2f"),
    ("P99 TTFT (ms)", "p99_ttft_ms", ".2f"), ("Mean TPOT (ms)", "mean_tpot_ms", ".2f"),
    ("Median TPOT (ms)", "median_tpot_ms", ".2f"), ("P99 TPOT (ms)", "p99_tpot_ms", ".2f"),
    ("Mean ITL (ms)", "mean_itl_ms", ".2f"), ("Median ITL (ms)", "median_itl_ms", ".2f"),
    ("P99 ITL (ms)", "p99_itl_ms", ".2f"), ("Mean E2EL (ms)", "mean_e2el_ms", ".2f"),
    ("P99 E2EL (ms)", "p99_e2el_ms", ".2f"),
]


def _free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _parse_temperatures(text: str) -> list[float]:
    try:
        ts = [float(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--temperatures {text!r} must be comma-separated numbers, e.g. 0,1.0") from None
    if not ts or any(t < 0 for t in ts):
        raise ValueError(f"--temperatures {text!r}: give one or more temperatures >= 0")
    return ts


def environment() -> dict:
    """Python, torch, transformers and tokenfab versions, OS, CPU model and core counts, git commit if any."""
    import platform
    import subprocess
    import sys

    import torch
    import transformers

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        from tokenfab import __version__ as tf_version
    except ImportError:
        tf_version = "unknown"
    commit = None
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=5).stdout.strip() or None
    except Exception:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
           "tokenfab": str(tf_version), "git_commit": commit, "platform": platform.platform(),
           "machine": platform.machine(), "cpu_model": cpu, "cpu_count": os.cpu_count(),
           "cpus_available": affinity, "torch_threads": torch.get_num_threads(),
           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env["gpu"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def summary_markdown(results: list[tuple[float, dict]], cfg: dict, env: dict, describe_line: str) -> str:
    """The run's Markdown summary: what ran, on what, and one result column per temperature."""
    head = "| Metric | " + " | ".join(f"temperature {t:g}" for t, _ in results) + " |"
    sep = "|---|" + "---:|" * len(results)
    lines = ["# tokenfab demo", "",
             f"Model: {describe_line}", "",
             f"Workload: {cfg['num_prompts']} prompts, random dataset, {cfg['input_len']} tokens in / "
             f"{cfg['output_len']} out (ignore_eos), at most {cfg['max_concurrency']} in flight, all sent at "
             "once (the published 8K-in / 1K-out shape, scaled to this machine).", "",
             f"Machine: {env.get('cpu_model')} ({env.get('cpus_available')} CPUs available), python "
             f"{env.get('python')}, torch {env.get('torch')}, transformers {env.get('transformers')}.", "",
             f"Server: `{cfg['server_command']}`", "",
             "## Results", "", head, sep]
    for label, key, fmt in SUMMARY_ROWS:
        cells = []
        for _, r in results:
            v = r.get(key)
            cells.append("n/a" if v is None else format(int(v) if fmt == "d" else float(v), fmt))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", f"Total demo wall time: {cfg.get('wall_time_s', float('nan')):.1f} s "
              f"(server start {cfg.get('server_start_s', float('nan')):.1f} s).", ""]
    return "\n".join(lines)


class DemoError(RuntimeError):
    """The demo could not run (server did not start ...): reported as one line."""

    user_error = True


class _ServerProcess:
    """``tokenfab serve`` in a subprocess, output to ``log_path``; :meth:`stop` ends it (SIGINT, then harder)."""

    def __init__(self, cmd: list[str], log_path: str, base_url: str):
        import subprocess

        self.cmd, self.base_url, self.log_path = cmd, base_url, log_path
        self.log = open(log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float) -> None:
        import time

        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise DemoError(f"the server exited with code {self.proc.returncode} before it was ready; "
                                   f"see {self.log_path}:\n{self.tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise DemoError(f"the server was not ready after {timeout:.0f} s; see {self.log_path}")

    def tail(self, n: int = 15) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> int | None:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self.log.close()
        return self.proc.returncode


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo described by ``args`` (see :func:`register`); returns 0 when every request succeeded."""
    import json
    import shlex
    import sys
    import time
    from datetime import datetime

    import httpx

    from tokenfab.bench.serve import make_args, run_bench_serve

    t_start = time.perf_counter()
    for field in ("num_prompts", "max_concurrency", "input_len", "output_len"):
        if getattr(args, field) < 1:
            raise ValueError(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}.")
    temps = _parse_temperatures(args.temperatures)

    if args.model:
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise FileNotFoundError(f"--model {args.model!r}: no config.json there (give a checkpoint folder).")
        model = os.path.abspath(args.model)
        describe_line = f"{model} (given with --model)"
        served = os.path.basename(model.rstrip("/")) or "model"
    else:
        from tokenfab.default_model import DEFAULT_MODEL_NAME, describe, ensure_default_model

        model = ensure_default_model()
        describe_line = describe()
        served = DEFAULT_MODEL_NAME
    print(f"[demo] model: {describe_line}", flush=True)
    from tokenfab.engine.engine_config import resolve_device
    if resolve_device(args.device).type == "cpu":  # build the fused CPU kernels here, on the console, not in the server
        from tokenfab.kernels import cpu_kernels
        cpu_kernels.load()

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = os.path.abspath(args.out or os.path.join("runs", f"demo-{stamp}"))
    os.makedirs(out, exist_ok=True)
    host = "127.0.0.1"
    port = args.port or _free_port(host)
    base_url = f"http://{host}:{port}"
    bs = 16
    max_model_len = args.max_model_len or ((args.input_len + args.output_len + 64 + bs - 1) // bs) * bs
    server_cmd = [sys.executable, "-m", "tokenfab.cli", "serve", model, "--host", host, "--port", str(port),
                  "--served-model-name", served, "--max-model-len", str(max_model_len),
                  "--max-num-seqs", str(args.max_num_seqs or args.max_concurrency), "--dtype", args.dtype,
                  "--device", args.device, "--seed", "0"]
    cfg = {"model": model, "served_model_name": served, "describe": describe_line, "num_prompts": args.num_prompts,
           "max_concurrency": args.max_concurrency, "input_len": args.input_len, "output_len": args.output_len,
           "temperatures": temps, "dataset_name": "random", "ignore_eos": True, "request_rate": "inf",
           "max_model_len": max_model_len, "max_num_seqs": args.max_num_seqs or args.max_concurrency,
           "dtype": args.dtype, "device": args.device, "base_url": base_url, "out": out,
           "server_command": shlex.join(server_cmd),
           "demo_command": shlex.join(["tokenfab", *sys.argv[1:]]) if sys.argv else None}
    env = environment()
    with open(os.path.join(out, "environment.json"), "w") as f:
        json.dump(env, f, indent=2)
    print(f"[demo] machine: {env['cpu_model']} ({env['cpus_available']} CPUs), python {env['python']}, "
          f"torch {env['torch']}, transformers {env['transformers']}", flush=True)
    print(f"[demo] starting the server: {cfg['server_command']}", flush=True)

    server = _ServerProcess(server_cmd, os.path.join(out, "server.log"), base_url)
    results: list[tuple[float, dict]] = []
    try:
        t0 = time.perf_counter()
        server.wait_ready(args.server_timeout)
        cfg["server_start_s"] = time.perf_counter() - t0
        print(f"[demo] server ready at {base_url} after {cfg['server_start_s']:.1f} s", flush=True)
        # One short untimed request: first-call costs (kernels, allocator) stay out of the measurement.
        httpx.post(base_url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4, "ignore_eos": True},
                   timeout=300.0, trust_env=False)
        for t in temps:
            print(f"\n[demo] benchmark at temperature {t:g}: {args.num_prompts} prompts, {args.input_len} in / "
                  f"{args.output_len} out, max concurrency {args.max_concurrency}", flush=True)
            bargs = make_args(base_url=base_url, model=model, served_model_name=served, dataset_name="random",
                              num_prompts=args.num_prompts, random_input_len=args.input_len,
                              random_output_len=args.output_len, max_concurrency=args.max_concurrency,
                              ignore_eos=True, temperature=t, seed=0, save_result=True, result_dir=out,
                              result_filename=f"result-temperature-{t:g}.json",
                              percentile_metrics="ttft,tpot,itl,e2el", metric_percentiles="50,90,99",
                              disable_tqdm=args.disable_tqdm, command_line=cfg["demo_command"],
                              power_cap_kw=args.power_cap_kw, device_hour_price=args.device_hour_price)
            results.append((t, run_bench_serve(bargs)))
    finally:
        rc = server.stop()
        print(f"[demo] server stopped ({'cleanly' if rc in (0, 130, -2) else f'exit code {rc}'})", flush=True)

    cfg["wall_time_s"] = time.perf_counter() - t_start
    cfg["result_files"] = [os.path.basename(r.get("result_path", "")) for _, r in results]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    md = summary_markdown(results, cfg, env, describe_line)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md)
    print("\n" + md)

    if not args.no_report:
        try:
            from tokenfab.cost.report import write_report
        except ImportError:
            write_report = None
        if write_report is not None:
            try:
                path = write_report([os.path.join(out, n) for n in cfg["result_files"] if n],
                                    os.path.join(out, "report"), None)
                print(f"[demo] cost report: {path}")
            except Exception as e:  # the report is an extra; never lose the run over it
                print(f"[demo] WARNING: cost report failed: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"[demo] run folder: {out}  (total wall time {cfg['wall_time_s']:.1f} s)")
    ok = all(r.get("failed", 1) == 0 and r.get("completed", 0) == args.num_prompts for _, r in results)
    return 0 if ok else 1


def register(subparsers) -> None:
    """Add ``demo`` to the top-level ``tokenfab`` parser."""
    p = subparsers.add_parser(
        "demo", help="Serve the embedded (or given) model and benchmark it end to end, offline.",
        description="Start tokenfab serve on a free loopback port, run bench serve (random dataset, ignore-eos) at "
                    "temperature 0 and 1.0, and write a run folder with the configuration, environment, raw "
                    "results and a Markdown summary.")
    p.add_argument("--model", default=None, help="Checkpoint folder. Default: the embedded default model.")
    p.add_argument("--num-prompts", type=int, default=64, help="Requests per benchmark run. Default 64.")
    p.add_argument("--max-concurrency", type=int, default=16, help="Most requests in flight. Default 16.")
    p.add_argument("--input-len", type=int, default=512, help="Prompt tokens per request. Default 512.")
    p.add_argument("--output-len", type=int, default=128, help="Generated tokens per request. Default 128.")
    p.add_argument("--temperatures", default=DEFAULT_TEMPERATURES,
                   help="Comma-separated temperatures, one benchmark run each. Default 0,1.0.")
    p.add_argument("--port", type=int, default=0, help="Server port on 127.0.0.1. Default: a free one.")
    p.add_argument("--out", default=None, help="Run folder. Default runs/demo-<timestamp>/.")
    p.add_argument("--dtype", default="auto", help="Server dtype (auto = bfloat16). Default auto.")
    p.add_argument("--device", default="auto", help="Server device (auto, cpu, cuda). Default auto.")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="Server max_model_len. Default: input + output + 64, rounded up to 16.")
    p.add_argument("--max-num-seqs", type=int, default=None, help="Server max_num_seqs. Default: --max-concurrency.")
    p.add_argument("--server-timeout", type=float, default=600.0,
                   help="Seconds to wait for the server to become healthy. Default 600.")
    p.add_argument("--disable-tqdm", action="store_true", help="No progress bars.")
    p.add_argument("--no-report", action="store_true", help="Skip the cost report even when it is available.")
    p.add_argument("--power-cap-kw", type=float, default=None,
                   help="Power cap (kW) for the cost table when none can be read from the machine.")
    p.add_argument("--device-hour-price", type=float, action="append", default=None,
                   help="Rental $ per device-hour for the cost table (repeatable).")
    p.set_defaults(func=run_demo)
