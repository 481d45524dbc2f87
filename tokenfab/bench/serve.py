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
from tokenfab.bench.metrics import compute_metrics, percentile_key, steady_state_throughputs, steady_state_window
from tokenfab.bench.request import DEFAULT_ENDPOINTS, ENDPOINT_SUFFIXES
from tokenfab.bench.serve_args import (  # noqa: F401  (add_cli_args .. make_args: the command line, re-exported)
    _apply_general_lengths,
    _validate,
    add_cli_args,
    build_parser,
    make_args,
    parse_extra_body,
    parse_goodput,
    parse_headers,
    parse_metadata,
    parse_metric_names,
    parse_percentiles,
    resolve_base_url,
    short_errors,
)

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
# `vllm bench serve` flags tokenfab refuses by name (flag -> why); everything else vLLM's generation benchmark takes
# is accepted with vLLM's meaning (see add_cli_args).
def load_tokenizer(path: str, trust_remote_code: bool = False, tokenizer_mode: str = "auto") -> Any:
    """Load a Hugging Face tokenizer offline from a local folder (or the local HF cache).

    ``tokenizer_mode`` "slow" loads the Python tokenizer (``use_fast=False``), "auto" / "hf" the fast one.

    Raises:
        BenchError: the folder is missing or holds no loadable tokenizer (names ``--tokenizer``).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenfab.tokenizers.tiktoken_tokenizer import TiktokenTokenizer, is_tiktoken_folder
    if os.path.isdir(path) and is_tiktoken_folder(path):  # Kimi's tiktoken.model folders: no remote code runs
        try:
            return TiktokenTokenizer.from_pretrained(path)
        except ValueError as e:
            raise BenchError(f"--tokenizer '{path}': {e}") from None
    try:
        from transformers import AutoTokenizer

        from tokenfab.tokenizers.hf_folder import load_tokenizer_json, reads_tokenizer_json_directly
        if os.path.isdir(path) and reads_tokenizer_json_directly(path, trust_remote_code):  # kimi_k2 & co
            return load_tokenizer_json(path, local_files_only=True)
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code,
                                             use_fast=tokenizer_mode != "slow")
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


def fetch_models(base_url: str, headers: dict[str, str], verify: bool = True) -> list[tuple[str, str | None]]:
    """``GET /v1/models`` -> ``[(id, root), ...]`` (``root``: the model folder the server loaded, vLLM's field;
    None when the server does not say).

    Raises:
        BenchError: the server answers with an error or no model list (names ``--model``).
    """
    import httpx

    try:
        r = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0, trust_env=False, verify=verify)
        r.raise_for_status()
        data = r.json().get("data") or []
        out = [(str(m["id"]), (str(m["root"]) if m.get("root") else None)) for m in data]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as e:
        detail = " ".join(str(e).split())[:200]
        raise BenchError(f"--model not given and {base_url}/v1/models listed no model ({detail}); pass --model."
                         ) from None
    if not out:
        raise BenchError(f"--model not given and {base_url}/v1/models listed no model; pass --model.")
    return out


def resolve_model_and_tokenizer(args: argparse.Namespace, base_url: str, headers: dict[str, str],
                                verify: bool = True) -> tuple[str, str, str]:
    """``(model_id, model_name, tokenizer_id)`` as vLLM picks them, with the tokenizer found locally.

    Without ``--model``: the name is the first ``/v1/models`` id and ``model_id`` its ``root`` (the server's model
    folder). With it: ``model_id`` = ``--model``, the name ``--served-model-name`` or ``--model``. The tokenizer is
    ``--tokenizer``, else ``model_id`` when that is a local folder, else the ``root`` the server reports for the
    model (so ``--model SERVED_NAME`` works without ``--tokenizer`` against a server on this machine).

    Raises:
        BenchError: no local folder to load the tokenizer from (asks for ``--tokenizer``).
    """
    if args.model:
        model_id = args.model
        name = args.served_model_name or args.model
        if args.tokenizer:
            return model_id, name, args.tokenizer
        if os.path.isdir(model_id):
            return model_id, name, model_id
        try:
            listed = fetch_models(base_url, headers, verify)
        except BenchError:
            listed = []
        root = next((rt for mid, rt in listed if mid in (args.model, args.served_model_name)), None)
        if root is None and len(listed) == 1:
            root = listed[0][1]
        if root and os.path.isdir(root):
            return model_id, name, root
        where = f"; the server reports its model folder as {root!r}, not readable here" if root else ""
        raise BenchError(f"--model {model_id!r} is not a local folder to load the tokenizer from{where}: pass "
                         "--tokenizer with a local Hugging Face tokenizer folder.")
    listed = fetch_models(base_url, headers, verify)
    served_id, root = listed[0]
    model_id = root or served_id
    name = args.served_model_name or served_id
    if args.tokenizer:
        return model_id, name, args.tokenizer
    if root and os.path.isdir(root):
        return model_id, name, root
    if os.path.isdir(served_id):
        return model_id, name, served_id
    said = (f"reports its model folder (/v1/models root) as {root!r}, which is not readable here" if root else
            "reports no model folder (/v1/models root)")
    raise BenchError(f"the server at {base_url} {said}: pass --tokenizer with a local Hugging Face tokenizer "
                     f"folder for {served_id!r}.")


def _check_reachable(base_url: str, headers: dict[str, str], verify: bool = True) -> None:
    """Fail early, in one line, when nothing answers at the server address (any HTTP status counts as an answer)."""
    import httpx

    try:
        httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0, trust_env=False, verify=verify)
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
    if result.get("request_goodput") is not None:
        lines.append(_fmt_line("Request goodput (req/s):", result["request_goodput"], ".2f"))
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
    from tokenfab.bench.spec_metrics import format_spec_decode
    lines.extend(format_spec_decode(result, _fmt_line))
    from tokenfab.bench.host_expert_metrics import format_host_experts
    lines.extend(format_host_experts(result, _fmt_line))
    lines.append("=" * 50)
    return "\n".join(lines)


def result_filename(args: argparse.Namespace, model_name: str, date: str) -> str:
    """vLLM's default name ``{label}-{rate}qps[-concurrencyN]-{model}-{date}.json`` (label: ``--label``, else
    ``--backend``), or ``--result-filename``; inside ``--result-dir`` when given.

    ``{model}`` is the last path part of ``--model`` when given, else of ``model_name``, the served model name (the
    first ``/v1/models`` id, or ``--served-model-name``): the name clients use, never the folder the server reads
    (``/v1/models`` root: for a GGUF file or the default model, a cache folder)."""
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    label = getattr(args, "label", None) or args.backend
    model = (getattr(args, "model", None) or model_name).rstrip("/").split("/")[-1]
    name = args.result_filename or f"{label}-{args.request_rate}qps{conc}-{model}-{date}.json"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


# --------------------------------------------------------------------------------------------------------- run
# Per-request lists vLLM keeps in the result only with --save-detailed.
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


async def _run_requests(args, base_url, api_url, model_name, samples, headers, offsets, on_first_send):
    """Send every sample at its offset, at most ``max_concurrency`` in flight; returns (records, start, end,
    warm-up records).

    One untimed GET of ``/v1/models`` first warms the client (lazy imports of the async HTTP stack and the first
    connection would otherwise block the event loop and delay the first concurrent sends by ~0.1 s). Then
    ``--num-warmups`` copies of the first sample run (at most ``max_concurrency`` at once, as vLLM's warm-up) and
    are left out of the measured records."""
    import httpx
    from tqdm import tqdm

    from tokenfab.bench.request import RequestInput, send_request

    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "min_p": args.min_p, "frequency_penalty": args.frequency_penalty,
                "presence_penalty": args.presence_penalty, "repetition_penalty": args.repetition_penalty}
    sampling.update(parse_extra_body(args.extra_body))
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    timeout = httpx.Timeout(args.request_timeout)

    def make_input(sample, index):
        rid = f"{args.request_id_prefix}{index}" if args.request_id_prefix is not None and index is not None \
            else None
        return RequestInput(api_url=api_url, model=model_name, prompt=sample.prompt, prompt_len=sample.prompt_len,
                            output_len=sample.expected_output_len, ignore_eos=args.ignore_eos,
                            sampling=sampling, headers=headers, request_id=rid, logprobs=args.logprobs)

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False,
                                 verify=not args.insecure) as client:
        async def one(inp, bar):
            if sem is None:
                return await send_request(client, args.backend, inp, bar)
            async with sem:
                return await send_request(client, args.backend, inp, bar)

        try:
            await client.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
        except Exception:  # only a warm-up; reachability was checked before
            pass
        warmups: list = []
        if args.num_warmups > 0:
            print(f"Warming up with {args.num_warmups} requests...")
            wbar = tqdm(total=args.num_warmups, disable=args.disable_tqdm, desc="warm-up", unit="req")
            warm_input = make_input(samples[0], None)
            warmups = list(await asyncio.gather(*(one(warm_input, wbar) for _ in range(args.num_warmups))))
            wbar.close()
            print("Warmup run completed.")
        pbar = tqdm(total=len(samples), disable=args.disable_tqdm, desc="bench serve", unit="req")
        on_first_send()
        start = time.perf_counter()
        tasks = []
        for i, (sample, due) in enumerate(zip(samples, offsets)):
            wait = start + due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(make_input(sample, i), pbar)))
        records = await asyncio.gather(*tasks)
        end = time.perf_counter()
    pbar.close()
    return list(records), start, end, warmups


def _auth_headers(headers: dict[str, str]) -> dict[str, str]:
    """Add ``Authorization: Bearer $OPENAI_API_KEY`` (vLLM's client does) unless a header already sets it."""
    key = os.environ.get("OPENAI_API_KEY")
    if key and not any(k.lower() == "authorization" for k in headers):
        return {**headers, "Authorization": f"Bearer {key}"}
    return headers


def run_bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Run the serving benchmark described by ``args`` (see :func:`make_args`); print and optionally save it.

    Returns the result dict (the saved JSON's content; the per-request lists :data:`DETAILED_KEYS` only with
    ``--save-detailed``, as vLLM). Must not be called from inside a running event loop.

    Raises:
        BenchError: bad flags, an unloadable tokenizer or an unreachable server (one line naming the flag).
    """
    _validate(args)
    _apply_general_lengths(args)
    metric_names = parse_metric_names(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    goodput_slos = parse_goodput(args.goodput)
    metadata = parse_metadata(args.metadata)
    parse_extra_body(args.extra_body)  # fail before any request
    headers = _auth_headers(parse_headers(args.header))
    base_url = resolve_base_url(args)
    endpoint = args.endpoint or DEFAULT_ENDPOINTS[args.backend]
    if not endpoint.startswith("/"):
        endpoint = "/" + endpoint
    suffix = ENDPOINT_SUFFIXES[args.backend]
    if not endpoint.rstrip("/").endswith(suffix) or (suffix == "completions" and "chat/" in endpoint):
        raise BenchError(f"--endpoint {endpoint!r} does not fit --backend {args.backend} (its API path ends with "
                         f"/{suffix}); use --backend openai-chat for /v1/chat/completions, vllm or openai for "
                         "/v1/completions.")
    api_url = base_url + endpoint
    if args.ignore_eos is None:  # vLLM: the random dataset always runs to the requested length
        args.ignore_eos = args.dataset_name == "random"
    verify = not args.insecure

    _check_reachable(base_url, headers, verify)
    model_id, model_name, tokenizer_id = resolve_model_and_tokenizer(args, base_url, headers, verify)
    tokenizer = load_tokenizer(tokenizer_id, getattr(args, "trust_remote_code", False),
                               getattr(args, "tokenizer_mode", "auto"))

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
    from tokenfab.bench.spec_metrics import fetch_spec_counters, spec_decode_result
    spec_before = fetch_spec_counters(base_url)  # speculative-decoding counters, when the server exports them
    from tokenfab.bench.host_expert_metrics import fetch_host_expert_counters, host_experts_result
    host_before = fetch_host_expert_counters(base_url)  # host-offloaded experts' time split, when exported
    records, t_start, t_end, warmups = asyncio.run(
        _run_requests(args, base_url, api_url, model_name, samples, headers, offsets, on_first_send))
    spec_result = spec_decode_result(spec_before, fetch_spec_counters(base_url) if spec_before else None)
    host_result = host_experts_result(host_before, fetch_host_expert_counters(base_url) if host_before else None)
    duration = max(t_end - t_start, 1e-9)
    warm_failed = [r.error for r in warmups if not r.success]
    if warm_failed:
        print(f"WARNING: {len(warm_failed)} of {len(warmups)} warm-up request(s) failed; first: {warm_failed[0]}",
              file=sys.stderr)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    metrics = compute_metrics(records, duration, percentiles, count_tokens=count_tokens,
                              num_devices=args.num_devices, goodput_slos_ms=goodput_slos or None)
    metrics.pop("tpots", None)
    window = steady_state_window([(r.send_time, r.end_time) for r in records], args.max_concurrency)

    date = datetime.now().strftime("%Y%m%d-%H%M%S")

    result: dict[str, Any] = {
        "date": date,
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "served_model_name": model_name,
        "tokenizer_id": tokenizer_id,
        "num_prompts": args.num_prompts,
    }
    result.update(metadata)  # vLLM stores --metadata as top-level keys, before the run's own keys
    result.update({
        "base_url": base_url,
        "endpoint": endpoint,
        "dataset_name": args.dataset_name,
        "dataset_path": args.dataset_path,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "random_prefix_len": args.random_prefix_len,
        **({"prefix_repetition_prefix_len": args.prefix_repetition_prefix_len,
            "prefix_repetition_suffix_len": args.prefix_repetition_suffix_len,
            "prefix_repetition_num_prefixes": args.prefix_repetition_num_prefixes,
            "prefix_repetition_output_len": args.prefix_repetition_output_len}
           if args.dataset_name == "prefix_repetition" else {}),
        "ignore_eos": bool(args.ignore_eos),
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "num_warmups": args.num_warmups,
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "duration": duration,
        "goodput_slos_ms": goodput_slos or None,
    })
    result.update(metrics)
    if spec_result is not None:
        result.update(spec_result)
    if host_result is not None:
        result.update(host_result)
    if args.num_prompts < 1:  # custom dataset, whole file
        result["num_prompts"] = len(records)
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
    shadowed = sorted(k for k in metadata if result[k] != metadata[k])
    if shadowed:
        print(f"WARNING: --metadata key(s) {', '.join(shadowed)} are result keys; the measured values are kept.",
              file=sys.stderr)

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

    if not args.save_detailed:
        for key in DETAILED_KEYS:
            result.pop(key, None)

    if args.save_result or args.append_result:
        path = result_filename(args, model_name, date)
        with open(path, "a" if args.append_result else "w") as f:
            if args.append_result:  # one JSON object per line, as vLLM appends
                if f.tell() != 0:
                    f.write("\n")
                json.dump(result, f)
            else:
                json.dump(result, f, indent=2)
        result["result_path"] = path
        print(f"Saved result to {path}")
    return result
