"""Speculative decoding on hybrid (KDA) models: the recurrent state of each verification row is held through the
verification forward and committed up to its last accepted token (tokenfab/engine/state_commit.py).

Covers, on a tiny random Kimi Linear (tests/test_kimi_linear.py, conv taps scaled so a wrong conv state changes the
tokens): greedy outputs identical with and without n-gram speculation (mixed prompt lengths, and under preemption);
the KDA state after a verification with a scripted rejection equals the state of a plain run over the same tokens
(state tensors compared directly; the state without the commit differs, so the comparison can fail); the output
distribution unchanged at temperature 1 with a random drafter; the commit's own edge cases (kept = 0 leaves the
state before the step, bad counts refused).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from spec_helpers import NGRAM, RandomProposer, spec_prompts, token_hist, token_ids
from test_kimi_linear import make_kimi_linear
from tokenfab import LLM, SamplingParams
from tokenfab.spec_decode.proposer import Proposal, Proposer

@pytest.fixture(scope="module")
def kl_path(tmp_path_factory, tokenizer_dir):
    return make_kimi_linear(str(tmp_path_factory.mktemp("kimi_linear_spec")), tokenizer_dir)


def _llm(path, spec=None, **kw):
    kw.setdefault("max_model_len", 256)
    return LLM(path, dtype="float32", device="cpu", progress=False, speculative_config=spec, **kw)


def _count_commits(llm):
    """Wrap the runner's commit to count written (layer, row) states."""
    runner = llm.llm_engine.runner
    orig, n = runner.commit_state, [0]

    def counted(rows, kept):
        r = orig(rows, kept)
        n[0] += r
        return r

    runner.commit_state = counted
    return n


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def kl_greedy(kl_path):
    """Greedy tokens of spec_prompts() without speculation."""
    return token_ids(_llm(kl_path).generate(spec_prompts(), GREEDY, use_tqdm=False))


class OracleProposer(Proposer):
    """Drafts the known greedy continuation of each prompt (keyed by prompt length), with one draft wrong at a
    position that cycles with the output length (none wrong every fourth step): every acceptance count 0..k."""

    def __init__(self, expected: dict[int, list[int]], V: int, k: int = 3):
        self.num_speculative_tokens, self.expected, self.V = k, expected, V

    def propose(self, seqs, rows, token_ids, lengths, max_lens):
        k = self.num_speculative_tokens
        d = np.zeros((len(seqs), k), dtype=np.int64)
        for i, s in enumerate(seqs):
            o = s.num_output_tokens
            d[i] = (self.expected[s.num_prompt_tokens][o:o + k] + [0] * k)[:k]
            if o % (k + 1) < k:
                d[i, o % (k + 1)] = (d[i, o % (k + 1)] + 1) % self.V
        return Proposal(d, np.minimum(k, max_lens).astype(np.int64), None)


def test_greedy_identical_with_ngram_kimi_linear(kl_path, kl_greedy):
    """n-gram lookup (a random model rarely repeats its prompt: its drafts are nearly all rejected, each one
    committed after its first token), then drafts from the known continuation with one wrong token at varying positions (rows accept
    0..3 drafts), four prompts of 7..34 tokens in one batch."""
    llm = _llm(kl_path, NGRAM)
    committed = _count_commits(llm)
    assert token_ids(llm.generate(spec_prompts(), GREEDY, use_tqdm=False)) == kl_greedy
    st = llm.llm_engine.get_stats()
    assert st["spec_decode_num_drafts"] > 0 and committed[0] > 0
    eng = llm.llm_engine
    expected = {len(p["prompt_token_ids"]): b for p, b in zip(spec_prompts(), kl_greedy)}
    eng.spec.proposer = OracleProposer(expected, eng.model_config.vocab_size)
    before = dict(st)
    assert token_ids(llm.generate(spec_prompts(), GREEDY, use_tqdm=False)) == kl_greedy
    st = eng.get_stats()
    per_pos = [a - b for a, b in zip(st["spec_decode_num_accepted_tokens_per_pos"],
                                     before["spec_decode_num_accepted_tokens_per_pos"])]
    assert per_pos[0] > per_pos[2] > 0  # rows accepted 0, 1, 2 and 3 drafts
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_greedy_identical_under_preemption_kimi_linear(kl_path, kl_greedy):
    """A pool of 7 blocks x 16 tokens for four requests of 31..58 tokens: sequences are preempted (their KDA state
    recomputed from zero) between verification steps."""
    llm = _llm(kl_path, NGRAM, num_kv_blocks=7, max_model_len=96)
    eng = llm.llm_engine
    expected = {len(p["prompt_token_ids"]): b for p, b in zip(spec_prompts(), kl_greedy)}
    eng.spec.proposer = OracleProposer(expected, eng.model_config.vocab_size)
    assert token_ids(llm.generate(spec_prompts(), GREEDY, use_tqdm=False)) == kl_greedy
    st = eng.get_stats()
    assert st["num_preemptions"] > 0 and st["spec_decode_num_accepted_tokens"] > 0


