"""The measured switch-off (spec_decode/step_timing.py): the on/off decision on hand-worked timings, and through
the engine a drafter that costs more than it saves (on a virtual clock) being switched off by the clock while a
free one is not, with the tokens unchanged either way (greedy)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tokenfab import LLM, SamplingParams
from tokenfab.spec_decode import spec_decoder
from tokenfab.spec_decode.proposer import Proposal, Proposer
from tokenfab.spec_decode.step_timing import MAX_PROBE_INTERVAL, PLAIN_SAMPLE_INTERVAL, StepTiming, bucket


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (0, 1, 2, 3, 4, 5, 16, 17)] == [1, 1, 2, 4, 4, 8, 16, 32]


def test_decisions_hand_worked():
    t = StepTiming(probe_interval=2)
    assert t.wants_plain(16)            # nothing measured at this bucket yet: a plain sample first
    t.record_plain(16, 0.100)
    assert not t.wants_plain(16)        # no speculative measurement yet: speculate
    t.record_spec(16, 0.300, 32)        # 0.3 s for 2 tokens per row: 0.15 s per row-token > 0.1 * 1.05: off
    assert t.is_off(16)
    assert t.wants_plain(16)            # off ...
    assert not t.wants_plain(16)        # ... the 2nd step is a probe
    t.record_spec(16, 0.300, 32)        # the probe confirms: the interval doubles to 4
    assert [t.wants_plain(16) for _ in range(4)] == [True, True, True, False]
    t.record_spec(16, 0.100, 64)        # 0.025 s per row-token: EMA 0.7 * 0.15 + 0.3 * 0.025 = 0.1125: still off
    assert t.spec[16] == pytest.approx(0.7 * 0.15 + 0.3 * 0.025) and t.is_off(16)
    for _ in range(3):                  # more paying probes bring it back on, and the interval back to 2
        while t.wants_plain(16):
            pass
        t.record_spec(16, 0.100, 64)
    assert not t.is_off(16) and t._interval[16] == 2
    assert not t.is_off(4) and t.wants_plain(4)  # buckets are independent


def test_probe_interval_backs_off_to_its_cap_and_plain_samples_recur():
    t = StepTiming(probe_interval=8)
    t.record_plain(1, 0.01)
    for _ in range(12):
        t.record_spec(1, 1.0, 1)
    assert t._interval[1] == MAX_PROBE_INTERVAL
    t2 = StepTiming(probe_interval=8)
    t2.record_plain(2, 0.01)
    t2.record_spec(2, 0.001, 10)  # paying: speculate, but sample a plain step every PLAIN_SAMPLE_INTERVAL steps
    plain = [t2.wants_plain(2) for _ in range(PLAIN_SAMPLE_INTERVAL + 1)]
    assert plain == [False] * PLAIN_SAMPLE_INTERVAL + [True]


class VirtualClock:
    """Stands in for ``time`` in spec_decode/spec_decoder.py: every read of ``perf_counter`` advances ``tick``
    virtual seconds (a plain step then measures one tick), and a proposer's ``sleep`` advances the clock without
    waiting. The clock's decision then depends on the stated costs, not on how busy the machine running the test is
    (a real sleep of 0.25 s lost to plain steps slowed past 60 ms by a contended CI machine)."""

    def __init__(self, tick=1e-3):
        self.t, self.tick = 0.0, tick

    def perf_counter(self):
        self.t += self.tick
        return self.t

    def monotonic(self):
        return self.t

    def sleep(self, s):
        self.t += s


class SlowProposer(Proposer):
    """Drafts the true greedy continuation (all accepted) but costs ``delay`` seconds per proposal on ``clock``
    (``time`` by default: a real sleep)."""

    def __init__(self, k, truth, delay, clock=time):
        self.num_speculative_tokens, self.truth, self.delay, self.clock = k, truth, delay, clock

    def propose(self, seqs, rows, token_ids, lengths, max_lens):
        self.clock.sleep(self.delay)
        d = np.zeros((len(seqs), self.num_speculative_tokens), dtype=np.int64)
        for i, s in enumerate(seqs):
            cont = self.truth[tuple(s.token_ids[:s.num_prompt_tokens])]
            o = s.num_output_tokens
            nxt = cont[o:o + self.num_speculative_tokens]
            d[i, :len(nxt)] = nxt
        return Proposal(d, np.minimum(self.num_speculative_tokens, max_lens).astype(np.int64))


def _run(path, delay, timed, monkeypatch):
    prompts = [[11, 23, 37, 41, 53, 67, 79] * 2, [5, 9, 300, 42, 7]]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(path, dtype="float32", progress=False).generate([{"prompt_token_ids": p} for p in prompts], sp)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)}
    llm = LLM(path, dtype="float32", progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "timed_switch_off": timed})
    clock = VirtualClock()
    monkeypatch.setattr(spec_decoder, "time", clock)
    llm.llm_engine.spec.proposer = SlowProposer(3, truth, delay, clock)
    try:
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    finally:
        monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    return llm.llm_engine.get_stats()["spec_decode_num_drafts"]


def test_engine_switches_a_drafter_off_when_it_costs_more_than_it_saves(tiny_model, monkeypatch):
    """On the virtual clock (a plain step 1 ms), a drafter whose every proposal costs 0.25 s speculates in a handful
    of steps (the first measurement and the backing-off probes: at most half the rows-with-drafts count it gets
    without the clock, where it speculates every step); a free drafter (every draft accepted) keeps speculating.
    Hand-worked at batch 2, k = 3: the slow drafter's step is 0.25 s for 4 tokens per row, 0.0625 s per row-token
    against the plain step's 0.001 s: off; the free one's is 0.001 s x 2 / 8 < 0.001 s: on."""
    path = tiny_model("llama")
    slow_timed = _run(path, 0.25, True, monkeypatch)
    slow_untimed = _run(path, 0.25, False, monkeypatch)
    free_timed = _run(path, 0.0, True, monkeypatch)
    print(f"\nspeculative steps: slow drafter {slow_timed} timed, {slow_untimed} untimed; free {free_timed}")
    assert slow_untimed >= 15 and 2 * slow_timed <= slow_untimed, (slow_timed, slow_untimed)
    assert free_timed >= 10


class CostedProposer(SlowProposer):
    """The true continuation (every draft accepted), declaring each drafting forward to cost ``f`` plain steps."""

    def __init__(self, k, truth, f):
        super().__init__(k, truth, 0.0)
        self.f = f

    def drafting_cost(self, seqs, lengths, batch_size, plain_step_s):
        from tokenfab.spec_decode.drafting_cost import DraftingCost
        return DraftingCost(self.f, np.zeros(len(seqs)))


def test_engine_cost_rule_switches_a_costly_drafter_off_at_batch_16_not_at_1(tiny_model):
    """Rule 3 with the proposer's cost through the engine (clock off, so the rule alone decides): every draft
    accepted (a = 1), each forward f = 0.8 plain steps, r = 0.035, o = 0.1. Depth kk nets kk (1 / (1 + r B) - f)
    - o / (1 + r B): at B = 1 4 x 0.1662 - 0.0966 = 0.568 > 0 (speculates, depth 4); at B = 16 1 / 1.56 = 0.641
    < 0.8, a loss at every depth, so no step speculates, probes (every 2nd step) included. Without the cost the
    same batch of 16 speculates. Tokens equal plain decoding's throughout."""
    path = tiny_model("llama")
    prompts = [[11 + i, 23, 37, 41, 53, 67, 79, 83] for i in range(16)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(path, dtype="float32", progress=False, max_num_seqs=16).generate(
        [{"prompt_token_ids": p} for p in prompts], sp)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)}
    spec = {"method": "ngram", "num_speculative_tokens": 4, "timed_switch_off": False, "probe_interval": 2}

    def drafts(n, f):
        llm = LLM(path, dtype="float32", progress=False, max_num_seqs=n, speculative_config=spec)
        llm.llm_engine.spec.proposer = (CostedProposer(4, truth, f) if f is not None else
                                        SlowProposer(4, truth, 0.0))
        out = llm.generate([{"prompt_token_ids": p} for p in prompts[:n]], sp)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain[:n]]
        return llm.llm_engine.get_stats()["spec_decode_num_drafts"]

    assert drafts(16, 0.8) == 0
    assert drafts(16, None) > 0
    assert drafts(1, 0.8) > 0


def test_plain_steps_are_timed_while_requests_wait_for_a_free_row(tiny_model):
    """With max_num_seqs 1 and a queue, the running request's plain decode steps admit nothing, so the clock times
    them (it used to skip every step while a request waited, leaving the bucket unmeasured, hence plain, for the
    whole of every queued request); the step that admits the next request is not timed."""
    path = tiny_model("llama")
    llm = LLM(path, dtype="float32", progress=False, max_num_seqs=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    eng = llm.llm_engine
    seen = []
    orig = eng.spec.timing.record_plain

    def rec(b, s):
        seen.append((b, len(eng.scheduler.waiting), [x.num_output_tokens for x in eng.scheduler.running]))
        orig(b, s)
    eng.spec.timing.record_plain = rec
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 9, 300, 42, 7]}, {"prompt_token_ids": [11, 23, 37, 41]}], sp)
    assert any(w == 1 for _, w, _ in seen)  # timed while the second request waited
    assert all(b == 1 and all(n > 1 for n in outs) for b, _, outs in seen)  # never the admitting (prefill) step
