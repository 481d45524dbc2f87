"""``tokenfab report``: Markdown tables and SVG + PNG charts over saved benchmark runs and published peer figures.

Inputs are result JSON files from ``tokenfab bench serve --save-result`` (or directories of them). Keys read (vLLM
``bench serve`` names plus ours): ``total_token_throughput``, ``output_throughput``, ``mean_ttft_ms``,
``median_ttft_ms``, ``mean_tpot_ms``, ``median_tpot_ms``, ``num_prompts``, ``max_concurrency``, ``num_devices``,
``power`` (its ``cap_total_kw`` and the steady / whole-run ``total_kw``), ``cost`` (its ``cap_kw``, ``measured_kw``
and prices), ``label`` / ``model_id``. A file without ``total_token_throughput`` is listed as skipped.

Every row is priced at the same report prices so rows compare: electricity $/kWh = ``kwh_price`` if given, else the
first run's first electricity price, else $0.10; rental $/device-hour = ``device_hour_price`` if given, else the
first run's first rental price, else no rental column values.

Peers file (TOML; see ``benchmarks/peers.example.toml``): one ``[[peer]]`` table per published figure::

    [[peer]]
    label = "vLLM 0.x, 8x H200, DeepSeek-V3"   # required: row name
    source = "https://... (page, table, date)"  # required: where the figure comes from
    devices = 8                                 # required: devices serving the throughput
    total_tok_s = 12000.0                       # required: total (input + output) tokens/s
    example = true                              # optional: marks an illustrative, not a real, figure
    hardware = "8x H200 SXM"                    # optional
    model = "deepseek-ai/DeepSeek-V3"           # optional
    output_tok_s = 6000.0                       # optional
    cap_kw = 5.6                                # optional: total configured power cap, kW
    measured_kw = 5.1                           # optional: measured draw, kW
    temperature = 0.0                           # optional: sampling temperature used
    max_concurrency = 256                       # optional
    num_prompts = 1000                          # optional
    mean_ttft_ms = 900.0                        # optional (also median_ttft_ms, mean_tpot_ms, median_tpot_ms)
    caveats = ["FP8 weights", "input/output 1000/1000"]   # optional free-text caveats

Caveats added automatically to peer rows: "cap unstated" when ``cap_kw`` is absent, "temperature unstated" when
``temperature`` is absent, "example figure" when ``example = true``.

Outputs in ``out_dir``: ``report.md``, ``report.json`` (the rows) and up to four charts, each as .svg and .png:
``tok_s_per_device``, ``tok_s_per_kw``, ``usd_per_mtok``, ``latency``. A chart, a panel or a bar series without
data in any row is left out (the Markdown says which charts and what they need); row labels are wrapped or
shortened to fit the chart (:func:`chart_label`), legends sit outside the data area.
"""
from __future__ import annotations

import glob
import json
import os

from tokenfab.cost.model import (
    electricity_usd_per_mtok,
    price,
    rental_usd_per_mtok,
    tok_s_per_kw,
    usd,
)

DEFAULT_KWH_PRICE = 0.10
PEER_KEYS = {"label", "source", "devices", "total_tok_s", "example", "hardware", "model", "output_tok_s", "cap_kw",
             "measured_kw", "temperature", "max_concurrency", "num_prompts", "mean_ttft_ms", "median_ttft_ms",
             "mean_tpot_ms", "median_tpot_ms", "caveats"}
LATENCY_KEYS = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms")
CHARTS = ("tok_s_per_device", "tok_s_per_kw", "usd_per_mtok", "latency")


class ReportError(ValueError):
    """Bad report input; the message names the file (and the entry)."""

    user_error = True


def _expand(inputs: list[str]) -> list[str]:
    files: list[str] = []
    for p in inputs:
        if os.path.isdir(p):
            files.extend(sorted(glob.glob(os.path.join(p, "*.json"))))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"tokenfab report: no such file or directory {p}")
    return files


def _measured_kw(res: dict) -> float | None:
    cost, power = res.get("cost") or {}, res.get("power") or {}
    if cost.get("measured_kw"):
        return float(cost["measured_kw"])
    for key in ("steady", "whole_run"):
        w = power.get(key)
        if isinstance(w, dict) and w.get("total_kw"):
            return float(w["total_kw"])
    return None


def _cap_kw(res: dict) -> float | None:
    cost, power = res.get("cost") or {}, res.get("power") or {}
    for v in (cost.get("cap_kw"), power.get("cap_total_kw")):
        if v:
            return float(v)
    return None