class ScriptedProposer(Proposer):
    """Drafts the known greedy continuation, with draft number ``wrong`` (0-based) replaced by a wrong token."""

    def __init__(self, expected: list[int], V: int, k: int = 3, wrong: int = 1):
        self.num_speculative_tokens, self.expected, self.V, self.wrong = k, expected, V, wrong

    def propose(self, seqs, rows, token_ids, lengths, max_lens):
        d = np.zeros((len(seqs), self.num_speculative_tokens), dtype=np.int64)
        for i, s in enumerate(seqs):
            o = s.num_output_tokens
            nxt = (self.expected[o:o + self.num_speculative_tokens] + [0] * self.num_speculative_tokens)
            d[i] = nxt[:self.num_speculative_tokens]
            d[i, self.wrong] = (d[i, self.wrong] + 1) % self.V
        return Proposal(d, np.minimum(self.num_speculative_tokens, max_lens).astype(np.int64), None)


def _states(eng):
    """{layer: (conv, recurrent)} copies of the one running sequence's KDA state slots."""
    row = eng.scheduler.running[0].row
    return [(c.conv[row].clone(), c.recurrent[row].clone()) for c in eng.runner.state_caches]


def _run_steps(eng, prompt, n_steps):
    eng.add_request("r", None, prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(n_steps):
        eng.step()
    return eng.scheduler.running[0]


@pytest.mark.parametrize("wrong", [0, 1, 2])
def test_state_after_scripted_rejection_equals_plain_run(kl_path, wrong):
    """Prefill, then one verification step of 3 drafts with draft ``wrong`` incorrect (``wrong`` accepted, one
    recovered token): every KDA layer's conv and recurrent state equals the plain engine's after the same tokens
    (1 + wrong + 1 outputs, the last not yet run). Without the commit the state is the one before the step, which
    differs."""
    prompt = spec_prompts()[2]["prompt_token_ids"]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = token_ids(_llm(kl_path).generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False))[0]

    def spec_engine(commit: bool):
        llm = _llm(kl_path, NGRAM, max_num_seqs=2)
        eng = llm.llm_engine
        eng.spec.proposer = ScriptedProposer(expected, eng.model_config.vocab_size, wrong=wrong)
        if not commit:
            eng.runner.commit_state = lambda rows, kept: 0
        seq = _run_steps(eng, prompt, 2)  # prefill (1 token), then one verification step
        assert seq.output_token_ids == expected[:2 + wrong]
        assert eng.get_stats()["spec_decode_num_accepted_tokens"] == wrong
        return seq, _states(eng)

    seq, got = spec_engine(True)
    plain = _llm(kl_path, max_num_seqs=2).llm_engine
    pseq = _run_steps(plain, prompt, 2 + wrong)
    assert pseq.output_token_ids == seq.output_token_ids and pseq.num_computed_tokens == seq.num_computed_tokens
    ref = _states(plain)
    assert len(ref) == 3  # the tiny model's three KDA layers
    for (c, r), (c_ref, r_ref) in zip(got, ref):
        torch.testing.assert_close(c, c_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r, r_ref, rtol=1e-5, atol=1e-5)
    _, stale = spec_engine(False)
    gap = max(max((c - c_ref).abs().max().item(), (r - r_ref).abs().max().item())
              for (c, r), (c_ref, r_ref) in zip(stale, ref))
    assert gap > 1e-2, gap  # the comparison above would catch a missing commit


