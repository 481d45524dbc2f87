"""The seeded contract under speculation and preemption: a request with a seed gives the same tokens whatever its
batch mates, so a KV pool small enough to preempt (``num_kv_blocks`` tiny: sequences lose their blocks, recompute,
and lose the drafts of the step that preempted them) changes nothing, for every proposer (ngram, draft_model, mtp,
dspark), for n = 1 and n = 2 (each completion its own seeded stream). The tokens are those of plain decoding."""
from __future__ import annotations

import pytest
import torch

from tokenfab import LLM, SamplingParams

ALWAYS = {"verify_token_cost": 0.0, "verify_step_overhead": 0.0, "random_row_cost": 0.0}  # draft k every step


def _prompts(n=4):
    base = [11, 23, 37, 41, 53, 67, 79, 83, 97, 101, 113, 127]
    return [{"prompt_token_ids": (base[: 3 + i] * 8)[: 7 + 9 * i]} for i in range(n)]


def _k3_prompts():
    g = torch.Generator().manual_seed(9)
    return [{"prompt_token_ids": torch.randint(5, 500, (n,), generator=g).tolist()} for n in (5, 17, 30)]


def _params(n: int, max_tokens: int, count: int) -> list[SamplingParams]:
    """Seeded random rows (top-k 3: drafts are accepted and rejected), one seed per request."""
    return [SamplingParams(n=n, temperature=1.0, top_k=3, max_tokens=max_tokens, ignore_eos=True, seed=100 + i)
            for i in range(count)]


def _all_tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _run(path, prompts, params, spec, **kw):
    llm = LLM(path, dtype="float32", progress=False, speculative_config=spec, **kw)
    outs = _all_tokens(llm.generate(prompts, params, use_tqdm=False))
    st = llm.llm_engine.get_stats()
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every reserved block came back
    return outs, st


