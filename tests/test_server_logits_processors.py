"""The server passes presence / frequency / repetition penalties, min_p, logit_bias, allowed_token_ids and bad_words
to the engine (the same text as offline generation with the same SamplingParams, which
test_logits_processors_engine.py checks against a reference), and refuses bad values with a 400 naming the field."""
from __future__ import annotations

import httpx
import pytest

from server_fixtures import SERVED_NAME, http, server, server_model_dir, start_test_server  # noqa: F401

PROMPT = [5, 77, 300, 41, 9, 120]


@pytest.fixture(scope="module")
def offline(server_model_dir):  # noqa: F811
    from tokenfab.entrypoints.llm import LLM

    return LLM(server_model_dir, progress=False, dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8)


def _complete(http, **fields):
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **fields}
    return http.post("/v1/completions", json=body)


@pytest.mark.parametrize("fields", [
    dict(repetition_penalty=1.7), dict(frequency_penalty=1.2), dict(presence_penalty=1.5),
    dict(logit_bias={"300": 25.0, "41": -100}), dict(allowed_token_ids=[9, 41, 77, 120, 300]),
    dict(bad_words=None), dict(min_p=0.2, temperature=0.7, seed=5)])
def test_fields_reach_the_engine(http, offline, fields):
    from tokenfab.sampling_params import SamplingParams

    base = offline.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=10, ignore_eos=True,
                                                                           temperature=0.0), use_tqdm=False)[0]
    if "bad_words" in fields:  # a word of the plain greedy answer
        fields = dict(bad_words=[offline.get_tokenizer().decode(base.outputs[0].token_ids[2:3])])
    r = _complete(http, **fields)
    assert r.status_code == 200, r.text
    kw = dict(fields)
    if "logit_bias" in kw:
        kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
    kw.setdefault("temperature", 0.0)
    want = offline.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=10, ignore_eos=True, **kw),
                            use_tqdm=False)[0]
    assert r.json()["choices"][0]["text"] == want.outputs[0].text
    if "min_p" not in fields:  # greedy: the field changed the answer, so the comparison can fail
        assert want.outputs[0].text != base.outputs[0].text


def test_chat_accepts_the_fields(http):
    r = http.post("/v1/chat/completions", json={
        "model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
        "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.1,
        "logit_bias": {"7": 2}, "allowed_token_ids": [7, 8, 9], "bad_words": ["x"]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("fields,param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={"abc": 1}), "logit_bias"), (dict(logit_bias={"600": 1}), "logit_bias"),
    (dict(logit_bias={"5": 101}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[5, 512]), "allowed_token_ids"), (dict(bad_words=[" "]), "bad_words")])
def test_bad_values_are_a_400_naming_the_field(http, fields, param):
    r = _complete(http, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
