"""Error handling of the server: OpenAI error JSON and statuses, disconnects, and isolation of bad requests."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from server_fixtures import (  # noqa: F401
    SERVED_NAME,
    metric_value,
    no_template_model_dir,
    server_model_dir,
    start_test_server,
)
from tokenfab import Logprob


@pytest.fixture(scope="module")
def server(server_model_dir):  # noqa: F811
    h = start_test_server(server_model_dir, max_model_len=512)
    yield h
    h.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=60) as c:
        yield c


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_malformed_json(http):
    r = http.post("/v1/completions", content=b'{"prompt": "hi", ', headers={"content-type": "application/json"})
    assert "JSON" in _error(r, 400)["message"]


def test_form_encoded_body_says_to_send_json(http):
    """curl -d without a JSON Content-Type: the 400 names the header to send."""
    r = http.post("/v1/completions", content=b'{"prompt": "hi"}',
                  headers={"content-type": "application/x-www-form-urlencoded"})
    assert "Content-Type: application/json" in _error(r, 400)["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": "lots"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 9}, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tool_choice"),  # "auto" (the default with tools) needs --enable-auto-tool-choice
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
])
def test_wrong_fields_give_400_naming_the_field(http, path, body, param):
    err = _error(http.post(path, json=body), 400)
    assert err["param"] == param, err


def test_unknown_model_404(http):
    err = _error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404)
    assert "gpt-9" in err["message"]
    _error(http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
           404)
    _error(http.get("/v1/nothing-here"), 404)


def test_prompt_too_long_400_says_lengths(http):
    err = _error(http.post("/v1/completions", json={"prompt": [7] * 600, "max_tokens": 4}), 400)
    assert "512" in err["message"] and "600" in err["message"]
    err = _error(http.post("/v1/completions", json={"prompt": [7] * 500, "max_tokens": 20}), 400)
    assert "520" in err["message"] and "512" in err["message"]


def test_chat_without_template_400(no_template_model_dir):  # noqa: F811
    h = start_test_server(no_template_model_dir, name="plain")
    try:
        with httpx.Client(base_url=h.base_url, trust_env=False) as c:
            err = _error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 400)
            assert "chat template" in err["message"]
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        h.stop()


def _metrics(http) -> str:
    return http.get("/metrics").text


def test_disconnect_mid_stream_frees_everything(server, http):
    before = metric_value(_metrics(http), "tokenfab:num_aborted_requests_total")
    body = {"prompt": "hello", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got == 3:
                        break
    deadline = time.time() + 15
    while True:
        text = _metrics(http)
        if (metric_value(text, "vllm:num_requests_running") == 0
                and metric_value(text, "vllm:kv_cache_usage_perc") == 0.0
                and metric_value(text, "tokenfab:num_aborted_requests_total") == before + 1):
            break
        assert time.time() < deadline, text
        time.sleep(0.05)
    assert metric_value(text, "vllm:num_requests_waiting") == 0


def test_metrics_names_exist(http):
    text = _metrics(http)
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:num_preemptions_total", "vllm:request_success_total",
                 "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"]:
        assert name in text, name


def test_bad_request_does_not_disturb_others(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, trust_env=False, timeout=60) as c:
            async def good(i):
                body = {"prompt": f"request {i}", "max_tokens": 12, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}, "temperature": 0}
                usage, text = None, ""
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            d = json.loads(line[6:])
                            assert "error" not in d
                            usage = d.get("usage") or usage
                            text += "".join(ch["text"] for ch in d["choices"])
                return usage, text

            bad = [c.post("/v1/completions", json={"prompt": [3] * 700}),
                   c.post("/v1/completions", json={"prompt": [1, 2, -5]}),
                   c.post("/v1/completions", content=b"nope", headers={"content-type": "application/json"})]
            return await asyncio.gather(*[good(i) for i in range(4)], *bad)

    res = asyncio.run(main())
    for usage, text in res[:4]:
        assert usage["completion_tokens"] == 12 and text
    assert [r.status_code for r in res[4:]] == [400, 400, 400]


def test_engine_step_failure_fails_only_running_requests(server, http):
    llm = server.async_llm
    eng = llm.engine
    real_step = eng.step
    state = {"armed": True}

    def flaky_step():
        if state["armed"] and eng.scheduler.running:
            state["armed"] = False
            raise RuntimeError("injected failure")
        return real_step()

    eng.step = flaky_step
    try:
        err = _error(http.post("/v1/completions", json={"prompt": "boom", "max_tokens": 5}), 500)
        assert "injected failure" in err["message"]
        assert "Traceback" not in err["message"]
    finally:
        eng.step = real_step
    r = http.post("/v1/completions", json={"prompt": "fine", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert http.get("/health").status_code == 200


def test_503_while_shutting_down(server, http):
    server.app.state.shutting_down = True
    try:
        _error(http.post("/v1/completions", json={"prompt": "x"}), 503)
        assert http.get("/health").status_code == 503
    finally:
        server.app.state.shutting_down = False
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_health_503_when_the_engine_cannot_serve(server, http):
    """A dead tensor-parallel group (reported by the engine's health check) makes /health answer 503."""
    eng = server.async_llm.engine
    real = eng.health_error
    eng.health_error = lambda: "a tensor-parallel rank failed (rank 4); restart the server"
    try:
        err = _error(http.get("/health"), 503)
        assert "rank 4" in err["message"]
    finally:
        eng.health_error = real
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["\\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "hi"}', "model"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "x"}]}', "messages"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]}', "messages"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
])
def test_lone_surrogates_give_400_and_keep_the_connection(server, path, raw, param):
    """JSON's \\ud800 escape without its pair is not text UTF-8 can encode: a 400 in OpenAI's error JSON naming
    the field (not a plain-text 500 that drops the keep-alive connection), and the same connection serves on."""
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=60) as c:
        err = _error(c.post(path, content=raw, headers={"content-type": "application/json"}), 400)
        assert err["param"] == param and "surrogate" in err["message"]
        r = c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})
        assert r.status_code == 200


