"""MTP and DSpark speculation under tensor parallelism (N CPU processes over gloo, float32).

The drafter runs unsharded on rank 0 from the captured target hidden states (MTP: final post-norm states; DSpark:
layer taps) and full copies of the target's embedding / LM head read from the checkpoint
(tokenfab/spec_decode/target_vocab.py). Checked at N = 2 and 3 (4 attention heads, a 512-row vocabulary and 8 / 6
experts: no split on 3 ranks is even), with four (MTP) / three (DSpark) prompts of mixed lengths and a 16-token step
budget, so verification rows share steps with prefill chunks:

* greedy tokens identical to a single-rank run without speculation;
* every proposal identical to the single-rank speculative run's (same lengths, same drafts): the drafter saw the
  same (complete) hidden states and tables on rank 0 as on one device, where tests/test_spec_mtp.py and
  tests/test_spec_dspark.py check the drafts against hand-written references;
* a perfect drafter (MTP: ``perfect_mtp_pair``; DSpark: drafts replaced by the known continuation) gets drafts
  accepted, so the test fails if drafting silently never happens under tensor parallel.
"""
from __future__ import annotations

import os

import pytest

from spec_helpers import spec_prompts, token_ids
from test_spec_dspark import ALWAYS, K3_5MLA, _k3_prompts, _Oracle
from test_spec_mtp import MTP
from tokenfab import LLM, SamplingParams

os.environ.setdefault("TOKENFAB_TP_TIMEOUT", "120")  # a broken test fails instead of hanging

ENGINE_KW = dict(dtype="float32", device="cpu", max_model_len=96, max_num_batched_tokens=16, block_size=8,
                 max_num_seqs=4, progress=False)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
_CACHE: dict = {}


def _run(path: str, n: int, prompts, spec=None, oracle_from=None):
    """(tokens, stats, proposals) of ``prompts`` on ``n`` ranks; proposals {(prompt length, length): drafts}.
    ``oracle_from``: outputs of a plain run; the same engine then generates ``prompts`` again with every proposal's
    drafts replaced by those continuations (_Oracle), and a second (tokens, stats of that run alone) is returned."""
    llm = LLM(path, tensor_parallel_size=n, speculative_config=spec, **ENGINE_KW)
    eng = llm.llm_engine
    props: dict = {}
    try:
        if spec is None:
            return token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)), eng.get_stats(), props
        prop = eng.spec.proposer
        inner = orig = prop.propose

        def propose(seqs, rows, token_ids, lengths, max_lens):
            out = inner(seqs, rows, token_ids, lengths, max_lens)
            for s, L, d, c in zip(seqs, lengths, out.draft_ids, out.draft_lens):
                props[(s.num_prompt_tokens, int(L))] = d[: int(c)].tolist()
            return out

        prop.propose = propose
        res = (token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)), dict(eng.get_stats()), props)
        if oracle_from is None:
            return res
        full, orig_add = {}, eng.add_request

        def add(rid, *a, **kw):  # this run's request ids -> the plain run's continuations, in prompt order
            o = oracle_from[len(full)]
            full[rid] = o.prompt_token_ids + o.outputs[0].token_ids
            return orig_add(rid, *a, **kw)

        eng.add_request = add
        oracle = _Oracle(prop, full)
        oracle.orig, inner, props = orig, oracle, {}  # the drafter's own propose underneath
        toks = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
        st = eng.get_stats()
        return res, (toks, {k: st[k] - res[1][k] for k in ("spec_decode_num_draft_tokens",
                                                          "spec_decode_num_accepted_tokens")})
    finally:
        eng.shutdown()


def _cached(key, fn):
    if key not in _CACHE:
        _CACHE[key] = fn()
    return _CACHE[key]


