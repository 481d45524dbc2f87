"""Speculative decoding: config validation, n-gram lookup, the rejection sampler against the formula by exact
enumeration, greedy outputs identical with and without each proposer (Llama, DeepSeek-V3, mixed prompt lengths,
preemption), output distributions unchanged at temperature > 0 (bad and perfect drafters), exact counters on a
scripted proposer, seeded reproducibility."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from server_fixtures import SERVED_NAME, server_model_dir  # noqa: F401
from spec_helpers import NGRAM, RandomProposer, spec_prompts, token_hist, token_ids
from tokenfab import LLM, SamplingParams
from tokenfab.errors import EngineConfigError, UnsupportedError
from tokenfab.spec_decode.config import parse_speculative_config
from tokenfab.spec_decode.ngram_proposer import ngram_lookup
from tokenfab.spec_decode.proposer import Proposal, Proposer
from tokenfab.spec_decode.rejection_sampler import (SamplingTensors, acceptance_probs, recovery_probs,
                                                    rejection_sample, target_probs)

# ------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("cfg, match", [
    ({"method": "ngram"}, "num_speculative_tokens is missing"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be in"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_mx": 3}, "unknown field 'prompt_lookup_mx'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
     "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model is missing"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/folder"}, "not a checkpoint folder"),
    ({"method": "foo", "num_speculative_tokens": 2}, "method 'foo' is unknown"),
    ('{"method": "ngram", ', "cannot read"),
])
def test_config_errors_name_the_field(cfg, match):
    with pytest.raises(EngineConfigError, match=match):
        parse_speculative_config(cfg)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_unimplemented_methods_refused_by_name(method):
    with pytest.raises(UnsupportedError, match=f"'{method}' is not implemented yet"):
        parse_speculative_config({"method": method, "num_speculative_tokens": 1})


def test_config_json_and_defaults():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5}')
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (5, 4, 1)
    assert parse_speculative_config({}) is None and parse_speculative_config(None) is None


# ---------------------------------------------------------------------------------------------- n-gram lookup
def test_ngram_lookup_hand_worked():
    # row 0: suffix [1, 7, 8] occurred at positions 0-2 (a 3-gram beats the later 2-gram [7, 8] at 5-6) -> 2, 3, 7
    # row 1: no earlier occurrence of its last token -> no draft; row 2: suffix [3] only (n_min 1) -> 4, 5, 3
    toks = np.array([[1, 7, 8, 2, 3, 7, 8, 9, 1, 7, 8],
                     [5, 6, 7, 8, 9, 0, 0, 0, 0, 0, 0],
                     [3, 4, 5, 3, 0, 0, 0, 0, 0, 0, 0]])
    lens = np.array([11, 5, 4])
    d, n = ngram_lookup(toks, lens, 1, 3, 3)
    assert n.tolist() == [3, 0, 3]
    assert d[0].tolist() == [2, 3, 7] and d[2].tolist() == [4, 5, 3]
    # the longest match wins over a later shorter one: suffix [1, 2]; [2] alone also ends at 5
    d, n = ngram_lookup(np.array([[1, 2, 5, 6, 9, 2, 8, 1, 2]]), np.array([9]), 1, 2, 2)
    assert d[0].tolist() == [5, 6]
    d, n = ngram_lookup(toks, lens, 1, 2, 3)  # only 2-grams: the latest [7, 8] ends at 6 -> 9, 1, 7
    assert d[0].tolist() == [9, 1, 7]
    d, n = ngram_lookup(toks, lens, 1, 3, 3, max_lens=np.array([1, 3, 0]))
    assert n.tolist() == [1, 0, 0]


# ----------------------------------------------------------------------------- rejection sampler, exactly
def _intervals(points):
    """[0, 1) cut at ``points``: (midpoints, lengths)."""
    cuts = np.unique(np.clip(np.concatenate([[0.0, 1.0], np.asarray(points, dtype=np.float64)]), 0, 1))
    return (cuts[:-1] + cuts[1:]) / 2, np.diff(cuts)


@pytest.mark.parametrize("top_k", [3, None])
@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampler_matches_formula_by_enumeration(one_hot, top_k):
    """k = 2 drafts over V = 4 with temperature 0.8 and top-k 3. Enumerate every draft pair (weighted by q, or
    fixed for one-hot proposals) and every interval of the uniforms between the points where the decision can
    change: the exact joint law of the first two emitted tokens must be p0 x p1 (the target's; position 1's target
    here does not depend on position 0's token, so the next step after a rejection draws from p1)."""
    g = torch.Generator().manual_seed(3)
    V, k = 4, 2
    logits = torch.randn(1, k + 1, V, generator=g) * 2
    st = SamplingTensors(torch.tensor([0.8]), None if top_k is None else torch.tensor([top_k]), None,
                         torch.tensor([False]))
    p = target_probs(logits, st)[0].double()  # [3, V]
    # independent reference for the processed target: softmax(logits / T) restricted to its top k
    ref = torch.softmax(logits[0].double() / 0.8, -1)
    if top_k is not None:
        ref = ref * (ref >= ref.sort(-1, descending=True).values[:, top_k - 1:top_k])
    assert torch.allclose(p, ref / ref.sum(-1, keepdim=True), atol=1e-6)
    q = torch.softmax(torch.randn(k, V, generator=g, dtype=torch.float64), -1)
    drafts = list(itertools.product(range(V), repeat=2))
    joint = torch.zeros(V, V, dtype=torch.float64)
    for d0, d1 in drafts:
        w = 1.0 if one_hot else float(q[0, d0] * q[1, d1])
        qd = torch.nn.functional.one_hot(torch.tensor([d0, d1]), V).double() if one_hot else q
        a = acceptance_probs(p[torch.arange(2), torch.tensor([d0, d1])], qd[torch.arange(2), torch.tensor([d0, d1])])
        finals = [recovery_probs(p[0], qd[0]), recovery_probs(p[1], qd[1]), p[2]]
        cdf_pts = np.concatenate([torch.cumsum(f, 0).numpy() for f in finals])
        u0, w0 = _intervals([float(a[0])])
        u1, w1 = _intervals([float(a[1])])
        uf, wf = _intervals(cdf_pts)
        grid = [(x0, x1, xf, a0 * a1 * af) for (x0, a0), (x1, a1), (xf, af) in
                itertools.product(zip(u0, w0), zip(u1, w1), zip(uf, wf))]
        n = len(grid)
        res = rejection_sample(logits.expand(n, -1, -1), torch.tensor([[d0, d1]] * n), torch.full((n,), 2),
                               None if one_hot else q.float().expand(n, -1, -1),
                               SamplingTensors(st.temperatures.expand(n),
                                               None if st.top_k is None else st.top_k.expand(n), None,
                                               st.greedy.expand(n)),
                               torch.tensor([[g0, g1] for g0, g1, _, _ in grid], dtype=torch.float32),
                               torch.tensor([gf for _, _, gf, _ in grid], dtype=torch.float32))
        toks, emitted = res.token_ids.numpy(), res.num_emitted.numpy()
        for r, (_, _, _, mass) in enumerate(grid):
            if emitted[r] >= 2:
                joint[toks[r, 0], toks[r, 1]] += w * mass
            else:  # one token emitted: the next step draws the second from p1
                joint[toks[r, 0]] += w * mass * p[1]
    total = float(joint.sum())
    if one_hot:  # every draft pair is a separate experiment of mass 1
        joint /= len(drafts)
        total /= len(drafts)
    assert abs(total - 1) < 1e-6  # p is float32 (sums to 1 within ~1e-8)
    assert torch.allclose(joint, torch.outer(p[0], p[1]), atol=2e-6), (joint, torch.outer(p[0], p[1]))


def test_rejection_sampler_greedy_and_bonus():
    # target argmax per position: 2, 0, 3, 1; drafts accepted while equal, then the target's token
    logits = torch.full((3, 4, 5), -1.0)
    for j, t in enumerate([2, 0, 3, 1]):
        logits[:, j, t] = 5.0
    drafts = torch.tensor([[2, 0, 3], [2, 4, 3], [1, 0, 3]])
    st = SamplingTensors(torch.zeros(3), None, None, torch.ones(3, dtype=torch.bool))
    res = rejection_sample(logits, drafts, torch.tensor([3, 3, 2]), None, st, torch.zeros(3, 3), torch.zeros(3))
    assert res.num_accepted.tolist() == [3, 1, 0]
    assert res.token_ids[0].tolist() == [2, 0, 3, 1]  # all accepted + bonus
    assert res.token_ids[1, :2].tolist() == [2, 0] and res.token_ids[2, 0].item() == 2


# ------------------------------------------------------------------------------------ greedy, through the engine
def _llm(path, spec=None, **kw):
    return LLM(path, dtype="float32", progress=False, speculative_config=spec, **kw)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_greedy_identical_with_ngram(tiny_model, family):
    path = tiny_model(family)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = token_ids(_llm(path).generate(spec_prompts(), sp))
    llm = _llm(path, NGRAM)
    assert token_ids(llm.generate(spec_prompts(), sp)) == base
    st = llm.llm_engine.get_stats()
    assert st["spec_decode_num_drafts"] > 0 and st["spec_decode_num_accepted_tokens"] > 0
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every reserved block came back


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_greedy_identical_with_draft_model(tiny_model, family):
    path = tiny_model(family)
    bad = tiny_model("llama", seed=7, num_hidden_layers=1)  # same vocabulary, unrelated weights
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = token_ids(_llm(path).generate(spec_prompts(3), sp))
    for draft, full in ((bad, False), (path, True)):
        llm = _llm(path, {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                          "verify_token_cost": 0.0, "verify_step_overhead": 0.0,
         "random_row_cost": 0.0}, max_model_len=512)
        assert token_ids(llm.generate(spec_prompts(3), sp)) == base
        st = llm.llm_engine.get_stats()
        assert st["spec_decode_num_drafts"] > 0
        if full:  # the target as its own draft: every draft accepted
            assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]


