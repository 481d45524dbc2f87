"""End-to-end `tokenfab bench serve` against a fake OpenAI-compatible streaming server on 127.0.0.1.

The fake server (FastAPI + uvicorn, written here) streams one SSE chunk per token with known delays
(TTFT_DELAY before the first, ITL_DELAY between the others), then a usage chunk and ``[DONE]``. Without
``ignore_eos`` it stops early at EOS_AFTER tokens, so the tests can see that ``--ignore-eos`` reaches the server.
"""

import asyncio
import json
import os
import socket
import threading
import time

import pytest

from tokenfab.bench import BenchError
from tokenfab.bench.datasets import sample_random_requests
from tokenfab.bench.serve import build_parser, make_args, run_bench_serve

TTFT_DELAY = 0.06   # s before the first token
ITL_DELAY = 0.02    # s between tokens
EOS_AFTER = 3       # tokens generated when ignore_eos is not set


MODEL_ROOT: dict = {}  # set "root" to make /v1/models report a model folder (vLLM's field)


def _make_app(received: list):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        card = {"id": "fake-model", "object": "model"}
        if MODEL_ROOT.get("root"):
            card["root"] = MODEL_ROOT["root"]
        return {"object": "list", "data": [card]}

    async def _stream(request: Request, chat: bool):
        body = await request.json()
        received.append({"path": request.url.path, "body": body, "headers": dict(request.headers)})
        if request.headers.get("x-fail") == "1":
            return JSONResponse({"error": {"message": "forced failure"}}, status_code=500)
        max_tokens = int(body.get("max_tokens") or 16)
        n = max_tokens if body.get("ignore_eos") else min(EOS_AFTER, max_tokens)

        async def gen():
            if chat:  # real servers open with a role-only chunk (no text): must not count as the first token
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
            await asyncio.sleep(TTFT_DELAY)
            for i in range(n):
                if i:
                    await asyncio.sleep(ITL_DELAY)
                text = f" t{i}"
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
            yield ": keep-alive comment\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _stream(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _stream(request, chat=True)

    return app


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    received: list = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_make_app(received), log_level="warning", lifespan="off"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    assert server.started, "fake server did not start"
    yield {"url": f"http://127.0.0.1:{port}", "received": received}
    server.should_exit = True
    th.join(timeout=5)
    sock.close()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenfab.testing.tokenizer_builder import build_tokenizer

    return build_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=512)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


