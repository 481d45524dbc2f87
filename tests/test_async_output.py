"""Deferred output processing (engine/output_processor.py, ``TOKENFAB_ASYNC_OUTPUT``): a step's detokenization, stop
strings and RequestOutputs made during the next step's forward. On by default for GPU engines only; forced on here
for CPU engines, whose outputs must equal those of the same engine with outputs in line: token ids, text, finish and
stop reasons, logprobs — with stop strings (seen one step late: the extra token is dropped), stop tokens, EOS
ignored or not, min_tokens, n > 1, seeded sampling, chunked prefill and an abort while outputs are held back.
"""
from __future__ import annotations

import pytest

from tokenfab import LLM, SamplingParams
from tokenfab.engine.output_processor import async_output_enabled
from tokenfab.errors import EngineConfigError

PROMPTS = [[5, 9, 14, 3, 7], [11, 12, 13], [7] * 30, [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]


def make_llm(monkeypatch, path: str, mode: str) -> LLM:
    monkeypatch.setenv("TOKENFAB_ASYNC_OUTPUT", mode)
    llm = LLM(path, dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=16, progress=False)
    assert llm.llm_engine.async_output == (mode == "1")
    return llm


def summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [sorted((t, round(lp.logprob, 5)) for t, lp in d.items())
                                               for d in c.logprobs]) for c in o.outputs] for o in outs]


def test_deferred_outputs_equal_outputs_in_line(monkeypatch, tiny_model):
    path = tiny_model("llama")
    sync = make_llm(monkeypatch, path, "0")
    probe = sync.generate([{"prompt_token_ids": p} for p in PROMPTS],
                          SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    text0, toks1 = probe[0].outputs[0].text, probe[1].outputs[0].token_ids
    assert len(text0) > 12, text0
    stop_str = text0[8:11]  # a stop string the first prompt's greedy text reaches after some tokens
    stop_tok = toks1[6]  # a stop token the second prompt's greedy output reaches
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, stop=[stop_str], ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_tok], ignore_eos=True),
        SamplingParams(temperature=0.9, max_tokens=17, seed=7, n=2, min_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=9, stop=[stop_str, "zz"], min_tokens=3),
    ]
    want = summary(sync.generate([{"prompt_token_ids": p} for p in PROMPTS], params))
    assert want[0][0][2:4] == ("stop", stop_str) and want[1][0][2:4] == ("stop", stop_tok), want
    deferred = make_llm(monkeypatch, path, "1")
    assert summary(deferred.generate([{"prompt_token_ids": p} for p in PROMPTS], params)) == want


def test_outputs_arrive_one_step_later_and_abort_flushes(monkeypatch, tiny_model):
    """With deferral a step returns the previous step's outputs; an abort flushes what is held back (returned by the
    next step) and the aborted request's final text is the decode of its tokens."""
    path = tiny_model("llama")
    llm = make_llm(monkeypatch, path, "1")
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eng.add_request("a", None, PROMPTS[0], sp)
    eng.add_request("b", None, PROMPTS[1], sp)
    assert eng.step() == []  # both prefills ran and sampled; their outputs wait for the next step's forward
    first = {o.request_id: len(o.outputs[0].token_ids) for o in eng.step()}
    assert first == {"a": 1, "b": 1}
    eng.step()
    final = eng.abort_request("a")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    n_a = len(final.outputs[0].token_ids)
    assert n_a == 3
    assert final.outputs[0].text == eng.tokenizer.decode(final.outputs[0].token_ids, skip_special_tokens=True)
    nxt = eng.step()  # the flushed outputs of the step before the abort come first (not the aborted request's)
    assert [o.request_id for o in nxt] == ["b"] and len(nxt[0].outputs[0].token_ids) == 3
    while eng.has_unfinished_requests():
        for o in eng.step():
            last = o
    assert last.request_id == "b" and last.finished and len(last.outputs[0].token_ids) == 20


def test_env_setting():
    import os
    old = os.environ.get("TOKENFAB_ASYNC_OUTPUT")
    try:
        os.environ.pop("TOKENFAB_ASYNC_OUTPUT", None)
        assert not async_output_enabled("cpu")
        os.environ["TOKENFAB_ASYNC_OUTPUT"] = "1"
        assert async_output_enabled("cpu")
        os.environ["TOKENFAB_ASYNC_OUTPUT"] = "yes"
        with pytest.raises(EngineConfigError, match="TOKENFAB_ASYNC_OUTPUT"):
            async_output_enabled("cpu")
    finally:
        if old is None:
            os.environ.pop("TOKENFAB_ASYNC_OUTPUT", None)
        else:
            os.environ["TOKENFAB_ASYNC_OUTPUT"] = old