def test_greedy_identical_under_preemption(tiny_model):
    path = tiny_model("llama")
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = spec_prompts(4)
    base = token_ids(_llm(path).generate(prompts, sp))
    llm = _llm(path, NGRAM, num_kv_blocks=9, max_model_len=128)
    assert token_ids(llm.generate(prompts, sp)) == base
    st = llm.llm_engine.get_stats()
    assert st["num_preemptions"] > 0 and st["spec_decode_num_drafts"] > 0
    llm = _llm(path, {"method": "draft_model", "model": path, "num_speculative_tokens": 2,
                                "verify_token_cost": 0.0, "verify_step_overhead": 0.0,
         "random_row_cost": 0.0}, num_kv_blocks=9,
               max_model_len=128)
    assert token_ids(llm.generate(prompts, sp)) == base
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0


def test_draft_model_vocab_mismatch_refused(tiny_model, tokenizer_dir, tmp_path):
    from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
    path = tiny_model("llama")
    other = make_tiny_checkpoint(str(tmp_path / "v640"), "llama", vocab_size=640, tokenizer_dir=tokenizer_dir)
    with pytest.raises(EngineConfigError, match="vocab_size"):
        _llm(path, {"method": "draft_model", "model": other, "num_speculative_tokens": 2})


# ------------------------------------------------------------------------------ scripted proposer: exact counters
class ScriptedProposer(Proposer):
    """Proposes the known greedy continuation for 2 tokens, then a wrong token."""

    def __init__(self, expected: dict[int, list[int]], V: int):
        self.num_speculative_tokens = 3
        self.expected, self.V = expected, V

    def propose(self, seqs, rows, token_ids, lengths, max_lens):
        d = np.zeros((len(seqs), 3), dtype=np.int64)
        for i, s in enumerate(seqs):
            exp = self.expected[s.num_prompt_tokens]
            o = s.num_output_tokens
            nxt = exp[o:o + 3] + [0, 0, 0]
            d[i] = [nxt[0], nxt[1], (nxt[2] + 1) % self.V]
        return Proposal(d, np.minimum(3, max_lens).astype(np.int64), None)