def _priced(row: dict, kwh: float, dev_h: float | None) -> dict:
    """Fill the derived per-device / per-kW / $ columns of a row from its tok/s, devices, cap and measured kW."""
    t, d = row["total_tok_s"], row["devices"]
    row["tok_s_per_device"] = t / d if d else None
    row["tok_s_per_kw_cap"] = tok_s_per_kw(t, row["cap_kw"]) if row["cap_kw"] else None
    row["tok_s_per_kw_measured"] = tok_s_per_kw(t, row["measured_kw"]) if row["measured_kw"] else None
    row["elec_usd_per_mtok_cap"] = electricity_usd_per_mtok(row["cap_kw"], kwh, t) if row["cap_kw"] else None
    row["elec_usd_per_mtok_measured"] = (electricity_usd_per_mtok(row["measured_kw"], kwh, t)
                                         if row["measured_kw"] else None)
    row["rental_usd_per_mtok"] = rental_usd_per_mtok(d, dev_h, t) if (dev_h is not None and d) else None
    return row


def load_run(path: str) -> dict:
    """Read one result JSON; raise :class:`ReportError` when it is not a benchmark result."""
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ReportError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(res, dict):
        raise ReportError(f"{path}: top level is not an object")
    if not res.get("total_token_throughput"):
        raise ReportError(f"{path}: no total_token_throughput (not a bench serve result)")
    return res


def run_row(path: str, res: dict) -> dict:
    """The unpriced table row of a run (label, tok/s, devices, kW, latency); see :func:`_priced`."""
    model = res.get("model_id")
    label = res.get("label") or (os.path.basename(os.path.normpath(model)) if model else None) \
        or os.path.splitext(os.path.basename(path))[0]
    devices = res.get("num_devices") or 1
    row = {
        "kind": "run",
        "label": str(label),
        "source": path,
        "devices": int(devices),
        "total_tok_s": float(res["total_token_throughput"]),
        "output_tok_s": res.get("output_throughput"),
        "cap_kw": _cap_kw(res),
        "measured_kw": _measured_kw(res),
        "max_concurrency": res.get("max_concurrency"),
        "num_prompts": res.get("num_prompts"),
        "caveats": [] if res.get("num_devices") else ["num_devices missing: assumed 1"],
    }
    for k in LATENCY_KEYS:
        row[k] = res.get(k)
    return row


def load_peers(path: str) -> list[dict]:
    """Read a peers TOML file (format in the module docstring) into unpriced rows with their caveats."""
    import tomllib

    if not os.path.isfile(path):
        raise FileNotFoundError(f"--peers: no such file {path}")
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ReportError(f"--peers {path}: invalid TOML ({e})") from None
    peers = doc.get("peer", [])
    if not isinstance(peers, list):
        raise ReportError(f"--peers {path}: use [[peer]] tables")
    rows = []
    for i, p in enumerate(peers):
        unknown = set(p) - PEER_KEYS
        if unknown:
            raise ReportError(f"--peers {path}: peer[{i}] has unknown key(s) {sorted(unknown)}")
        for req in ("label", "source", "devices", "total_tok_s"):
            if req not in p:
                raise ReportError(f"--peers {path}: peer[{i}] ({p.get('label', '?')}) lacks {req}")
        if not isinstance(p["total_tok_s"], (int, float)) or p["total_tok_s"] <= 0:
            raise ReportError(f"--peers {path}: peer[{i}].total_tok_s must be > 0")
        if not isinstance(p["devices"], int) or p["devices"] < 1:
            raise ReportError(f"--peers {path}: peer[{i}].devices must be an integer >= 1")
        caveats = []
        if p.get("example"):
            caveats.append("example figure")
        if p.get("cap_kw") is None:
            caveats.append("cap unstated")
        if p.get("temperature") is None:
            caveats.append("temperature unstated")
        caveats.extend(str(c) for c in p.get("caveats", []))
        label = str(p["label"])
        if p.get("example") and not label.endswith("(example)"):
            label += " (example)"
        row = {
            "kind": "peer",
            "label": label,
            "source": str(p["source"]),
            "devices": int(p["devices"]),
            "total_tok_s": float(p["total_tok_s"]),
            "output_tok_s": p.get("output_tok_s"),
            "cap_kw": p.get("cap_kw"),
            "measured_kw": p.get("measured_kw"),
            "max_concurrency": p.get("max_concurrency"),
            "num_prompts": p.get("num_prompts"),
            "caveats": caveats,
            "hardware": p.get("hardware"),
            "model": p.get("model"),
        }
        for k in LATENCY_KEYS:
            row[k] = p.get(k)
        rows.append(row)
    return rows


