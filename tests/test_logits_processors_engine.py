"""Penalties, logit_bias, allowed_token_ids, bad_words and min_p through LLM.generate, against a reference loop:
transformers' model on the same tiny checkpoint, the per-row reference formulas of test_logits_processors.py,
greedy argmax (min_p: every sampled token must be inside the reference's min-p set)."""
from __future__ import annotations

import math

import pytest
import torch

from test_logits_processors import ref_bad_words, ref_penalties
from tokenfab import LLM, SamplingParams
from tokenfab.request_validation import bad_words_token_ids

PROMPTS = [[7, 81, 19, 300, 42, 5, 77], [12, 400, 3, 3, 91], [250, 17, 17, 17, 64, 9, 120, 33, 200]]
N_NEW = 14


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model("llama"), dtype="float32", max_model_len=128, max_num_seqs=16, progress=False)


def reference_generate(model, prompt: list[int], p: SamplingParams, bad_ids: list[list[int]], n: int) -> list[int]:
    """Greedy tokens with vLLM's processing order: allow-list, bad words, logit bias, then the penalties."""
    toks = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            row = model(torch.tensor([toks])).logits[0, -1].float().tolist()
        out = toks[len(prompt):]
        if p.allowed_token_ids is not None:
            row = [x if t in p.allowed_token_ids else -math.inf for t, x in enumerate(row)]
        row = ref_bad_words(row, out, bad_ids)
        for t, b in (p.logit_bias or {}).items():
            row[t] += b
        row = ref_penalties(row, prompt, out, p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        toks.append(max(range(len(row)), key=row.__getitem__))
    return toks[len(prompt):]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, **kw)


def test_each_parameter_matches_reference_in_one_batch(llm, llama_ref):
    plain = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(),
                                                          use_tqdm=False)]
    tok = llm.get_tokenizer()
    word = tok.decode(plain[0][3:5]).strip() or "ab"  # a word the plain greedy output does produce
    cases = [dict(repetition_penalty=1.8), dict(repetition_penalty=0.6), dict(frequency_penalty=1.5),
             dict(presence_penalty=2.0), dict(logit_bias={plain[1][0]: -100.0, plain[1][2]: -30.0, 11: 12.0}),
             dict(allowed_token_ids=[3, 9, 17, 64, 81, 120, 200, 300, 411, 500]), dict(bad_words=[word]),
             dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3, logit_bias={5: 3.0}), {}]
    reqs, params = [], []
    for i, kw in enumerate(cases):
        reqs.append({"prompt_token_ids": PROMPTS[i % len(PROMPTS)]})
        params.append(_greedy(**kw))
    outs = llm.generate(reqs, params, use_tqdm=False)  # one batch: every row with its own parameters
    for i, (kw, o) in enumerate(zip(cases, outs)):
        prompt = PROMPTS[i % len(PROMPTS)]
        bad = bad_words_token_ids(params[i].bad_words, tok) if params[i].bad_words else []
        want = reference_generate(llama_ref, prompt, params[i], bad, N_NEW)
        got = o.outputs[0].token_ids
        assert got == want, f"{kw}: {got} != reference {want}"
        if kw:  # the parameter changed something, so the comparison can fail
            assert got != plain[i % len(PROMPTS)], f"{kw} left the greedy output unchanged"
        else:  # a plain row in a penalized batch is untouched
            assert got == plain[i % len(PROMPTS)]


def test_penalties_survive_preemption(tiny_model, llama_ref):
    # a KV pool of 6 blocks of 16 tokens for 4 sequences of ~40 tokens: sequences are preempted and re-admitted,
    # which rebuilds their output counts from the token lists
    small = LLM(tiny_model("llama"), dtype="float32", max_model_len=64, max_num_seqs=4, num_kv_blocks=6,
                block_size=16, progress=False)
    p = _greedy(repetition_penalty=1.5, frequency_penalty=0.7)
    p.max_tokens = 30
    outs = small.generate([{"prompt_token_ids": q} for q in PROMPTS + PROMPTS[:1]], p, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    for q, o in zip(PROMPTS + PROMPTS[:1], outs):
        assert o.outputs[0].token_ids == reference_generate(llama_ref, q, p, [], 30)


def test_min_p_keeps_samples_inside_the_reference_set(llm, llama_ref):
    T, min_p, steps = 0.8, 0.3, 3

    def allowed(tokens: list[int]) -> set[int]:
        with torch.no_grad():
            probs = torch.softmax(llama_ref(torch.tensor([tokens])).logits[0, -1].float() / T, dim=-1)
        return set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())

    prompt = PROMPTS[0]
    with_min_p = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        n=24, temperature=T, min_p=min_p, max_tokens=steps, ignore_eos=True, seed=3), use_tqdm=False)[0]
    for c in with_min_p.outputs:
        for j, t in enumerate(c.token_ids):
            assert t in allowed(prompt + c.token_ids[:j])
    # without min_p the same draws leave the set: the check above can fail
    free = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        n=24, temperature=T, max_tokens=1, ignore_eos=True, seed=3), use_tqdm=False)[0]
    first = allowed(prompt)
    assert any(c.token_ids[0] not in first for c in free.outputs)


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    for kw, field in ((dict(logit_bias={512: 1.0}), "logit_bias"), (dict(allowed_token_ids=[3, 600]),
                                                                     "allowed_token_ids")):
        with pytest.raises(ValueError, match=field):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], _greedy(**kw), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], _greedy(), use_tqdm=False)  # the engine still serves
    assert len(out[0].outputs[0].token_ids) == N_NEW