def test_acceptance_counters_exact_on_scripted_proposer(tiny_model):
    path = tiny_model("llama")
    max_tokens = 14
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = spec_prompts(3)
    base = token_ids(_llm(path).generate(prompts, sp))
    llm = _llm(path, NGRAM)
    eng = llm.llm_engine
    expected = {len(p["prompt_token_ids"]): b for p, b in zip(prompts, base)}
    eng.spec.proposer = ScriptedProposer(expected, eng.model_config.vocab_size)
    assert token_ids(llm.generate(prompts, sp)) == base
    drafts = draft_tokens = accepted = 0
    per_pos = [0, 0, 0]
    for _ in prompts:  # hand simulation: 1 token from the prefill, then verification steps
        o = 1
        while o < max_tokens:
            c = min(3, max_tokens - o - 1)
            if c <= 0:
                o += 1  # a plain decode step
                continue
            a = min(2, c)
            drafts, draft_tokens, accepted = drafts + 1, draft_tokens + c, accepted + a
            for j in range(a):
                per_pos[j] += 1
            o += a + 1
    st = eng.get_stats()
    assert (st["spec_decode_num_drafts"], st["spec_decode_num_draft_tokens"],
            st["spec_decode_num_accepted_tokens"]) == (drafts, draft_tokens, accepted)
    assert st["spec_decode_num_accepted_tokens_per_pos"] == per_pos


