"""One bad request never touches another: failures inside an engine step fail only the request whose rows raised
(offline and through the server), the offline LLM stays usable, and the final text is exactly the tokenizer's
decode of the tokens (UTF-8 tails flushed, stop strings before min_tokens kept).

Faults are injected by wrapping ``ModelRunner.execute`` so that any batch holding the marked request's rows raises,
as an input that slipped past validation would; the other requests must finish with the tokens a fault-free run
gives (greedy and seeded requests, whose tokens do not depend on batch mates)."""
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import time

import httpx
import pytest
import torch

from server_fixtures import metric_value, server_model_dir, start_test_server  # noqa: F401
from tokenfab import LLM, SamplingParams
from tokenfab.engine.sampler import Sampler, apply_top_k_top_p

MARK = [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7]  # the prompt of the request whose rows fail


class RowFault:
    """Wraps ``runner.execute``: a batch holding a sequence with prompt ``MARK`` that has produced at least
    ``after`` tokens raises RuntimeError (counted in ``hits``); every other batch runs normally."""

    def __init__(self, runner, after: int = 0, exc: type = RuntimeError):
        self.runner, self.real, self.after, self.exc, self.hits = runner, runner.execute, after, exc, 0

    def __call__(self, batch):
        for s in batch.seqs:
            if s.token_ids[:s.num_prompt_tokens] == MARK and s.num_output_tokens >= self.after:
                self.hits += 1
                raise self.exc("injected fault in the marked request's rows")
        return self.real(batch)

    def __enter__(self):
        self.runner.execute = self
        return self

    def __exit__(self, *a):
        del self.runner.execute  # back to the class method


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in (30, 5, 17, 3, 22)]


def _params() -> list[SamplingParams]:
    """Greedy and seeded requests (their tokens do not depend on the batch), all 8 tokens long."""
    return [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=8, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2),
            SamplingParams(temperature=1.0, seed=3, top_k=20, max_tokens=8, ignore_eos=True)]


@pytest.fixture(scope="module")
def llm(tiny_model):
    # a small token budget chunks the prefills, so failing steps mix decodes and prefill chunks
    return LLM(tiny_model("llama"), dtype="float32", max_model_len=128, max_num_batched_tokens=24, block_size=8,
               progress=False)


def _assert_idle(llm):
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    assert not eng.scheduler.running and not eng.scheduler.waiting
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert len(eng.scheduler.free_rows) == eng.scheduler.max_num_seqs


@pytest.mark.parametrize("after", [0, 3])
def test_a_failing_request_fails_alone_offline(llm, after):
    """The marked request's rows raise from its ``after``-th token on (0: in its prefill). It alone finishes with
    "error"; the other requests get exactly the fault-free tokens; the LLM stays usable and leaks nothing."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()] + [{"prompt_token_ids": MARK}]
    params = _params() + [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    clean = llm.generate(prompts, params, use_tqdm=False)
    with RowFault(llm.llm_engine.runner, after) as fault:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert fault.hits >= 1
    bad = got[-1]
    assert bad.error is not None and "RuntimeError" in bad.error and "injected" in bad.error
    assert [o.finish_reason for o in bad.outputs] == ["error"]
    assert bad.outputs[0].token_ids == clean[-1].outputs[0].token_ids[:after]  # what it had before the fault
    for c, g in zip(clean[:-1], got[:-1]):
        assert g.error is None
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in c.outputs]
        assert [o.finish_reason for o in g.outputs] == ["length"] * len(c.outputs)
        assert [o.text for o in g.outputs] == [o.text for o in c.outputs]
    _assert_idle(llm)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [[o.token_ids for o in r.outputs] for r in again] == [[o.token_ids for o in r.outputs] for r in clean]
    assert llm.llm_engine.stats["requests_failed_total"] >= 1


def test_two_failing_requests_are_both_found(llm):
    """Bisection finds every raising row: two marked requests fail, the rest finish as without the fault."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    params = _params()
    clean = llm.generate(prompts, params, use_tqdm=False)
    both = prompts[:2] + [{"prompt_token_ids": MARK}] + prompts[2:] + [{"prompt_token_ids": MARK}]
    both_params = params[:2] + [SamplingParams(temperature=0.0, max_tokens=8)] + params[2:] + [
        SamplingParams(temperature=1.0, seed=1, max_tokens=8)]
    with RowFault(llm.llm_engine.runner, after=1):
        got = llm.generate(both, both_params, use_tqdm=False)
    assert [r.error is not None for r in got] == [False, False, True, False, False, False, True]
    rest = got[:2] + got[3:6]
    assert [[o.token_ids for o in r.outputs] for r in rest] == [[o.token_ids for o in r.outputs] for r in clean]
    _assert_idle(llm)