def test_random_dataset_retokenizes_to_requested_length(tokenizer):
    reqs = sample_random_requests(tokenizer, 12, input_len=64, output_len=10, prefix_len=8, seed=3)
    assert len(reqs) == 12
    for r in reqs:
        n = len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert n == r.prompt_len
        assert abs(n - (64 + 8)) <= 2
        assert r.expected_output_len == 10
    # Bodies start at offset + index (vLLM's formula); with a 512-token vocabulary two may coincide, rarely more.
    assert len({r.prompt for r in reqs}) >= 9
    # All prompts share the prefix text (first few characters at least).
    assert len({r.prompt[:4] for r in reqs}) == 1
    # Same seed, same prompts.
    again = sample_random_requests(tokenizer, 12, input_len=64, output_len=10, prefix_len=8, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    # range ratio: lengths inside [floor(L(1-r)), ceil(L(1+r))]
    ranged = sample_random_requests(tokenizer, 20, input_len=40, output_len=20, range_ratio=0.5, seed=1)
    assert all(18 <= r.prompt_len <= 62 for r in ranged)
    assert all(10 <= r.expected_output_len <= 30 for r in ranged)
    assert len({r.expected_output_len for r in ranged}) > 1
    with pytest.raises(BenchError, match="--random-range-ratio"):
        sample_random_requests(tokenizer, 2, range_ratio=1.0)


def test_bench_serve_completions(fake_server, tokenizer_dir, tokenizer, tmp_path, capsys):
    n_prompts, out_len, in_len = 6, 8, 32
    start = len(fake_server["received"])
    args = make_args(
        base_url=fake_server["url"], model="fake-model", tokenizer=tokenizer_dir, num_prompts=n_prompts,
        random_input_len=in_len, random_output_len=out_len, max_concurrency=2, ignore_eos=True,
        save_result=True, result_dir=str(tmp_path), result_filename="out.json", disable_tqdm=True,
        percentile_metrics="ttft,tpot,itl,e2el", metric_percentiles="50,99", num_devices=2,
        header=[["X-Bench=yes"]], command_line="tokenfab bench serve (test)", save_detailed=True,
    )
    result = run_bench_serve(args)
    out = capsys.readouterr().out

    # The request bodies the server saw.
    got = fake_server["received"][start:]
    assert len(got) == n_prompts
    for g in got:
        b = g["body"]
        assert g["path"] == "/v1/completions"
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["ignore_eos"] is True and b["max_tokens"] == out_len and b["temperature"] == 0.0
        assert b["model"] == "fake-model" and isinstance(b["prompt"], str)
        assert g["headers"].get("x-bench") == "yes"

    saved = json.load(open(tmp_path / "out.json"))
    for key in ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
                "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
                "ttfts", "itls", "generated_texts", "errors",
                "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "p50_ttft_ms",
                "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
                "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
                "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p99_e2el_ms",
                "num_devices", "output_throughput_per_device", "total_token_throughput_per_device",
                "steady_state_window", "command", "tokenfab_version"):
        assert key in saved, key
    assert saved["request_rate"] == "inf" and saved["max_concurrency"] == 2 and saved["backend"] == "openai"
    assert saved["command"] == "tokenfab bench serve (test)"
    assert saved["completed"] == n_prompts and saved["failed"] == 0
    assert saved["errors"] == [""] * n_prompts
    # ignore-eos: every request generated exactly the requested length.
    assert saved["output_lens"] == [out_len] * n_prompts
    assert saved["total_output_tokens"] == n_prompts * out_len
    assert all(len(t.split()) == out_len for t in saved["generated_texts"])
    # Input lengths are the dataset's token counts (the fake server reports no prompt_tokens).
    assert all(abs(n - in_len) <= 2 for n in saved["input_lens"])
    assert saved["total_input_tokens"] == sum(saved["input_lens"])
    # Timing follows the fake delays (loose bounds: shared CPUs).
    assert TTFT_DELAY * 1000 * 0.8 <= saved["median_ttft_ms"] <= TTFT_DELAY * 1000 + 250
    assert ITL_DELAY * 1000 * 0.8 <= saved["median_itl_ms"] <= ITL_DELAY * 1000 + 60
    assert all(len(itl) == out_len - 1 for itl in saved["itls"])
    assert saved["median_tpot_ms"] == pytest.approx(saved["mean_itl_ms"], rel=0.3)
    # Concurrency 2: 3 waves of ~(0.06 + 7 * 0.02) s each.
    assert saved["max_concurrent_requests"] == 2
    assert saved["duration"] >= 3 * (TTFT_DELAY + (out_len - 1) * ITL_DELAY) * 0.9
    assert saved["output_throughput"] == pytest.approx(n_prompts * out_len / saved["duration"])
    assert saved["output_throughput_per_device"] == pytest.approx(saved["output_throughput"] / 2)
    win = saved["steady_state_window"]
    assert win is not None and 0 <= win["start"] < win["end"] <= saved["duration"]
    # In the steady window 2 streams each emit a token every ~ITL_DELAY s at most.
    assert 0 < saved["steady_output_throughput"] <= 2 / ITL_DELAY * 1.2
    assert saved["steady_total_token_throughput"] >= saved["steady_output_throughput"]
    assert result["completed"] == n_prompts

    # The printed block.
    assert "============ Serving Benchmark Result ============" in out
    assert "---------------Time to First Token----------------" in out
    for line in ("Successful requests:", "Maximum request concurrency:", "Benchmark duration (s):",
                 "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
                 "Output token throughput (tok/s):", "Total Token throughput (tok/s):", "Mean TTFT (ms):",
                 "Median TPOT (ms):", "P99 ITL (ms):", "P50 E2EL (ms):", "Output tok/s per device:"):
        assert line in out, line
    assert out.rstrip().endswith("=" * 50) or ("=" * 50) in out


