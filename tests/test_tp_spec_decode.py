"""Speculative decoding under tensor parallelism (N CPU processes over gloo, float32): greedy tokens identical to a
single-rank run without speculation.

* Qwen3 (8 heads, 2 KV heads: no even split on 3 ranks) at N = 2 and 3, with n-gram lookup and with a draft model
  (the target's own checkpoint, run unsharded on rank 0: every draft must be accepted, so the verification logits
  gathered across ranks are exactly the plain ones); four prompts of 7..34 tokens and a 16-token step budget, so
  verification rows share steps with prefill chunks.
* Kimi Linear (5 KDA heads split 3 + 2) at N = 2: n-gram drafts, then drafts from the known continuation with one
  wrong token at varying positions; each rank commits its own heads' KDA state (the commit is broadcast).
"""
from __future__ import annotations

import os

import pytest

from spec_helpers import NGRAM, spec_prompts, token_ids
from test_kimi_linear import make_kimi_linear
from test_spec_state_commit import OracleProposer
from tokenfab import LLM, SamplingParams

os.environ.setdefault("TOKENFAB_TP_TIMEOUT", "120")  # a broken test fails instead of hanging

ENGINE_KW = dict(dtype="float32", device="cpu", max_model_len=96, max_num_batched_tokens=16, block_size=8,
                 max_num_seqs=4, progress=False)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
QWEN3 = dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=100, num_hidden_layers=2)
_BASE: dict[str, list] = {}


def _generate(path: str, n: int, spec=None, proposer=None):
    """(tokens, engine stats) of spec_prompts() on ``n`` ranks; ``proposer(engine)`` replaces the drafter."""
    llm = LLM(path, tensor_parallel_size=n, speculative_config=spec, **ENGINE_KW)
    try:
        if proposer is not None:
            llm.llm_engine.spec.proposer = proposer(llm.llm_engine)
        return token_ids(llm.generate(spec_prompts(), GREEDY, use_tqdm=False)), llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()


def _base(name: str, path: str) -> list:
    if name not in _BASE:
        _BASE[name] = _generate(path, 1)[0]
    return _BASE[name]


@pytest.mark.parametrize("n", [2, 3])
def test_tp_greedy_identical_with_ngram_and_draft_model(tiny_model, n):
    path = tiny_model("qwen3", **QWEN3)
    base = _base("qwen3", path)
    toks, st = _generate(path, n, NGRAM)
    assert toks == base
    assert st["spec_decode_num_drafts"] > 0
    toks, st = _generate(path, n, {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                                   "verify_token_cost": 0.0, "verify_step_overhead": 0.0, "random_row_cost": 0.0})
    assert toks == base
    assert st["spec_decode_num_draft_tokens"] > 0
    assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]


def test_tp2_kimi_linear_greedy_identical_with_state_commit(tmp_path, tokenizer_dir):
    path = make_kimi_linear(str(tmp_path / "kl5"), tokenizer_dir, seed=11, linear_num_heads=5)
    base = _base("kimi_linear", path)
    expected = {len(p["prompt_token_ids"]): b for p, b in zip(spec_prompts(), base)}
    toks, st = _generate(path, 2, NGRAM)
    assert toks == base and st["spec_decode_num_drafts"] > 0
    toks, st = _generate(path, 2, NGRAM, lambda eng: OracleProposer(expected, eng.model_config.vocab_size))
    assert toks == base
    per_pos = st["spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos[0] > per_pos[2] > 0  # rows accepted 0..3 drafts: states committed after 1..4 tokens