def test_logprobs_of_accepted_drafts_are_their_positions(tiny_model):
    """With drafts accepted (the scripted proposer above: two of three per step), each emitted token's logprobs come
    from its own verified position: the same top-2 ids and values within 1e-5 as plain decoding at every output
    position (a mix-up of positions, e.g. every token given its step's first position, fails here)."""
    path = tiny_model("llama")
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = spec_prompts(3)
    base = _llm(path).generate(prompts, sp)
    llm = _llm(path, NGRAM)
    eng = llm.llm_engine
    eng.spec.proposer = ScriptedProposer({len(p["prompt_token_ids"]): b for p, b in zip(prompts, token_ids(base))},
                                         eng.model_config.vocab_size)
    out = llm.generate(prompts, sp)
    assert token_ids(out) == token_ids(base) and eng.get_stats()["spec_decode_num_accepted_tokens"] > 0
    for a, b in zip(out, base):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert set(x) == set(y) and all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)


# --------------------------------------------------------------------------- distributions at temperature > 0
N_SAMPLES = 1200
# top-k 2 at temperature 1: output token 2 takes <= 4 values, token 3 <= 8. Two independent samples of 1,200 from
# one law over 8 values have E[TV] ~ 0.05 (sd ~ 0.015); a verifier that keeps rejected random drafts gives TV ~ 1.
TV_TOL = 0.12


TV_PROMPT = {"prompt_token_ids": [11, 23, 37, 41, 53, 11, 23, 37]}


@pytest.fixture(scope="module")
def no_spec_samples(tiny_model):
    """The 1,200 requests (seeds 0..1199, top-k 2, temperature 1) without speculation: the law every drafter's
    counts are compared with, generated once for the module."""
    sps = [SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True, seed=i) for i in range(N_SAMPLES)]
    return _llm(tiny_model("llama"), max_num_seqs=128).generate([TV_PROMPT] * N_SAMPLES, sps)


