"""One short table from benchmarks/decode_floor.py's JSON results: the last thing benchmarks/gpu_check.sh prints.

    python benchmarks/gpu_summary.py DIR [--expect llama3b,qwen3moe,...] [--failed DIR/failed_steps] [--out FILE]

Reads every ``*-decode-floor.json`` in DIR (a run killed by its timeout leaves the rows it finished, ``complete``
false); results are grouped by their ``label`` (the case), the newest file of a label winning. One row per (case,
batch): step time with decode CUDA graphs and eager (rows' ``mode``; results older than the ``mode`` field count as
graphs when ``decode_graphs`` is true), the batch's memory floor, step / floor for each and eager / graphs. Under
the table, per case with an eager profile (decode_floor.py ``--profile-steps``): device time per step and per
layer, kernel launches per layer and the three kernels with the most device time. ``--expect``: cases without any
result get a row saying so; ``--failed``: gpu_check.sh's list of failed steps is repeated under the table. A batch
whose steps decoded fewer sequences than asked (``running``) says so. Cases with rows scheduled in step
(decode_floor.py ``--also-sync``) get a line comparing their step time and engine overhead with the async rows'.

Prints the Markdown table (and writes it to ``--out`` when given). Exit status 0, also when results are missing
(the table says so); 2 when DIR does not exist.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys


def load_results(folder: str) -> dict[str, dict]:
    """{label: result} of the ``*-decode-floor.json`` files in ``folder``; for a label seen twice, the result with
    the later ``date`` (then the later file name). Files that are not JSON objects are skipped."""
    out: dict[str, tuple] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*-decode-floor*.json"))):
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(r, dict) or not isinstance(r.get("rows"), list):
            continue
        label = r.get("label") or os.path.basename(path).split("-decode-floor")[0]
        key = (str(r.get("date", "")), path)
        if label not in out or key > out[label][0]:
            out[label] = (key, r)
    return {k: v[1] for k, v in out.items()}


def _mode(row: dict, result: dict) -> str:
    m = row.get("mode")
    if m:
        return m
    return "graphs" if result.get("decode_graphs") else "eager"


def _f(v, fmt: str = "{:.2f}") -> str:
    return "—" if v is None else fmt.format(v)


def case_rows(label: str, result: dict) -> list[list[str]]:
    """Table rows (cells) of one case: one per batch size, in the order first measured."""
    by_batch: dict[int, dict[str, dict]] = {}
    for row in result["rows"]:
        by_batch.setdefault(int(row["batch"]), {})[_mode(row, result)] = row
    cells = []
    for batch, modes in by_batch.items():
        g, e = modes.get("graphs"), modes.get("eager")
        floor = (g or e).get("floor_ms")
        g_ms, e_ms = (g or {}).get("step_ms"), (e or {}).get("step_ms")
        ran = min(r.get("running", batch) for r in modes.values())
        cells.append([label, str(batch) if ran == batch else f"{batch} (only {ran} ran)", _f(g_ms), _f(e_ms),
                      _f(floor, "{:.3f}"),
                      _f(g_ms / floor if g_ms and floor else None) + ("x" if g_ms and floor else ""),
                      _f(e_ms / floor if e_ms and floor else None) + ("x" if e_ms and floor else ""),
                      _f(e_ms / g_ms if e_ms and g_ms else None) + ("x" if e_ms and g_ms else "")])
    return cells


def profile_line(label: str, result: dict) -> str | None:
    """One sentence on the case's eager profile, or None without one."""
    p = result.get("profile")
    if not p:
        return None
    top = ", ".join(f"{t['name'][:40]} {t['ms_per_step']:.3f} ms" for t in p.get("top", [])[:3])
    per_layer = p.get("device_ms_per_layer", p["device_ms_per_step"] / max(p.get("num_layers", 1), 1))
    return (f"- {label}: eager batch 1 device time {p['device_ms_per_step']:.3f} ms of "
            f"{p.get('wall_ms_per_step', float('nan')):.3f} ms wall per step ({per_layer:.3f} ms and "
            f"{p['launches_per_layer']:.1f} launches per layer, {p.get('counted', 'kernels')}); top: {top}")


