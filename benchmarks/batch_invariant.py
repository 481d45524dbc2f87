"""What batch-invariant mode costs: decode step time at batch 1 and 16 and prefill tokens/s, default mode against
``batch_invariant=True``, side by side in one run.

    .venv/bin/python benchmarks/batch_invariant.py [--model DIR] [--rounds 3] [--steps 20] [--prompt-len 512]

Both engines (bf16, one thread pool: everything runs on the main thread) are built on the same model in one process
(default: SmolLM2-135M-Instruct, the default model). Per round and mode, in the order default, invariant, invariant,
default, ... (ABBA, so slow drift of a shared machine hits both alike):

* decode: ``batch`` requests of a ``--context``-token prompt are prefilled, then ``--steps`` decode steps of
  ``LLMEngine.step()`` are timed (greedy, plain rows: the fused decode stack's LM head and draw); median step.
* prefill: one step that prefills ``--prompts`` prompts of ``--prompt-len`` tokens each and samples their first
  token; tokens / wall time of that step.

Each cell is reported as its fastest round (the least disturbed on a shared machine), with every round listed, and
the invariant / default ratio. A discarded warm-up pass of every cell runs first. Writes <--out, default benchmarks/results>/<date>-batch-invariant.{md,json} (with the
command line).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.engine_steps import median_decode_ms  # noqa: E402
from benchmarks.results_file import unused_stem, write_markdown  # noqa: E402


def prompt_ids(seed: int, n: int, vocab: int) -> list[int]:
    """A deterministic prompt of ``n`` token ids in [100, vocab)."""
    return [100 + (seed * 7919 + i * 104729) % (vocab - 100) for i in range(n)]


def time_decode(engine, batch: int, context: int, steps: int, vocab: int, warmup: int = 3) -> float:
    """Median wall time (ms) of ``steps`` decode steps of ``batch`` greedy sequences after a ``context``-token
    prompt."""
    from tokenfab import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=steps + warmup + 8, ignore_eos=True)
    return median_decode_ms(engine, [prompt_ids(i, context, vocab) for i in range(batch)], params, steps, warmup)


def time_prefill(engine, prompts: int, length: int, vocab: int) -> float:
    """Tokens/s of one step prefilling ``prompts`` prompts of ``length`` tokens (and drawing their first tokens)."""
    from tokenfab import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for i in range(prompts):
        engine.add_request(f"p-{time.monotonic_ns()}-{i}", None, prompt_ids(100 + i, length, vocab), params)
    t = time.perf_counter()
    engine.step()
    dt_s = time.perf_counter() - t
    assert not engine.has_unfinished_requests(), "the prompts did not fit one step: raise --max-num-batched-tokens"
    return prompts * length / dt_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the default model, SmolLM2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before the timed decode steps")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=1, help="prompts prefilled together in the timed prefill step")
    ap.add_argument("--threads", type=int, default=None,
                    help="intra-op threads (default: torch's). 1 keeps a machine shared with other jobs from turning "
                         "every parallel region's fork/join into a scheduler wait")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()

    import torch

    from tokenfab import LLM
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    kw = dict(dtype="bfloat16", max_model_len=max(args.prompt_len, args.context + args.steps + 16) + 16,
              max_num_seqs=max(batches + [args.prompts]), max_num_batched_tokens=max(8192, args.prompts *
                                                                                    args.prompt_len),
              progress=False)
    llms = {"default": LLM(args.model, **kw), "batch_invariant": LLM(args.model, batch_invariant=True, **kw)}
    model = llms["default"].engine_config.model
    vocab = llms["default"].llm_engine.model_config.vocab_size
    cells = [("decode", b) for b in batches] + [("prefill", args.prompts)]
    rounds: dict[str, dict[str, list[float]]] = {m: {f"{k}@{b}": [] for k, b in cells} for m in llms}
    for mode, llm in llms.items():  # warm-up (oneDNN's kernel generation, first-touch of the KV pool): discarded
        time_prefill(llm.llm_engine, args.prompts, args.prompt_len, vocab)
        for b in batches:
            time_decode(llm.llm_engine, b, args.context, 3, vocab, warmup=1)
    for r in range(args.rounds):
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        for kind, b in cells:
            for mode in order:
                eng = llms[mode].llm_engine
                v = (time_decode(eng, b, args.context, args.steps, vocab) if kind == "decode"
                     else time_prefill(eng, b, args.prompt_len, vocab))
                rounds[mode][f"{kind}@{b}"].append(v)
                print(f"round {r} {mode:16s} {kind}@{b}: {v:.2f} {'ms/step' if kind == 'decode' else 'tok/s'}",
                      flush=True)
    best = {m: {c: (min(v) if c.startswith("decode") else max(v)) for c, v in rs.items()} for m, rs in rounds.items()}
    cmd = "python benchmarks/batch_invariant.py " + " ".join(sys.argv[1:])
    date = dt.date.today().isoformat()
    lines = [f"# Batch-invariant mode: what it costs ({date})", "",
             f"Command: `{cmd}`", "",
             f"Model: `{os.path.basename(model.rstrip('/'))}` (bf16), {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}; both engines in one process, "
             f"interleaved (ABBA) over {args.rounds} rounds; best round per cell (decode: fastest median step of "
             f"{args.steps}; prefill: one step of {args.prompts} x {args.prompt_len}-token prompts), all rounds "
             "listed. Absolute times on this shared VM move by 10-30%; read the ratios.", "",
             "| cell | default | batch_invariant | invariant / default | rounds (default; invariant) |",
             "|---|---|---|---|---|"]
    for kind, b in cells:
        c = f"{kind}@{b}"
        d, i = best["default"][c], best["batch_invariant"][c]
        unit = "ms/step" if kind == "decode" else "tok/s"
        label = f"decode step, batch {b}, context {args.context}" if kind == "decode" else \
            f"prefill, {b} x {args.prompt_len} tokens"
        ratio = i / d if kind == "decode" else d / i  # both as time ratios
        lines.append(f"| {label} | {d:.2f} {unit} | {i:.2f} {unit} | {ratio:.2f}x the time | "
                     f"{', '.join(f'{x:.1f}' for x in rounds['default'][c])}; "
                     f"{', '.join(f'{x:.1f}' for x in rounds['batch_invariant'][c])} |")
    os.makedirs(args.out, exist_ok=True)
    stem = unused_stem(os.path.join(args.out, f"{date}-batch-invariant"))
    md = write_markdown(args.out, os.path.basename(stem) + ".md", lines)
    with open(stem + ".json", "w") as f:
        json.dump({"command": cmd, "date": date, "model": model, "threads": torch.get_num_threads(),
                   "rounds": rounds, "best": best, "args": vars(args)}, f, indent=1)
    print("\n".join(lines))
    print(f"wrote {stem}.json and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
