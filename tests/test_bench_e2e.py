"""``bench serve`` (tokenfab's benchmark client) against tokenfab's own live server, and a ``tokenfab demo`` smoke run."""
from __future__ import annotations

import json
import os

import pytest

from server_fixtures import SERVED_NAME, server_model_dir, start_test_server  # noqa: F401


@pytest.fixture(scope="module")
def server(server_model_dir):  # noqa: F811
    h = start_test_server(server_model_dir, max_model_len=256, max_num_seqs=4)
    yield h
    h.stop()


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_bench_serve_against_live_server(server, server_model_dir, tmp_path, backend):  # noqa: F811
    from tokenfab.bench.serve import make_args, run_bench_serve

    args = make_args(base_url=server.base_url, model=server_model_dir, served_model_name=SERVED_NAME,
                     backend=backend, num_prompts=5, random_input_len=24, random_output_len=7, max_concurrency=3,
                     ignore_eos=True, temperature=0.0, save_result=True, result_dir=str(tmp_path),
                     result_filename="r.json", disable_tqdm=True, power="none", save_detailed=True)
    res = run_bench_serve(args)
    with open(tmp_path / "r.json") as f:
        saved = json.load(f)
    for key in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_tpot_ms", "p99_itl_ms",
                "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"):
        assert key in saved, key
    assert saved["completed"] == 5 and saved["failed"] == 0, saved["errors"]
    assert saved["output_lens"] == [7] * 5  # server usage: ignore_eos gives exactly max_tokens
    assert saved["total_output_tokens"] == 35 == res["total_output_tokens"]
    assert saved["total_input_tokens"] == sum(saved["input_lens"])
    if backend == "openai":  # the server counts the prompt as the client built it (+ BOS, if the tokenizer adds one)
        assert all(24 <= n <= 25 for n in saved["input_lens"]), saved["input_lens"]
    else:  # chat adds the template's tokens
        assert all(n > 24 for n in saved["input_lens"])
    assert all(t > 0 for t in saved["ttfts"]) and all(len(i) <= 6 for i in saved["itls"])
    assert all(saved["generated_texts"])


def test_demo_smoke(server_model_dir, tmp_path):  # noqa: F811
    from tokenfab.cli import main

    out = tmp_path / "run"
    rc = main(["demo", "--model", server_model_dir, "--num-prompts", "4", "--input-len", "32", "--output-len", "8",
               "--max-concurrency", "2", "--out", str(out), "--disable-tqdm", "--dtype", "float32",
               "--device", "cpu", "--no-report"])
    assert rc == 0
    files = set(os.listdir(out))
    assert {"config.json", "environment.json", "summary.md", "server.log", "result-temperature-0.json",
            "result-temperature-1.json"} <= files, files
    env = json.load(open(out / "environment.json"))
    assert {"python", "torch", "transformers", "cpu_model", "cpu_count"} <= set(env)
    cfg = json.load(open(out / "config.json"))
    assert cfg["num_prompts"] == 4 and cfg["temperatures"] == [0.0, 1.0] and cfg["wall_time_s"] > 0
    for t in ("0", "1"):
        r = json.load(open(out / f"result-temperature-{t}.json"))
        assert r["completed"] == 4 and r["total_output_tokens"] == 32 and r["temperature"] == float(t)
    md = (out / "summary.md").read_text()
    assert "temperature 0" in md and "temperature 1" in md and "Output token throughput" in md