@pytest.mark.parametrize("drafter", ["random_tokens", "random_draft_model", "target_as_draft"])
def test_distribution_unchanged_at_temperature_one(tiny_model, no_spec_samples, drafter):
    """Output tokens 2 and 3 (the first two that verification produces: a draft or its recovery, then the bonus)
    over 1,200 requests (fixed seeds), top-k 2 at temperature 1: total variation to the same counts without
    speculation below TV_TOL."""
    path = tiny_model("llama")
    prompt = TV_PROMPT
    V = 512
    base = no_spec_samples
    if drafter == "random_tokens":
        llm = _llm(path, dict(NGRAM, num_speculative_tokens=2), max_num_seqs=128)
        llm.llm_engine.spec.proposer = RandomProposer(2, V)
    else:
        draft = tiny_model("llama", seed=5) if drafter == "random_draft_model" else path
        llm = _llm(path, {"method": "draft_model", "model": draft, "num_speculative_tokens": 2,
                          "verify_token_cost": 0.0, "verify_step_overhead": 0.0,
         "random_row_cost": 0.0}, max_num_seqs=128, max_model_len=512)
    spec = llm.generate([prompt] * N_SAMPLES, [SamplingParams(temperature=1.0, top_k=2, max_tokens=3,
                                                              ignore_eos=True, seed=10_000 + i)
                                               for i in range(N_SAMPLES)])
    st = llm.llm_engine.get_stats()
    assert st["spec_decode_num_draft_tokens"] == N_SAMPLES  # one draft each (max_tokens leaves room for one)
    if drafter == "target_as_draft":
        assert st["spec_decode_num_accepted_tokens"] >= 0.97 * N_SAMPLES
    elif drafter == "random_tokens":
        assert st["spec_decode_num_accepted_tokens"] < 0.05 * N_SAMPLES
    for pos in (1, 2):
        tv = 0.5 * np.abs(token_hist(base, pos, V) - token_hist(spec, pos, V)).sum()
        assert tv < TV_TOL, (drafter, pos, tv)


def test_seeded_request_reproducible_whatever_its_batch(tiny_model):
    path = tiny_model("llama")
    llm = _llm(path, NGRAM)
    sp = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)
    p = spec_prompts(4)
    alone = token_ids(llm.generate([p[2]], sp))[0]
    mates = [SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True)] * 3
    together = token_ids(llm.generate(p, [mates[0], mates[1], sp, mates[2]]))[2]
    assert together == alone
    assert llm.llm_engine.get_stats()["spec_decode_num_drafts"] > 0


def test_rows_with_logprobs_are_speculated_with_the_same_logprobs(tiny_model):
    """Rows asking for logprobs (one with a repetition penalty: logprobs stay the model's raw ones) are verified
    like any other: same tokens, the same top-2 ids and each logprob within 1e-5 of plain decoding (float32; the
    verified positions' logits come from one multi-token forward)."""
    path = tiny_model("llama")
    sps = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, repetition_penalty=1.3),
           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    base = _llm(path).generate(spec_prompts(3), sps)
    llm = _llm(path, NGRAM)
    out = llm.generate(spec_prompts(3), sps)
    assert token_ids(out) == token_ids(base)
    assert llm.llm_engine.get_stats()["spec_decode_num_drafts"] > 0
    for a, b in zip(out[:2], base[:2]):
        assert len(a.outputs[0].logprobs) == len(b.outputs[0].logprobs) == 12
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(x) == set(y)
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)
    assert out[2].outputs[0].logprobs is None


