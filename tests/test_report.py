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
