"""``tokenfab report`` on two saved runs (+ the example peers file): valid SVG/PNG, Markdown numbers match the JSON."""
from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET

import pytest

from tokenfab.cli import main
from tokenfab.cost.report import CHARTS, write_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN_A = {
    "label": "tokenfab tp6 cap800",
    "model_id": "tiny-moe",
    "total_token_throughput": 5661.0,
    "output_throughput": 2830.5,
    "mean_ttft_ms": 123.45,
    "median_ttft_ms": 110.0,
    "mean_tpot_ms": 21.5,
    "median_tpot_ms": 20.25,
    "num_prompts": 200,
    "max_concurrency": 64,
    "num_devices": 6,
    "power": {"measured": True, "cap_total_kw": 4.8, "whole_run": {"total_kw": 4.3}, "steady": {"total_kw": 4.18}},
    "cost": {"cap_kw": 4.8, "measured_kw": 4.18,
             "electricity": [{"usd_per_kwh": 0.10}], "rental": [{"usd_per_device_hour": 2.95}]},
}
RUN_B = {  # no power measured, no cap: per-kW and electricity cells are "—"
    "model_id": "tiny-dense",
    "total_token_throughput": 2400.0,
    "output_throughput": 1200.0,
    "mean_ttft_ms": 80.0,
    "median_ttft_ms": 75.5,
    "mean_tpot_ms": 15.0,
    "median_tpot_ms": 14.0,
    "num_prompts": 100,
    "max_concurrency": 16,
    "num_devices": 4,
}


def _tables(md: str) -> dict[str, list[dict[str, str]]]:
    """Markdown tables by section heading: list of {header: cell}."""
    out, section, header = {}, None, None
    for line in md.splitlines():
        if line.startswith("## "):
            section, header = line[3:], None
        elif line.startswith("| ") and section:
            cells = [c.strip() for c in line.strip()[2:-2].split(" | ")]
            if header is None:
                header = cells
                out[section] = []
            elif not set(cells) <= {"---", "---:"}:
                out[section].append(dict(zip(header, cells)))
    return out


@pytest.fixture
def runs(tmp_path):
    d = tmp_path / "runs"
    d.mkdir()
    (d / "a.json").write_text(json.dumps(RUN_A))
    (d / "b.json").write_text(json.dumps(RUN_B))
    (d / "notes.json").write_text(json.dumps({"hello": 1}))  # not a result: listed as skipped
    return d