@pytest.mark.parametrize("prompt", [[True, False], [1.0], [1, "1"], [[2.5]], [[1, 2], [3, True]]])
def test_prompt_token_ids_must_be_integers(http, prompt):
    """true, 1.0 or "1" are not token ids (a one-element list of strings is a text prompt, as OpenAI's API)."""
    err = _error(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}), 400)
    assert err["param"] == "prompt"


@pytest.mark.parametrize("body,param,words", [
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"temperature": float("inf")}, "temperature", "finite"),
    ({"top_p": float("nan")}, "top_p", "finite"),
    ({"seed": 2 ** 64}, "seed", "2**64"),
    ({"seed": -(2 ** 63) - 1}, "seed", "seed"),
    ({"stop_token_ids": [512], "min_tokens": 1}, "stop_token_ids", "512"),
    ({"stop_token_ids": [2 ** 70]}, "stop_token_ids", "vocab"),
    ({"stop_token_ids": [True]}, "stop_token_ids", "integer"),
    ({"top_k": -3}, "top_k", "top_k"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"min_tokens": -1}, "min_tokens", "min_tokens"),
])
def test_sampling_fields_are_checked_before_any_step(http, body, param, words):
    """Out-of-range, non-finite or out-of-vocabulary sampling fields: a 400 naming the field, from the checks the
    offline API runs; nothing reaches the engine (the issue's triggers of failed steps among them)."""
    raw = json.dumps({"prompt": "hi", "max_tokens": 3, **body}).encode()  # json.dumps writes NaN / Infinity
    err = _error(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)
    assert err["param"] == param, err
    assert words in err["message"], err
    assert "65536" not in err["message"]


def test_plain_text_format_and_tool_choice_none_run(http):
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for extra in ({"response_format": {"type": "text"}}, {"tools": tools, "tool_choice": "none"}):
        r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text


def test_top_p_below_float32_range_runs(http):
    """top_p = 1e-300 is in (0, 1]: it runs (the most likely token) instead of failing the step."""
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "top_p": 1e-300, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    g = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.json()["choices"][0]["text"] == g.json()["choices"][0]["text"]


def test_completion_top_logprobs_keep_the_chosen_token(server):
    """Byte-fallback pieces of one character all decode to U+FFFD: keyed by text they collide, and the chosen
    token's entry must stay, equal to its token_logprobs value; among the others the most likely one is kept."""
    serving = server.app.state.serving
    tok = serving.tokenizer
    fffd = [i for i in range(len(tok)) if tok.decode([i]) == "\ufffd"]
    assert len(fffd) >= 3
    a, b, c = fffd[:3]

    def lps(d):  # the engine's {token_id: Logprob}
        return {t: Logprob(v) for t, v in d.items()}

    lp = serving.completion_logprobs([a], [lps({a: -3.0, b: -1.0, c: -2.0, 7: -0.5})], 0)
    assert lp["token_logprobs"] == [-3.0]
    top = lp["top_logprobs"][0]
    assert top["\ufffd"] == -3.0 and top[tok.decode([7])] == -0.5 and len(top) == 2
    assert list(top.values()) == sorted(top.values(), reverse=True)
    lp = serving.completion_logprobs([7], [lps({7: -0.5, b: -1.0, c: -2.0})], 0)
    assert lp["top_logprobs"][0] == {tok.decode([7]): -0.5, "\ufffd": -1.0}
