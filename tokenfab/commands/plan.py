"""``tokenfab plan``: will a model fit on N devices, and how large a KV pool does each rank get?"""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    """Add the ``plan`` command to the CLI."""
    p = subparsers.add_parser(
        "plan", help="memory plan: weights per rank, KV bytes per token, largest KV pool that fits",
        description="Plan device memory for MODEL on N devices under tokenfab's shard plan (tensor parallel = "
                    "expert parallel = N, uneven splits allowed). Reads config.json and, when present, the "
                    "safetensors headers (never tensor data) for real dtypes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", metavar="MODEL_DIR_OR_CONFIG_JSON", help="checkpoint folder or a config.json file")
    p.add_argument("--devices", type=int, default=1, help="number of devices (world size)")
    p.add_argument("--device-memory", required=True,
                   help="memory per device: 288GiB (2^30), 141GB or 80G (10^9)")
    p.add_argument("--max-model-len", default=None, help="context length one sequence must fit (tokens, e.g. 128K)")
    p.add_argument("--kv-tokens", default=None, help="KV pool size to fit (tokens, e.g. 1M = 10^6, 1Mi = 2^20)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "bfloat16", "float16", "float32", "fp8"], help="KV cache element type")
    p.add_argument("--weight-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32", "fp8", "int4"],
                   help="auto: real dtypes from safetensors headers, else config.json's quantization_config / "
                        "dtype; others compute bytes from the config in that format")
    p.add_argument("--activation-reserve", default="10%",
                   help="memory kept for activations, CUDA graphs, workspace: percent of device memory or a size")
    p.add_argument("--offload-experts", action="store_true", help="keep routed experts in host memory")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    """Run ``tokenfab plan``; returns 0 when the request fits, 1 when it does not."""
    import json

    from tokenfab.planner.memory_planner import parse_count, parse_size, plan_memory, render_plan

    mem = parse_size(args.device_memory, "--device-memory")
    mp = plan_memory(args.model, args.devices, mem,
                     max_model_len=parse_count(args.max_model_len, "--max-model-len"),
                     kv_tokens=parse_count(args.kv_tokens, "--kv-tokens"),
                     kv_cache_dtype=args.kv_cache_dtype, weight_dtype=args.weight_dtype,
                     activation_reserve=args.activation_reserve, offload_experts=args.offload_experts)
    if args.json:
        print(json.dumps(mp.to_dict(), indent=2))
    else:
        render_plan(mp)
    return 0 if mp.fits else 1
