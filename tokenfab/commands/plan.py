"""``tokenfab plan``: will a model fit on N devices, and how large a KV pool does each rank get?"""
from __future__ import annotations

import argparse

from tokenfab.commands.expert_placement_args import add_expert_placement_args


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
    p.add_argument("--offload-experts", action="store_true",
                   help="split routed experts between the devices and host memory: each device filled with its "
                        "experts first (after dense weights, the requested KV and the reserve), the rest on the "
                        "host; prints the split and the host bytes")
    add_expert_placement_args(p, planning=True)
    p.add_argument("--max-num-seqs", type=int, default=1,
                   help="requests whose per-request state is held at once (hybrid KDA models: the recurrent state "
                        "of each is reserved on every rank before the KV pool is sized)")
    p.add_argument("--sweep-devices", default=None, metavar="N-M|N,M,...",
                   help="instead of one plan, a table of what fits on each of these device counts (e.g. 4-8)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    """Run ``tokenfab plan``; returns 0 when the request fits (a sweep: on some device count), 1 when not."""
    import json

    from tokenfab.planner.memory_planner import plan_device_sweep, plan_memory
    from tokenfab.planner.plan_inputs import parse_count, parse_device_counts, parse_size
    from tokenfab.planner.plan_report import render_plan, render_sweep, sweep_rows

    mem = parse_size(args.device_memory, "--device-memory")
    kw = dict(max_model_len=parse_count(args.max_model_len, "--max-model-len"),
              kv_tokens=parse_count(args.kv_tokens, "--kv-tokens"),
              kv_cache_dtype=args.kv_cache_dtype, weight_dtype=args.weight_dtype,
              activation_reserve=args.activation_reserve, offload_experts=args.offload_experts,
              max_num_seqs=args.max_num_seqs, host_experts=args.host_experts,
              num_device_experts=args.num_device_experts, expert_popularity=args.expert_popularity)
    if args.sweep_devices is not None:
        plans = plan_device_sweep(args.model, parse_device_counts(args.sweep_devices), mem, **kw)
        if args.json:
            print(json.dumps({"plans": [p.to_dict() for p in plans], "rows": sweep_rows(plans)}, indent=2))
        else:
            render_sweep(plans)
        return 0 if any(p.fits for p in plans) else 1
    mp = plan_memory(args.model, args.devices, mem, **kw)
    if args.json:
        print(json.dumps(mp.to_dict(), indent=2))
    else:
        render_plan(mp)
    return 0 if mp.fits else 1