def test_report_two_runs(runs, tmp_path):
    out = tmp_path / "out"
    md_path = write_report([str(runs)], str(out), None)
    assert md_path == str(out / "report.md")
    for name in CHARTS:
        png = (out / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n", name
        root = ET.parse(out / f"{name}.svg").getroot()
        assert root.tag.endswith("svg"), name
    md = open(md_path).read()
    t = _tables(md)
    eff = {r["row"]: r for r in t["Throughput and efficiency"]}
    a, b = eff["tokenfab tp6 cap800"], eff["tiny-dense"]
    assert a["devices"] == "6" and a["total tok/s"] == "5,661.0"
    assert a["tok/s per device"] == "943.5"                       # 5661 / 6
    assert a["cap kW"] == "4.800" and a["measured kW"] == "4.180"
    assert a["tok/s per kW (cap)"] == "1,179"                      # 5661 / 4.8
    assert a["tok/s per kW (measured)"] == "1,354"                 # 5661 / 4.18 = 1354.3
    assert b["total tok/s"] == "2,400.0" and b["tok/s per device"] == "600.0"
    assert b["tok/s per kW (cap)"] == "—" and b["measured kW"] == "—"
    cost = {r["row"]: r for r in t["Cost per million total tokens"]}
    assert cost["tokenfab tp6 cap800"]["electricity $/M tok (cap, $0.10/kWh)"] == "$0.024"
    assert cost["tokenfab tp6 cap800"]["rental $/M tok ($2.95/device-h)"] == "$0.87"
    # run B at the report's $2.95/device-h: 4 x 2.95 x 1e6 / (2400 x 3600) = 11.8e6 / 8.64e6 = 1.366 -> $1.37
    assert cost["tiny-dense"]["rental $/M tok ($2.95/device-h)"] == "$1.37"
    assert cost["tiny-dense"]["electricity $/M tok (cap, $0.10/kWh)"] == "—"
    lat = {r["row"]: r for r in t["Latency"]}
    assert lat["tokenfab tp6 cap800"]["mean TTFT ms"] == "123.45"
    assert lat["tokenfab tp6 cap800"]["median TPOT ms"] == "20.25"
    assert lat["tiny-dense"]["median TTFT ms"] == "75.50" and lat["tiny-dense"]["max concurrency"] == "16"
    assert "notes.json" in md and "Skipped" in md
    for name in CHARTS:
        assert f"({name}.svg)" in md
    rows = json.load(open(out / "report.json"))["rows"]
    assert rows[0]["tok_s_per_kw_measured"] == pytest.approx(5661 / 4.18)


def test_report_with_example_peers_via_cli(runs, tmp_path, capsys):
    out = tmp_path / "out2"
    peers = os.path.join(REPO, "benchmarks", "peers.example.toml")
    rc = main(["report", str(runs / "a.json"), str(runs / "b.json"), "--peers", peers, "--out", str(out)])
    assert rc == 0 and "report.md" in capsys.readouterr().out
    t = _tables((out / "report.md").read_text())
    eff = {r["row"]: r for r in t["Throughput and efficiency"]}
    peer_a = eff["Example engine A, 8 GPUs (example)"]
    assert peer_a["kind"] == "peer" and peer_a["tok/s per device"] == "1,250.0"    # 10000 / 8
    assert peer_a["tok/s per kW (cap)"] == "1,786"                                 # 10000 / 5.6 = 1785.7
    assert "example figure" in peer_a["caveats"] and "cap unstated" not in peer_a["caveats"]
    peer_b = eff["Example engine B, 4 GPUs (example)"]
    assert "cap unstated" in peer_b["caveats"] and "temperature unstated" in peer_b["caveats"]
    for name in CHARTS:
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_report_errors(tmp_path, capsys):
    rc = main(["report", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o")])
    assert rc == 2 and "nope.json" in capsys.readouterr().err
    bad = tmp_path / "peers.toml"
    bad.write_text('[[peer]]\nlabel = "x"\ndevices = 1\n')
    good = tmp_path / "r.json"
    good.write_text(json.dumps(RUN_B))
    rc = main(["report", str(good), "--peers", str(bad), "--out", str(tmp_path / "o")])
    assert rc == 2 and "lacks source" in capsys.readouterr().err


LONG_PREFIX = "tokenfab-deepseek-v3-tp6-ep6-bf16-cap800W-in8192-out1024-temperature-1.0-"  # 73 chars


def _long_runs(tmp_path, n=3):
    d = tmp_path / "long"
    d.mkdir()
    names = []
    for i in range(n):
        run = json.loads(json.dumps(RUN_A if i % 2 == 0 else RUN_B))
        run["label"] = f"{LONG_PREFIX}run-{i:03d}"  # 80 characters, differing only at the end
        run["total_token_throughput"] = 1000.0 * (i + 1)
        names.append(run["label"])
        (d / f"{i}.json").write_text(json.dumps(run))
    return d, names


def test_long_run_names_stay_readable(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tokenfab.cost.report import build_charts

    d, names = _long_runs(tmp_path)
    assert all(len(x) == 80 for x in names)
    out = tmp_path / "out"
    md = open(write_report([str(d)], str(out), None)).read()
    for name in CHARTS:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "full names" in md and all(x in md for x in names)  # the tables keep the full names
    rep = json.load(open(out / "report.json"))
    figs = build_charts(plt, rep["rows"], rep["usd_per_kwh"], rep["usd_per_device_hour"])
    assert set(figs) == set(CHARTS)
    for name, fig in figs.items():
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        fig_box = fig.bbox
        for ax in fig.axes:
            ticks = [t.get_text() for t in ax.get_yticklabels()]
            assert len(set(ticks)) == len(names), (name, ticks)  # still distinct
            for i, t in enumerate(ticks):
                lines = t.split("\n")
                assert len(lines) <= 2 and max(map(len, lines)) <= 24, (name, t)
                assert f"run-{i:03d}" in t.replace("\n", "")  # the distinguishing end survives
            for lab in ax.get_yticklabels():  # not clipped at the figure's edge
                bb = lab.get_window_extent(renderer)
                assert bb.x0 >= fig_box.x0 - 1 and bb.x1 <= fig_box.x1 + 1, (name, lab.get_text())
            legend = ax.get_legend()
            if legend is not None:  # outside the data area, inside the figure
                lb, ab = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
                assert lb.x0 >= ab.x1 and lb.x1 <= fig_box.x1 + 1, name
        plt.close(fig)


def test_chart_without_data_is_left_out(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tokenfab.cost.report import build_charts

    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "a.json").write_text(json.dumps(RUN_A))
    (runs / "b.json").write_text(json.dumps(RUN_B))
    out = tmp_path / "out"
    write_report([str(runs)], str(out), None)
    assert (out / "tok_s_per_kw.svg").is_file()  # with power data it is drawn
    # RUN_B alone: no cap, no measured draw, no $/device-hour: no per-kW and no $/M tok chart
    md = open(write_report([str(runs / "b.json")], str(out), None)).read()
    for name in ("tok_s_per_kw", "usd_per_mtok"):
        assert not (out / f"{name}.svg").exists() and not (out / f"{name}.png").exists(), name  # stale removed
        assert f"{name}.svg" not in md and f"{name}.png" not in md
    for name in ("tok_s_per_device", "latency"):
        assert (out / f"{name}.svg").is_file() and f"({name}.svg)" in md
    assert "Left out" in md and "tok/s per kW (needs a power cap or a measured draw)" in md
    # with a rental price the cost chart comes back with only its rental panel; a cap alone gives one series
    capped = dict(RUN_B, power={"cap_total_kw": 2.0})
    rows = json.load(open(write_report([str(runs / "b.json")], str(out), None, device_hour_price=2.0)
                          .replace("report.md", "report.json")))["rows"]
    figs = build_charts(plt, rows, 0.1, 2.0)
    assert [ax.get_title() for ax in figs["usd_per_mtok"].axes] == ["Rental $/M tok at $2.00/device-h"]
    (runs / "c.json").write_text(json.dumps(capped))
    rep = json.load(open(write_report([str(runs / "c.json")], str(out), None).replace("report.md", "report.json")))
    figs2 = build_charts(plt, rep["rows"], rep["usd_per_kwh"], rep["usd_per_device_hour"])
    ax = figs2["tok_s_per_kw"].axes[0]
    assert ax.get_legend() is None and len(ax.patches) == 1  # only the "at cap" bar, no empty series
    for f in list(figs.values()) + list(figs2.values()):
        plt.close(f)
