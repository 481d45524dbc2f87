"""The peer benchmark's pure report helpers (benchmarks/peers/peer_report.py) and the harness's argument parsing
(benchmarks/peers/run_peers.py) on hand-made numbers; no peers needed."""
from __future__ import annotations

import importlib.util
import math
import os
import types

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "peers", "run_peers.py")


@pytest.fixture(scope="module")
def rp():
    """The report helpers and the harness's names in one namespace (loading the harness puts its folder on
    sys.path, so peer_report imports from there)."""
    spec = importlib.util.spec_from_file_location("run_peers", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import peer_report
    return types.SimpleNamespace(**{**vars(peer_report), **vars(mod)})


def _rec(engine, client, total, output, ttft, tpot, conc=4, model="deepseek_v3", workload="256x64", error=None):
    metrics = None if total is None else {"total_tok_s": total, "output_tok_s": output, "median_ttft_ms": ttft,
                                          "median_tpot_ms": tpot, "completed": 32, "failed": 0}
    return {"model": model, "workload": workload, "concurrency": conc, "engine": engine, "client": client,
            "metrics": metrics, "error": error}


def test_parse_workload(rp):
    assert rp.parse_workload("256x64") == (256, 64)
    assert rp.parse_workload("1024X128") == (1024, 128)
    for bad in ("256", "ax64", "0x5", "1x2x3"):
        with pytest.raises(ValueError):
            rp.parse_workload(bad)


def test_summarize_bench_reads_vllm_keys(rp):
    res = {"completed": 30, "errors": ["", "boom", None, "x"], "total_token_throughput": 1234.5,
           "output_throughput": 200.0, "median_ttft_ms": 50.0, "median_tpot_ms": 8.0, "mean_ttft_ms": 55.0,
           "duration": 10.0, "total_input_tokens": 7680, "total_output_tokens": 1920}
    s = rp.summarize_bench(res)
    assert s["total_tok_s"] == 1234.5 and s["output_tok_s"] == 200.0
    assert s["median_ttft_ms"] == 50.0 and s["median_tpot_ms"] == 8.0
    assert s["completed"] == 30 and s["failed"] == 2  # counted from errors when "failed" is absent
    assert rp.summarize_bench({"completed": 1, "failed": 3})["failed"] == 3
    assert rp.summarize_bench({"total_token_throughput": float("nan")})["total_tok_s"] is None


def test_ratio_and_format(rp):
    assert rp.ratio(300, 100) == 3.0
    assert rp.ratio(None, 100) is None and rp.ratio(1, 0) is None and rp.ratio(1, float("inf")) is None
    assert rp.fmt(1234.567) == "1,234.6" and rp.fmt(None) == "—" and rp.fmt(2.5, 0) == "2"
    assert rp.fmt_ratio(1.2345) == "1.23×" and rp.fmt_ratio(None) == "—"


def test_ratio_rows_pair_same_cell_and_client(rp):
    recs = [
        _rec("tokenfab", "tokenfab", 1000, 200, 50, 10),
        _rec("tokenfab", "vllm", 900, 180, 60, 11),
        _rec("vllm", "tokenfab", 500, 100, 100, 5),
        _rec("vllm", "vllm", 450, 90, 120, 5.5),
        _rec("llamacpp", "tokenfab", 2000, 400, 25, 20),
        _rec("llamacpp", "tokenfab", 1, 1, 1, 1, conc=1),      # no tokenfab cell at conc 1: no ratio
        _rec("transformers", "offline", 250, 50, 200, 40, conc=4),
        _rec("llamacpp", "vllm", None, None, None, None, error="server died"),
    ]
    rows = {(r["peer"], r["client"], r["concurrency"]): r for r in rp.ratio_rows(recs)}
    assert set(rows) == {("vllm", "tokenfab", 4), ("vllm", "vllm", 4), ("llamacpp", "tokenfab", 4),
                         ("transformers", "offline", 4)}
    v = rows[("vllm", "tokenfab", 4)]
    assert v["total_tok_s"] == 2.0 and v["output_tok_s"] == 2.0
    assert v["median_ttft_ms"] == 0.5 and v["median_tpot_ms"] == 2.0
    vv = rows[("vllm", "vllm", 4)]
    assert vv["total_tok_s"] == pytest.approx(2.0) and vv["median_ttft_ms"] == pytest.approx(0.5)
    assert rows[("llamacpp", "tokenfab", 4)]["total_tok_s"] == 0.5
    # the offline row is compared with tokenfab measured by the tokenfab client at concurrency = batch size
    t = rows[("transformers", "offline", 4)]
    assert t["total_tok_s"] == 4.0 and t["median_tpot_ms"] == 0.25


def test_geomean_and_summary(rp):
    assert rp.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert rp.geomean([None, 0.0]) is None
    recs = [_rec("tokenfab", "tokenfab", 100, 10, 10, 10, conc=c) for c in (1, 4)]
    recs += [_rec("vllm", "tokenfab", 50, 5, 10, 10, conc=1), _rec("vllm", "tokenfab", 200, 5, 10, 10, conc=4)]
    lines = rp.summary_lines(recs)
    assert len(lines) == 1 and "1.00×" in lines[0] and "2 cell(s)" in lines[0]
    assert math.isclose(rp.geomean([r["total_tok_s"] for r in rp.ratio_rows(recs)]), 1.0)


def test_markdown_tables(rp):
    recs = [_rec("vllm", "tokenfab", 500, 100, 100, 5), _rec("tokenfab", "tokenfab", 1000, 200, 50, 10),
            _rec("transformers", "offline", 250, 50, 200, 40, conc=16, workload="1024x128"),
            _rec("llamacpp", "tokenfab", None, None, None, None, error="server start failed: boom")]
    lines = rp.results_table(recs)
    assert lines[0].startswith("| model |") and len(lines) == 2 + len(recs)
    assert "| tokenfab | tokenfab | 1,000.0 | 200.0 | 50.0 | 10.0 | 32/0 |" in lines[2]  # tokenfab sorts first
    assert any("batch 16" in l and "1024/128" in l for l in lines)
    assert any("error: server start failed: boom" in l for l in lines)
    rl = rp.ratios_table(recs)
    assert len(rl) == 3 and "| 2.00× | 2.00× | 0.50× | 2.00× |" in rl[2]
    md = rp.render_markdown({"title": "T", "label": "smoke", "records": recs, "machine": {"cpu_model": "X"},
                             "versions": {"a": "1"}, "commands": {"run": "python run_peers.py"}})
    assert md.startswith("# T") and "smoke" in md and "python run_peers.py" in md and "## Failures" in md


def test_parse_args_smoke_defaults(rp):
    a = rp.parse_args(["--smoke", "--skip-vllm"])
    assert a.num_prompts == 8 and a.workload_list == ["64x16"] and a.conc_list == [4]
    assert a.model_list == ["deepseek_v3"] and a.label == "smoke"
    assert "vllm" not in a.engine_list and "vllm" not in a.client_list
    b = rp.parse_args(["--concurrency", "1,4,16", "--hf-batch", "all"])
    assert b.hf_batches == [1, 4, 16] and b.vllm_client_conc == {4}
    with pytest.raises(SystemExit):
        rp.parse_args(["--workloads", "2000x100"])
    c = rp.parse_args(["--workloads", "8192x1024", "--max-model-len", "9216", "--drift"])
    assert c.max_model_len == 9216 and c.drift and c.workload_list == ["8192x1024"]


def test_results_never_overwrite_an_earlier_run(tmp_path, rp):
    """A second run with the same date and label gets a time suffix; the first run's files stay as they were, and
    a name no file uses is kept as is (benchmarks/results_file.py, used by run_peers and the benchmarks)."""
    from benchmarks.results_file import unused_stem, write_markdown
    stem = str(tmp_path / "2026-12-01-x-peers")
    assert unused_stem(stem) == stem
    (tmp_path / "2026-12-01-x-peers.json").write_text("{}")
    other = unused_stem(stem)
    assert other != stem and other.startswith(stem + "-") and len(other) == len(stem) + 7
    first = write_markdown(str(tmp_path), "r.md", ["first"])
    second = write_markdown(str(tmp_path), "r.md", ["second"])
    assert first != second and open(first).read() == "first\n" and open(second).read() == "second\n"


def test_drift_and_pivot(rp):
    """A re-measured first cell gives end / start per engine and stays out of the grid's tables; the pivot table
    holds one row per cell with each engine's tok/s, TPOT and TTFT."""
    recs = [_rec("tokenfab", "tokenfab", 1000, 200, 50, 10), _rec("vllm", "tokenfab", 500, 100, 100, 5),
            dict(_rec("tokenfab", "tokenfab", 900, 180, 60, 10), repeat=True),
            dict(_rec("vllm", "tokenfab", 500, 100, 110, 5), repeat=True)]
    d = {r["engine"]: r for r in rp.drift_rows(recs)}
    assert d["tokenfab"]["total_tok_s"] == pytest.approx(0.9) and d["tokenfab"]["median_ttft_ms"] == 1.2
    assert d["vllm"]["total_tok_s"] == 1.0 and d["vllm"]["median_ttft_ms"] == pytest.approx(1.1)
    assert len(rp.ratio_rows(rp.measured(recs))) == 1
    pv = rp.pivot_table(recs)
    assert len(pv) == 3 and "| 1,000, 10.0 ms, 50 ms | 500, 5.0 ms, 100 ms |" in pv[2]
    md = rp.render_markdown({"title": "T", "records": recs})
    assert "## Drift" in md and "| 0.90× | 1.20× |" in md and md.count("| 2.00× |") >= 1