# ----------------------------------------------------------------------------------- /metrics and bench client
def test_server_exports_spec_counters_and_bench_reads_them(server_model_dir):
    import httpx
    from server_fixtures import start_test_server

    from tokenfab.bench.spec_metrics import fetch_spec_counters, format_spec_decode, spec_decode_result
    h = start_test_server(server_model_dir, speculative_config=dict(NGRAM))
    try:
        before = fetch_spec_counters(h.base_url)
        assert before == {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {0: 0.0, 1: 0.0, 2: 0.0}}
        with httpx.Client(base_url=h.base_url, trust_env=False, timeout=60) as c:
            r = c.post("/v1/completions", json={"model": SERVED_NAME, "max_tokens": 24, "temperature": 0,
                                                 "prompt": "one two three one two three one two", "ignore_eos": True})
            assert r.status_code == 200, r.text
        import time
        st = h.async_llm.engine.get_stats()
        for _ in range(50):  # the engine thread publishes its stats just after delivering the last output
            after = fetch_spec_counters(h.base_url)
            if after["drafts"] == st["spec_decode_num_drafts"]:
                break
            time.sleep(0.1)
    finally:
        h.stop()
    assert after["drafts"] > 0 and after["draft_tokens"] >= after["accepted"]
    assert after["drafts"] == st["spec_decode_num_drafts"]
    assert after["accepted"] == st["spec_decode_num_accepted_tokens"]
    assert [after["per_pos"].get(j, 0) for j in range(3)] == st["spec_decode_num_accepted_tokens_per_pos"]
    res = spec_decode_result(before, after)
    assert res["spec_decode_acceptance_rate"] == pytest.approx(100 * after["accepted"] / after["draft_tokens"])
    assert res["spec_decode_acceptance_length"] == pytest.approx(1 + after["accepted"] / after["drafts"])
    text = "\n".join(format_spec_decode(res, lambda a, b, f="": f"{a} {b:{f}}"))
    assert "Acceptance rate (%)" in text and "Position 0" in text


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_bf16_greedy_identical_through_fused_decode_stack(tiny_model, family):
    """bf16: verification runs through the fused CPU decode stack (each verification row as 1 + k one-token rows);
    greedy tokens equal plain decoding's."""
    path = tiny_model(family, dtype="bfloat16")
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = token_ids(LLM(path, dtype="bfloat16", progress=False, max_model_len=512).generate(spec_prompts(), sp))
    llm = LLM(path, dtype="bfloat16", progress=False, max_model_len=512, speculative_config=NGRAM)
    if llm.llm_engine.runner.cpu_decode_stack is None:
        pytest.skip("no fused CPU decode stack on this machine (needs the C++ kernels and AVX512-BF16)")
    assert token_ids(llm.generate(spec_prompts(), sp)) == base
    assert llm.llm_engine.spec.num_fused_steps > 0
    assert llm.llm_engine.get_stats()["spec_decode_num_accepted_tokens"] > 0


def test_draft_model_as_large_as_its_target_never_pays(tiny_model):
    """The target as its own draft (weight-bytes ratio 1): each drafting forward costs a plain step, more than any
    accepted token returns, so with the default costs (clock off: the prior decides) no step speculates, at c = 1
    either, probes included (test_greedy_identical_with_draft_model: the always-draft
    mode drafts)."""
    path = tiny_model("llama")
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = token_ids(_llm(path).generate(spec_prompts(2), sp))
    llm = _llm(path, {"method": "draft_model", "model": path, "num_speculative_tokens": 3, "timed_switch_off": False,
                      "probe_interval": 2}, max_num_seqs=1, max_model_len=512)
    assert llm.llm_engine.spec.proposer.cost_model.ratio == pytest.approx(1.0)
    assert token_ids(llm.generate(spec_prompts(2), sp)) == base
    assert llm.llm_engine.get_stats()["spec_decode_num_drafts"] == 0


# ---------------------------------------------------------------------- logits processors on speculated rows
def _processor_params(i: int, temperature: float = 0.0, seed=None, max_tokens: int = 20):
    """Processors verification applies per position, on different rows: penalties (each kind), logit bias,
    allowed_token_ids and min_p (bad words use the same per-position lengths; tests/test_logits_processors.py
    covers their matching)."""
    kinds = [dict(repetition_penalty=1.4), dict(frequency_penalty=0.7, presence_penalty=0.4),
             dict(logit_bias={23: 2.5, 37: -3.0}), dict(allowed_token_ids=list(range(5, 140))),
             dict(min_p=0.05), dict(repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={11: 1.5})]
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                          **kinds[i % len(kinds)])


