"""Property-based fuzzing of SamplingParams (offline) and of the HTTP API (hypothesis; derandomized, no deadline).

Offline: every generated bad value of a SamplingParams field raises a ValueError naming that field; every good
combination is accepted and generates. HTTP: every generated bad request (tokenfab/testing/api_fuzz.py: malformed
JSON, wrong types, huge numbers, NaN / inf, lone surrogates, nested garbage, missing fields ...) is answered with a
4xx in OpenAI's error JSON (borderline ones may also succeed), never a 5xx or a dropped connection, while an
innocent greedy stream, re-run throughout, keeps the text and token count it has alone. A schemathesis run drives
the app's own OpenAPI schema in negative mode the same way. benchmarks/fuzz_api.py is the longer run.
"""
from __future__ import annotations

import json
import math
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_fixtures import *  # noqa: F401,F403
from tokenfab import LLM, SamplingParams
from tokenfab.testing.api_fuzz import check_answer, fuzz_cases

CI = settings(deadline=None, derandomize=True, database=None, print_blob=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
VOCAB = 512


# ------------------------------------------------------------------------------------------ SamplingParams
def _bad_values():
    """field -> strategy of values that field must refuse."""
    not_int = st.one_of(st.floats(allow_nan=True), st.booleans(), st.text(max_size=3), st.none(), st.just([1]))
    not_num = st.one_of(st.booleans(), st.text(max_size=3), st.none(), st.just([1.0]))
    nonfinite = st.sampled_from([math.nan, math.inf, -math.inf])
    return {
        "n": st.one_of(st.integers(max_value=0), not_int),
        "temperature": st.one_of(st.floats(max_value=-1e-300), st.floats(min_value=65536.5, allow_infinity=False),
                                 nonfinite, not_num),
        "top_p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0000001, allow_infinity=False), nonfinite,
                           not_num),
        "top_k": st.one_of(st.integers(max_value=-2), st.just(1.5), st.booleans()),
        "max_tokens": st.one_of(st.integers(max_value=0), st.floats(allow_nan=True), st.booleans(), st.text(max_size=2)),
        "min_tokens": st.one_of(st.integers(max_value=-1), st.floats(allow_nan=True), st.booleans()),
        "seed": st.one_of(st.integers(min_value=2 ** 64), st.integers(max_value=-(2 ** 63) - 1), st.floats(),
                          st.booleans(), st.text(max_size=2)),
        "stop": st.one_of(st.lists(st.integers(), min_size=1, max_size=2), st.integers(), st.just({"a": 1})),
        "stop_token_ids": st.one_of(st.lists(st.integers(max_value=-1), min_size=1, max_size=2),
                                    st.lists(st.text(min_size=1, max_size=2), min_size=1, max_size=2),
                                    st.just([1.5]), st.just([True])),
        "logprobs": st.one_of(st.integers(max_value=-1), st.just(1.5), st.booleans()),
        "prompt_logprobs": st.one_of(st.integers(max_value=-1), st.just(2.5), st.booleans()),
        "presence_penalty": st.one_of(st.floats(min_value=2.0001, allow_infinity=False),
                                      st.floats(max_value=-2.0001, allow_infinity=False), nonfinite),
        "frequency_penalty": st.one_of(st.floats(min_value=2.0001, allow_infinity=False), nonfinite),
        "repetition_penalty": st.one_of(st.floats(max_value=0.0), nonfinite),
        "min_p": st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=1.0000001, allow_infinity=False),
                           nonfinite),
    }


@settings(CI, max_examples=150)
@given(data=st.data())
def test_sampling_params_refuse_every_bad_value_by_name(data):
    field = data.draw(st.sampled_from(sorted(_bad_values())), label="field")
    value = data.draw(_bad_values()[field], label="value")
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert getattr(e.value, "param", None) == field, (field, value, str(e.value))
    assert field in str(e.value)