def test_bench_serve_chat_without_ignore_eos(fake_server, tokenizer_dir):
    start = len(fake_server["received"])
    args = make_args(base_url=fake_server["url"], backend="openai-chat", tokenizer=tokenizer_dir, num_prompts=2,
                     random_input_len=16, random_output_len=6, disable_tqdm=True, request_rate=50.0,
                     ignore_eos=False, save_detailed=True)
    result = run_bench_serve(args)  # --model omitted: taken from /v1/models
    assert result["model_id"] == "fake-model"
    got = fake_server["received"][start:]
    assert [g["path"] for g in got] == ["/v1/chat/completions"] * 2
    assert got[0]["body"]["messages"][0]["role"] == "user" and "ignore_eos" not in got[0]["body"]
    assert result["output_lens"] == [EOS_AFTER, EOS_AFTER]  # stopped at "EOS"
    # The role-only opening chunk does not count: TTFT still reflects the fake prefill delay.
    assert min(result["ttfts"]) >= TTFT_DELAY * 0.8
    assert result["request_rate"] == 50.0


def test_failed_requests_are_counted_not_raised(fake_server, tokenizer_dir):
    args = make_args(base_url=fake_server["url"], model="fake-model", tokenizer=tokenizer_dir, num_prompts=3,
                     random_input_len=16, random_output_len=4, disable_tqdm=True, header=[["X-Fail=1"]],
                     save_detailed=True)
    result = run_bench_serve(args)
    assert result["completed"] == 0 and result["failed"] == 3
    assert all(e.startswith("HTTP 500") and "forced failure" in e for e in result["errors"])
    assert result["mean_ttft_ms"] == 0.0


def test_clear_errors(tokenizer_dir, tmp_path):
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    with pytest.raises(BenchError, match=r"--base-url / --host / --port"):
        run_bench_serve(make_args(port=dead, model="m", tokenizer=tokenizer_dir, disable_tqdm=True))
    with pytest.raises(BenchError, match="--dataset-name"):
        run_bench_serve(make_args(dataset_name="sonnet", model="m", tokenizer=tokenizer_dir))
    with pytest.raises(BenchError, match="--percentile-metrics"):
        run_bench_serve(make_args(percentile_metrics="ttft,foo", model="m"))
    with pytest.raises(BenchError, match="--header"):
        run_bench_serve(make_args(header=[["no-separator"]], model="m"))


def test_cli_unknown_dataset_is_one_line(capsys):
    from tokenfab.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--dataset-name", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--dataset-name" in err and "Traceback" not in err


