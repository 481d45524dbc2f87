"""Offline logprobs in vLLM's shape: ``{token_id: Logprob(logprob, rank, decoded_token)}`` per position.

Checked by hand against transformers on a tiny float32 Llama: every rank is the token's place in the reference's
sorted vocabulary, every text its ``tokenizer.decode([id])``, the top-k ids the reference's k largest, and the
position's own token (sampled, or the prompt's) is always there, also when it falls outside the top k.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import load_reference, reference_logprobs
from tokenfab import LLM, Logprob, SamplingParams

PROMPT = [1, 17, 42, 99, 5, 250, 7, 31]


@pytest.fixture(scope="module")
def setup(tiny_model):
    path = tiny_model("llama")
    llm = LLM(path, dtype="float32", max_model_len=64, progress=False)
    return llm, load_reference(path), llm.get_tokenizer()


def _hand_rank(row: torch.Tensor, token: int) -> int:
    """1 + the number of vocabulary entries more likely than ``token`` (the reference row has no exact ties)."""
    order = sorted(range(row.numel()), key=lambda v: -row[v].item())
    return order.index(token) + 1


def _check_position(d: dict, own: int, k: int, row: torch.Tensor, tok) -> None:
    assert own in d  # the sampled / prompt token is always present
    top = row.topk(k).indices.tolist() if k else []
    assert set(d) == set(top) | {own}
    assert list(d)[0] == own  # first in the dict, as it is built
    for t, e in d.items():
        assert isinstance(e, Logprob)
        assert e.logprob == pytest.approx(row[t].item(), abs=1e-4)
        assert e.rank == _hand_rank(row, t)
        assert e.decoded_token == tok.decode([t])
    assert [d[t].rank for t in top] == list(range(1, k + 1))


@pytest.mark.parametrize("k", [0, 1, 3])
def test_ranks_texts_and_own_token_by_hand(setup, k):
    llm, ref, tok = setup
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, logprobs=k, prompt_logprobs=k)
    out = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    lp = reference_logprobs(ref, PROMPT + gen)  # row t: the distribution of token t + 1
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        _check_position(out.prompt_logprobs[i], PROMPT[i], k, lp[i - 1], tok)
    logprobs = out.outputs[0].logprobs
    assert len(logprobs) == len(gen)
    for j, (t, d) in enumerate(zip(gen, logprobs)):
        _check_position(d, t, k, lp[len(PROMPT) + j - 1], tok)
    # sampling at temperature 1 from a near-uniform tiny model: some drawn tokens rank far below the top k
    assert any(d[t].rank > k + 1 for t, d in zip(gen, logprobs))
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(gen, logprobs)))


def test_greedy_token_is_rank_one(setup):
    llm, _, _ = setup
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    c = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs[0]
    assert all(d[t].rank == 1 and len(d) == 2 for t, d in zip(c.token_ids, c.logprobs))


def test_logprob_is_vllms_dataclass():
    assert [f.name for f in dataclasses.fields(Logprob)] == ["logprob", "rank", "decoded_token"]
    e = Logprob(-0.5)
    assert e.rank is None and e.decoded_token is None and e == Logprob(-0.5, None, None)
