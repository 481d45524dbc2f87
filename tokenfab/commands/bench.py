"""``tokenfab bench serve``: benchmark any OpenAI-compatible server with vLLM's serving workload and metrics.

Example::

    tokenfab bench serve --base-url http://127.0.0.1:8000 --model /models/qwen3-8b \\
        --dataset-name random --random-input-len 1024 --random-output-len 128 \\
        --num-prompts 200 --max-concurrency 16 --ignore-eos --temperature 0 --save-result

    # as pasted from vLLM's docs: tokenizer from the server's /v1/models root, ShareGPT from a local file
    tokenfab bench serve --backend vllm --dataset-name sharegpt \\
        --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json --num-prompts 100 \\
        --goodput ttft:500 tpot:50 --num-warmups 4 --label run1 --metadata tp=1 --save-result --save-detailed

Heavy imports (httpx, numpy, transformers) happen inside :func:`_run_serve`, so ``tokenfab --help`` stays fast.
"""
from __future__ import annotations

import argparse

from tokenfab.bench.serve import add_cli_args, short_errors

try:
    from tokenfab.power import bench_hook
except ImportError:  # the power/cost hook is optional
    bench_hook = None


def _run_serve(args: argparse.Namespace) -> int:
    from tokenfab.bench.serve import run_bench_serve

    result = run_bench_serve(args)
    return 0 if result.get("completed", 0) > 0 else 1


def register(subparsers) -> None:
    """Add ``bench`` with its ``serve`` sub-command to the top-level ``tokenfab`` parser."""
    bench = subparsers.add_parser("bench", help="Benchmark a running server (vLLM-compatible workloads and metrics).",
                                  description="Benchmarks against running servers.")
    sub = bench.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    serve = sub.add_parser(
        "serve", help="Online serving benchmark against any OpenAI-compatible server (vLLM's `bench serve`).",
        description="Stream requests to an OpenAI-compatible server and report TTFT, TPOT, ITL, E2EL, goodput and "
                    "throughput with vLLM's definitions and JSON keys. Takes `vllm bench serve` flags as they are "
                    "pasted; the ones tokenfab lacks are refused by name.",
    )
    short_errors(serve)
    add_cli_args(serve)
    if bench_hook is not None:
        bench_hook.add_power_args(serve)
    serve.set_defaults(func=_run_serve)
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