@st.composite
def good_params(draw) -> dict:
    """A valid SamplingParams field set (within every documented range)."""
    kw = {"max_tokens": draw(st.integers(1, 6))}
    kw["min_tokens"] = draw(st.integers(0, kw["max_tokens"]))
    kw["n"] = draw(st.integers(1, 2))
    kw["temperature"] = draw(st.one_of(st.just(0.0), st.floats(1e-30, 65536.0)))
    kw["top_p"] = draw(st.one_of(st.just(1.0), st.floats(1e-300, 1.0, exclude_min=False).filter(lambda x: x > 0)))
    kw["top_k"] = draw(st.one_of(st.just(-1), st.integers(1, 10 ** 6)))
    kw["seed"] = draw(st.one_of(st.none(), st.integers(-(2 ** 63), 2 ** 64 - 2)))
    kw["stop"] = draw(st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=3), max_size=2)))
    kw["stop_token_ids"] = draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))
    kw["ignore_eos"] = draw(st.booleans())
    kw["logprobs"] = draw(st.one_of(st.none(), st.integers(0, 20)))
    kw["prompt_logprobs"] = draw(st.one_of(st.none(), st.integers(0, 5)))
    kw["presence_penalty"] = draw(st.floats(-2.0, 2.0))
    kw["frequency_penalty"] = draw(st.floats(-2.0, 2.0))
    kw["repetition_penalty"] = draw(st.floats(1e-3, 100.0))
    kw["min_p"] = draw(st.floats(0.0, 1.0))
    kw["logit_bias"] = draw(st.one_of(st.none(), st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100),
                                                                 max_size=3)))
    kw["allowed_token_ids"] = draw(st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)))
    return kw


@pytest.fixture(scope="module")
def fuzz_llm(server_model_dir):
    return LLM(server_model_dir, dtype="float32", max_model_len=64, max_num_seqs=8, progress=False)