def sync_line(label: str, result: dict) -> str | None:
    """One sentence comparing each batch's async-scheduled steps with the same steps scheduled in step (modes
    "<m>" and "<m>-sync"), or None without sync rows."""
    by_batch: dict[int, dict[str, dict]] = {}
    for row in result["rows"]:
        by_batch.setdefault(int(row["batch"]), {})[_mode(row, result)] = row
    parts = []
    for batch, modes in by_batch.items():
        for m, r in modes.items():
            a = modes.get(m[:-len("-sync")]) if m.endswith("-sync") else None
            if a is not None:
                parts.append(f"batch {batch} {a['step_ms']:.2f} vs {r['step_ms']:.2f} ms (overhead "
                             f"{a['overhead_ms']:.2f} vs {r['overhead_ms']:.2f} ms)")
    if not parts:
        return None
    return f"- {label}: async scheduling vs in step: " + "; ".join(parts)


def summary_lines(results: dict[str, dict], expect: list[str] | None = None, failed: list[str] | None = None
                  ) -> list[str]:
    """The Markdown lines: the table, the profile lines, then missing cases and failed steps."""
    order = list(expect or [])
    order += sorted(k for k in results if k not in order)
    head = results[next(iter(results))] if results else {}
    gpu = head.get("gpu") or head.get("cpu") or "?"
    bws = [r.get("copy_bandwidth_GBps") for r in results.values() if r.get("copy_bandwidth_GBps")]
    lines = [f"## GPU check summary ({gpu}; copy bandwidth {min(bws):.0f}-{max(bws):.0f} GB/s)" if bws
             else f"## GPU check summary ({gpu})", "",
             "| case | batch | step ms (graphs) | step ms (eager) | floor ms | graphs / floor | eager / floor "
             "| eager / graphs |", "|---|---|---|---|---|---|---|---|"]
    for label in order:
        r = results.get(label)
        if r is None:
            lines.append(f"| {label} | — | no result (step failed or timed out: see the check's log) | | | | | |")
            continue
        rows = case_rows(label, r)
        if not rows:
            lines.append(f"| {label} | — | no rows (stopped before the first batch) | | | | | |")
        for cells in rows:
            lines.append("| " + " | ".join(cells) + " |")
        if not r.get("complete", True):
            lines.append(f"| {label} | … | incomplete: stopped after these rows | | | | | |")
    notes = [s for s in (profile_line(k, results[k]) for k in order if k in results) if s]
    notes += [s for s in (sync_line(k, results[k]) for k in order if k in results) if s]
    errs = [f"- {k}: CUDA-graph engine failed, eager only: {results[k]['graphs_error']}" for k in order
            if k in results and results[k].get("graphs_error")]
    errs += [f"- {k}: profile failed: {results[k]['profile_error']}" for k in order
             if k in results and results[k].get("profile_error")]
    if notes or errs:
        lines += ["", "Eager profiles, async scheduling and graph failures:"] + notes + errs
    if failed:
        lines += ["", f"Failed steps ({len(failed)}): " + "; ".join(failed)]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="folder holding decode_floor.py's *-decode-floor.json results")
    ap.add_argument("--expect", default="", help="comma list of labels (cases) that should have a result")
    ap.add_argument("--failed", default=None, help="file listing failed steps, one a line (gpu_check.sh)")
    ap.add_argument("--out", default=None, help="also write the table to this Markdown file")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.folder):
        print(f"gpu_summary.py: no folder {args.folder}", file=sys.stderr)
        return 2
    failed = None
    if args.failed and os.path.isfile(args.failed):
        with open(args.failed) as f:
            failed = [line.strip() for line in f if line.strip()]
    lines = summary_lines(load_results(args.folder), [c for c in args.expect.split(",") if c], failed)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