def test_invalid_input_that_slips_past_validation_fails_alone(llm, monkeypatch):
    """The issue's trigger (an out-of-vocabulary stop token with min_tokens: IndexError in the min_tokens mask),
    with validation switched off to reach the step: only that request fails; later generate() calls work."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:3]]
    params = _params()[:3]
    clean = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(SamplingParams, "validate", lambda self, vocab_size: None, raising=False)
    bad = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[600])
    got = llm.generate(prompts + [{"prompt_token_ids": [5, 6, 7]}], params + [bad], use_tqdm=False)
    assert got[-1].outputs[0].finish_reason == "error" and "IndexError" in got[-1].error
    assert [r.outputs[0].token_ids for r in got[:-1]] == [r.outputs[0].token_ids for r in clean]
    _assert_idle(llm)
    monkeypatch.undo()
    assert llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids == clean[0].outputs[0].token_ids


def test_a_step_error_that_escapes_leaves_no_request_behind(llm, monkeypatch):
    """An error the engine cannot pin on a request (here: in the scheduler) propagates from generate(), which then
    aborts its requests: nothing stays queued or running, and the next generate() is unaffected."""
    eng = llm.llm_engine
    real = eng.scheduler.schedule
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("scheduler broke")
        return real()

    monkeypatch.setattr(eng.scheduler, "schedule", flaky)
    with pytest.raises(RuntimeError, match="scheduler broke"):
        llm.generate([{"prompt_token_ids": [5] * 40}], SamplingParams(max_tokens=4), use_tqdm=False)
    _assert_idle(llm)
    out = llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_top_p_that_rounds_to_zero_keeps_the_top_token(llm):
    """top_p = 1e-300 is valid ((0, 1]) but 0.0 in float32: the nucleus keeps the most likely token (greedy),
    never an empty set (which returned token id == vocab_size)."""
    logits = torch.randn(3, 50)
    masked = apply_top_k_top_p(logits, None, torch.tensor([1e-300, 0.0, 1e-45], dtype=torch.float32))
    assert torch.equal(masked.argmax(-1), logits.argmax(-1))
    assert (torch.isfinite(masked).sum(-1) == 1).all()
    seqs = [type("S", (), {"params": SamplingParams(top_p=1e-300, top_k=k), "generator": None})() for k in (-1, 7)]
    toks = Sampler(torch.Generator().manual_seed(0))(logits[:2], seqs).token_ids
    assert toks.tolist() == logits[:2].argmax(-1).tolist()
    p = [{"prompt_token_ids": p} for p in _prompts()[:2]]
    tiny = llm.generate(p, SamplingParams(temperature=1.0, top_p=1e-300, seed=4, max_tokens=6), use_tqdm=False)
    greedy = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert [r.outputs[0].token_ids for r in tiny] == [r.outputs[0].token_ids for r in greedy]


def test_top_k_above_the_vocabulary_beside_a_small_one():
    """A huge top_k (disabled in effect) next to a small one in the same batch: no int64 overflow in the sampler."""
    logits = torch.randn(2, 40)
    seqs = [type("S", (), {"params": SamplingParams(top_k=k), "generator": None})() for k in (2 ** 70, 3)]
    toks = Sampler(torch.Generator().manual_seed(0))(logits, seqs).token_ids
    assert 0 <= toks[0] < 40 and toks[1] in logits[1].topk(3).indices.tolist()


# ---- text = decode(tokens) --------------------------------------------------------------------------------------
def test_final_text_is_the_decode_of_the_tokens(llm):
    """40 random outputs (temperature 1: byte pieces of multi-byte characters are common with this byte-level
    BPE): each final text equals tokenizer.decode(token_ids), incomplete trailing characters included."""
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": [5 + i, 40 + i]} for i in range(40)]
    params = [SamplingParams(temperature=1.2, seed=100 + i, max_tokens=10 + i % 7, ignore_eos=True)
              for i in range(40)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    want = [tok.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs]
    assert sum(w.endswith("\ufffd") for w in want) >= 3  # the case under test occurs
    assert texts == want


def test_stop_string_before_min_tokens_is_not_cut(llm):
    """A stop string completed while the sequence is below min_tokens is ignored, and its text stays: the text is
    always a prefix of decode(tokens), and with min_tokens = max_tokens the whole decode."""
    tok = llm.get_tokenizer()
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt in ([11, 12, 13], [40, 41], [100, 7, 300], [250, 251, 252, 253]):
        ref = llm.generate([{"prompt_token_ids": prompt}], base, use_tqdm=False)[0].outputs[0]
        early = tok.decode(ref.token_ids[:2], skip_special_tokens=True)
        if "\ufffd" not in early and early.strip():
            break
    else:
        pytest.fail("no greedy output with printable text in its first two tokens")
    stop = early[-2:] if len(early) >= 2 else early
    p = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, ignore_eos=True, stop=[stop])
    o = llm.generate([{"prompt_token_ids": prompt}], p, use_tqdm=False)[0].outputs[0]
    assert o.token_ids == ref.token_ids and o.finish_reason == "length"
    assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
    p = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4, ignore_eos=True, stop=[stop])
    o = llm.generate([{"prompt_token_ids": prompt}], p, use_tqdm=False)[0].outputs[0]
    full = tok.decode(o.token_ids, skip_special_tokens=True)
    assert full.startswith(o.text)
    assert len(full) - len(o.text) >= len(stop) or o.finish_reason == "length"


# ---- a checkpoint without tokenizer files -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def no_tokenizer_dir(tiny_model, tmp_path_factory):
    src = tiny_model("llama")
    dst = str(tmp_path_factory.mktemp("notok"))
    for f in os.listdir(src):
        if f in ("config.json", "generation_config.json") or f.endswith(".safetensors"):
            shutil.copy(os.path.join(src, f), dst)
    return dst


def test_no_tokenizer_generates_token_ids_with_empty_text(llm, no_tokenizer_dir):
    """vLLM's skip_tokenizer_init shape: token ids in, token ids out, text empty; a text prompt or stop strings
    are refused by name."""
    bare = LLM(no_tokenizer_dir, dtype="float32", max_model_len=128, progress=False)
    assert bare.get_tokenizer() is None
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    got = bare.generate([{"prompt_token_ids": [5, 6, 7]}], p, use_tqdm=False)[0].outputs[0]
    want = llm.generate([{"prompt_token_ids": [5, 6, 7]}], p, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text == "" and got.finish_reason == "length"
    with pytest.raises(ValueError, match="no tokenizer.*prompt_token_ids") as e:
        bare.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert e.value.param == "prompt"
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        bare.generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=2, stop=["x"]), use_tqdm=False)
    assert not bare.llm_engine.has_unfinished_requests()


def test_no_tokenizer_server(no_tokenizer_dir):
    h = start_test_server(no_tokenizer_dir, name="bare")
    try:
        with httpx.Client(base_url=h.base_url, trust_env=False, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True,
                                                "logprobs": 1})
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            assert ch["text"] == "" and r.json()["usage"]["completion_tokens"] == 4
            assert len(ch["logprobs"]["tokens"]) == 4
            r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "echo": True, "stream": True})
            assert r.status_code == 200 and "error" not in r.text and r.text.rstrip().endswith("[DONE]")
            for body, path in (({"prompt": "hi"}, "/v1/completions"), ({"prompt": "hi"}, "/tokenize"),
                               ({"messages": [{"role": "user", "content": "x"}]}, "/v1/chat/completions")):
                r = c.post(path, json=body)
                assert r.status_code == 400, r.text
                msg = r.json()["error"]["message"]
                assert "tokenizer" in msg or "chat template" in msg, msg
    finally:
        h.stop()


# ---- the server ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(server_model_dir):  # noqa: F811
    h = start_test_server(server_model_dir, max_model_len=256, max_num_batched_tokens=32)
    yield h
    h.stop()


async def _stream(c: httpx.AsyncClient, body: dict) -> dict:
    """One streamed completion: {"tokens": [...], "text", "errors": [...], "finish"}; logprobs=0 gives tokens."""
    body = dict(body, stream=True)
    res = {"text": "", "errors": [], "finish": None, "n_chunks": 0}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if "error" in d:
                res["errors"].append(d["error"])
                continue
            for ch in d["choices"]:
                res["text"] += ch["text"]
                res["n_chunks"] += 1
                res["finish"] = ch["finish_reason"] or res["finish"]
    return res


def _bodies() -> list[dict]:
    prompts = _prompts()
    return [{"prompt": prompts[0], "max_tokens": 10, "ignore_eos": True, "temperature": 0},
            {"prompt": prompts[1], "max_tokens": 10, "ignore_eos": True, "temperature": 1.0, "seed": 7},
            {"prompt": prompts[2], "max_tokens": 10, "ignore_eos": True, "temperature": 0.8, "top_p": 0.9,
             "seed": 2},
            {"prompt": prompts[4], "max_tokens": 10, "ignore_eos": True, "temperature": 0}]


def test_a_failing_request_fails_alone_through_the_server(server):
    """Four streams beside a marked request whose rows raise from its 2nd token on: the marked stream (and a
    non-streamed marked request) get the engine's error, the four finish with the text of a fault-free run, and
    the failure shows in /metrics."""
    eng = server.async_llm.engine

    async def run(with_bad: bool):
        async with httpx.AsyncClient(base_url=server.base_url, trust_env=False, timeout=60) as c:
            jobs = [_stream(c, b) for b in _bodies()]
            if with_bad:
                jobs.append(_stream(c, {"prompt": MARK, "max_tokens": 10, "ignore_eos": True}))
                jobs.append(c.post("/v1/completions", json={"prompt": MARK, "max_tokens": 10}))
            return await asyncio.gather(*jobs)

    clean = asyncio.run(run(False))
    before = metric_value(httpx.get(server.base_url + "/metrics", trust_env=False).text,
                          "tokenfab:num_engine_step_failures_total")
    fault = RowFault(eng.runner, after=2)
    with fault:
        got = asyncio.run(run(True))
    assert fault.hits >= 1
    *good, bad_stream, bad_plain = got
    assert bad_stream["errors"] and "injected" in bad_stream["errors"][0]["message"]
    assert bad_stream["errors"][0]["code"] == 500
    assert bad_plain.status_code == 500 and "injected" in bad_plain.json()["error"]["message"]
    for c, g in zip(clean, good):
        assert not g["errors"] and g["finish"] == "length"
        assert g["text"] == c["text"]
    text = httpx.get(server.base_url + "/metrics", trust_env=False).text
    assert metric_value(text, "tokenfab:num_engine_step_failures_total") > before
    assert 'finished_reason="error"' in text
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=60) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": MARK, "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_aborted_requests_are_counted_as_abort(server):
    """A client that leaves mid-stream: vllm:request_success_total{finished_reason="abort"} goes up by one."""
    def abort_count() -> float:
        text = httpx.get(server.base_url + "/metrics", trust_env=False).text
        for line in text.splitlines():
            if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
                return float(line.rsplit(" ", 1)[1])
        raise KeyError("abort")

    before = abort_count()
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 200, "ignore_eos": True,
                                                       "stream": True}) as r:
            for i, line in enumerate(r.iter_lines()):
                if i >= 4:
                    break
    deadline = time.time() + 15
    while abort_count() != before + 1:
        assert time.time() < deadline, (before, abort_count())
        time.sleep(0.05)


def test_a_failing_request_fails_alone_with_recurrent_state(tmp_path, tokenizer_dir):
    """Kimi Linear keeps a recurrent KDA state per request, which a failed run may already have advanced: the
    other requests are recomputed from their tokens (preempted) and still finish with the fault-free tokens."""
    from test_kimi_linear import make_kimi_linear
    path = make_kimi_linear(str(tmp_path / "kl"), tokenizer_dir)
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=24, block_size=8, progress=False)
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:3]] + [{"prompt_token_ids": MARK}]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    clean = llm.generate(prompts, params, use_tqdm=False)
    preempted_before = llm.llm_engine.scheduler.num_preemptions
    with RowFault(llm.llm_engine.runner, after=2):
        got = llm.generate(prompts, params, use_tqdm=False)
    assert got[-1].outputs[0].finish_reason == "error"
    assert [r.outputs[0].token_ids for r in got[:-1]] == [r.outputs[0].token_ids for r in clean[:-1]]
    assert llm.llm_engine.scheduler.num_preemptions > preempted_before
    _assert_idle(llm)