def _report_prices(runs: list[dict], kwh_price: float | None, device_hour_price: float | None):
    kwh, dev_h = kwh_price, device_hour_price
    for res in runs:
        cost = res.get("cost") or {}
        if kwh is None and cost.get("electricity"):
            kwh = cost["electricity"][0].get("usd_per_kwh")
        if dev_h is None and cost.get("rental"):
            dev_h = cost["rental"][0].get("usd_per_device_hour")
    return (DEFAULT_KWH_PRICE if kwh is None else float(kwh)), (None if dev_h is None else float(dev_h))


def _cell(x, spec: str) -> str:
    if x is None:
        return "—"
    return format(x, spec)


def _md_escape(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[str]], text_cols: tuple[str, ...] = ("row", "kind", "caveats")) -> str:
    align = ["---" if h in text_cols else "---:" for h in header]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render_markdown(rows: list[dict], kwh: float, dev_h: float | None, skipped: list[str],
                    chart_names: list[str]) -> str:
    """The report as Markdown: efficiency, cost and latency tables, caveats, and links to the charts."""
    out = ["# tokenfab benchmark report", ""]
    out.append(f"Prices for every row: electricity {price(kwh)}/kWh; rental "
               + (f"{price(dev_h)}/device-hour." if dev_h is not None else "not priced (no $/device-hour given)."))
    out.append("tok/s = total (input + output) tokens per second. $/M tok = dollars per million total tokens: "
               "electricity = kW × $/kWh × 1e6 / (tok/s × 3600); rental = devices × $/device-hour × 1e6 / "
               "(tok/s × 3600). Peer rows are typed from published figures; see their caveats.")
    out.append("")
    out.append("## Throughput and efficiency")
    out.append("")
    out.append(_table(
        ["row", "kind", "devices", "total tok/s", "tok/s per device", "cap kW", "measured kW", "tok/s per kW (cap)",
         "tok/s per kW (measured)", "caveats"],
        [[_md_escape(r["label"]), r["kind"], str(r["devices"]), _cell(r["total_tok_s"], ",.1f"),
          _cell(r["tok_s_per_device"], ",.1f"), _cell(r["cap_kw"], ",.3f"), _cell(r["measured_kw"], ",.3f"),
          _cell(r["tok_s_per_kw_cap"], ",.0f"), _cell(r["tok_s_per_kw_measured"], ",.0f"),
          _md_escape("; ".join(r["caveats"])) or "—"] for r in rows]))
    out.append("")
    out.append("## Cost per million total tokens")
    out.append("")
    out.append(_table(
        ["row", f"electricity $/M tok (cap, {price(kwh)}/kWh)", f"electricity $/M tok (measured, {price(kwh)}/kWh)",
         "rental $/M tok" + (f" ({price(dev_h)}/device-h)" if dev_h is not None else "")],
        [[_md_escape(r["label"]), usd(r["elec_usd_per_mtok_cap"]), usd(r["elec_usd_per_mtok_measured"]),
          usd(r["rental_usd_per_mtok"])] for r in rows]))
    out.append("")
    out.append("## Latency")
    out.append("")
    out.append(_table(
        ["row", "max concurrency", "prompts", "output tok/s", "mean TTFT ms", "median TTFT ms", "mean TPOT ms",
         "median TPOT ms"],
        [[_md_escape(r["label"]), _cell(r["max_concurrency"], ""), _cell(r["num_prompts"], ""),
          _cell(r["output_tok_s"], ",.1f"), _cell(r["mean_ttft_ms"], ",.2f"), _cell(r["median_ttft_ms"], ",.2f"),
          _cell(r["mean_tpot_ms"], ",.2f"), _cell(r["median_tpot_ms"], ",.2f")] for r in rows]))
    out.append("")
    out.append("## Sources")
    out.append("")
    for r in rows:
        extra = ", ".join(x for x in (r.get("hardware"), r.get("model")) if x)
        out.append(f"- **{_md_escape(r['label'])}** ({r['kind']}): {_md_escape(r['source'])}"
                   + (f" — {_md_escape(extra)}" if extra else ""))
    if skipped:
        out.append("")
        out.append("Skipped inputs:")
        out.extend(f"- {_md_escape(s)}" for s in skipped)
    out.append("")
    out.append("## Charts")
    out.append("")
    for name in chart_names:
        out.append(f"![{_CHART_TITLES[name]}]({name}.svg) ([PNG]({name}.png))")
        out.append("")
    left_out = [n for n in CHARTS if n not in chart_names]
    if left_out:
        out.append("Left out (no row has the data): "
                   + "; ".join(f"{_CHART_TITLES[n]} (needs {_CHART_NEEDS[n]})" for n in left_out) + ".")
        out.append("")
    if any(chart_label(r["label"]) != r["label"] for r in rows):
        out.append(f"Chart row labels are wrapped or shortened to {CHART_LABEL_LINES} lines of "
                   f"{CHART_LABEL_WIDTH} characters; the tables above give the full names.")
        out.append("")
    return "\n".join(out)