def test_good_sampling_params_are_accepted_and_generate(fuzz_llm):
    """Valid extremes (temperature 65536 or 1e-30, top_p 1e-300, top_k 10**6, repetition_penalty 1e-3, the seed
    range's ends ...) build, run, and give n outputs of min_tokens..max_tokens tokens inside the vocabulary; the
    engine is empty after each."""
    @settings(CI, max_examples=60)
    @given(good_params(), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
    def run(kw, prompt):
        sp = SamplingParams(**kw)
        ends = set(kw["stop_token_ids"]) | (set() if kw["ignore_eos"] else set(fuzz_llm.llm_engine.eos_token_ids))
        if kw["min_tokens"] > 0 and kw["allowed_token_ids"] and set(kw["allowed_token_ids"]) <= ends:
            with pytest.raises(ValueError, match="allowed_token_ids"):  # nothing could be drawn: refused by name
                fuzz_llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
            assert not fuzz_llm.llm_engine.has_unfinished_requests()
            return
        out = fuzz_llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        assert len(out.outputs) == kw["n"]
        for o in out.outputs:
            assert o.finish_reason in ("stop", "length"), (o.finish_reason, o)
            assert len(o.token_ids) <= kw["max_tokens"]
            assert all(0 <= t < VOCAB for t in o.token_ids)
            if kw["allowed_token_ids"] is not None and o.token_ids:
                # EOS / stop tokens end a sequence but are outside allowed_token_ids only if listed there
                assert set(o.token_ids[:-1]) <= set(kw["allowed_token_ids"]), o.token_ids
            if o.finish_reason == "length":
                assert len(o.token_ids) == kw["max_tokens"]
            else:
                assert len(o.token_ids) >= kw["min_tokens"]
            if kw["logprobs"] is not None:
                assert len(o.logprobs) == len(o.token_ids)
        assert not fuzz_llm.llm_engine.has_unfinished_requests()

    run()


# ------------------------------------------------------------------------------------------------- HTTP
INNOCENT = {"prompt": [11, 12, 13, 14], "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def innocent_stream(client: httpx.Client) -> tuple[str, int]:
    """(text, completion_tokens) of the innocent greedy stream; raises if it does not end in [DONE]."""
    text, usage, done = [], None, False
    with client.stream("POST", "/v1/completions", json=INNOCENT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            assert "error" not in obj, obj
            for ch in obj["choices"]:
                text.append(ch["text"])
            usage = obj.get("usage") or usage
    assert done
    return "".join(text), usage["completion_tokens"]


def send(client: httpx.Client, case) -> httpx.Response:
    headers = {"content-type": case.content_type} if case.content_type else {}
    return client.request(case.method, case.path, content=case.body, headers=headers)


class Innocents:
    """Re-runs the innocent stream on its own connection until stopped; records every result."""

    def __init__(self, base_url: str):
        self.base_url, self.results, self.errors = base_url, [], []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, trust_env=False, timeout=120) as c:
            while not self.stop.is_set():
                try:
                    self.results.append(innocent_stream(c))
                except Exception as e:  # noqa: BLE001 - reported by the test
                    self.errors.append(repr(e))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(120)


def test_fuzzed_requests_get_4xx_json_and_leave_others_alone(server):
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=60) as alone:
        reference = innocent_stream(alone)
    assert reference[1] == INNOCENT["max_tokens"]
    stats: dict = {}
    client = httpx.Client(base_url=server.base_url, trust_env=False, timeout=60)

    @settings(CI, max_examples=300)
    @given(fuzz_cases(VOCAB))
    def run(case):
        try:
            r = send(client, case)
        except httpx.TransportError as e:  # a dropped / reset connection
            raise AssertionError(f"connection dropped on {case!r}: {e!r}") from None
        stats.setdefault(case.kind, {}).setdefault(r.status_code, 0)
        stats[case.kind][r.status_code] += 1
        why = check_answer(case, r.status_code, r.content)
        assert why is None, f"{case!r}: {why}"

    try:
        with Innocents(server.base_url) as inn:
            run()
    finally:
        client.close()
    assert not inn.errors, inn.errors[:3]
    assert inn.results and all(res == reference for res in inn.results), (reference, inn.results[:3])
    print("fuzz statistics (kind -> status -> requests):", json.dumps(stats, sort_keys=True))
    assert server.async_llm.health_error() is None


def test_schemathesis_negative_cases_get_4xx(server):
    """schemathesis drives the app's own OpenAPI schema (FastAPI's /openapi.json) with schema-violating bodies:
    every answer is a 4xx in OpenAI's error JSON (or a success where the generated body happens to be one the
    server accepts), never a 5xx or a dropped connection."""
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis import GenerationMode

    from tokenfab.testing.api_fuzz import FuzzCase
    spec = httpx.get(server.base_url + "/openapi.json", trust_env=False).json()
    schema = schemathesis.openapi.from_dict(spec)
    seen: dict = {}
    for result in schema.get_all_operations():
        op = result.ok()
        if op.method.upper() != "POST":
            continue

        @settings(CI, max_examples=25)
        @given(op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
        def run(case):
            r = case.call(base_url=server.base_url, timeout=60)
            seen.setdefault(op.label, {}).setdefault(r.status_code, 0)
            seen[op.label][r.status_code] += 1
            why = check_answer(FuzzCase("schemathesis", op.method, op.path, b"", expect="not5xx"), r.status_code,
                               r.content)
            assert why is None, f"{op.label} {case.body!r}: {why}"

        run()
    print("schemathesis (operation -> status -> requests):", json.dumps(seen, sort_keys=True))
    assert set(seen) == {"POST /tokenize", "POST /detokenize", "POST /v1/completions", "POST /v1/chat/completions"}


@pytest.mark.parametrize("kw,param", [(dict(stop=1), "stop"), (dict(stop={"a": 1}), "stop"),
                                      (dict(top_k=False), "top_k"), (dict(top_k=True), "top_k")])
def test_sampling_params_fuzz_findings(kw, param):
    """What the fuzzing found: ``stop=1`` raised a TypeError, ``stop={"a": 1}`` was taken as ``["a"]`` and
    ``top_k=False`` as "disabled"; each is now a ValueError naming the field."""
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


@pytest.mark.parametrize("path,field,value", [
    ("/v1/chat/completions", "seed", True), ("/v1/chat/completions", "temperature", False),
    ("/v1/completions", "temperature", "0.5"), ("/v1/completions", "max_tokens", 2.0),
    ("/v1/completions", "stream", 1), ("/v1/completions", "top_k", True), ("/tokenize", "add_special_tokens", "yes"),
])
def test_http_fields_take_their_json_type_only(http, path, field, value):
    """What the fuzzing found (schemathesis): pydantic's lax mode took ``"seed": true`` as seed 1 and
    ``"temperature": false`` as greedy, where SamplingParams refuses bools; every field now takes the JSON type it
    declares (an integer is still a valid number: ``"temperature": 1``)."""
    body = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            "/v1/completions": {"prompt": "hi", "max_tokens": 2}, "/tokenize": {"prompt": "hi"}}[path]
    r = http.post(path, json=dict(body, **{field: value}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and "must be" in err["message"], err
    assert http.post(path, json=dict(body, temperature=1) if path != "/tokenize" else body).status_code == 200


def test_only_end_tokens_allowed_under_min_tokens_is_refused(fuzz_llm):
    """Found by the fuzzer: allowed_token_ids = [EOS] with min_tokens >= 1 masks every token (min_tokens forbids
    EOS), so the draw returned token 0, outside allowed_token_ids. Refused by name; with ignore_eos it generates."""
    eos = fuzz_llm.llm_engine.eos_token_ids[0]
    with pytest.raises(ValueError, match="allowed_token_ids") as e:
        fuzz_llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2, min_tokens=1,
                                                                          allowed_token_ids=[eos]), use_tqdm=False)
    assert getattr(e.value, "param", None) == "allowed_token_ids"
    out = fuzz_llm.generate([{"prompt_token_ids": [5, 6]}],
                            SamplingParams(max_tokens=2, min_tokens=1, allowed_token_ids=[eos], ignore_eos=True,
                                           temperature=0), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [eos, eos]
