"""Decode-step cost of structured outputs (xgrammar's token mask) against unconstrained decoding, side by side in
one run, and grammar compile times.

    .venv/bin/python benchmarks/structured_output_overhead.py [--model DIR] [--batches 1,16] [--steps 30] [--rounds 3]

For each batch size, two engines on the same weights each prefill ``B`` requests (the same prompts, ``--context``
tokens): one with no constraint, one with every row under a JSON schema (:data:`SCHEMA`: eight required string
properties, so no row can complete its JSON, and stop, within the timed steps; the number of rows still constrained
at the end is reported). Both greedy. Then ``--steps`` decode steps are timed with the two engines stepped in turn
(A, B, A, B, ...: on a heavily shared machine, load changes within seconds, and alternating single steps exposes both
configurations to the same load), ``--rounds`` times; each is reported as its fastest round's median step (all rounds
listed). Unconstrained rows take the fused CPU decode path (forward, LM head
and draw in one C++ call); grammar rows take forward + LM head, the mask (fill + apply) and the sampler's module
path, so the difference is the grammar plus leaving that path. A second table times the mask alone
(``GrammarState.apply``: fill the batch's bitmasks, apply them to random logits [B, V]; median of 50) and a third
the compile times (TokenizerInfo once per engine; each constraint cold, caches cleared; median of 5).

Writes <--out, default benchmarks/results>/<date>-structured-output.md (with the command line).
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
from benchmarks.engine_steps import start_requests  # noqa: E402
from benchmarks.results_file import write_markdown  # noqa: E402

KEYS = ["name", "city", "country", "street", "job", "company", "hobby", "pet"]
SCHEMA = {"type": "object", "properties": {k: {"type": "string"} for k in KEYS}, "required": KEYS}
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


def time_paired(engines, prompts, params_list, steps: int, warmup: int = 3) -> tuple[list[float], int]:
    """Decode-step times (ms; median of ``steps``) of each engine with its params, the engines stepped in turn
    (A, B, A, B, ...) so that a shared machine's load hits every configuration alike; and the rows still
    constrained in the last engine at the end."""
    ids = [start_requests(e, prompts, p) for e, p in zip(engines, params_list)]
    for _ in range(warmup):
        for e in engines:
            e.step()
    times = [[] for _ in engines]
    for _ in range(steps):
        for k, e in enumerate(engines):
            t = time.perf_counter()
            e.step()
            times[k].append(time.perf_counter() - t)
    e = engines[-1]
    st = e.runner.sampler.processors
    rows = [s.row for r in e.requests.values() for s in r.seqs if not s.is_finished]
    live = int(st.grammar.on[rows].sum()) if st.grammar is not None and rows else 0
    for eng, rids in zip(engines, ids):
        for rid in rids:
            eng.abort_request(rid)
    return [1e3 * statistics.median(t) for t in times], live


def time_mask(engine, B: int, reps: int = 50) -> float:
    """Median time (ms) of one ``GrammarState.apply`` over B rows under :data:`SCHEMA`, each after the same
    10-token JSON prefix, on random logits [B, V]."""
    from tokenfab import SamplingParams, StructuredOutputsParams
    from tokenfab.engine.grammar_state import GrammarState
    from tokenfab.engine.sequence import Sequence

    V = engine.model_config.vocab_size
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    g = engine.compile_grammar(params)
    prefix = engine.tokenizer.encode('{"name": "Ann", "city": "Par', add_special_tokens=False)
    gs = GrammarState(B, V)
    for i in range(B):
        s = Sequence(i, str(i), 0, [1, 2, 3], params, 0.0)
        s.token_ids += prefix
        s.row, s.grammar = i, g
        gs.admit(s)
    assert gs.on.all()
    index = rows = np.arange(B, dtype=np.int64)
    logits = torch.randn(B, V)
    times = []
    for _ in range(reps + 3):
        x = logits.clone()
        t = time.perf_counter()
        gs.apply(x, index, rows)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[3:])


def time_compiles(engine, reps: int = 5) -> list[tuple[str, float]]:
    """(label, median ms) of TokenizerInfo construction and of cold compiles of several constraints."""
    from tokenfab.structured_output.compiler import GrammarCompiler
    from tokenfab.structured_output.params import StructuredOutputsParams

    V = engine.model_config.vocab_size
    out = []
    t_info = []
    for _ in range(reps):
        gc = GrammarCompiler(engine.tokenizer, V, engine.eos_token_ids)
        t = time.perf_counter()
        gc._xgr_compiler()
        t_info.append(time.perf_counter() - t)
    out.append(("TokenizerInfo + compiler (once per engine)", 1e3 * statistics.median(t_info)))
    cases = [("json_schema: 8 required strings", StructuredOutputsParams(json=SCHEMA)),
             ("json_schema: name / age 0-120 / tags", StructuredOutputsParams(json=PERSON)),
             ("json_object", StructuredOutputsParams(json_object=True)),
             ("regex: date", StructuredOutputsParams(regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]")),
             ("choice: 3 strings", StructuredOutputsParams(choice=["positive", "negative", "neutral"]))]
    for label, so in cases:
        ts = []
        for _ in range(reps):
            gc._cache.clear()
            gc._compiler.clear_cache()
            t = time.perf_counter()
            gc.compile(so)
            ts.append(time.perf_counter() - t)
        out.append((label, 1e3 * statistics.median(ts)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: tokenfab's default model)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    from tokenfab import LLM, SamplingParams, StructuredOutputsParams
    # two engines on the same weights, one per configuration, stepped in turn (time_paired)
    engines = [LLM(args.model, max_num_seqs=max(batches), max_model_len=args.context + 512, progress=False).llm_engine
               for _ in range(2)]
    engine = engines[1]
    V = engine.model_config.vocab_size
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, V, args.context).tolist() for _ in range(max(batches))]
    cfgs = [("no grammar", SamplingParams(temperature=0.0, max_tokens=args.steps + 64)),
            ("json_schema on every row", SamplingParams(temperature=0.0, max_tokens=args.steps + 64,
                                                        structured_outputs=StructuredOutputsParams(json=SCHEMA)))]
    engine.compile_grammar(cfgs[1][1])  # compile once, outside the timed steps (the server does it per request)
    res: dict[tuple[int, str], list[float]] = {}
    live: dict[int, int] = {}
    for _ in range(args.rounds):
        for B in batches:
            ms, n_live = time_paired(engines, prompts[:B], [p for _, p in cfgs], args.steps)
            for (label, _), m in zip(cfgs, ms):
                res.setdefault((B, label), []).append(m)
            live[B] = min(live.get(B, B), n_live)
    mask_ms = {B: time_mask(engine, B) for B in batches}
    compiles = time_compiles(engine)
    stack = engine.runner.cpu_decode_stack is not None

    name = os.path.basename(os.path.normpath(engine.config.model))
    cmd = (f".venv/bin/python benchmarks/structured_output_overhead.py --batches {args.batches} --context "
           f"{args.context} --steps {args.steps} --rounds {args.rounds}" + (f" --model {args.model}" if args.model
                                                                           else ""))
    lines = ["# Structured outputs (xgrammar): decode-step overhead and compile time", "",
             f"Command: `{cmd}`", "",
             f"Model: {name} (vocab {V}, {engine.dtype}), {engine.device}, fused CPU decode stack "
             f"{'on' if stack else 'off'}; {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
             f"torch threads, {dt.datetime.now().isoformat(timespec='seconds')}. Prompts of {args.context} random "
             f"tokens, greedy. Step: median of {args.steps} decode steps in the fastest of {args.rounds} rounds, the "
             "two configurations' engines stepped in turn (every round's median listed). Grammar rows: every row under a JSON schema of eight required "
             "string properties (rows still constrained after the timed steps in the last column).", "",
             "| batch | configuration | decode step (ms) | vs no grammar | all rounds (ms) | rows constrained at end |",
             "|---:|---|---:|---:|---|---:|"]
    for B in batches:
        base = min(res[(B, "no grammar")])
        for label, _ in cfgs:
            med = min(res[(B, label)])
            lines.append(f"| {B} | {label} | {med:.2f} | {med / base:.2f}x (+{med - base:.2f} ms) | "
                         f"{', '.join(f'{x:.2f}' for x in res[(B, label)])} | "
                         f"{live[B] if label != 'no grammar' else '-'} |")
    lines += ["", "The mask alone (`GrammarState.apply`: `batch_fill_next_token_bitmask` + "
              "`apply_token_bitmask_inplace` on random logits [B, V], every row inside a JSON string; median of 50 "
              "calls):", "",
              "| batch | mask fill + apply (ms) |", "|---:|---:|"]
    lines += [f"| {B} | {mask_ms[B]:.3f} |" for B in batches]
    lines += ["", "Compile times (cold: tokenfab's and xgrammar's caches cleared; median of 5):", "",
              "| what | ms |", "|---|---:|"]
    lines += [f"| {label} | {ms:.2f} |" for label, ms in compiles]
    lines += ["", "Absolute times on this shared machine move by 10-30% between runs; the ratios come from the "
              "interleaved rounds above."]
    print("\n".join(lines))
    write_markdown(args.out, f"{dt.date.today().isoformat()}-structured-output.md", lines)


if __name__ == "__main__":
    main()
