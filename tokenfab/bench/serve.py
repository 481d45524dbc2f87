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
from tokenfab.bench.datasets import DATASET_NAMES, FILE_DATASETS
from tokenfab.bench.metrics import (
    GOODPUT_METRICS,
    METRIC_NAMES,
    compute_metrics,
    percentile_key,
    steady_state_throughputs,
    steady_state_window,
)
from tokenfab.bench.request import BACKENDS, DEFAULT_ENDPOINTS, ENDPOINT_SUFFIXES

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
_NO_DATASET = "its dataset is not supported here (datasets: random, sharegpt, custom, prefix_repetition)"
REFUSED_VLLM_FLAGS = {
    "--profile": "needs vLLM's torch profiler endpoints on the server",
    "--lora-modules": "tokenfab serves no LoRA adapters",
    "--lora-assignment": "tokenfab serves no LoRA adapters",
    "--ramp-up-strategy": "request-rate ramp-up is not implemented; use --request-rate / --burstiness",
    "--ramp-up-start-rps": "request-rate ramp-up is not implemented; use --request-rate / --burstiness",
    "--ramp-up-end-rps": "request-rate ramp-up is not implemented; use --request-rate / --burstiness",
    "--self-timed": "only for vLLM's timed_trace dataset",
    "--no-self-timed": "only for vLLM's timed_trace dataset",
    "--probe-request-rate": "probe requests are not implemented",
    "--use-beam-search": "tokenfab's server has no beam search",
    "--skip-tokenizer-init": "tokenfab counts prompt and output tokens with the tokenizer",
    "--chat-template-kwargs": "client-side chat templates take no extra kwargs here",
    "--plot-timeline": "no timeline plot; `tokenfab report` draws the charts",
    "--timeline-itl-thresholds": "no timeline plot; `tokenfab report` draws the charts",
    "--plot-dataset-stats": "no dataset plot; `tokenfab report` draws the charts",
    "--ready-check-timeout-sec": "tokenfab checks once that the server answers; start the benchmark when it is up",
    "--no-stream": "only for Hugging Face hub datasets",
    "--enable-multimodal-chat": "text-only benchmark",
    "--random-batch-size": "only for embedding benchmarks",
    "--no-reranker": "only for reranker benchmarks",
    **{f: _NO_DATASET for f in (
        "--sonnet-input-len", "--sonnet-output-len", "--sonnet-prefix-len", "--hf-subset", "--hf-split",
        "--hf-name", "--hf-output-len", "--spec-bench-output-len", "--spec-bench-category",
        "--blazedit-min-distance", "--blazedit-max-distance", "--asr-max-audio-len-sec", "--asr-min-audio-len-sec",
        "--random-mm-base-items-per-request", "--random-mm-num-mm-items-range-ratio",
        "--random-mm-limit-mm-per-prompt", "--random-mm-bucket-config")},
}
# vLLM names tokenfab knows but does not run: refused with the reason instead of "invalid choice".
VLLM_OTHER_BACKENDS = ("openai-audio", "openai-embeddings", "openai-embeddings-chat", "openai-embeddings-clip",
                       "openai-embeddings-vlm2vec", "infinity-embeddings", "infinity-embeddings-clip",
                       "vllm-pooling", "vllm-rerank")
VLLM_OTHER_DATASETS = ("burstgpt", "sonnet", "random-mm", "random-rerank", "hf", "custom_mm", "spec_bench", "txt-slices", "timed_trace")


class _RefusedFlag(argparse.Action):
    """A ``vllm bench serve`` flag tokenfab does not implement: exits with one line naming it and why."""

    def __init__(self, option_strings, dest, reason: str = "", **kwargs):
        kwargs.update(nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"{parser.prog}: error: {option_string} (a `vllm bench serve` flag) is not supported by "
                       f"tokenfab: {self.reason}.\n")