CHART_LABEL_WIDTH = 24  # characters per line of a chart's row label
CHART_LABEL_LINES = 2  # lines per row label; longer labels are shortened in the middle
_CHART_TITLES = {"tok_s_per_device": "Total tok/s per device", "tok_s_per_kw": "Total tok/s per kW",
                 "usd_per_mtok": "$ per million total tokens", "latency": "TTFT and TPOT"}
_CHART_NEEDS = {"tok_s_per_device": "total tok/s and devices",
                "tok_s_per_kw": "a power cap or a measured draw",
                "usd_per_mtok": "a power cap, a measured draw or a $/device-hour price",
                "latency": "TTFT or TPOT figures"}


def chart_label(label: str, width: int = CHART_LABEL_WIDTH, lines: int = CHART_LABEL_LINES) -> str:
    """A row label that fits a chart axis: at most ``lines`` lines of at most ``width`` characters.

    Wrapped at spaces and hyphens when that fits; otherwise the label keeps its head and its tail around "…" (run
    names often share a long prefix and differ at the end) and is cut into ``width``-character lines.
    """
    import textwrap

    label = " ".join(str(label).split())
    wrapped = textwrap.wrap(label, width, break_long_words=True, break_on_hyphens=True)
    if len(wrapped) <= lines:
        return "\n".join(wrapped)
    keep = width * lines - 1
    short = label[: keep // 2] + "…" + label[len(label) - (keep - keep // 2):]
    wrapped = textwrap.wrap(short, width, break_long_words=True, break_on_hyphens=True)
    if len(wrapped) > lines:
        wrapped = [short[i:i + width] for i in range(0, len(short), width)]
    return "\n".join(wrapped)


def chart_labels(labels: list[str]) -> list[str]:
    """:func:`chart_label` of each label, kept distinct: a label whose short form repeats another's gets its
    row number (``#3``) appended before shortening."""
    short = [chart_label(x) for x in labels]
    return [chart_label(f"{x} #{i + 1}") if short.count(s) > 1 else s for i, (x, s) in enumerate(zip(labels, short))]


def _barh(ax, rows: list[dict], labels: list[str], series: list[tuple[str, str]], title: str, xlabel: str) -> None:
    """Grouped horizontal bars: one group per row, one bar per (key, legend label) with data; peers hatched.
    A row without a value for a series gets no bar; the legend sits outside the axes, right of the data."""
    import numpy as np

    y = np.arange(len(rows))
    h = 0.8 / max(1, len(series))
    for j, (key, name) in enumerate(series):
        vals = [r.get(key) for r in rows]
        bars = ax.barh(y + (j - (len(series) - 1) / 2) * h, [v if v is not None else 0.0 for v in vals],
                       height=h, label=name)
        for b, r, v in zip(bars, rows, vals):
            if r["kind"] == "peer":
                b.set_hatch("//")
            if v is None:
                b.set_visible(False)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=9)
    if len(series) > 1:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)


def chart_panels(rows: list[dict], kwh: float, dev_h: float | None) -> dict[str, list]:
    """Each chart's panels ``(series, title, xlabel)`` keeping only the series that have a value in some row; a
    panel without such series is dropped, and a chart without panels is absent from the result."""
    specs = {
        "tok_s_per_device": [([("tok_s_per_device", "tok/s per device")], "Total tok/s per device", "tokens/s")],
        "tok_s_per_kw": [([("tok_s_per_kw_cap", "at cap"), ("tok_s_per_kw_measured", "at measured draw")],
                          "Total tok/s per kW", "tokens/s per kW")],
        "usd_per_mtok": [([("elec_usd_per_mtok_cap", "at cap"), ("elec_usd_per_mtok_measured", "measured")],
                          f"Electricity $/M tok at {price(kwh)}/kWh", "$ per million tokens"),
                         ([("rental_usd_per_mtok", "rental")],
                          "Rental $/M tok" + (f" at {price(dev_h)}/device-h" if dev_h is not None else ""),
                          "$ per million tokens")],
        "latency": [([("mean_ttft_ms", "mean"), ("median_ttft_ms", "median")], "TTFT", "ms"),
                    ([("mean_tpot_ms", "mean"), ("median_tpot_ms", "median")], "TPOT", "ms")],
    }
    out = {}
    for name, panels in specs.items():
        kept = []
        for series, title, xlabel in panels:
            series = [(k, n) for k, n in series if any(r.get(k) is not None for r in rows)]
            if series:
                kept.append((series, title, xlabel))
        if kept:
            out[name] = kept
    return out


