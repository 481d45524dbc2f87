"""``tokenfab bench serve``: drive an OpenAI-compatible server with vLLM's serving-benchmark workload.

Orchestration only: build the dataset (:mod:`tokenfab.bench.datasets`), send requests
(:mod:`tokenfab.bench.request`) with Poisson / gamma arrivals and a concurrency cap, show progress, compute the
metrics (:mod:`tokenfab.bench.metrics`), print vLLM's result block and save vLLM-named JSON plus tokenfab's
additions (per-device throughput, steady-state window, command line, version, power / cost when the power hook
is installed).

Arrivals follow vLLM's ``get_request`` (vllm/benchmarks/serve.py): inter-arrival gaps are gamma-distributed with
shape ``burstiness`` and scale ``1 / (rate * burstiness)`` (burstiness 1 = Poisson), and the cumulative send
times are rescaled so the last request is due at ``num_prompts / rate`` seconds. ``--request-rate inf`` sends
everything at once; ``--max-concurrency`` then bounds the requests in flight.

Call :func:`run_bench_serve` with a namespace from :func:`make_args` to run it from Python.
Module import is cheap: numpy, httpx, tqdm and transformers load inside the functions that use them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import time
from datetime import datetime
from typing import Any

from tokenfab.bench import BenchError
from tokenfab.bench.datasets import DATASET_NAMES
from tokenfab.bench.metrics import (
    METRIC_NAMES,
    compute_metrics,
    percentile_key,
    steady_state_throughputs,
    steady_state_window,
)
from tokenfab.bench.request import BACKENDS, DEFAULT_ENDPOINTS

try:
    from tokenfab.power import bench_hook
except ImportError:  # the power/cost hook is optional
    bench_hook = None

METRIC_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


# ----------------------------------------------------------------------------------------------------- arguments
def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench serve`` flags (vLLM's names and defaults, plus ``--num-devices`` and ``--request-timeout``)."""
    g = parser.add_argument_group("server")
    g.add_argument("--backend", default="openai", choices=list(BACKENDS),
                   help="API flavour: openai (/v1/completions) or openai-chat (/v1/chat/completions). Default openai.")
    g.add_argument("--base-url", default=None,
                   help="Server base URL, e.g. http://127.0.0.1:8000 (overrides --host/--port).")
    g.add_argument("--host", default="127.0.0.1", help="Server host when --base-url is not given. Default 127.0.0.1.")
    g.add_argument("--port", type=int, default=8000, help="Server port when --base-url is not given. Default 8000.")
    g.add_argument("--endpoint", default=None,
                   help="API path. Default /v1/completions (openai) or /v1/chat/completions (openai-chat).")
    g.add_argument("--header", action="append", nargs="+", default=None, metavar="KEY=VALUE",
                   help="Extra HTTP header for every request (repeatable), e.g. --header Connection=close.")
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0,
                   help="Per-request timeout in seconds. Default 21600 (6 h, as vLLM).")
    g.add_argument("--model", default=None,
                   help="Model name/path; the request's model field and the default tokenizer. "
                        "Default: the first model the server lists at /v1/models.")
    g.add_argument("--served-model-name", default=None,
                   help="Name sent in the request's model field when it differs from --model.")
    g.add_argument("--tokenizer", default=None,
                   help="Local Hugging Face tokenizer folder (default: --model). Loaded offline.")
    g.add_argument("--trust-remote-code", action="store_true", help="Allow custom tokenizer code from the folder.")

    d = parser.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", choices=list(DATASET_NAMES),
                   help="Workload. Only 'random' (vLLM's random token prompts). Default random.")
    d.add_argument("--num-prompts", type=int, default=1000, help="Number of requests. Default 1000.")
    d.add_argument("--random-input-len", type=int, default=1024, help="Prompt tokens per request. Default 1024.")
    d.add_argument("--random-output-len", type=int, default=128, help="max_tokens per request. Default 128.")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths uniform in [L*(1-r), L*(1+r)], r in [0, 1). Default 0.")
    d.add_argument("--random-prefix-len", type=int, default=0,
                   help="Tokens of a random prefix shared by all prompts (added to the input length). Default 0.")
    d.add_argument("--seed", type=int, default=0, help="Seed for prompts and arrival times. Default 0.")

    t = parser.add_argument_group("traffic")
    t.add_argument("--max-concurrency", type=int, default=None,
                   help="Most requests in flight at once (client-side cap). Default: no cap.")
    t.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Requests per second (Poisson arrivals with --burstiness 1). Default inf: send all at once.")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of the inter-arrival times: 1 = Poisson, <1 burstier, >1 more regular.")

    s = parser.add_argument_group("sampling")
    s.add_argument("--ignore-eos", action="store_true",
                   help="Send ignore_eos=true so every request generates exactly its max_tokens.")
    s.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature. Default 0 (greedy).")
    s.add_argument("--top-p", type=float, default=None, help="top_p (not sent unless given).")
    s.add_argument("--top-k", type=int, default=None, help="top_k (vLLM / llama-server extension; not sent unless given).")

    r = parser.add_argument_group("results")
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="Metrics to print with percentiles: any of ttft,tpot,itl,e2el. Default ttft,tpot,itl.")
    r.add_argument("--metric-percentiles", default="99", help="Comma-separated percentiles, e.g. 50,90,99. Default 99.")
    r.add_argument("--num-devices", type=int, default=1,
                   help="Accelerators behind the server, for per-device throughput. Default 1.")
    r.add_argument("--save-result", action="store_true", help="Save the result JSON.")
    r.add_argument("--result-dir", default=None, help="Folder for the result JSON. Default: current folder.")
    r.add_argument("--result-filename", default=None,
                   help="File name for the result JSON. Default {backend}-{rate}qps[-concurrencyN]-{model}-{date}.json.")
    r.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser with the ``bench serve`` flags (and the power hook's, when installed)."""
    parser = argparse.ArgumentParser(prog="tokenfab bench serve")
    add_cli_args(parser)
    if bench_hook is not None:
        bench_hook.add_power_args(parser)
    return parser


def make_args(**overrides: Any) -> argparse.Namespace:
    """The default ``bench serve`` namespace with ``overrides`` applied (keyword names use underscores)."""
    args = build_parser().parse_args([])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


# ------------------------------------------------------------------------------------------------------- helpers
def parse_headers(items: Any) -> dict[str, str]:
    """``["Connection=close", ...]`` (or nested lists from ``append`` + ``nargs``) -> header dict.

    ``KEY: VALUE`` is accepted as well as ``KEY=VALUE``.

    Raises:
        BenchError: an item with neither ``=`` nor ``:``.
    """
    flat: list[str] = []
    for it in items or []:
        flat.extend(it if isinstance(it, (list, tuple)) else [it])
    headers = {}
    for item in flat:
        sep = "=" if "=" in item else (":" if ":" in item else None)
        if sep is None:
            raise BenchError(f"--header {item!r} is not KEY=VALUE.")
        k, v = item.split(sep, 1)
        if not k.strip():
            raise BenchError(f"--header {item!r} has an empty key.")
        headers[k.strip()] = v.strip()
    return headers


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``; each in (0, 100].

    Raises:
        BenchError: not a comma-separated list of numbers in range (names ``--metric-percentiles``).
    """
    try:
        ps = [float(p) for p in str(text).split(",") if p.strip()]
    except ValueError:
        raise BenchError(f"--metric-percentiles {text!r} must be comma-separated numbers, e.g. 50,90,99.") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise BenchError(f"--metric-percentiles {text!r}: each percentile must be in (0, 100].")
    return ps


def parse_metric_names(text: str) -> list[str]:
    """``"ttft,tpot,itl"`` -> names, each one of ttft, tpot, itl, e2el.

    Raises:
        BenchError: an unknown name (names ``--percentile-metrics``).
    """
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    bad = [n for n in names if n not in METRIC_NAMES]
    if bad or not names:
        raise BenchError(f"--percentile-metrics {text!r}: choose from {','.join(METRIC_NAMES)}.")
    return names


def resolve_base_url(args: argparse.Namespace) -> str:
    """``--base-url`` (trailing slash removed) or ``http://HOST:PORT`` (IPv6 hosts bracketed).

    Raises:
        BenchError: ``--base-url`` without an http:// or https:// scheme.
    """
    if args.base_url:
        url = args.base_url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise BenchError(f"--base-url {args.base_url!r} must start with http:// or https://.")
        return url
    host = args.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"http://{host}:{args.port}"


def _validate(args: argparse.Namespace) -> None:
    if args.backend not in BACKENDS:
        raise BenchError(f"--backend {args.backend!r} is not supported; choose one of: {', '.join(BACKENDS)}.")
    if args.dataset_name not in DATASET_NAMES:
        raise BenchError(f"--dataset-name {args.dataset_name!r} is not supported; choose one of: "
                         f"{', '.join(DATASET_NAMES)}.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {args.max_concurrency}.")
    if not args.request_rate > 0:
        raise BenchError(f"--request-rate must be > 0 (or inf), got {args.request_rate}.")
    if not args.burstiness > 0:
        raise BenchError(f"--burstiness must be > 0, got {args.burstiness}.")
    if args.num_prompts < 1:
        raise BenchError(f"--num-prompts must be >= 1, got {args.num_prompts}.")
    if args.num_devices < 1:
        raise BenchError(f"--num-devices must be >= 1, got {args.num_devices}.")
    if not args.request_timeout > 0:
        raise BenchError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}.")


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """Load a Hugging Face tokenizer offline from a local folder (or the local HF cache).

    Raises:
        BenchError: the folder is missing or holds no loadable tokenizer (names ``--tokenizer``).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:
        what = "is not a local folder" if not os.path.isdir(path) else "holds no loadable tokenizer"
        detail = " ".join(str(e).split())[:200]
        raise BenchError(f"--tokenizer {path!r} {what} (pass a local Hugging Face folder): {detail}") from None


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds after the benchmark start for ``n`` requests.

    ``inf`` rate -> all zeros. Otherwise gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)) (exponential,
    i.e. Poisson arrivals, at burstiness 1), cumulated and rescaled so the last send is at ``n / rate`` s (vLLM's
    normalisation, which removes the run-to-run drift of the total). ``burstiness=inf`` gives a constant gap.
    """
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = [1.0 / request_rate] * n
    else:
        import numpy as np

        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n).tolist()
    out, acc = [], 0.0
    for g in gaps:
        acc += g
        out.append(acc)
    if out[-1] > 0:
        scale = (n / request_rate) / out[-1]
        out = [t * scale for t in out]
    return out


def _fetch_first_model(base_url: str, headers: dict[str, str]) -> str:
    import httpx

    try:
        r = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0, trust_env=False)
        r.raise_for_status()
        data = r.json().get("data") or []
        return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        detail = " ".join(str(e).split())[:200]
        raise BenchError(f"--model not given and {base_url}/v1/models listed no model ({detail}); pass --model."
                         ) from None


def _check_reachable(base_url: str, headers: dict[str, str]) -> None:
    """Fail early, in one line, when nothing answers at the server address (any HTTP status counts as an answer)."""
    import httpx

    try:
        httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0, trust_env=False)
    except httpx.HTTPError as e:
        detail = " ".join(str(e).split())[:200] or type(e).__name__
        raise BenchError(f"cannot reach the server at {base_url} (check --base-url / --host / --port): {detail}"
                         ) from None


def _tokenfab_version() -> str:
    try:
        from tokenfab import __version__

        return str(__version__)
    except ImportError:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("tokenfab")
        except PackageNotFoundError:
            return "unknown"


def _fmt_line(label: str, value: Any, fmt: str = "") -> str:
    v = format(value, fmt) if fmt else str(value)
    return "{:<40} {:<10}".format(label, v)


def format_result(result: dict[str, Any], metric_names: list[str], percentiles: list[float]) -> str:
    """The result block, laid out as vLLM prints it, plus tokenfab's per-device and steady-state lines."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append(_fmt_line("Successful requests:", result["completed"]))
    lines.append(_fmt_line("Failed requests:", result["failed"]))
    if result.get("max_concurrency") is not None:
        lines.append(_fmt_line("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate") not in (None, "inf"):
        lines.append(_fmt_line("Request rate configured (RPS):", float(result["request_rate"]), ".2f"))
    lines.append(_fmt_line("Benchmark duration (s):", result["duration"], ".2f"))
    lines.append(_fmt_line("Total input tokens:", result["total_input_tokens"]))
    lines.append(_fmt_line("Total generated tokens:", result["total_output_tokens"]))
    lines.append(_fmt_line("Request throughput (req/s):", result["request_throughput"], ".2f"))
    lines.append(_fmt_line("Output token throughput (tok/s):", result["output_throughput"], ".2f"))
    lines.append(_fmt_line("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f"))
    lines.append(_fmt_line("Peak concurrent requests:", result["max_concurrent_requests"]))
    lines.append(_fmt_line("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f"))
    lines.append(_fmt_line("Number of devices:", result["num_devices"]))
    lines.append(_fmt_line("Output tok/s per device:", result["output_throughput_per_device"], ".2f"))
    lines.append(_fmt_line("Total tok/s per device:", result["total_token_throughput_per_device"], ".2f"))
    win = result.get("steady_state_window")
    if win:
        lines.append(_fmt_line("Steady-state window (s):", f"{win['start']:.2f} - {win['end']:.2f}"))
        if "steady_output_throughput" in result:
            lines.append(_fmt_line("Steady output tok/s:", result["steady_output_throughput"], ".2f"))
            lines.append(_fmt_line("Steady total tok/s:", result["steady_total_token_throughput"], ".2f"))
    for name in metric_names:
        short, header = METRIC_HEADERS[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(_fmt_line(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f"))
        lines.append(_fmt_line(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f"))
        for p in percentiles:
            key = percentile_key(p)
            lines.append(_fmt_line(f"{key.upper()} {short} (ms):", result[f"{key}_{name}_ms"], ".2f"))
    lines.append("=" * 50)
    return "\n".join(lines)


def result_filename(args: argparse.Namespace, model_id: str, date: str) -> str:
    """vLLM's default name ``{backend}-{rate}qps[-concurrencyN]-{model basename}-{date}.json`` (or
    ``--result-filename``), inside ``--result-dir`` when given."""
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or (
        f"{args.backend}-{args.request_rate}qps{conc}-{os.path.basename(model_id.rstrip('/'))}-{date}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


# --------------------------------------------------------------------------------------------------------- run
async def _run_requests(args, base_url, api_url, model_name, samples, headers, offsets, on_first_send):
    """Send every sample at its offset, at most ``max_concurrency`` in flight; returns (records, start, end).

    One untimed GET of ``/v1/models`` first warms the client (lazy imports of the async HTTP stack and the first
    connection would otherwise block the event loop and delay the first concurrent sends by ~0.1 s)."""
    import httpx
    from tqdm import tqdm

    from tokenfab.bench.request import RequestInput, send_request

    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    timeout = httpx.Timeout(args.request_timeout)
    pbar = tqdm(total=len(samples), disable=args.disable_tqdm, desc="bench serve", unit="req")

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        async def one(sample):
            inp = RequestInput(api_url=api_url, model=model_name, prompt=sample.prompt, prompt_len=sample.prompt_len,
                               output_len=sample.expected_output_len, ignore_eos=args.ignore_eos,
                               sampling=sampling, headers=headers)
            if sem is None:
                return await send_request(client, args.backend, inp, pbar)
            async with sem:
                return await send_request(client, args.backend, inp, pbar)

        try:
            await client.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
        except Exception:  # only a warm-up; reachability was checked before
            pass
        on_first_send()
        start = time.perf_counter()
        tasks = []
        for sample, due in zip(samples, offsets):
            wait = start + due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(sample)))
        records = await asyncio.gather(*tasks)
        end = time.perf_counter()
    pbar.close()
    return list(records), start, end


def run_bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Run the serving benchmark described by ``args`` (see :func:`make_args`); print and optionally save it.

    Returns the result dict (the saved JSON's content). Must not be called from inside a running event loop.

    Raises:
        BenchError: bad flags, an unloadable tokenizer or an unreachable server (one line naming the flag).
    """
    _validate(args)
    metric_names = parse_metric_names(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    headers = parse_headers(args.header)
    base_url = resolve_base_url(args)
    endpoint = args.endpoint or DEFAULT_ENDPOINTS[args.backend]
    if not endpoint.startswith("/"):
        endpoint = "/" + endpoint
    api_url = base_url + endpoint

    _check_reachable(base_url, headers)
    model_id = args.model or _fetch_first_model(base_url, headers)
    model_name = args.served_model_name or model_id
    tokenizer_id = args.tokenizer or model_id
    tokenizer = load_tokenizer(tokenizer_id, getattr(args, "trust_remote_code", False))

    from tokenfab.bench.datasets import get_samples

    samples = get_samples(args, tokenizer)
    offsets = arrival_offsets(len(samples), args.request_rate, args.burstiness, args.seed)

    distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness} ({distribution})")
    print(f"Maximum request concurrency: {args.max_concurrency}")

    hook_state: dict[str, Any] = {"run": None}

    def on_first_send() -> None:
        if bench_hook is None:
            return
        try:
            hook_state["run"] = bench_hook.start(args)
        except Exception as e:  # power measurement must never lose a benchmark run
            hook_state["error"] = f"power hook start failed: {type(e).__name__}: {e}"
            print(f"WARNING: {hook_state['error']}", file=sys.stderr)

    wall_minus_perf = time.time() - time.perf_counter()
    records, t_start, t_end = asyncio.run(
        _run_requests(args, base_url, api_url, model_name, samples, headers, offsets, on_first_send))
    duration = max(t_end - t_start, 1e-9)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    metrics = compute_metrics(records, duration, percentiles, count_tokens=count_tokens,
                              num_devices=args.num_devices)
    metrics.pop("tpots", None)
    window = steady_state_window([(r.send_time, r.end_time) for r in records], args.max_concurrency)

    date = datetime.now().strftime("%Y%m%d-%H%M%S")

    result: dict[str, Any] = {
        "date": date,
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": None,
        "model_id": model_id,
        "served_model_name": model_name,
        "tokenizer_id": tokenizer_id,
        "base_url": base_url,
        "endpoint": endpoint,
        "num_prompts": args.num_prompts,
        "dataset_name": args.dataset_name,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "random_prefix_len": args.random_prefix_len,
        "ignore_eos": bool(args.ignore_eos),
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "duration": duration,
        "request_goodput": None,
    }
    result.update(metrics)
    result["start_times"] = [r.send_time - t_start for r in records]
    result["generated_texts"] = [r.generated_text for r in records]
    result["errors"] = [r.error for r in records]
    result["steady_state_window"] = None if window is None else {
        "start": window[0] - t_start, "end": window[1] - t_start, "duration": window[1] - window[0]}
    if window is not None:
        steady = steady_state_throughputs(records, result["output_lens"], window)
        steady.pop("steady_duration")
        result.update(steady)
    result["command"] = getattr(args, "command_line", None) or shlex.join(
        ["tokenfab" if os.path.basename(sys.argv[0]) in ("tokenfab", "cli.py", "__main__.py") else sys.argv[0],
         *sys.argv[1:]])
    result["tokenfab_version"] = _tokenfab_version()

    failed = [r.error for r in records if not r.success]
    if failed:
        print(f"{len(failed)} request(s) failed; first errors:", file=sys.stderr)
        for err in failed[:5]:
            print(f"  {err}", file=sys.stderr)

    power_text = ""
    if bench_hook is not None:
        wall_window = None if window is None else (window[0] + wall_minus_perf, window[1] + wall_minus_perf)
        try:
            power_text = bench_hook.finish(hook_state["run"], result, args, wall_window) or ""
        except Exception as e:
            hook_state["error"] = f"power hook finish failed: {type(e).__name__}: {e}"
            print(f"WARNING: {hook_state['error']}", file=sys.stderr)
    if "error" in hook_state:
        result["power_error"] = hook_state["error"]

    print(format_result(result, metric_names, percentiles))
    if power_text:
        print(power_text.rstrip("\n"))

    if args.save_result:
        path = result_filename(args, model_id, date)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        result["result_path"] = path
        print(f"Saved result to {path}")
    return result