def _choice(kind: str, supported: tuple[str, ...], vllm_only: tuple[str, ...]):
    def parse(value: str) -> str:
        if value in supported:
            return value
        if value in vllm_only:
            raise argparse.ArgumentTypeError(
                f"{value!r} is a vLLM {kind} tokenfab does not support; choose one of: {', '.join(supported)}")
        raise argparse.ArgumentTypeError(f"unknown {kind} {value!r}; choose one of: {', '.join(supported)}")
    parse.__name__ = kind
    return parse


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench serve`` flags: vLLM's names, defaults and meanings (plus tokenfab's ``--num-devices`` and
    ``--request-timeout``), and the vLLM flags tokenfab refuses by name (:data:`REFUSED_VLLM_FLAGS`)."""
    g = parser.add_argument_group("server")
    g.add_argument("--backend", default="openai", type=_choice("backend", BACKENDS, VLLM_OTHER_BACKENDS),
                   help="API flavour (vLLM's names): vllm or openai (/v1/completions, prompt), openai-chat "
                        "(/v1/chat/completions, one user message). Default openai, as vLLM.")
    g.add_argument("--base-url", default=None,
                   help="Server base URL, e.g. http://127.0.0.1:8000 (overrides --host/--port).")
    g.add_argument("--host", default="127.0.0.1", help="Server host when --base-url is not given. Default 127.0.0.1.")
    g.add_argument("--port", type=int, default=8000, help="Server port when --base-url is not given. Default 8000.")
    g.add_argument("--endpoint", default=None,
                   help="API path. Default /v1/completions (vllm, openai) or /v1/chat/completions (openai-chat).")
    g.add_argument("--header", action="append", nargs="+", default=None, metavar="KEY=VALUE",
                   help="Extra HTTP header for every request (repeatable), e.g. --header Connection=close. "
                        "OPENAI_API_KEY in the environment is sent as 'Authorization: Bearer ...', as vLLM does.")
    g.add_argument("--insecure", action="store_true", help="Do not verify TLS certificates (https servers).")
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0,
                   help="Per-request timeout in seconds. Default 21600 (6 h, as vLLM).")
    g.add_argument("--request-id-prefix", default=None,
                   help="Send x-request-id PREFIX<index> with each request (vLLM's flag). Default: no header.")
    g.add_argument("--model", default=None,
                   help="Model name/path; the request's model field and the default tokenizer. "
                        "Default: the first model the server lists at /v1/models (its folder, 'root', is the "
                        "tokenizer).")
    g.add_argument("--served-model-name", default=None,
                   help="Name sent in the request's model field when it differs from --model.")
    g.add_argument("--tokenizer", default=None,
                   help="Local Hugging Face tokenizer folder. Default: --model when it is a local folder, else the "
                        "folder the server reports at /v1/models (root). Loaded offline.")
    g.add_argument("--tokenizer-mode", default="auto",
                   type=_choice("tokenizer mode", ("auto", "hf", "slow"), ("mistral", "deepseek_v32", "custom")),
                   help="vLLM's tokenizer mode: auto/hf load the fast tokenizer, slow the Python one. Default auto.")
    g.add_argument("--trust-remote-code", action="store_true", help="Allow custom tokenizer code from the folder.")

    d = parser.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random",
                   type=_choice("dataset", DATASET_NAMES, VLLM_OTHER_DATASETS),
                   help="Workload: random (vLLM's random token prompts), sharegpt or custom (local files, "
                        "--dataset-path), prefix_repetition (groups of prompts sharing a random prefix). "
                        "Default random.")
    d.add_argument("--dataset-path", default=None,
                   help="Local file for sharegpt (ShareGPT JSON) or custom (JSONL, one {\"prompt\": ..., "
                        "\"output_tokens\": N} per line).")
    d.add_argument("--num-prompts", type=int, default=1000, help="Number of requests. Default 1000.")
    d.add_argument("--input-len", type=int, default=None, help="Sets --random-input-len (vLLM's general flag).")
    d.add_argument("--output-len", type=int, default=None,
                   help="Sets --random-output-len, --sharegpt-output-len and --custom-output-len.")
    d.add_argument("--random-input-len", type=int, default=1024, help="Prompt tokens per request. Default 1024.")
    d.add_argument("--random-output-len", type=int, default=128, help="max_tokens per request. Default 128.")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths uniform in [L*(1-r), L*(1+r)], r in [0, 1). Default 0.")
    d.add_argument("--random-prefix-len", type=int, default=0,
                   help="Tokens of a random prefix shared by all prompts (added to the input length). Default 0.")
    d.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                   help="prefix_repetition: tokens of each shared prefix. Default 256.")
    d.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                   help="prefix_repetition: tokens of each prompt's own suffix. Default 256.")
    d.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                   help="prefix_repetition: number of distinct prefixes (num_prompts // this prompts each). "
                        "Default 10.")
    d.add_argument("--prefix-repetition-output-len", type=int, default=128,
                   help="prefix_repetition: max_tokens per request. Default 128.")
    d.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="Fixed max_tokens for sharegpt. Default: the token count of each conversation's gpt turn.")
    d.add_argument("--custom-output-len", type=int, default=256,
                   help="max_tokens for custom; -1 reads each line's output_tokens. Default 256.")
    d.add_argument("--skip-chat-template", action="store_true",
                   help="custom: send prompts without the tokenizer's chat template (always so for openai-chat, "
                        "where the server applies it).")
    d.add_argument("--disable-shuffle", action="store_true", help="sharegpt/custom: keep the file's order.")
    d.add_argument("--no-oversample", action="store_true",
                   help="sharegpt/custom: with fewer usable samples than --num-prompts, send only those.")
    d.add_argument("--seed", type=int, default=0, help="Seed for prompts and arrival times. Default 0.")

    t = parser.add_argument_group("traffic")
    t.add_argument("--max-concurrency", type=int, default=None,
                   help="Most requests in flight at once (client-side cap). Default: no cap.")
    t.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Requests per second (Poisson arrivals with --burstiness 1). Default inf: send all at once.")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of the inter-arrival times: 1 = Poisson, <1 burstier, >1 more regular.")
    t.add_argument("--num-warmups", type=int, default=0,
                   help="Requests sent before the measured run (copies of the first prompt, at most "
                        "--max-concurrency at once); not counted in any metric. Default 0.")

    s = parser.add_argument_group("sampling")
    s.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="Send ignore_eos=true so every request generates exactly its max_tokens. Default: on for "
                        "the random dataset (as vLLM), off otherwise; --no-ignore-eos turns it off.")
    s.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature. Default 0 (greedy).")
    s.add_argument("--top-p", type=float, default=None, help="top_p (not sent unless given).")
    s.add_argument("--top-k", type=int, default=None, help="top_k (vLLM / llama-server extension; not sent unless given).")
    s.add_argument("--min-p", type=float, default=None, help="min_p (not sent unless given).")
    s.add_argument("--frequency-penalty", type=float, default=None, help="frequency_penalty (not sent unless given).")
    s.add_argument("--presence-penalty", type=float, default=None, help="presence_penalty (not sent unless given).")
    s.add_argument("--repetition-penalty", type=float, default=None,
                   help="repetition_penalty (not sent unless given).")
    s.add_argument("--logprobs", type=int, default=None,
                   help="Completions logprobs per token (vllm/openai backends; not sent unless given).")
    s.add_argument("--extra-body", type=str, default=None, metavar="JSON",
                   help="JSON object merged into every request body, e.g. '{\"min_tokens\": 8}'.")

    r = parser.add_argument_group("results")
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="Metrics to print with percentiles: any of ttft,tpot,itl,e2el. Default ttft,tpot,itl.")
    r.add_argument("--metric-percentiles", default="99", help="Comma-separated percentiles, e.g. 50,90,99. Default 99.")
    r.add_argument("--goodput", nargs="+", default=None, metavar="KEY:VALUE",
                   help="Service-level objectives in ms, e.g. --goodput ttft:500 tpot:50 e2el:1000 (keys ttft, tpot, "
                        "e2el); reports request_goodput = requests meeting all of them per second.")
    r.add_argument("--num-devices", type=int, default=1,
                   help="Accelerators behind the server, for per-device throughput. Default 1.")
    r.add_argument("--label", default=None,
                   help="Label of the run, saved as 'label' and used as the file name prefix. Default: --backend.")
    r.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                   help="Key-value pairs saved as top-level keys of the result JSON, e.g. --metadata tp=1 hw=cpu.")
    r.add_argument("--save-result", action="store_true", help="Save the result JSON.")
    r.add_argument("--save-detailed", action="store_true",
                   help="Keep the per-request lists (input_lens, output_lens, start_times, ttfts, itls, "
                        "generated_texts, errors) in the result; without it they are left out, as vLLM does.")
    r.add_argument("--append-result", action="store_true",
                   help="Append the result as one JSON line to the result file instead of overwriting it.")
    r.add_argument("--result-dir", default=None, help="Folder for the result JSON. Default: current folder.")
    r.add_argument("--result-filename", default=None,
                   help="File name for the result JSON. Default {label}-{rate}qps[-concurrencyN]-{model}-{date}.json.")
    r.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")

    x = parser.add_argument_group(
        "vllm bench serve flags refused",
        "Refused by name with the reason: " + ", ".join(sorted(REFUSED_VLLM_FLAGS)) + ".")
    for flag, reason in REFUSED_VLLM_FLAGS.items():
        x.add_argument(flag, action=_RefusedFlag, reason=reason)


def short_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` report a bad flag in one line (plus a --help hint) instead of its long usage block."""
    def error(message: str):
        parser.exit(2, f"{parser.prog}: error: {message}\n(see {parser.prog} --help)\n")
    parser.error = error  # type: ignore[method-assign]
    return parser


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser with the ``bench serve`` flags (and the power hook's, when installed)."""
    parser = short_errors(argparse.ArgumentParser(prog="tokenfab bench serve"))
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


def parse_goodput(items: Any) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds; vLLM's ``--goodput``).

    Raises:
        BenchError: an item not ``KEY:VALUE``, a key outside ttft/tpot/e2el, or a negative value.
    """
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = str(item).partition(":")
        try:
            if not sep:
                raise ValueError
            ms = float(value)
        except ValueError:
            raise BenchError(f"--goodput {item!r} is not KEY:VALUE with VALUE in milliseconds, e.g. ttft:500."
                             ) from None
        key = key.strip()
        if key not in GOODPUT_METRICS:
            raise BenchError(f"--goodput {item!r}: the objective must be one of {', '.join(GOODPUT_METRICS)}.")
        if not ms >= 0 or math.isinf(ms):
            raise BenchError(f"--goodput {item!r}: the objective must be a finite number of ms >= 0.")
        slos[key] = ms
    return slos


def parse_metadata(items: Any) -> dict[str, str]:
    """``["tp=1", "hw=cpu"]`` -> ``{"tp": "1", "hw": "cpu"}`` (vLLM's ``--metadata``; values stay strings).

    Raises:
        BenchError: an item without ``=`` or with an empty key.
    """
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise BenchError(f"--metadata {item!r} is not KEY=VALUE.")
        out[key.strip()] = value.strip()
    return out


def parse_extra_body(text: str | None) -> dict[str, Any]:
    """``--extra-body`` JSON text -> dict (``{}`` when None).

    Raises:
        BenchError: not a JSON object.
    """
    if text is None:
        return {}
    if isinstance(text, dict):
        return dict(text)
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise BenchError(f"--extra-body is not valid JSON ({e.msg}); give an object, e.g. '{{\"min_tokens\": 8}}'."
                         ) from None
    if not isinstance(body, dict):
        raise BenchError(f"--extra-body must be a JSON object, got {type(body).__name__}.")
    return body


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
        what = "is a vLLM backend tokenfab does not support" if args.backend in VLLM_OTHER_BACKENDS else \
            "is not supported"
        raise BenchError(f"--backend {args.backend!r} {what}; choose one of: {', '.join(BACKENDS)}.")
    if args.dataset_name not in DATASET_NAMES:
        raise BenchError(f"--dataset-name {args.dataset_name!r} is not supported; choose one of: "
                         f"{', '.join(DATASET_NAMES)}.")
    if args.dataset_name == "random" and args.dataset_path is not None:
        raise BenchError(f"--dataset-path {args.dataset_path!r} does not go with --dataset-name random; name the "
                         "file's format: --dataset-name sharegpt or custom.")
    if args.dataset_name in FILE_DATASETS and not args.dataset_path:
        raise BenchError(f"--dataset-name {args.dataset_name} needs --dataset-path (a local file).")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {args.max_concurrency}.")
    if not args.request_rate > 0:
        raise BenchError(f"--request-rate must be > 0 (or inf), got {args.request_rate}.")
    if not args.burstiness > 0:
        raise BenchError(f"--burstiness must be > 0, got {args.burstiness}.")
    if args.num_prompts < 1 and args.dataset_name != "custom":  # custom: <= 0 takes the whole file, as vLLM
        raise BenchError(f"--num-prompts must be >= 1, got {args.num_prompts}.")
    if args.num_devices < 1:
        raise BenchError(f"--num-devices must be >= 1, got {args.num_devices}.")
    if not args.request_timeout > 0:
        raise BenchError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}.")
    if args.num_warmups < 0:
        raise BenchError(f"--num-warmups must be >= 0, got {args.num_warmups}.")
    if args.logprobs is not None and args.backend == "openai-chat":
        raise BenchError("--logprobs is sent by the completions backends only (vllm, openai), as in vLLM; for chat "
                         "pass --extra-body '{\"logprobs\": true, \"top_logprobs\": N}'.")


def _apply_general_lengths(args: argparse.Namespace) -> None:
    """vLLM's ``--input-len`` / ``--output-len``: they set the dataset-specific length flags."""
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.output_len
        args.sharegpt_output_len = args.output_len
        args.custom_output_len = args.output_len


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


def result_filename(args: argparse.Namespace, model_id: str, date: str) -> str:
    """vLLM's default name ``{label}-{rate}qps[-concurrencyN]-{model basename}-{date}.json`` (label: ``--label``,
    else ``--backend``), or ``--result-filename``; inside ``--result-dir`` when given."""
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    label = getattr(args, "label", None) or args.backend
    name = args.result_filename or (
        f"{label}-{args.request_rate}qps{conc}-{os.path.basename(model_id.rstrip('/'))}-{date}.json")
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
        path = result_filename(args, model_id, date)
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