def build_charts(plt, rows: list[dict], kwh: float, dev_h: float | None) -> dict:
    """The matplotlib figures of the charts that have data, by name (see :func:`chart_panels`); row labels
    through :func:`chart_labels`. The caller saves and closes them."""
    labels = chart_labels([r["label"] for r in rows])
    n_lines = max(s.count("\n") + 1 for s in labels)
    height = 1.3 + (0.3 + 0.14 * n_lines) * max(1, len(rows))
    figs = {}
    with plt.rc_context({"text.parse_math": False}):  # "$" is a dollar sign here, not mathtext
        for name, panels in chart_panels(rows, kwh, dev_h).items():
            fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), height), squeeze=False)
            for ax, (series, title, xlabel) in zip(axes[0], panels):
                _barh(ax, rows, labels, series, title, xlabel)
            if any(r["kind"] == "peer" for r in rows):
                fig.text(0.01, 0.005, "hatched: peer figures typed from published sources (see report caveats)",
                         fontsize=7, color="dimgray")
            fig.tight_layout(rect=(0, 0.03, 1, 1))
            figs[name] = fig
    return figs


def write_charts(rows: list[dict], out_dir: str, kwh: float, dev_h: float | None) -> list[str]:
    """Write the charts that have data as SVG and PNG into ``out_dir``; return their base names (in
    :data:`CHARTS` order). Files of a chart left out, from an earlier report in the same folder, are removed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # "$" is a dollar sign here, not mathtext; a fixed hash salt keeps SVG ids stable between runs.
    with plt.rc_context({"svg.hashsalt": "tokenfab-report", "text.parse_math": False}):
        figs = build_charts(plt, rows, kwh, dev_h)
        for name, fig in figs.items():
            fig.savefig(os.path.join(out_dir, f"{name}.svg"), format="svg", metadata={"Date": None})
            fig.savefig(os.path.join(out_dir, f"{name}.png"), format="png", dpi=120)
            plt.close(fig)
    for name in CHARTS:
        if name not in figs:
            for ext in ("svg", "png"):
                stale = os.path.join(out_dir, f"{name}.{ext}")
                if os.path.isfile(stale):
                    os.remove(stale)
    return [n for n in CHARTS if n in figs]


def write_report(inputs: list[str], out_dir: str, peers: str | None = None, kwh_price: float | None = None,
                 device_hour_price: float | None = None) -> str:
    """Build the report from result JSONs (files or directories) and an optional peers TOML; return report.md's path.

    ``kwh_price`` ($/kWh) and ``device_hour_price`` ($/device-hour) override the prices taken from the runs.
    """
    files = _expand(inputs)
    runs, rows, skipped = [], [], []
    for path in files:
        try:
            res = load_run(path)
        except ReportError as e:
            skipped.append(str(e))
            continue
        runs.append(res)
        rows.append(run_row(path, res))
    seen: dict[str, int] = {}
    for r in rows:  # distinct labels for the charts
        seen[r["label"]] = seen.get(r["label"], 0) + 1
    for r in rows:
        if seen[r["label"]] > 1:
            r["label"] = f"{r['label']} [{os.path.splitext(os.path.basename(r['source']))[0]}]"
    if peers:
        rows.extend(load_peers(peers))
    if not rows:
        raise ReportError("tokenfab report: no benchmark result among the inputs"
                          + (f" (skipped: {'; '.join(skipped)})" if skipped else ""))
    kwh, dev_h = _report_prices(runs, kwh_price, device_hour_price)
    for r in rows:
        _priced(r, kwh, dev_h)
    os.makedirs(out_dir, exist_ok=True)
    charts = write_charts(rows, out_dir, kwh, dev_h)
    md = render_markdown(rows, kwh, dev_h, skipped, charts)
    md_path = os.path.join(out_dir, "report.md")
    with open(md_path, "w") as f:
        f.write(md)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump({"usd_per_kwh": kwh, "usd_per_device_hour": dev_h, "rows": rows, "skipped": skipped}, f, indent=2)
    return md_path
