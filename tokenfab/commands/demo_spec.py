"""``tokenfab demo --speculative-config '{...}'``: the demo's workload with and without speculation, side by side.

For each temperature (0 and 1.0 by default) the same requests run through two offline engines on the same model
(both built first, their runs alternating), one plain and one with the given ``speculative_config`` (parsed and
validated by :func:`tokenfab.spec_decode.config.parse_speculative_config`, so a bad field is refused before any
model loads).
Per engine and temperature: mean TPOT ((finish - first token) / (output tokens - 1) per request, averaged over
requests, ms), output tok/s (output tokens / wall time of the ``generate`` call), and with speculation vLLM's
acceptance figures from the engine's counters over that run: acceptance rate = accepted / draft tokens, mean
acceptance length = 1 + accepted / drafts (drafts: rows verified with at least one draft). At temperature 0 the
table also says whether the speculative run's tokens are identical to the plain run's, request by request.

The workload is the demo's random dataset shape: ``num_prompts`` prompts of ``input_len`` random token ids (seeded),
``output_len`` tokens each with ``ignore_eos``, at most ``max_concurrency`` in flight (``max_num_seqs``). Heavy
imports happen inside the functions.
"""
from __future__ import annotations

import statistics
import time

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def random_workload(vocab_size: int, num_prompts: int, input_len: int, seed: int = 0) -> list[dict]:
    """``num_prompts`` prompts of ``input_len`` token ids drawn uniformly from [min(100, V/4), V - that) (away from
    special tokens at either end), as ``{"prompt_token_ids": [...]}`` dicts, reproducible from ``seed``."""
    import numpy as np

    margin = min(100, vocab_size // 4)
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(margin, vocab_size - margin, size=input_len).tolist()}
            for _ in range(num_prompts)]


def timed_run(llm, prompts: list[dict], params) -> dict:
    """One untimed one-prompt warm-up, then ``llm.generate(prompts, params)`` timed.

    Returns ``tpot_ms`` (mean over requests with >= 2 tokens), ``tok_s``, ``output_tokens``, ``token_ids`` (one
    list per request, in order) and ``counters``: the change of :data:`COUNTERS` over the timed call (all 0 when
    the engine does not speculate)."""
    llm.generate(prompts[:1], params)
    eng = llm.llm_engine
    before = dict(eng.get_stats())
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=True)  # progress bar on stderr: these runs take minutes on CPU
    wall = time.monotonic() - t0
    after = eng.get_stats()
    tpots, ntok, ids = [], 0, []
    for o in outs:
        toks = list(o.outputs[0].token_ids)
        ids.append(toks)
        ntok += len(toks)
        m = o.metrics
        if len(toks) > 1 and m is not None and m.first_token_time is not None and m.finished_time is not None:
            tpots.append((m.finished_time - m.first_token_time) / (len(toks) - 1))
    return {"tpot_ms": 1e3 * statistics.mean(tpots) if tpots else float("nan"), "tok_s": ntok / wall,
            "output_tokens": ntok, "token_ids": ids,
            "counters": {c: int(after.get(c, 0)) - int(before.get(c, 0)) for c in COUNTERS}}


def acceptance(counters: dict) -> tuple[float | None, float | None]:
    """(acceptance rate, mean acceptance length) from counter deltas, vLLM's definitions (module docstring);
    (None, None) when nothing was drafted."""
    drafts, draft_tokens = counters["spec_decode_num_drafts"], counters["spec_decode_num_draft_tokens"]
    accepted = counters["spec_decode_num_accepted_tokens"]
    if not drafts or not draft_tokens:
        return None, None
    return accepted / draft_tokens, 1.0 + accepted / drafts


