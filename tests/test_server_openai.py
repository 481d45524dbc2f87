"""The OpenAI-compatible server through the official ``openai`` SDK: a live server on 127.0.0.1 with a tiny Llama."""
from __future__ import annotations

import httpx
import pytest

from server_fixtures import SERVED_NAME, no_template_model_dir, server, server_model_dir, start_test_server  # noqa: F401

PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=60))


@pytest.fixture(scope="module")
def offline(server_model_dir):  # noqa: F811
    from tokenfab.entrypoints.llm import LLM

    return LLM(server_model_dir, progress=False, dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8)


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    with httpx.Client(base_url=server.base_url, trust_env=False) as c:
        assert c.get("/health").status_code == 200
        assert "version" in c.get("/version").json()


def test_greedy_completion_equals_offline(client, offline):
    from tokenfab.sampling_params import SamplingParams

    ref = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.text == ref.outputs[0].text
    tok = offline.get_tokenizer()
    assert ch.logprobs.tokens == [tok.decode([t]) for t in ref.outputs[0].token_ids]  # the same 12 tokens
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == len(ref.prompt_token_ids) + 12
    assert ch.finish_reason == "length"
    assert all(lp <= 0 for lp in ch.logprobs.token_logprobs)


def test_token_id_prompt_equals_offline(client, offline):
    from tokenfab.sampling_params import SamplingParams

    ids = [5, 77, 300, 41, 9, 120]
    ref = offline.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0]
    r = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8


def test_streaming_completion_with_usage(client):
    full = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.parametrize("n_tokens", [1, 23])
def test_ignore_eos_gives_exact_length(client, n_tokens):
    r = client.completions.create(model=SERVED_NAME, prompt="hello", max_tokens=n_tokens, temperature=1.0,
                                  extra_body={"ignore_eos": True, "min_tokens": 0})
    assert r.usage.completion_tokens == n_tokens


def test_chat_stream_and_not(server, client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    full = client.chat.completions.create(model=SERVED_NAME, messages=msgs, max_completion_tokens=9, temperature=0,
                                          extra_body={"ignore_eos": True})
    with httpx.Client(base_url=server.base_url, trust_env=False) as c:
        n_prompt = c.post("/tokenize", json={"messages": msgs}).json()["count"]
    assert full.usage.prompt_tokens == n_prompt and full.usage.completion_tokens == 9
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=msgs, max_tokens=9, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert item.logprob <= 0 and item.top_logprobs[0].logprob >= item.logprob - 1e-5


def test_n2_with_seed_is_reproducible(client):
    kw = dict(model=SERVED_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=1234,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in sorted(a.choices, key=lambda c: c.index)] == \
           [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert a.usage.completion_tokens == 16


def test_stop_string(client):
    base = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 2]
    assert stop.strip(), base
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == base[:base.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    s = list(client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in s) == base[:base.index(stop)]


def test_echo(client):
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT)


def test_tokenize_detokenize(server):
    with httpx.Client(base_url=server.base_url, trust_env=False) as c:
        t = c.post("/tokenize", json={"model": SERVED_NAME, "prompt": "hello world"}).json()
        assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 256
        d = c.post("/detokenize", json={"model": SERVED_NAME, "tokens": t["tokens"]}).json()
        assert "hello world" in d["prompt"]