def test_greedy_identical_with_processors_on_speculated_rows(tiny_model):
    """Greedy rows with penalties, bias, allowed ids and min_p are speculated (drafts counted) and give exactly
    the tokens of plain decoding: position j of a verification applies the processors with drafts 1..j counted as
    output (a penalty that ignored them would change tokens: repeated prompts make drafts repeat tokens)."""
    path = tiny_model("llama")
    prompts = spec_prompts(6)
    sps = [_processor_params(i) for i in range(6)]
    base = token_ids(_llm(path).generate(prompts, sps))
    llm = _llm(path, NGRAM)
    assert token_ids(llm.generate(prompts, sps)) == base
    st = llm.llm_engine.get_stats()
    assert st["spec_decode_num_drafts"] > 0 and st["spec_decode_num_accepted_tokens"] > 0


def test_penalties_count_drafts_hand_worked():
    """apply_verify on a hand-made row: seen tokens {3 (prompt), 5 (output once)}, drafts [5, 7]. Position 0 sees
    counts {5: 1}; position 1 {5: 2}; position 2 {5: 2, 7: 1}. Frequency 1, presence 0.5, repetition 2 on logits of
    all 1.0 give 1/2 - f * count - p * [count > 0] for output tokens, 1/2 for prompt-only token 3."""
    from tokenfab.engine.logits_state import LogitsProcessorState
    V = 10
    tok = np.zeros((1, 16), dtype=np.int64)
    tok[0, :2] = [3, 5]  # prompt [3], output [5]
    st = LogitsProcessorState(1, V, tok)

    class S:  # the fields _admit_one reads
        row = 0
        num_prompt_tokens = 1
        num_tokens = 2
        token_ids = [3, 5]
        prompt_token_ids = [3]
        output_token_ids = [5]
        params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
        grammar = None
        bad_words_token_ids = None
    st.admit([S()])
    tok[0, 2:4] = [5, 7]
    out = st.apply_verify(torch.ones(1, 3, V), np.array([0]), np.array([2]), np.array([[5, 7]]),
                          torch.zeros(1))[0]
    want = torch.ones(3, V)
    want[:, 3] = 0.5
    for j, counts in enumerate([{5: 1}, {5: 2}, {5: 2, 7: 1}]):
        for t, c in counts.items():
            want[j, t] = 0.5 - c - 0.5
    assert torch.equal(out, want)


PENALTY_PROMPT = {"prompt_token_ids": [11, 23, 37, 41, 53, 11, 23, 37, 41, 53, 11, 23]}


def penalty_params(off: int) -> list[SamplingParams]:
    """N_SAMPLES requests' parameters (seeds off, off + 1, ...): top-k 4, temperature 1, penalties and min_p."""
    return [SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=off + i,
                           frequency_penalty=1.5, presence_penalty=0.5, min_p=0.02) for i in range(N_SAMPLES)]


@pytest.fixture(scope="module")
def no_spec_penalty_samples(tiny_model):
    """:func:`penalty_params` (seeds from 0) without speculation, generated once for the module."""
    return _llm(tiny_model("llama"), max_num_seqs=128).generate([PENALTY_PROMPT] * N_SAMPLES, penalty_params(0))