def test_cli_bad_tokenizer_is_one_line(fake_server, tmp_path, capsys):
    from tokenfab.cli import main

    rc = main(["bench", "serve", "--base-url", fake_server["url"], "--model", "fake-model",
               "--tokenizer", str(tmp_path / "missing"), "--disable-tqdm"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tokenizer" in err[0]


def test_arrival_offsets():
    from tokenfab.bench.serve import arrival_offsets

    assert arrival_offsets(4, float("inf")) == [0.0] * 4
    t = arrival_offsets(100, 20.0, burstiness=1.0, seed=0)  # Poisson, rescaled so the last send is at 100/20 s
    assert t[-1] == pytest.approx(5.0) and all(b >= a for a, b in zip(t, t[1:]))
    assert arrival_offsets(100, 20.0, seed=0) == t          # seeded
    assert arrival_offsets(3, 2.0, burstiness=float("inf")) == pytest.approx([0.5, 1.0, 1.5])  # constant gaps


def test_vllm_flags_reach_the_result(fake_server, tokenizer_dir, tmp_path, monkeypatch):
    """--label, --metadata, --num-warmups, --save-detailed off, --goodput, --request-id-prefix, penalties,
    --extra-body, OPENAI_API_KEY and the tokenizer taken from /v1/models root (no --model, no --tokenizer)."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    MODEL_ROOT["root"] = tokenizer_dir
    try:
        start = len(fake_server["received"])
        args = build_parser().parse_args([
            "--base-url", fake_server["url"], "--backend", "vllm", "--num-prompts", "3", "--input-len", "16",
            "--output-len", "5", "--num-warmups", "2", "--max-concurrency", "2", "--label", "mylabel",
            "--metadata", "tp=1", "hw=cpu", "--goodput", "ttft:10000", "tpot:10000", "--request-id-prefix", "b-",
            "--repetition-penalty", "1.1", "--min-p", "0.05", "--extra-body", '{"min_tokens": 2}',
            "--save-result", "--result-dir", str(tmp_path), "--disable-tqdm", "--power", "none"])
        result = run_bench_serve(args)
    finally:
        MODEL_ROOT.clear()
    # this run's requests (its --extra-body marks them): a request an earlier test left in flight may land late
    got = [g for g in fake_server["received"][start:] if g["body"].get("min_tokens") == 2]
    assert len(got) == 5                                    # 2 warm-ups + 3 measured
    assert result["completed"] == 3 and result["num_warmups"] == 2
    assert result["total_output_tokens"] == 15              # ignore_eos (random dataset default) x 5 tokens x 3
    # warm-ups carry no request id; with --max-concurrency 2 the measured requests can arrive in either order
    warm = [g for g in got if "x-request-id" not in g["headers"]]
    measured = sorted((g for g in got if "x-request-id" in g["headers"]), key=lambda g: g["headers"]["x-request-id"])
    assert len(warm) == 2
    assert [g["headers"]["x-request-id"] for g in measured] == ["b-0", "b-1", "b-2"]
    assert warm[0]["body"]["prompt"] == warm[1]["body"]["prompt"] == measured[0]["body"]["prompt"]  # first prompt
    for g in got:
        b = g["body"]
        assert g["path"] == "/v1/completions" and b["ignore_eos"] is True and b["max_tokens"] == 5
        assert b["repetition_penalty"] == 1.1 and b["min_p"] == 0.05 and b["min_tokens"] == 2
        assert "frequency_penalty" not in b and "presence_penalty" not in b
        assert g["headers"]["authorization"] == "Bearer sk-test"
    assert result["model_id"] == tokenizer_dir and result["tokenizer_id"] == tokenizer_dir
    assert result["served_model_name"] == "fake-model"
    # goodput: every request meets 10 s objectives -> goodput = throughput
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["goodput_slos_ms"] == {"ttft": 10000.0, "tpot": 10000.0}
    path = result["result_path"]
    saved = json.load(open(path))
    # named after the served model, as clients call it, not after the folder the server reads (its root)
    assert os.path.basename(path) == f"mylabel-infqps-concurrency2-fake-model-{saved['date']}.json"
    assert os.path.dirname(path) == str(tmp_path)
    assert saved["label"] == "mylabel" and saved["tp"] == "1" and saved["hw"] == "cpu"
    for key in ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"):
        assert key not in saved, key                        # vLLM keeps them only with --save-detailed
    assert "latencies" in saved and saved["backend"] == "vllm"


def test_result_filename_names_the_model_as_given():
    from tokenfab.bench.serve import result_filename
    args = build_parser().parse_args(["--max-concurrency", "4", "--model", "org/Some-Model"])
    assert result_filename(args, "served", "D") == "openai-infqps-concurrency4-Some-Model-D.json"
    args = build_parser().parse_args(["--request-rate", "2", "--label", "x"])  # no --model: the served name
    assert result_filename(args, "SmolLM2-135M-Instruct", "D") == "x-2.0qps-SmolLM2-135M-Instruct-D.json"


def test_save_detailed_and_append(fake_server, tokenizer_dir, tmp_path):
    common = dict(base_url=fake_server["url"], model="fake-model", tokenizer=tokenizer_dir, num_prompts=2,
                  random_input_len=12, random_output_len=4, disable_tqdm=True, power="none",
                  result_dir=str(tmp_path), result_filename="runs.json")
    for _ in range(2):
        run_bench_serve(make_args(append_result=True, save_detailed=True, **common))
    lines = (tmp_path / "runs.json").read_text().splitlines()
    assert len(lines) == 2
    for line in lines:
        r = json.loads(line)
        assert r["output_lens"] == [4, 4] and r["errors"] == ["", ""] and len(r["ttfts"]) == 2
        assert [len(i) for i in r["itls"]] == [3, 3] and len(r["generated_texts"]) == 2
        assert len(r["input_lens"]) == 2 and len(r["start_times"]) == 2


def test_vllm_flag_errors(fake_server, tokenizer_dir, tmp_path):
    base = dict(base_url=fake_server["url"], model="fake-model", tokenizer=tokenizer_dir, disable_tqdm=True)
    with pytest.raises(BenchError, match="--endpoint '/v1/chat/completions' does not fit --backend openai"):
        run_bench_serve(make_args(endpoint="/v1/chat/completions", **base))
    with pytest.raises(BenchError, match="--goodput 'itl:5'"):
        run_bench_serve(make_args(goodput=["itl:5"], **base))
    with pytest.raises(BenchError, match="--extra-body must be a JSON object"):
        run_bench_serve(make_args(extra_body="[1]", **base))
    with pytest.raises(BenchError, match="--dataset-path .* does not go with --dataset-name random"):
        run_bench_serve(make_args(dataset_path="x.json", **base))
    with pytest.raises(BenchError, match="--dataset-name sharegpt needs --dataset-path"):
        run_bench_serve(make_args(dataset_name="sharegpt", **base))
    # no --tokenizer, --model not a folder and the server reports no root: ask for --tokenizer
    with pytest.raises(BenchError, match="pass --tokenizer"):
        run_bench_serve(make_args(base_url=fake_server["url"], model="fake-model", disable_tqdm=True))
    MODEL_ROOT["root"] = str(tmp_path / "elsewhere")
    try:
        with pytest.raises(BenchError, match=r"model folder \(/v1/models root\) as .*elsewhere.* not readable here"):
            run_bench_serve(make_args(base_url=fake_server["url"], disable_tqdm=True))
    finally:
        MODEL_ROOT.clear()


@pytest.mark.parametrize("argv, words", [
    (["--profile"], ["--profile", "vllm bench serve", "not supported"]),
    (["--ramp-up-strategy", "linear"], ["--ramp-up-strategy", "not supported", "--request-rate"]),
    (["--lora-modules", "a", "b"], ["--lora-modules", "LoRA"]),
    (["--backend", "openai-audio"], ["--backend", "vLLM backend", "vllm, openai, openai-chat"]),
    (["--dataset-name", "sonnet"], ["--dataset-name", "vLLM dataset", "random, sharegpt, custom"]),
    (["--tokenizer-mode", "mistral"], ["--tokenizer-mode", "vLLM tokenizer mode"]),
])
def test_cli_refuses_unsupported_vllm_flags_by_name(argv, words, capsys):
    from tokenfab.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


def test_cli_accepts_pasted_vllm_command():
    """A typical `vllm bench serve` line parses unchanged (values checked on the namespace)."""
    args = build_parser().parse_args(
        "--backend vllm --model m --endpoint /v1/completions --dataset-name sharegpt --dataset-path d.json "
        "--num-prompts 10 --request-rate 4 --burstiness 0.5 --max-concurrency 8 --save-result --save-detailed "
        "--result-dir out --label run1 --metadata tp=1 gpu=none --goodput ttft:500 tpot:50 e2el:1000 "
        "--num-warmups 3 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --seed 1 "
        "--sharegpt-output-len 64 --ignore-eos --temperature 0 --top-p 0.9 --top-k 5 --tokenizer-mode auto "
        "--header x-a=1 --disable-shuffle --no-oversample --trust-remote-code".split())
    assert (args.backend, args.dataset_name, args.dataset_path, args.label) == ("vllm", "sharegpt", "d.json", "run1")
    assert args.metadata == ["tp=1", "gpu=none"] and args.goodput == ["ttft:500", "tpot:50", "e2el:1000"]
    assert args.num_warmups == 3 and args.save_detailed and args.ignore_eos is True and args.sharegpt_output_len == 64
