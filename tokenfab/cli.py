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


class _Parser(argparse.ArgumentParser):
    """argparse whose "unrecognized arguments" error names the nearest flag of the chosen sub-command
    (difflib.get_close_matches), e.g. --gpu-memory-utilisation -> --gpu-memory-utilization."""

    argv: list[str] = []

    def error(self, message):
        if message.startswith("unrecognized arguments:"):
            message += _flag_hints(self, self.argv, message.split(":", 1)[1].split())
        super().error(message)


def _flag_hints(parser: argparse.ArgumentParser, argv: list[str], unknown: list[str]) -> str:
    """" (did you mean --x?)" for the unknown flags that have a close known one, else ""."""
    import difflib
    while True:  # descend to the (sub-)sub-command the arguments chose, e.g. `bench serve`
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        cmd = next((t for t in argv if sub is not None and t in sub.choices), None)
        if cmd is None:
            break
        parser, argv = sub.choices[cmd], argv[argv.index(cmd) + 1:]
    known = [o for o in parser._option_string_actions if o.startswith("--")]
    hints = []
    for tok in unknown:
        flag = tok.split("=", 1)[0]
        near = difflib.get_close_matches(flag, known, n=1, cutoff=0.6) if flag.startswith("--") else []
        if near:
            hints.append(f"{near[0]} for {flag}" if sum(t.startswith("--") for t in unknown) > 1 else near[0])
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def build_parser() -> argparse.ArgumentParser:
    """The ``tokenfab`` argument parser: one subcommand per module of ``tokenfab.commands`` (COMMAND_MODULES), each
    registering its own flags."""
    parser = _Parser(prog="tokenfab", description="tokenfab: LLM inference and serving engine.")
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
    """Run the ``tokenfab`` command line on ``argv`` (default: ``sys.argv[1:]``) and return the exit status: the
    subcommand's; 2 after printing the help where no subcommand is given, or a user error's one-line message (bad
    input named, no traceback); 130 on Ctrl-C.

    Raises:
        SystemExit: 2 on a usage error (argparse's message, with a hint for a mistyped flag).
    """
    parser = build_parser()
    parser.argv = list(sys.argv[1:] if argv is None else argv)
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
