"""The /v1/completions features lm-eval's ``local-completions`` model uses: echo + logprobs (the prompt's
log-likelihood, read from ``token_logprobs[ctxlen:-1]``) and a list of token-id prompts per request.

Values are checked against transformers' logits on the same checkpoint (an independent implementation) and against
the same prompts sent one per request. lm-eval itself is not needed (benchmarks/lm_eval_check.py runs it)."""
from __future__ import annotations

import httpx
import pytest

from server_fixtures import SERVED_NAME, http, server, server_model_dir, start_test_server  # noqa: F401
from conftest import load_reference, reference_logprobs

PROMPTS = [[5, 77, 300, 41, 9, 120, 33], [400, 12, 8, 250, 3], [17, 18, 19, 20, 21, 22, 23, 24, 25]]


@pytest.fixture(scope="module")
def reference(server_model_dir):  # noqa: F811
    return load_reference(server_model_dir)


@pytest.fixture(scope="module")
def tokenizer(server_model_dir):  # noqa: F811
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(server_model_dir)


def expected_top(tokenizer, row, token: int, k: int) -> dict:
    """OpenAI's text-keyed top_logprobs from reference log-probabilities ``row`` [vocab]: the prompt token's
    entry, then the k most likely ids, the first id of each text kept (ids can share a text: byte pieces)."""
    top = {tokenizer.decode([token]): row[token].item()}
    vals, ids = row.topk(k)
    for v, i in zip(vals.tolist(), ids.tolist()):
        top.setdefault(tokenizer.decode([i]), v)
    return top


def _post(http, **body):
    r = http.post("/v1/completions", json={"model": SERVED_NAME, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_logprobs_match_transformers(http, reference, tokenizer):
    """lm-eval's log-likelihood request: echo, logprobs=1, max_tokens=1, temperature 0, token-id prompts."""
    ids = PROMPTS[0]
    out = _post(http, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1  # every prompt position, then the generated one
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = reference_logprobs(reference, ids)  # [len, vocab]: row t predicts token t + 1
    for t in range(1, len(ids)):
        assert lp["token_logprobs"][t] == pytest.approx(ref[t - 1, ids[t]].item(), abs=1e-4)
        want = expected_top(tokenizer, ref[t - 1], ids[t], 1)  # the prompt token and the most likely one
        got = lp["top_logprobs"][t]
        assert set(got) == set(want) and all(got[s] == pytest.approx(v, abs=1e-4) for s, v in want.items())
    greedy = int(ref[-1].argmax())
    assert lp["token_logprobs"][-1] == pytest.approx(ref[-1, greedy].item(), abs=1e-4)
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 1
    # lm-eval's sum over a continuation = the reference's sum
    ctxlen = 3
    got = sum(lp["token_logprobs"][ctxlen:-1])
    want = sum(ref[t - 1, ids[t]].item() for t in range(ctxlen, len(ids)))
    assert got == pytest.approx(want, abs=1e-3)


def test_echo_logprobs_text_prompt_top_k(http, reference, tokenizer):
    """A text prompt with logprobs=3: three alternatives (plus the prompt token when outside them) each."""
    out = _post(http, prompt="The quick brown fox", echo=True, logprobs=3, max_tokens=2, temperature=0)
    ch = out["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"].startswith("The quick brown fox")
    tok = httpx.post(f"{http.base_url}/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    ref = reference_logprobs(reference, tok)
    assert len(lp["token_logprobs"]) == len(tok) + 2
    for t in range(1, len(tok)):
        assert lp["token_logprobs"][t] == pytest.approx(ref[t - 1, tok[t]].item(), abs=1e-4)
        want = expected_top(tokenizer, ref[t - 1], tok[t], 3)
        got = lp["top_logprobs"][t]
        assert set(got) == set(want) and all(got[s] == pytest.approx(v, abs=1e-4) for s, v in want.items())
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


def test_list_of_prompts_equals_one_per_request(http):
    batch = _post(http, prompt=PROMPTS, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    total = 0
    for i, ids in enumerate(PROMPTS):
        one = _post(http, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)["choices"][0]
        got = batch["choices"][i]
        assert got["text"] == one["text"]
        assert got["logprobs"]["token_logprobs"][1:] == pytest.approx(one["logprobs"]["token_logprobs"][1:], abs=1e-5)
        total += len(ids) + 1
    assert batch["usage"]["total_tokens"] == total


def test_list_of_prompts_generation_and_n(http):
    """lm-eval's generate_until batch: plain generation of several prompts, with n=2 ordered prompt-major."""
    texts = ["one two three", "alpha beta"]
    batch = _post(http, prompt=texts, max_tokens=4, temperature=0, n=2)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    for i, t in enumerate(texts):
        one = _post(http, prompt=t, max_tokens=4, temperature=0)["choices"][0]["text"]
        assert batch["choices"][2 * i]["text"] == one == batch["choices"][2 * i + 1]["text"]


def test_bad_prompt_in_list_named_by_index(http):
    r = http.post("/v1/completions", json={"prompt": [[1, 2], [3, 99999]], "max_tokens": 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt[1]" and "prompt[1]" in err["message"]


def test_stream_with_list_refused(http):
    r = http.post("/v1/completions", json={"prompt": ["a b", "c d"], "max_tokens": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
