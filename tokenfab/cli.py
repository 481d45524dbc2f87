"""The ``tokenfab`` command line: one sub-command per module in :mod:`tokenfab.commands`.

Each command module defines ``register(subparsers)`` (adds its parser and sets ``func``) and keeps heavy imports
(torch, transformers, FastAPI) inside the function that runs it, so that ``tokenfab --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# Order shown in --help.
COMMAND_MODULES = ["demo", "generate", "serve", "bench", "plan", "eval", "cost", "report"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenfab", description="tokenfab: LLM inference and serving engine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(f"tokenfab.commands.{name}")
        except ModuleNotFoundError as e:  # a command whose module is not written yet
            if e.name == f"tokenfab.commands.{name}":
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        from tokenfab.errors import is_user_error
        if not is_user_error(e):
            raise
        print(f"tokenfab {args.command}: error: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
