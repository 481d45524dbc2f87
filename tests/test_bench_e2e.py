"""``bench serve`` (tokenfab's benchmark client) against tokenfab's own live server, and a ``tokenfab demo`` smoke run."""
from __future__ import annotations

import json
import os

import pytest

from server_fixtures import SERVED_NAME, metric_value, server_model_dir, start_test_server  # noqa: F401


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


def _finished(server) -> tuple[float, float, float]:
    """(finished requests, their generated tokens, requests running or waiting) from the server's /metrics."""
    import httpx

    text = httpx.get(server.base_url + "/metrics", timeout=30.0, trust_env=False).text

    def value(name):  # a labelled histogram has no sample before its first request
        try:
            return metric_value(text, name)
        except KeyError:
            return 0.0
    busy = value("vllm:num_requests_running") + value("vllm:num_requests_waiting")
    return value("vllm:request_generation_tokens_count"), value("vllm:request_generation_tokens_sum"), busy


def _settled(server, want_count: float | None = None) -> tuple[float, float]:
    """The finished-request counters once the server is idle (and, given ``want_count``, has counted that many
    finished requests: they are observed on the engine thread a moment after the client read the stream's end);
    gives up waiting after 10 s and returns what it has."""
    import time

    deadline = time.monotonic() + 10.0
    count, tokens, busy = _finished(server)
    while (busy or (want_count is not None and count < want_count)) and time.monotonic() < deadline:
        time.sleep(0.05)
        count, tokens, busy = _finished(server)
    return count, tokens


@pytest.mark.parametrize("backend", ["vllm", "openai", "openai-chat"])
def test_pasted_vllm_command_against_live_server(server, server_model_dir, tmp_path, backend):  # noqa: F811
    """No --model and no --tokenizer (the server's /v1/models root is the tokenizer), warm-ups sent but not
    counted, --label / --metadata / --goodput in the saved JSON."""
    from tokenfab.bench.serve import build_parser, run_bench_serve

    n, warm, out_len = 3, 2, 4
    count0, tokens0 = _settled(server)
    args = build_parser().parse_args([
        "--base-url", server.base_url, "--backend", backend, "--dataset-name", "random", "--num-prompts", str(n),
        "--random-input-len", "16", "--random-output-len", str(out_len), "--num-warmups", str(warm),
        "--max-concurrency", "2", "--temperature", "0", "--label", f"e2e-{backend}", "--metadata", "case=e2e",
        "--goodput", "ttft:60000", "e2el:60000", "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
        "--disable-tqdm", "--power", "none"])
    res = run_bench_serve(args)
    # The server finished the warm-ups too (ignore_eos is on for the random dataset, as in vLLM) ...
    count1, tokens1 = _settled(server, count0 + n + warm)
    assert (count1 - count0, tokens1 - tokens0) == (n + warm, (n + warm) * out_len)
    # ... but the result counts only the measured requests.
    assert res["completed"] == n and res["failed"] == 0, res["errors"]
    assert res["output_lens"] == [out_len] * n and res["total_output_tokens"] == n * out_len
    assert len(res["ttfts"]) == len(res["itls"]) == len(res["start_times"]) == n
    # One gap per later non-empty text chunk (a chunk may carry several tokens when bytes wait for a character).
    assert all(t > 0 for t in res["ttfts"]) and all(len(i) <= out_len - 1 for i in res["itls"]) and any(res["itls"])
    assert res["mean_tpot_ms"] > 0 and res["mean_itl_ms"] > 0        # timed on the streamed text / chat deltas
    assert res["tokenizer_id"] == server_model_dir == res["model_id"] and res["served_model_name"] == SERVED_NAME
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])  # 60 s objectives: all good
    saved = json.load(open(res["result_path"]))
    assert os.path.basename(res["result_path"]).startswith(f"e2e-{backend}-infqps-concurrency2-")
    assert saved["label"] == f"e2e-{backend}" and saved["case"] == "e2e" and saved["backend"] == backend
    assert saved["errors"] == [""] * n and saved["request_goodput"] == res["request_goodput"]


def test_sharegpt_file_against_live_server(server, server_model_dir, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer

    from tokenfab.bench.serve import make_args, run_bench_serve

    tok = AutoTokenizer.from_pretrained(server_model_dir, local_files_only=True)
    convs = [("What is a paged key value cache for?", "It stores the keys and values of many requests."),
             ("How does the scheduler batch the decode steps?", "It runs one step for every running request."),
             ("Why count the time to the first token?", "It measures how long the prefill took.")]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
                                for q, a in convs]))
    res = run_bench_serve(make_args(base_url=server.base_url, backend="openai", dataset_name="sharegpt",
                                    dataset_path=str(path), num_prompts=3, disable_shuffle=True, ignore_eos=True,
                                    disable_tqdm=True, power="none", save_detailed=True))
    assert res["completed"] == 3, res["errors"]
    # max_tokens = the gpt turn's token count; the server's prompt count is the human turn's (+ BOS if any)
    assert res["output_lens"] == [len(tok(a).input_ids) for _, a in convs]
    assert all(0 <= n - len(tok(q).input_ids) <= 1 for n, (q, _) in zip(res["input_lens"], convs))


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
