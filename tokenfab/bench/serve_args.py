"""``tokenfab bench serve``'s command line: vLLM's ``vllm bench serve`` flags (those it lacks refused by name),
their parsing (headers, percentiles, metric names, goodput, metadata, extra body) and the checks run before any
request is sent. :mod:`tokenfab.bench.serve` runs the benchmark from the namespace built here.
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Any

from tokenfab.bench import BenchError
from tokenfab.bench.datasets import DATASET_NAMES, FILE_DATASETS
from tokenfab.bench.metrics import GOODPUT_METRICS, METRIC_NAMES
from tokenfab.bench.request import BACKENDS

try:
    from tokenfab.power import bench_hook
except ImportError:  # the power/cost hook is optional
    bench_hook = None


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
                   help="File name for the result JSON. Default {label}-{rate}qps[-concurrencyN]-{model}-{date}.json, "
                        "{model} the last part of --model, else the served model name.")
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