def test_commit_of_zero_leaves_the_state_before_the_step_and_refuses_bad_counts(kl_path):
    """kept = 0 (the failed-step path) leaves, exactly, the state before the verification forward (which held it:
    a forward that wrote a held row fails here); kept above the tokens a row ran is a ValueError naming the counts
    (and changes nothing)."""
    prompt = spec_prompts()[1]["prompt_token_ids"]
    eng = _llm(kl_path, NGRAM, max_num_seqs=2).llm_engine
    eng.spec.proposer = ScriptedProposer([5] * 40, eng.model_config.vocab_size, wrong=0)
    _run_steps(eng, prompt, 1)  # the prefill
    before = _states(eng)
    runner = eng.runner
    orig, seen = runner.commit_state, []

    def bad_then_zero(rows, kept):
        seen.append(kept.tolist())
        with pytest.raises(ValueError, match="kept exceeds the tokens"):
            orig(rows, np.full(len(rows), 99))
        return orig(rows, np.zeros_like(kept))

    runner.commit_state = bad_then_zero
    eng.step()  # one verification step of 3 drafts, the first wrong: kept would be 1
    assert seen == [[1]]
    for (c, r), (c0, r0) in zip(_states(eng), before):
        assert torch.equal(c, c0) and torch.equal(r, r0)


N_SAMPLES = 500
# top-k 2 at temperature 1: output token 2 takes <= 2 values, token 3 <= 4, token 4 <= 8. Two independent samples
# of 500 from one law over 8 values have E[TV] ~ 0.07 (sd ~ 0.02); a verifier that keeps rejected drafts, or a
# state left after them, moves token 3 or 4 to other values.
TV_TOL = 0.16


def test_distribution_unchanged_at_temperature_one_kimi_linear(kl_path):
    """Output tokens 2-4 over 500 seeded requests, top-k 2 at temperature 1, random drafts (2 per row: nearly
    always rejected at once, so token 4 is computed from a state committed after one token): total variation to the same counts
    without speculation below TV_TOL."""
    prompt = {"prompt_token_ids": [11, 23, 37, 41, 53, 11, 23, 37]}
    V = 512

    def params(seed0):
        return [SamplingParams(temperature=1.0, top_k=2, max_tokens=4, ignore_eos=True, seed=seed0 + i)
                for i in range(N_SAMPLES)]

    base = _llm(kl_path, max_num_seqs=128).generate([prompt] * N_SAMPLES, params(0), use_tqdm=False)
    llm = _llm(kl_path, dict(NGRAM, num_speculative_tokens=2), max_num_seqs=128)
    llm.llm_engine.spec.proposer = RandomProposer(2, V)
    committed = _count_commits(llm)
    spec = llm.generate([prompt] * N_SAMPLES, params(10_000), use_tqdm=False)
    st = llm.llm_engine.get_stats()
    assert st["spec_decode_num_draft_tokens"] >= 2 * N_SAMPLES
    assert st["spec_decode_num_accepted_tokens"] < 0.05 * st["spec_decode_num_draft_tokens"]
    assert committed[0] >= 3 * N_SAMPLES  # three KDA layers per verification row
    for pos in (1, 2, 3):
        tv = 0.5 * np.abs(token_hist(base, pos, V) - token_hist(spec, pos, V)).sum()
        assert tv < TV_TOL, (pos, tv)


def test_kept_by_row_hand_worked():
    """The commit's per-row lookup (engine/state_commit.py), shared by the layers' entries and the decode-graph
    buffers' commit: held rows named get their count, others -1; a count above the tokens run is refused."""
    from tokenfab.engine.state_commit import kept_by_row
    rows_h, hold, ran = np.array([3, 0, 5, 8]), np.array([True, False, True, True]), np.array([4, 1, 4, 1])
    got = kept_by_row(rows_h, hold, ran, np.array([5, 3, 0]), np.array([2, 4, 1]))
    assert got.tolist() == [4, -1, 2, -1]  # row 0 named but not held, row 8 held but not named
    with pytest.raises(ValueError, match="kept exceeds the tokens"):
        kept_by_row(rows_h, hold, ran, np.array([8]), np.array([2]))
