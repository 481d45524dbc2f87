"""The pure-Python pieces of benchmarks/gpu_check.sh on hand-made inputs: the per-batch floor's expected distinct
experts (benchmarks/decode_floor.py), the profile aggregation (benchmarks/decode_profile.py) and the summary table
(benchmarks/gpu_summary.py), whose numbers come from a GPU only there."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


# ---- the floor's expert count, the profile and the summary -------------------------------------------------------
def test_expected_distinct_experts():
    from benchmarks.decode_floor import experts_hit
    assert experts_hit(128, 8, 1) == 8
    assert experts_hit(128, 8, 16) == pytest.approx(128 * (1 - (120 / 128) ** 16))
    assert 127 < experts_hit(128, 8, 256) <= 128
    assert experts_hit(0, 0, 4) == 0


def test_kv_pool_holds_the_largest_batch():
    """The engine's default pool (at most 2 GiB) holds 18,724 tokens of the Llama-3.2-3B shape (114,688 bytes a
    token): 64 sequences of 1,113 tokens need 64 x 70 blocks of 16; a small model keeps the default."""
    from benchmarks.decode_floor import kv_blocks_for_batch
    per_token = 28 * 2 * 8 * 128 * 2
    assert kv_blocks_for_batch(per_token, 64, 1113, 64, 16) == 64 * 70
    assert kv_blocks_for_batch(per_token, 64, 1113, 16, 16) is None  # 16 x 1,113 tokens fit in 18,724
    assert kv_blocks_for_batch(6 * 576 * 2, 64, 558, 64, 16) is None
    assert kv_blocks_for_batch(0, 64, 1113, 64, 16) is None


def test_profile_aggregation():
    from benchmarks.decode_profile import summarize_events
    ev = [("ampere_bf16_gemm", 300.0, 8), ("triton_rms_norm", 40.0, 16), ("ampere_bf16_gemm", 100.0, 4),
          ("_fused_moe_kernel", 60.0, 2)]
    p = summarize_events(ev, steps=2, num_layers=4, top=2)
    assert p["device_ms_per_step"] == pytest.approx(0.25) and p["device_ms_per_layer"] == pytest.approx(0.0625)
    assert p["launches_per_step"] == 15 and p["launches_per_layer"] == pytest.approx(3.75)
    assert [t["name"] for t in p["top"]] == ["ampere_bf16_gemm", "_fused_moe_kernel"]
    assert p["top"][0]["ms_per_step"] == pytest.approx(0.2) and p["top"][0]["share"] == pytest.approx(0.8)
    assert p["by_kind"]["gemm"]["launches_per_step"] == 6 and p["by_kind"]["moe"]["ms_per_step"] == \
        pytest.approx(0.03)
    with pytest.raises(ValueError):
        summarize_events(ev, steps=0, num_layers=4)


def test_profile_event_selection():
    """On CUDA the device events (kernels, memcpy) with their own span; on CPU the leaf aten ops with their self
    CPU time (an op that calls another aten op is not counted)."""
    from types import SimpleNamespace as NS

    from benchmarks.decode_profile import _device_events

    def ev(name, dev, us=0.0, children=(), self_cpu=0.0):
        return NS(name=name, device_type=f"DeviceType.{dev}", time_range=NS(elapsed_us=lambda: us),
                  cpu_children=list(children), self_cpu_time_total=self_cpu)
    mm = ev("aten::mm", "CPU", self_cpu=7.0)
    linear = ev("aten::linear", "CPU", children=[mm], self_cpu=2.0)
    prof = NS(events=lambda: [linear, mm, ev("cudaLaunchKernel", "CPU", self_cpu=3.0),
                              ev("nvjet_gemm", "CUDA", 40.0), ev("Memcpy HtoD", "CUDA", 2.0)])
    assert _device_events(prof, cuda=True) == [("nvjet_gemm", 40.0, 1), ("Memcpy HtoD", 2.0, 1)]
    assert _device_events(prof, cuda=False) == [("aten::mm", 7.0, 1)]


def _result(label, rows, **kw):
    return dict({"date": "2026-12-05T10:00:00", "label": label, "gpu": "NVIDIA H200", "copy_bandwidth_GBps": 3950.0,
                 "decode_graphs": True, "rows": rows, "complete": True, "profile": None}, **kw)


def test_summary_table_from_hand_made_results(tmp_path, capsys):
    from benchmarks.gpu_summary import main
    rows = [{"batch": 1, "mode": "graphs", "step_ms": 5.0, "floor_ms": 2.0},
            {"batch": 1, "mode": "eager", "step_ms": 25.0, "floor_ms": 2.1},
            {"batch": 16, "mode": "graphs", "step_ms": 8.0, "floor_ms": 2.5},
            {"batch": 64, "running": 17, "mode": "graphs", "step_ms": 8.1, "floor_ms": 2.6},
            {"batch": 1, "mode": "graphs-sync", "step_ms": 5.6, "floor_ms": 2.0, "overhead_ms": 1.1}]
    rows[0]["overhead_ms"] = 0.4
    prof = {"device_ms_per_step": 4.0, "device_ms_per_layer": 0.5, "wall_ms_per_step": 28.0, "launches_per_layer": 31.5,
            "counted": "CUDA kernels",
            "top": [{"name": "gemm_a", "ms_per_step": 1.9}, {"name": "rms", "ms_per_step": 0.3}]}
    json.dump(_result("llama3b", rows, profile=prof), open(tmp_path / "2026-12-05-llama3b-decode-floor.json", "w"))
    old = _result("llama3b", [{"batch": 1, "step_ms": 99.0, "floor_ms": 1.0}], date="2026-12-04T10:00:00")
    json.dump(old, open(tmp_path / "2026-12-04-llama3b-decode-floor.json", "w"))  # older: not shown
    legacy = _result("embedded", [{"batch": 1, "step_ms": 2.0, "floor_ms": 0.5}], complete=False,
                     graphs_error="RuntimeError: capture failed", profile_error="RuntimeError: no CUPTI")
    json.dump(legacy, open(tmp_path / "2026-12-05-embedded-decode-floor.json", "w"))
    (tmp_path / "failed").write_text("decode_floor dsv3 FAILED rc=124\n")
    assert main([str(tmp_path), "--expect", "llama3b,dsv3", "--failed", str(tmp_path / "failed"),
                 "--out", str(tmp_path / "s.md")]) == 0
    text = capsys.readouterr().out
    assert text == (tmp_path / "s.md").read_text()
    assert "| llama3b | 1 | 5.00 | 25.00 | 2.000 | 2.50x | 12.50x | 5.00x |" in text
    assert "| llama3b | 16 | 8.00 | — | 2.500 | 3.20x | — | — |" in text
    assert "| llama3b | 64 (only 17 ran) | 8.10 |" in text
    assert "| dsv3 | — | no result" in text
    assert "| embedded | 1 | 2.00 | — | 0.500 | 4.00x | — | — |" in text
    assert "| embedded | … | incomplete" in text
    assert "(0.500 ms and 31.5 launches per layer" in text and "gemm_a 1.900 ms" in text and "capture failed" in text
    assert "embedded: profile failed: RuntimeError: no CUPTI" in text
    assert "Failed steps (1): decode_floor dsv3 FAILED rc=124" in text
    assert "99.00" not in text
    assert "- llama3b: async scheduling vs in step: batch 1 5.00 vs 5.60 ms (overhead 0.40 vs 1.10 ms)" in text
    assert main([str(tmp_path / "nope")]) == 2


def test_serve_check_cells_variants_and_rows():
    """benchmarks/serve_check.py: cells and variants parsed (bad ones refused by name; a speculative_config JSON kept
    whole), and a bench result's vLLM keys land in the row and its table line (percent acceptance, summed watts,
    the graph steps when the server counted them)."""
    from benchmarks.serve_check import markdown, parse_cells, parse_variant, row_of
    assert parse_cells("1024/128x1, 8192/1024x16") == [(1024, 128, 1), (8192, 1024, 16)]
    for bad in ("1024x16", "1024/128", "0/8x1", "a/bx1"):
        with pytest.raises(ValueError, match="cell"):
            parse_cells(bad)
    js = '{"method": "dspark", "model": "/m d", "num_speculative_tokens": 3}'
    assert parse_variant("dspark=" + js, spec=True) == ("dspark", ["--speculative-config", js])
    assert parse_variant("eager=--enforce-eager --max-num-batched-tokens 512") == (
        "eager", ["--enforce-eager", "--max-num-batched-tokens", "512"])
    assert parse_variant("plain") == ("plain", [])
    with pytest.raises(ValueError, match="no name"):
        parse_variant("=--enforce-eager")
    res = {"completed": 16, "total_token_throughput": 9000.0, "output_throughput": 1000.0, "median_ttft_ms": 250.0,
           "median_tpot_ms": 12.5, "median_itl_ms": 12.0, "spec_decode_acceptance_rate": 40.0,
           "spec_decode_acceptance_length": 2.2,
           "power": {"measured": True, "whole_run": {"avg_w_per_device": [600.0, 100.0], "total_tokens_per_j": 12.9}}}
    row = row_of("dspark", (1024, 128, 16), res)
    assert (row["total_tok_s"], row["acceptance_rate"], row["acceptance_length"], row["avg_w"]) == (
        9000.0, 40.0, 2.2, 700.0)
    meta = {"label": "x", "date": "d", "model": "m", "serve_command": "s", "commit": "c"}
    assert markdown(meta, [row])[-1] == ("| dspark | 1024 / 128 | 16 | 16 | 9000.0 | 1000.0 | 250.0 | 12.50 | 12.00 | "
                                         "40.0 / 2.20 | — | 700 | 12.90 |")
    row["graph_steps"] = {"decode": 12.0, "verify": 40.0, "draft": 38.0}  # the server's graph-step counters
    assert "| 40.0 / 2.20 | 12 / 40 / 38 | 700 |" in markdown(meta, [row])[-1]


def test_gpu_gguf_files_load_packed_with_their_types(tmp_path):
    """benchmarks/gpu_gguf.py (the GGUF GPU check's files) at test sizes: tokenfab's GGUF loader keeps every linear
    and the embedding packed in the case's block types, at the case's shapes, with finite small weights."""
    import numpy as np
    from benchmarks import gpu_gguf
    from tokenfab.loader.gguf_packed import iterate_gguf_weights
    from tokenfab.quant.gguf_weight import GGUFWeight
    for case in gpu_gguf.CASES:
        path = gpu_gguf.write_case(str(tmp_path), case, tiny=True)
        packed = {n: v for n, v in iterate_gguf_weights(path, progress=False) if isinstance(v, GGUFWeight)}
        c = dict(gpu_gguf.CASES[case], **gpu_gguf.TINY)
        assert len(packed) == 7 * c["layers"] + 1
        emb = packed["model.embed_tokens.weight"]
        assert emb.block.name == c["types"]["token_embd"] and (emb.out_features, emb.in_features) == (c["vocab"],
                                                                                                      c["hidden"])
        down = packed["model.layers.1.mlp.down_proj.weight"]
        assert down.block.name == c["types"]["ffn_down"] and (down.out_features, down.in_features) == (c["hidden"],
                                                                                                       c["inter"])
        w = down.dequantize_rows(0, down.out_features)
        assert np.isfinite(w.numpy()).all() and 1e-4 < w.abs().mean() < 1.0