def compare(model: str, spec, temperatures, *, num_prompts: int, input_len: int, output_len: int,
            max_concurrency: int, dtype: str = "auto", device: str = "auto", seed: int = 0,
            llm_kwargs: dict | None = None) -> dict:
    """Run the workload on ``model`` without and with ``spec`` (a dict, JSON text or SpeculativeConfig) at each of
    ``temperatures``. Returns ``{"model", "speculative_config", "workload", "rows": [...]}``, one row per
    temperature: ``temperature``, ``plain`` and ``spec`` (:func:`timed_run` results without token ids),
    ``acceptance_rate``, ``acceptance_length``, ``tpot_ratio`` (spec / plain), ``identical`` (bool at temperature
    0, None otherwise).

    Raises:
        EngineConfigError / UnsupportedError: from parse_speculative_config, before any model loads.
        ValueError: ``spec`` empty (speculation off: nothing to compare).
    """
    from tokenfab import LLM, SamplingParams
    from tokenfab.spec_decode.config import parse_speculative_config

    cfg = parse_speculative_config(spec)
    if cfg is None:
        raise ValueError("--speculative-config is empty: give e.g. '{\"method\": \"ngram\", "
                         "\"num_speculative_tokens\": 4}'.")
    max_len = input_len + output_len + 64
    kw = dict(progress=False, max_num_seqs=max_concurrency, max_model_len=max_len, dtype=dtype, device=device,
              seed=seed, **(llm_kwargs or {}))
    plain = LLM(model, **kw)
    specd = LLM(model, speculative_config=cfg, **kw)
    vocab = plain.llm_engine.model_config.vocab_size
    prompts = random_workload(vocab, num_prompts, input_len, seed)
    results = {t: {} for t in temperatures}
    for t in temperatures:  # plain and speculative runs alternate, so a change in machine load hits both
        sp = SamplingParams(temperature=t, max_tokens=output_len, ignore_eos=True)
        for side, llm in (("plain", plain), ("spec", specd)):
            print(f"[tokenfab] T={t:g}, {'with' if side == 'spec' else 'without'} speculation: {num_prompts} "
                  f"requests of {input_len} + {output_len} tokens", flush=True)
            results[t][side] = timed_run(llm, prompts, sp)
    del plain, specd
    rows = []
    for t in temperatures:
        p, s = results[t]["plain"], results[t]["spec"]
        rate, length = acceptance(s["counters"])
        rows.append({"temperature": t, "acceptance_rate": rate, "acceptance_length": length,
                     "tpot_ratio": s["tpot_ms"] / p["tpot_ms"] if p["tpot_ms"] else None,
                     "identical": (p["token_ids"] == s["token_ids"]) if t < 1e-5 else None,
                     "plain": {k: v for k, v in p.items() if k != "token_ids"},
                     "spec": {k: v for k, v in s.items() if k != "token_ids"}})
    return {"model": model, "speculative_config": cfg.to_dict(),
            "workload": {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
                         "max_concurrency": max_concurrency, "dataset": "random", "ignore_eos": True},
            "rows": rows}


def table_cells(result: dict) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The side-by-side table as text: (column headers, [(metric, one cell per column)]). Columns: for each
    temperature, "T=<t> off" and "T=<t> spec"."""
    heads, cols = [], []
    for r in result["rows"]:
        heads += [f"T={r['temperature']:g} off", f"T={r['temperature']:g} spec"]
        cols.append((r, r["plain"], None))
        cols.append((r, r["spec"], r))

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    def num(v, f=".2f"):
        return "-" if v is None else format(v, f)

    metrics = [
        ("TPOT (ms)", [num(run["tpot_ms"]) for _, run, _ in cols]),
        ("Output tok/s", [num(run["tok_s"], ".1f") for _, run, _ in cols]),
        ("TPOT spec / off", ["" if s is None else num(s["tpot_ratio"]) for _, _, s in cols]),
        ("Acceptance rate", ["" if s is None else pct(s["acceptance_rate"]) for _, _, s in cols]),
        ("Mean acceptance length", ["" if s is None else num(s["acceptance_length"]) for _, _, s in cols]),
        ("Drafts / draft tokens / accepted", ["" if s is None else
                                              "{spec_decode_num_drafts} / {spec_decode_num_draft_tokens} / "
                                              "{spec_decode_num_accepted_tokens}".format(**s["spec"]["counters"])
                                              for _, _, s in cols]),
        ("Tokens identical to off", ["" if s is None else ("-" if s["identical"] is None else
                                                           ("yes" if s["identical"] else "NO")) for _, _, s in cols]),
    ]
    return heads, metrics


def print_table(result: dict, console=None) -> None:
    """Print :func:`table_cells` as one rich table (``console``: a rich Console; default stdout)."""
    import sys

    from rich.console import Console
    from rich.table import Table

    heads, metrics = table_cells(result)
    w = result["workload"]
    tab = Table(title=f"Speculative decoding: {result['speculative_config'].get('method')} "
                      f"k={result['speculative_config'].get('num_speculative_tokens')} vs off; {w['num_prompts']} "
                      f"prompts, {w['input_len']} in / {w['output_len']} out, {w['max_concurrency']} in flight")
    tab.add_column("Metric")
    for h in heads:
        tab.add_column(h, justify="right")
    for name, cells in metrics:
        tab.add_row(name, *cells)
    (console or Console(width=None if sys.stdout.isatty() else 140)).print(tab)


def markdown(result: dict) -> str:
    """:func:`table_cells` as a Markdown table with the configuration above it."""
    import json

    heads, metrics = table_cells(result)
    lines = ["# Speculative decoding vs off", "", f"Model: {result['model']}", "",
             f"speculative_config: `{json.dumps(result['speculative_config'])}`", "",
             f"Workload: {json.dumps(result['workload'])}", "",
             "| Metric | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in metrics]
    return "\n".join(lines) + "\n"
