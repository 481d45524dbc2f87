"""Help texts that must follow the code: `tokenfab eval` names every evaluation it registers, and the MODEL help of
`serve` / `generate` lists the GGUF block types the packed kernels run."""
from __future__ import annotations

import argparse

from tokenfab.cli import build_parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_eval_help_names_every_evaluation(capsys):
    top = build_parser()
    evals = _subcommands(_subcommands(top)["eval"])
    assert {"kl", "needle", "tasks"} <= set(evals)
    top.print_help()
    listing = " ".join(capsys.readouterr().out.split())  # `tokenfab --help`, its lines rewrapped
    eval_help = _subcommands(top)["eval"].format_help()
    for name in evals:
        assert f"{name} (" in listing, name
        assert f"`eval {name}`" in " ".join(eval_help.split()), name


def test_model_help_lists_the_packed_gguf_types():
    from tokenfab.commands.model_arg import PACKED_GGUF_TYPES
    from tokenfab.quant.gguf_blocks import BLOCK_TYPES
    assert set(PACKED_GGUF_TYPES) == set(BLOCK_TYPES)
    subs = _subcommands(build_parser())
    for cmd in ("serve", "generate"):
        text = " ".join(subs[cmd].format_help().split())
        assert ".gguf file" in text and "run packed" in text and ", ".join(PACKED_GGUF_TYPES) in text, cmd
