"""Decode-step cost of the logits processors (penalties, min_p, logit_bias, allowed_token_ids, bad_words) against
plain sampling, side by side in one run.

    .venv/bin/python benchmarks/logits_processors_overhead.py [--model DIR] [--batch 16] [--steps 30] [--rounds 3]

For each configuration, ``--batch`` requests (the same prompts each time, ``--context`` tokens, all rows with the
configuration's SamplingParams) are prefilled, then ``--steps`` decode steps of ``LLMEngine.step()`` are timed;
configurations are interleaved ``--rounds`` times (ABCABC..., so slow drift of a shared machine hits all alike) and
each is reported as its fastest round's median step (on a machine shared with other work, the least disturbed
round; all rounds are listed). Plain rows take the fused CPU decode path (forward, LM head and the draw in
one C++ call); rows with processors take forward + LM head + the sampler's module path, so the difference is the
processors plus leaving that path. A second table times the sampler alone on random logits [batch, vocab]
(median of 50 calls), which isolates the processors from the forward.

Writes <--out, default benchmarks/results>/<date>-logits-processors.md (with the command line).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.engine_steps import median_decode_ms  # noqa: E402
from benchmarks.results_file import write_markdown  # noqa: E402


def configs(vocab: int, words: list[str]) -> list[tuple[str, dict]]:
    """(label, SamplingParams keywords) of the measured configurations."""
    rng = np.random.default_rng(0)
    bias = {int(t): float(b) for t, b in zip(rng.choice(vocab, 16, replace=False), rng.uniform(-5, 5, 16))}
    allowed = sorted(int(t) for t in rng.choice(vocab, 2000, replace=False))
    pen = dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5)
    return [
        ("greedy, no processors", dict(temperature=0.0)),
        ("T=0.8, no processors", dict(temperature=0.8)),
        ("greedy + repetition/frequency/presence", dict(temperature=0.0, **pen)),
        ("T=0.8 + repetition/frequency/presence", dict(temperature=0.8, **pen)),
        ("T=0.8 + min_p 0.05", dict(temperature=0.8, min_p=0.05)),
        ("greedy + logit_bias (16 ids)", dict(temperature=0.0, logit_bias=bias)),
        ("greedy + allowed_token_ids (2,000 ids)", dict(temperature=0.0, allowed_token_ids=allowed)),
        (f"greedy + bad_words ({len(words)} words)", dict(temperature=0.0, bad_words=words)),
        ("T=0.8 + all of the above", dict(temperature=0.8, min_p=0.05, logit_bias=bias, bad_words=words, **pen)),
    ]


def time_decode(engine, prompts: list[list[int]], params, steps: int, warmup: int = 3) -> float:
    """Median wall time (ms) of ``steps`` decode steps of ``len(prompts)`` sequences with ``params``."""
    return median_decode_ms(engine, prompts, params, steps, warmup)


def time_sampler(engine, prompts: list[list[int]], params, reps: int = 50) -> float:
    """Median time (ms) of one Sampler call on random logits [batch, vocab] for rows admitted with ``params`` (each
    with a 32-token output history)."""
    from tokenfab.request_validation import bad_words_token_ids
    from tokenfab.engine.logits_state import LogitsProcessorState
    from tokenfab.engine.sampler import Sampler
    from tokenfab.engine.sequence import Sequence

    V = engine.model_config.vocab_size
    B = len(prompts)
    g = torch.Generator().manual_seed(0)
    token_ids = np.zeros((B, 4096), dtype=np.int64)
    sampler = Sampler(torch.Generator().manual_seed(0))
    sampler.processors = LogitsProcessorState(B, V, token_ids)
    bad = bad_words_token_ids(params.bad_words, engine.tokenizer) if params.bad_words else []
    seqs = []
    for i, p in enumerate(prompts):
        s = Sequence(i, str(i), 0, p, params, 0.0)
        s.token_ids += torch.randint(0, V, (32,), generator=g).tolist()
        s.row, s.bad_words_token_ids = i, bad
        token_ids[i, :s.num_tokens] = s.token_ids
        seqs.append(s)
    sampler.processors.admit(seqs)
    rows = np.arange(B, dtype=np.int64)
    lengths = np.array([s.num_tokens for s in seqs], dtype=np.int64)
    logits = torch.randn(B, V, generator=g) * 3
    times = []
    for _ in range(reps + 3):
        t = time.perf_counter()
        sampler(logits, seqs, rows=rows, lengths=lengths)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: tokenfab's default model)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()

    from tokenfab import LLM, SamplingParams
    llm = LLM(args.model, max_num_seqs=args.batch, max_model_len=args.context + args.rounds * 64 + 512,
              progress=False)
    engine = llm.llm_engine
    V = engine.model_config.vocab_size
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, V, args.context).tolist() for _ in range(args.batch)]
    words = ["the", "and", "of", "hello world", "New York"]
    cfgs = configs(V, words)
    steps_ms: dict[str, list[float]] = {c: [] for c, _ in cfgs}
    for _ in range(args.rounds):
        for label, kw in cfgs:
            params = SamplingParams(max_tokens=args.steps + 64, ignore_eos=True, seed=None, **kw)
            steps_ms[label].append(time_decode(engine, prompts, params, args.steps))
    sampler_ms = {label: time_sampler(engine, prompts, SamplingParams(max_tokens=16, **kw)) for label, kw in cfgs}

    name = os.path.basename(os.path.normpath(engine.config.model))
    base = {"greedy": min(steps_ms[cfgs[0][0]]), "T=0.8": min(steps_ms[cfgs[1][0]])}
    sbase = {"greedy": sampler_ms[cfgs[0][0]], "T=0.8": sampler_ms[cfgs[1][0]]}
    lines = [f"# Logits processors: decode-step overhead at batch {args.batch}", "",
             f"Command: `.venv/bin/python benchmarks/logits_processors_overhead.py --batch {args.batch} "
             f"--context {args.context} --steps {args.steps} --rounds {args.rounds}"
             + (f" --model {args.model}" if args.model else "") + "`", "",
             f"Model: {name} (vocab {V}, {engine.dtype}), {engine.device}; {platform.processor() or platform.machine()},"
             f" {torch.get_num_threads()} torch threads, {dt.datetime.now().isoformat(timespec='seconds')}. Prompts of "
             f"{args.context} tokens, every row of the batch with the configuration's parameters. Step: median of "
             f"{args.steps} steps in the fastest of {args.rounds} interleaved rounds (every round's median listed). "
             "Sampler: one `Sampler` call on random logits [batch, vocab] with 32 output tokens of history per row "
             "(median of 50).", "",
             "| configuration | decode step (ms) | vs plain | all rounds (ms) | sampler call (ms) | vs plain |",
             "|---|---:|---:|---|---:|---:|"]
    for label, _ in cfgs:
        med = min(steps_ms[label])
        ref = base["greedy" if label.startswith("greedy") else "T=0.8"]
        sref = sbase["greedy" if label.startswith("greedy") else "T=0.8"]
        rounds = ", ".join(f"{x:.1f}" for x in steps_ms[label])
        lines.append(f"| {label} | {med:.2f} | {med - ref:+.2f} ms ({100 * (med / ref - 1):+.1f}%) | {rounds} | "
                     f"{sampler_ms[label]:.3f} | {sampler_ms[label] - sref:+.3f} ms |")
    lines += ["", "Plain rows (the first two) draw inside the fused CPU decode call (`CpuDecodeStack.run_sample`); rows "
              "with processors take forward + LM head and the sampler's module path (tokenfab/engine/sampler.py, "
              "logits_state.py), so their step difference includes leaving the fused path."]
    stamp = dt.date.today().isoformat()
    write_markdown(args.out, f"{stamp}-logits-processors.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
