"""``tokenfab cost``: the cost figures for typed-in numbers (throughput, devices, power).

    tokenfab cost --total-tok-s 5661 --devices 6 --power-kw 4.8 [--measured-kw 4.18] \
        --kwh-price 0.10 --device-hour-price 2.95 [--device-hour-price 5.99 ...] [--cost-scenarios FILE] [--json]
"""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    """Add the ``cost`` sub-command."""
    from tokenfab.cost.scenarios import add_price_args

    p = subparsers.add_parser("cost", help="tokens per device / kW / dollar for typed-in numbers",
                              description="Print tok/s per device, tok/s per kW and $ per million tokens "
                                          "(electricity and rental) for a throughput, a device count and a power.")
    p.add_argument("--total-tok-s", type=float, required=True, metavar="TOK_S",
                   help="total (input + output) tokens per second")
    p.add_argument("--devices", type=int, required=True, help="number of devices serving that throughput")
    p.add_argument("--power-kw", type=float, default=None, metavar="KW",
                   help="total configured power cap of those devices in kW (e.g. 6 x 800 W = 4.8)")
    p.add_argument("--measured-kw", type=float, default=None, metavar="KW", help="measured average draw in kW")
    add_price_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


class _CostArgError(ValueError):
    user_error = True


def run(args: argparse.Namespace) -> int:
    """Compute and print the cost figures."""
    import json

    from tokenfab.cost.model import compute_cost, render_cost_table
    from tokenfab.cost.scenarios import prices_from_args

    if args.total_tok_s <= 0:
        raise _CostArgError(f"--total-tok-s must be > 0, got {args.total_tok_s}")
    if args.devices < 1:
        raise _CostArgError(f"--devices must be >= 1, got {args.devices}")
    for flag, v in (("--power-kw", args.power_kw), ("--measured-kw", args.measured_kw)):
        if v is not None and v <= 0:
            raise _CostArgError(f"{flag} must be > 0, got {v}")
    cost = compute_cost(args.total_tok_s, args.devices, prices_from_args(args),
                        cap_kw=args.power_kw, measured_kw=args.measured_kw)
    if args.power_kw is None and args.measured_kw is None:
        cost["notes"] = ["give --power-kw and/or --measured-kw to price electricity"]
    if args.json:
        print(json.dumps(cost, indent=2))
    else:
        print(render_cost_table(cost), end="")
    return 0