# ------------------------------------------------------------------------------------------------------------ MTP
@pytest.fixture(scope="module")
def mtp_paths(tmp_path_factory, tokenizer_dir):
    """(tiny DeepSeek-V3 with one random MTP layer, its perfect-drafter pair)."""
    from tokenfab.testing.tiny_checkpoints import add_mtp_layers, make_tiny_checkpoint, perfect_mtp_pair
    root = tmp_path_factory.mktemp("tp_mtp")
    d = str(root / "ds")
    make_tiny_checkpoint(d, "deepseek_v3", vocab_size=512, tokenizer_dir=tokenizer_dir, dtype="float32")
    add_mtp_layers(d, 1, seed=3)
    return d, perfect_mtp_pair(d, str(root / "perfect"))


@pytest.mark.parametrize("n", [2, 3])
def test_tp_mtp_greedy_identical_and_drafts_as_one_device(mtp_paths, n):
    path, perfect = mtp_paths
    base = _cached(("mtp", path), lambda: _run(path, 1, spec_prompts())[0])
    one = _cached(("mtp-spec", path), lambda: _run(path, 1, spec_prompts(), MTP))
    toks, st, props = _run(path, n, spec_prompts(), MTP)
    assert toks == base
    assert st["spec_decode_num_draft_tokens"] > 0
    assert props == one[2]  # every proposal (length and drafts) as on one device
    assert st["spec_decode_num_accepted_tokens"] == one[1]["spec_decode_num_accepted_tokens"]
    pbase = _cached(("mtp", perfect), lambda: _run(perfect, 1, spec_prompts())[0])
    toks, st, _ = _run(perfect, n, spec_prompts(), MTP)
    assert toks == pbase
    assert st["spec_decode_num_draft_tokens"] > 0
    assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]


# --------------------------------------------------------------------------------------------------------- DSpark
@pytest.fixture(scope="module")
def k3_pair(tmp_path_factory, tokenizer_dir):
    """(tiny K3 with 3 MLA / 3 KDA heads and 6 MXFP4 experts as tests/test_tp_kimi.py, a SpecForge 5MLA drafter
    tapping layers 0 and 2)."""
    from test_kimi_k3 import TEXT, k3_tensors, write_k3
    from tokenfab.testing.tiny_dspark import write_tiny_dspark
    root = tmp_path_factory.mktemp("tp_dspark")
    text = dict(TEXT, num_attention_heads=3, num_experts=6, intermediate_size=97,
                linear_attn_config=dict(TEXT["linear_attn_config"], num_heads=3))
    stored, _ = k3_tensors(text, seed=2)
    target = write_k3(str(root / "k3"), tokenizer_dir, text=text, tensors=stored)
    drafter, _, _ = write_tiny_dspark(str(root / "drafter"), "specforge", K3_5MLA, block_size=4,
                                      target_layer_ids=(0, 2), target_num_layers=text["num_hidden_layers"], seed=3)
    return target, drafter


@pytest.mark.parametrize("n, tap", [(2, "attn_res_mixture"), (3, "partial_sum")])
def test_tp_dspark_greedy_identical_and_drafts_as_one_device(k3_pair, n, tap):
    """Both tap streams (the K3 partial block sum and the attention-residual mixture, read on rank 0); KDA states
    rolled back on every rank after each verification."""
    path, drafter = k3_pair
    spec = dict(ALWAYS, method="dspark", model=drafter, num_speculative_tokens=3, dspark_tap=tap)
    base_outs = _cached(("k3", path), lambda: LLM(path, **ENGINE_KW).generate(_k3_prompts(), GREEDY, use_tqdm=False))
    base = token_ids(base_outs)
    one = _cached(("k3-spec", tap), lambda: _run(path, 1, _k3_prompts(), spec))
    (toks, st, props), (otoks, ost) = _run(path, n, _k3_prompts(), spec, oracle_from=base_outs)
    assert toks == base
    assert st["spec_decode_num_draft_tokens"] > 0
    assert props == one[2]
    assert otoks == base  # the same engine, every draft the known continuation
    assert ost["spec_decode_num_draft_tokens"] > 0
    assert ost["spec_decode_num_accepted_tokens"] == ost["spec_decode_num_draft_tokens"]