@pytest.mark.parametrize("drafter", ["random_tokens", "target_as_draft"])
def test_distribution_unchanged_with_penalties_at_temperature_one(tiny_model, no_spec_penalty_samples, drafter):
    """Frequency and presence penalties plus min_p at temperature 1 with top-k 4 (the draft model's q knows
    nothing of them, random tokens are one-hot q): total variation of output tokens 2 and 3 to plain decoding
    below TV_TOL (same sample sizes as above)."""
    path = tiny_model("llama")
    prompt = PENALTY_PROMPT
    sps = penalty_params
    base = no_spec_penalty_samples
    if drafter == "random_tokens":
        llm = _llm(path, dict(NGRAM, num_speculative_tokens=2), max_num_seqs=128)
        llm.llm_engine.spec.proposer = RandomProposer(2, 512)
    else:
        llm = _llm(path, {"method": "draft_model", "model": path, "num_speculative_tokens": 2,
                          "verify_token_cost": 0.0, "verify_step_overhead": 0.0, "random_row_cost": 0.0},
                   max_num_seqs=128, max_model_len=512)
    spec = llm.generate([prompt] * N_SAMPLES, sps(10_000))
    st = llm.llm_engine.get_stats()
    assert st["spec_decode_num_draft_tokens"] == N_SAMPLES
    if drafter == "target_as_draft":  # q lacks the penalties, so not all accepted, but most
        assert 0.3 * N_SAMPLES < st["spec_decode_num_accepted_tokens"] < N_SAMPLES
    for pos in (1, 2):
        tv = 0.5 * np.abs(token_hist(base, pos, 512) - token_hist(spec, pos, 512)).sum()
        assert tv < TV_TOL, (pos, tv)


def test_min_tokens_rows_are_speculated_with_stop_tokens_masked(tiny_model):
    """A stop token that greedy decoding emits early (found by a plain run) with min_tokens 9: rows below
    min_tokens are verified with EOS and stop tokens masked at exactly the positions still below it, giving the
    tokens of plain decoding (which stop at the first later occurrence, or run to max_tokens)."""
    path = tiny_model("llama")
    prompts = spec_prompts(3)
    free = token_ids(_llm(path).generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)))
    sps = [SamplingParams(temperature=0, max_tokens=24, min_tokens=9, stop_token_ids=[t[2]]) for t in free]
    base = _llm(path).generate(prompts, sps)
    llm = _llm(path, NGRAM)
    llm.llm_engine.spec.proposer = RandomProposer(3, 512)  # drafts every step: every row goes through verification
    out = llm.generate(prompts, sps)
    assert token_ids(out) == token_ids(base)
    assert all(len(t) >= 9 for t in token_ids(out))
    assert llm.llm_engine.get_stats()["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bf16_draft_model_runs_through_fused_decode_stack(tiny_model, temperature):
    """bf16 draft model: its catch-up (one-token rows) and draft steps run through its fused CPU decode stack
    (greedy: forward, head and argmax in one run_sample call per draft token). With the target as its own draft
    the drafts are the target's own greedy tokens, so at T = 0 every draft is accepted and the tokens equal plain
    decoding's; at T = 1 q = p, so every draft is accepted with probability min(1, p/q) = 1 as well."""
    path = tiny_model("llama", dtype="bfloat16")
    sp = SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True, seed=3)
    base = token_ids(LLM(path, dtype="bfloat16", progress=False, max_model_len=512).generate(spec_prompts(), sp))
    llm = LLM(path, dtype="bfloat16", progress=False, max_model_len=512,
              speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                                  "verify_token_cost": 0.0, "verify_step_overhead": 0.0, "random_row_cost": 0.0})
    prop = llm.llm_engine.spec.proposer
    stack = prop.runner.cpu_decode_stack
    if stack is None or stack.vocab_size is None:
        pytest.skip("no fused CPU decode stack with the LM head on this machine (C++ kernels, AVX512-BF16)")
    calls = {"run": 0, "run_sample": 0}
    for name in calls:
        orig = getattr(stack, name)

        def spy(*a, _orig=orig, _name=name):
            calls[_name] += 1
            return _orig(*a)
        setattr(stack, name, spy)
    out = token_ids(llm.generate(spec_prompts(), sp))
    st = llm.llm_engine.get_stats()
    assert st["spec_decode_num_drafts"] > 0
    if temperature == 0:
        assert out == base
        assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]
        assert calls["run_sample"] > 0 and calls["run"] == 0  # greedy: no separate head, no module path
    else:  # q equals p up to bf16 rounding between the two stacks' row groupings
        assert st["spec_decode_num_accepted_tokens"] >= 0.9 * st["spec_decode_num_draft_tokens"]
        assert calls["run"] > 0
