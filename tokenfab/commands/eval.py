"""``tokenfab eval kl`` (fidelity vs transformers: KL + top-1 on prefill and decode) and ``tokenfab eval needle``
(planted-code recall). See :mod:`tokenfab.eval.kl` and :mod:`tokenfab.eval.needle`."""
from __future__ import annotations

import argparse
import shlex
import sys


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help text already states it."""

    def _get_help_string(self, action):
        text = action.help or ""
        return text if "(default" in text else super()._get_help_string(action)


def register(subparsers) -> None:
    """Add ``eval`` with its ``kl`` and ``needle`` sub-commands."""
    p = subparsers.add_parser("eval", help="fidelity (KL vs transformers) and needle recall evaluations",
                              description="Evaluate tokenfab's outputs: `eval kl` against the transformers reference, "
                                          "`eval needle` planted-code recall.")
    sub = p.add_subparsers(dest="eval_command", metavar="EVAL")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    k = sub.add_parser(
        "kl", help="KL(reference || tokenfab) and top-1 agreement on the prefill and decode paths",
        description="Run held-out rows through tokenfab (full-vocabulary prompt_logprobs / logprobs) and through "
                    "transformers (eager attention and experts, teacher-forced), and report mean / p99 / max KL and "
                    "top-1 agreement for the prefill path and for greedy and sampled decode paths.",
        formatter_class=_DefaultsFormatter)
    k.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint folder (default: the embedded default model)")
    k.add_argument("--reference", default="transformers", choices=["transformers"], help="reference implementation")
    k.add_argument("--reference-model", default=None, metavar="DIR",
                   help="checkpoint folder the reference reads (default: MODEL)")
    k.add_argument("--dataset", default=None, metavar="FILE.jsonl",
                   help="rows with 'text' or 'prompt_token_ids' (default: random token rows)")
    k.add_argument("--max-rows", type=int, default=None, help="use at most this many --dataset rows")
    k.add_argument("--random-rows", type=int, default=None, help="number of random token rows (default 8)")
    k.add_argument("--row-len", type=int, default=None,
                   help="tokens per random row (default 128); cuts --dataset rows when given")
    k.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="tokenfab dtype")
    k.add_argument("--reference-dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"],
                   help="dtype of the transformers reference (default: float32)")
    k.add_argument("--reference-device", default="cpu", help="torch device of the reference")
    k.add_argument("--device", default="auto", help="tokenfab's device")
    k.add_argument("--decode-steps", type=int, default=16, help="generated tokens K per decode run; K tokens give K - 1 decode positions (the first token's "
                        "distribution comes from the prefill forward and counts under prefill); 0: prefill only")
    k.add_argument("--temperature", type=float, default=1.0,
                   help="temperature of the sampled decode run (0 skips it)")
    k.add_argument("--seed", type=int, default=0, help="seed of random rows and of the sampled run")
    k.add_argument("--tensor-parallel-size", type=int, default=1, help="tokenfab tensor-parallel ranks")
    k.add_argument("--max-model-len", type=int, default=None, help="tokenfab max_model_len (tokens)")
    k.add_argument("--enforce-eager", action="store_true",
                   help="no decode CUDA graphs (GPU only): score the eager decode path instead of the replayed one")
    k.add_argument("--out", default="eval-kl", metavar="DIR", help="where kl.json and kl.md go")
    k.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    k.set_defaults(func=run_kl_command)

    n = sub.add_parser(
        "needle", help="planted-code (needle) recall per context length and depth",
        description="Plant K random access codes at given depths in filler text, ask for each, and score exact "
                    "recall per length and depth (table, JSON, Markdown, heat-map PNG). Runs the offline engine "
                    "on MODEL or any OpenAI-compatible server (--base-url).",
        formatter_class=_DefaultsFormatter)
    n.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint folder for the offline engine (default: the embedded default model); with "
                        "--base-url, the tokenizer folder used to count tokens")
    n.add_argument("--base-url", default=None, help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    n.add_argument("--served-model-name", default=None, help="'model' field sent to the server")
    n.add_argument("--tokenizer", default=None, help="tokenizer folder (server mode)")
    n.add_argument("--api-key", default=None, help="bearer token for the server")
    n.add_argument("--lengths", default="4k,16k,32k", help="context lengths in tokens (k = 1024)")
    n.add_argument("--needles", type=int, default=4, help="codes planted per haystack (each asked for)")
    n.add_argument("--depths", default="0,0.25,0.5,0.75,1.0", help="needle depths (fractions of the haystack)")
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--max-tokens", type=int, default=8, help="answer tokens")
    n.add_argument("--dtype", default="auto", help="tokenfab dtype (offline engine)")
    n.add_argument("--tensor-parallel-size", type=int, default=1, help="tokenfab tensor-parallel ranks")
    n.add_argument("--max-model-len", type=int, default=None, help="max_model_len (engine; or the server's)")
    n.add_argument("--out", default="eval-needle", metavar="DIR", help="where needle.json/.md/_heatmap.png go")
    n.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    n.set_defaults(func=run_needle_command)


def _command_line() -> str:
    return "tokenfab " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def run_kl_command(args) -> int:
    """Run ``tokenfab eval kl``: print the table, write kl.json / kl.md."""
    from tokenfab.eval import usage_error
    from tokenfab.eval.kl import print_table, run_kl, write_kl_outputs

    if args.tensor_parallel_size < 1:
        raise usage_error(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}.")
    result = run_kl(args.model, reference_model=args.reference_model, reference=args.reference,
                    dataset=args.dataset, random_rows=args.random_rows, row_len=args.row_len,
                    max_rows=args.max_rows, dtype=args.dtype, reference_dtype=args.reference_dtype,
                    reference_device=args.reference_device, decode_steps=args.decode_steps,
                    temperature=args.temperature, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
                    max_model_len=args.max_model_len, device=args.device, enforce_eager=args.enforce_eager,
                    progress=not args.no_progress, command=_command_line())
    print_table(result)
    jp, mp = write_kl_outputs(result, args.out)
    print(f"wrote {jp} and {mp}")
    return 0


def run_needle_command(args) -> int:
    """Run ``tokenfab eval needle``: print the table, write needle.json / needle.md / needle_heatmap.png."""
    from tokenfab.eval import usage_error
    from tokenfab.eval.needle import print_table, run_needle, write_needle_outputs

    if args.tensor_parallel_size < 1:
        raise usage_error(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}.")
    result = run_needle(args.model, base_url=args.base_url, lengths=args.lengths, needles=args.needles,
                        depths=args.depths, seed=args.seed, max_tokens=args.max_tokens, dtype=args.dtype,
                        tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
                        tokenizer=args.tokenizer, served_model_name=args.served_model_name, api_key=args.api_key,
                        progress=not args.no_progress, command=_command_line())
    if result["run_lengths"]:
        print_table(result)
    else:
        print("no length fits max_model_len; nothing was run.")
    paths = write_needle_outputs(result, args.out)
    print("wrote " + ", ".join(paths.values()))
    return 0