def _check(path, prompts, spec, n, small: dict, big: dict, max_tokens=30, accepts=True):
    """Seeded tokens with the ``small`` engine arguments (which must preempt) equal those with ``big`` (which must
    not), and both equal plain decoding's (seeded rows are verified by sampled match: the tokens plain decoding
    draws from the same stream); both draft, and with ``accepts`` some drafts are accepted (random drafters accept
    none at top-k 3)."""
    params = _params(n, max_tokens, len(prompts))
    want, st0 = _run(path, prompts, params, spec, **big)
    got, st = _run(path, prompts, params, spec, **small)
    if spec is not None:
        assert _run(path, prompts, params, None, **big)[0] == want
    assert st["num_preemptions"] > 0 and st0["num_preemptions"] == 0
    if spec is not None:
        assert st["spec_decode_num_drafts"] > 0 and st0["spec_decode_num_drafts"] > 0
        assert st0["spec_decode_num_accepted_tokens"] > 0 or not accepts
    assert got == want


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("method", [None, "ngram", "draft_model", "draft_model_other"])
def test_seeded_tokens_unchanged_by_preemption(tiny_model, method, n):
    """Llama target: no speculation, n-gram lookup, and a draft model (the target itself, and an unrelated
    one-layer model) give the same seeded tokens with a 9-block pool (preemptions) as with a large one."""
    path = tiny_model("llama")
    spec = None
    if method == "ngram":
        spec = dict(ALWAYS, method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    elif method is not None:
        draft = path if method == "draft_model" else tiny_model("llama", seed=7, num_hidden_layers=1)
        spec = dict(ALWAYS, method="draft_model", model=draft, num_speculative_tokens=2)
    _check(path, _prompts(), spec, n, dict(num_kv_blocks=9, max_model_len=128), dict(max_model_len=128),
           accepts=method != "draft_model_other")


@pytest.mark.parametrize("n", [1, 2])
def test_seeded_tokens_unchanged_by_preemption_mtp(tmp_path_factory, tokenizer_dir, n):
    """DeepSeek-V3 target with one MTP layer drafting (its own KV rebuilt after a preemption)."""
    from tokenfab.testing.tiny_checkpoints import add_mtp_layers, make_tiny_checkpoint
    d = str(tmp_path_factory.getbasetemp() / "seeded-mtp")
    import os
    if not os.path.isdir(d):
        make_tiny_checkpoint(d, "deepseek_v3", vocab_size=512, tokenizer_dir=tokenizer_dir)
        add_mtp_layers(d, 1, seed=3)
    spec = dict(ALWAYS, method="mtp", num_speculative_tokens=3)
    _check(d, _prompts(), spec, n, dict(num_kv_blocks=9, max_model_len=128), dict(max_model_len=128),
           accepts=False)


@pytest.mark.parametrize("n", [1, 2])
def test_seeded_tokens_unchanged_by_preemption_dspark(tmp_path_factory, tokenizer_dir, n):
    """Tiny Kimi K3 target (KDA state) with a DSpark drafter on its layer taps."""
    from test_kimi_k3 import TEXT, k3_tensors, write_k3
    from tokenfab.testing.tiny_dspark import write_tiny_dspark
    stored, _ = k3_tensors(TEXT)
    path = write_k3(str(tmp_path_factory.mktemp("k3s")), tokenizer_dir, tensors=stored)
    drafter, _, _ = write_tiny_dspark(str(tmp_path_factory.mktemp("dsparks")), "specforge", ["mla"] * 5,
                                      block_size=4, target_layer_ids=(0, 2),
                                      target_num_layers=TEXT["num_hidden_layers"], seed=3)
    spec = dict(ALWAYS, method="dspark", model=drafter, num_speculative_tokens=3)
    _check(path, _k3_prompts(), spec, n, dict(num_kv_blocks=4, max_model_len=64), dict(max_model_len=64),
           max_tokens=26, accepts=False)


def test_sampled_match_rows_emit_the_plain_draws():
    """rejection_sample's sampled-match rows (seeded): the token at verified position j is the inverse-CDF draw
    from p_j at u_match[j], drafts are accepted while they equal it, and the token after the accepted run is that
    draw; an unseeded row in the same call keeps the min(1, p/q) rule (its u_accept 0.99 rejects a draft with
    p(d) < 0.99). VerifyUniforms reads a seeded stream ahead without advancing it and advances it by the tokens
    emitted; DraftUniforms reads the same values."""
    from types import SimpleNamespace

    from tokenfab.engine.sampler import inverse_cdf_sample
    from tokenfab.spec_decode.rejection_sampler import (DraftUniforms, SamplingTensors, VerifyUniforms,
                                                        rejection_sample)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 6, generator=g)  # N 3, k 3, V 6
    st = SamplingTensors(torch.ones(3), None, None, torch.zeros(3, dtype=torch.bool))
    u = torch.tensor([[0.1, 0.5, 0.9, 0.3], [0.7, 0.2, 0.4, 0.6], [0.0, 0.0, 0.0, 0.0]])
    plain = inverse_cdf_sample(logits.softmax(-1).reshape(-1, 6), u.reshape(-1)).view(3, 4)
    drafts = plain[:, :3].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % 6  # row 1: mismatch at position 1
    res = rejection_sample(logits, drafts, torch.tensor([3, 3, 3]), None, st, torch.full((3, 3), 0.99),
                           torch.zeros(3), torch.tensor([True, True, False]), u)
    assert res.num_accepted[:2].tolist() == [3, 1]
    assert res.token_ids[0].tolist() == plain[0].tolist()  # 3 accepted + the bonus draw
    assert res.token_ids[1, :2].tolist() == plain[1, :2].tolist()  # 1 accepted + the draw at the mismatch
    p2 = logits[2].softmax(-1)
    assert int(res.num_accepted[2]) == int((p2[torch.arange(3), drafts[2]] > 0.99).cumprod(0).sum())

    seqs = [SimpleNamespace(generator=torch.Generator().manual_seed(7)), SimpleNamespace(generator=None)]
    ahead = torch.rand(5, generator=torch.Generator().manual_seed(7))
    vu = VerifyUniforms.draw(seqs, 4, torch.Generator(), [3, 2])
    assert vu.match_rows.tolist() == [True, False] and torch.equal(vu.u_match[0], ahead[:4])
    du = DraftUniforms(seqs, torch.Generator(), 3)
    assert [float(du(j)[0]) for j in range(3)] == ahead[:3].tolist()
    vu.advance(seqs, torch.tensor([2, 1]))
    assert float(torch.rand((), generator=seqs[0].generator)) == float(ahead[2])
