"""``tokenfab report RUN_DIR_OR_JSON... [--peers peers.toml] [--out DIR]``: Markdown tables and SVG/PNG charts
comparing saved benchmark runs (and published peer figures). See :mod:`tokenfab.cost.report`."""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    """Add the ``report`` sub-command."""
    p = subparsers.add_parser("report", help="Markdown + SVG/PNG report over saved benchmark results",
                              description="Compare saved `tokenfab bench serve` result JSONs (files or directories) "
                                          "and peer figures: tok/s per device, per kW, $ per million tokens, "
                                          "TTFT/TPOT.")
    p.add_argument("inputs", nargs="+", metavar="RUN_DIR_OR_JSON", help="result JSON files or directories of them")
    p.add_argument("--peers", default=None, metavar="TOML",
                   help="published peer figures (format: benchmarks/peers.example.toml)")
    p.add_argument("--out", default="report", metavar="DIR", help="output directory (default ./report)")
    p.add_argument("--kwh-price", type=float, default=None, metavar="USD",
                   help="$/kWh for every row (default: the first run's price, else 0.10)")
    p.add_argument("--device-hour-price", type=float, default=None, metavar="USD",
                   help="$/device-hour for every row (default: the first run's rental price, if any)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the report and print where it went."""
    from tokenfab.cost.report import write_report

    md = write_report(args.inputs, args.out, args.peers, kwh_price=args.kwh_price,
                      device_hour_price=args.device_hour_price)
    print(f"report: {md}")
    return 0
