"""The batched logits processors against per-row reference loops written from the formulas (CTRL / HF repetition
penalty, OpenAI frequency / presence penalties, min-p, logit bias, allow-lists, vLLM's bad words), on random logits
and histories, plus one hand-worked 4-token case per parameter."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from tokenfab.engine.logits_processors import (allowed_token_mask, apply_allowed_token_ids, apply_bad_words,
                                               apply_logit_bias, apply_min_p, apply_penalties, apply_penalties_at)
from tokenfab.engine.logits_state import LogitsProcessorState
from tokenfab.engine.sequence import Sequence
from tokenfab.request_validation import bad_words_token_ids
from tokenfab.sampling_params import SamplingParams

INF = float("inf")


# ---- references: one row at a time, plain Python -----------------------------------------------------------------
def ref_penalties(row: list[float], prompt: list[int], output: list[int], rep: float, freq: float, pres: float):
    out = list(row)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        c = output.count(t)
        out[t] -= freq * c + pres
    return out


def ref_min_p(row: list[float], min_p: float):
    m = max(row)
    z = sum(math.exp(x - m) for x in row)
    probs = [math.exp(x - m) / z for x in row]
    top = max(probs)
    return [-INF if p < min_p * top else x for x, p in zip(row, probs)]


def ref_bad_words(row: list[float], output: list[int], words: list[list[int]]):
    out = list(row)
    for w in words:
        k = len(w) - 1
        if k > len(output):
            continue
        if k == 0 or output[-k:] == w[:-1]:
            out[w[-1]] = -INF
    return out


def _pack_bad_words(pairs: list[tuple[int, list[int]]], outputs: list[list[int]]):
    """(row, word) pairs -> the right-aligned tensors apply_bad_words takes (history from the outputs)."""
    L = max(len(w) for _, w in pairs) - 1
    prefix = torch.full((len(pairs), L), -1, dtype=torch.int64)
    hist = torch.full((len(pairs), L), -2, dtype=torch.int64)
    for k, (r, w) in enumerate(pairs):
        if len(w) > 1:
            prefix[k, L - len(w) + 1:] = torch.tensor(w[:-1])
        tail = outputs[r][-L:] if L else []
        if tail:
            hist[k, L - len(tail):] = torch.tensor(tail)
    rows = torch.tensor([r for r, _ in pairs])
    last = torch.tensor([w[-1] for _, w in pairs])
    return rows, last, prefix, hist


# ---- hand-worked 4-token cases ---------------------------------------------------------------------------------
LOGITS4 = [2.0, -1.0, 0.5, 0.0]
PROMPT4, OUTPUT4 = [0], [2, 2, 3]  # token 0 in the prompt; token 2 twice and token 3 once in the output


def _pen4(rep=1.0, freq=0.0, pres=0.0):
    pm = torch.tensor([[True, False, False, False]])
    counts = torch.tensor([[0, 0, 2, 1]], dtype=torch.int32)
    return apply_penalties(torch.tensor([LOGITS4]), pm, counts, torch.tensor([rep]), torch.tensor([freq]),
                           torch.tensor([pres]))[0].tolist()


def test_repetition_penalty_hand_worked():
    # 2.0 (prompt, > 0) / 2 = 1.0; -1.0 unseen; 0.5 (output) / 2 = 0.25; 0.0 (output, not > 0) * 2 = 0.0
    assert _pen4(rep=2.0) == [1.0, -1.0, 0.25, 0.0]
    # a penalty below 1 raises: 2.0 / 0.5 = 4.0, 0.5 / 0.5 = 1.0
    assert _pen4(rep=0.5) == [4.0, -1.0, 1.0, 0.0]


def test_frequency_penalty_hand_worked():
    # output only (token 0 of the prompt untouched): 0.5 - 0.5 * 2 = -0.5; 0.0 - 0.5 * 1 = -0.5
    assert _pen4(freq=0.5) == [2.0, -1.0, -0.5, -0.5]


def test_presence_penalty_hand_worked():
    # once per present output token: 0.5 - 0.25, 0.0 - 0.25
    assert _pen4(pres=0.25) == [2.0, -1.0, 0.25, -0.25]


def test_all_penalties_hand_worked():
    # repetition first, then frequency, then presence: token 2: 0.5 / 2 - 1.0 - 0.25; token 3: 0 * 2 - 0.5 - 0.25
    assert _pen4(rep=2.0, freq=0.5, pres=0.25) == [1.0, -1.0, -1.0, -0.75]


def test_min_p_hand_worked():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    # threshold 0.2 * 0.5 = 0.1: only p = 0.05 goes
    out = apply_min_p(logits, torch.tensor([0.2]))[0]
    assert torch.isinf(out[3]) and out[3] < 0 and torch.equal(out[:3], logits[0, :3])
    # threshold 0.7 * 0.5 = 0.35: only the top token stays; 0 keeps all
    assert torch.isinf(apply_min_p(logits, torch.tensor([0.7]))[0, 1:]).all()
    assert torch.equal(apply_min_p(logits, torch.tensor([0.0])), logits)


def test_logit_bias_hand_worked():
    out = apply_logit_bias(torch.tensor([LOGITS4, LOGITS4]), torch.tensor([0, 0, 1]), torch.tensor([1, 3, 0]),
                           torch.tensor([5.0, -100.0, 1.5]))
    assert out.tolist() == [[2.0, 4.0, 0.5, -100.0], [3.5, -1.0, 0.5, 0.0]]


def test_allowed_token_ids_hand_worked():
    # row 0 allows {0, 2}; row 1 has no allow-list
    mask = allowed_token_mask(2, 4, torch.tensor([0]), torch.tensor([0, 0]), torch.tensor([0, 2]))
    out = apply_allowed_token_ids(torch.tensor([LOGITS4, LOGITS4]), mask)
    assert out.tolist() == [[2.0, -INF, 0.5, -INF], LOGITS4]


def test_bad_words_hand_worked():
    # output so far [1, 2]: [3] always masks 3; [2, 0] ends with the output's last token -> masks 0; [1, 1] does
    # not match; [2, 1, 2, 1] is longer than the output + 1 -> never matches
    words = [[3], [2, 0], [1, 1], [2, 1, 2, 1]]
    rows, last, prefix, hist = _pack_bad_words([(0, w) for w in words], [[1, 2]])
    out = apply_bad_words(torch.tensor([LOGITS4]), rows, last, prefix, hist)
    assert out.tolist() == [[-INF, -1.0, 0.5, -INF]]


# ---- random batches against the references ---------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_penalties_match_reference(seed):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    N, V = 6, 40
    logits = torch.randn(N, V, generator=g) * 3
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(1, 12))] for _ in range(N)]
    outputs = [[rng.randrange(V) for _ in range(rng.randrange(0, 25))] for _ in range(N)]
    rep = [rng.choice([1.0, 0.7, 1.3, 2.0]) for _ in range(N)]
    freq = [rng.choice([0.0, 0.5, -0.4, 2.0]) for _ in range(N)]
    pres = [rng.choice([0.0, 1.0, -1.5, 0.3]) for _ in range(N)]
    pm = torch.zeros(N, V, dtype=torch.bool)
    counts = torch.zeros(N, V, dtype=torch.int32)
    for i in range(N):
        pm[i, prompts[i]] = True
        for t in outputs[i]:
            counts[i, t] += 1
    got = apply_penalties(logits, pm, counts, torch.tensor(rep), torch.tensor(freq), torch.tensor(pres))
    want = torch.tensor([ref_penalties(logits[i].tolist(), prompts[i], outputs[i], rep[i], freq[i], pres[i])
                         for i in range(N)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # the sparse form: only the distinct seen (row, token) pairs, the same values bit for bit
    pairs = [(i, t) for i in range(N) for t in sorted(set(prompts[i]) | set(outputs[i]))]
    row, tok = torch.tensor([r for r, _ in pairs]), torch.tensor([t for _, t in pairs])
    sparse = apply_penalties_at(logits.clone(), row, tok, counts[row, tok], torch.tensor(rep), torch.tensor(freq),
                                torch.tensor(pres))
    assert torch.equal(sparse, got)


@pytest.mark.parametrize("seed", range(3))
def test_min_p_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    N, V = 5, 64
    logits = torch.randn(N, V, generator=g) * 2
    mp = torch.tensor([0.0, 0.05, 0.1, 0.5, 0.99])
    got = apply_min_p(logits, mp)
    want = torch.tensor([ref_min_p(logits[i].tolist(), float(mp[i])) for i in range(N)])
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)])


@pytest.mark.parametrize("seed", range(4))
def test_bad_words_match_reference(seed):
    rng = random.Random(seed)
    N, V = 5, 6  # a small vocabulary so that multi-token words do match the outputs' tails
    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(seed))
    outputs = [[rng.randrange(V) for _ in range(rng.randrange(0, 8))] for _ in range(N)]
    words = [[[rng.randrange(V) for _ in range(rng.randrange(1, 4))] for _ in range(rng.randrange(0, 6))]
             for _ in range(N)]
    for i in range(N):  # make sure some multi-token words match
        if len(outputs[i]) >= 2:
            words[i].append(outputs[i][-2:] + [rng.randrange(V)])
    pairs = [(i, w) for i in range(N) for w in words[i]]
    got = apply_bad_words(logits.clone(), *_pack_bad_words(pairs, outputs))
    want = torch.tensor([ref_bad_words(logits[i].tolist(), outputs[i], words[i]) for i in range(N)])
    assert torch.equal(got, want)


# ---- the per-row state: admission, appended tokens, all processors on one batch ----------------------------------
def _seq(i, prompt, output, params, row, bad_ids=None):
    s = Sequence(i, str(i), 0, prompt, params, 0.0)
    s.token_ids += output
    s.row = row
    s.bad_words_token_ids = bad_ids or []
    return s


def test_state_matches_reference_across_appends():
    rng = random.Random(7)
    V, rows_n = 30, 8
    token_ids = np.zeros((rows_n, 64), dtype=np.int64)
    state = LogitsProcessorState(rows_n, V, token_ids)
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(),  # no processors: its logits stay untouched
              SamplingParams(presence_penalty=1.0, logit_bias={3: 4.0, 7: -2.0}),
              SamplingParams(allowed_token_ids=[1, 2, 3, 5, 8, 13, 21], repetition_penalty=0.8),
              SamplingParams(min_p=0.1)]
    bad = [None, None, [[5], [4, 9]], None, [[1, 2, 6]]]
    rows = np.array([6, 0, 3, 5, 1], dtype=np.int64)
    seqs = []
    for i, p in enumerate(params):
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 6))]
        output = [rng.randrange(V) for _ in range(rng.randrange(0, 5))]
        s = _seq(i, prompt, output, p, int(rows[i]), bad[i])
        token_ids[s.row, :s.num_tokens] = s.token_ids
        seqs.append(s)
    state.admit(seqs)
    for step in range(6):
        logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(step))
        b = state.batch(rows)
        lengths = np.array([s.num_tokens for s in seqs], dtype=np.int64)
        got = state.apply(logits.clone(), b, lengths)
        for i, s in enumerate(seqs):
            p, row = s.params, logits[i].tolist()
            prompt, output = s.token_ids[:s.num_prompt_tokens], s.output_token_ids
            if p.allowed_token_ids is not None:
                row = [x if t in p.allowed_token_ids else -INF for t, x in enumerate(row)]
            row = ref_bad_words(row, output, bad[i] or [])
            for t, v in (p.logit_bias or {}).items():
                row[t] += v
            row = ref_penalties(row, prompt, output, p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
            torch.testing.assert_close(got[i], torch.tensor(row), rtol=1e-6, atol=1e-6)
        assert b.min_p is not None and b.min_p.tolist() == pytest.approx([0, 0, 0, 0, 0.1])
        toks = np.array([rng.choice([1, 2, 4, 9]) for _ in seqs], dtype=np.int64)  # 4 then 9 completes a bad word
        token_ids[rows, lengths] = toks
        state.record(rows, toks)
        for s, t in zip(seqs, toks.tolist()):
            s.token_ids.append(t)


def test_state_inactive_batch_is_none():
    state = LogitsProcessorState(4, 10, np.zeros((4, 8), dtype=np.int64))
    state.admit([_seq(0, [1, 2], [], SamplingParams(temperature=0.5), 2)])
    assert state.batch(np.array([2])) is None and not state.any_active(np.array([2]))
    state.admit([_seq(1, [1, 2], [], SamplingParams(min_p=0.2), 2)])  # the row is reused with min_p
    assert state.any_active(np.array([2]))


class _CharTokenizer:
    """One token per character ('a' = 1, ...); ' a' is one token 27 + letter, so words have a spaced variant."""

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            if text[i] == " " and i + 1 < len(text):
                out.append(27 + ord(text[i + 1]) - 96)
                i += 2
            else:
                out.append(ord(text[i]) - 96 if text[i] != " " else 0)
                i += 1
        return out


def test_bad_words_tokenized_with_and_without_space():
    # "ab": [1, 2]; " ab": [28, 2] (same length, another first token: kept); "  c" strips to "c": [3], [30]
    assert bad_words_token_ids(["ab", "  c"], _CharTokenizer()) == [[1, 2], [28, 2], [3], [30]]
    with pytest.raises(ValueError, match="bad_words"):
        bad_words_token_ids(["x"], None)


def test_plain_fast_path_steps_aside_for_rows_with_processors():
    from tokenfab.engine.sampler import Sampler
    sampler = Sampler(torch.Generator().manual_seed(0))
    sampler.processors = LogitsProcessorState(4, 10, np.zeros((4, 8), dtype=np.int64))
    plain = _seq(0, [1, 2], [], SamplingParams(temperature=0.0), 0)
    pen = _seq(1, [1, 2], [], SamplingParams(temperature=0.0, presence_penalty=1.0), 3)
    sampler.processors.admit([plain, pen])
    assert sampler.plain_inputs([plain], 10, np.array([0])) is not None
    assert sampler.plain_inputs([plain, pen], 10, np.array([0, 3])) is None
    # the module path then applies the penalty: token 1 (logit 1.0, in the prompt) loses to token 0 (0.9) under
    # repetition_penalty 2; the plain row keeps its argmax
    rep = _seq(2, [1, 2], [], SamplingParams(temperature=0.0, repetition_penalty=2.0), 3)
    sampler.processors.admit([rep])
    logits = torch.tensor([[0.9, 1.0] + [0.0] * 8] * 2)
    out = sampler(logits, [plain, rep], rows=np.array([0, 3]), lengths=np.array([2, 2]))
    assert out.token_ids.tolist() == [1, 0]
    assert logits[1, 1] == 1.0  # the caller's logits are not modified
