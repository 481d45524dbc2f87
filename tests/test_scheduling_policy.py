"""Scheduling policies (tokenfab/engine/scheduling_policy.py): fcfs schedules exactly what the scheduler scheduled
before the policy seam (its schedule recorded in tests/data/), fair interleaves prefills and never skips a decode,
priority orders and preempts by (priority, arrival), no request starves under any policy (a hypothesis property,
block-manager invariants checked every step), and greedy outputs are the same under all three policies (tiny float32
model, offline and served).

The scheduler tests drive :class:`Scheduler` without a model: each step applies the batch as the engine does
(``num_computed_tokens += num_new``; a sequence whose tokens are all computed gets one new token; it finishes at
``max_tokens``).
"""
from __future__ import annotations

import json
import os
from collections import deque

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server_fixtures import server_model_dir, start_test_server  # noqa: F401
from tokenfab.engine.block_manager import BlockManager
from tokenfab.engine.scheduler import ScheduledBatch, Scheduler
from tokenfab.engine.scheduling_policy import (FairPolicy, PriorityPolicy, SchedulingPolicy, check_priority,
                                               make_policy)
from tokenfab.engine.sequence import Sequence, SequenceStatus
from tokenfab.sampling_params import SamplingParams


# ---- a model-free driver ---------------------------------------------------------------------------------------
class Sim:
    """Requests (arrival step, prompt length, max_tokens, priority) driven through a scheduler step by step."""

    def __init__(self, sched, bm, requests, block_size):
        self.sched, self.bm, self.bs = sched, bm, block_size
        self.pending = sorted(range(len(requests)), key=lambda i: requests[i][0])
        self.requests = requests
        self.seqs: list[Sequence | None] = [None] * len(requests)
        self.finished_at: dict[int, int] = {}
        self.lost = 0  # tokens whose K/V a preemption threw away (recomputed later)
        self.step_no = 0
        self.batches: list[ScheduledBatch] = []

    def arrive(self):
        while self.pending and self.requests[self.pending[0]][0] <= self.step_no:
            i = self.pending.pop(0)
            _, plen, out, prio = self.requests[i]
            s = Sequence(i, str(i), 0, [(7 * i + j) % 97 + 1 for j in range(plen)], SamplingParams(max_tokens=out),
                         arrival_time=float(self.requests[i][0]))
            s.priority = prio
            self.seqs[i] = s
            self.sched.add(s)

    def step(self) -> ScheduledBatch:
        self.arrive()
        before = {id(s): s.num_computed_tokens for s in self.sched.running}
        batch = self.sched.schedule()
        for s in batch.preempted:
            self.lost += before.get(id(s), 0)
        for s, n in zip(batch.seqs, batch.num_new.tolist()):
            s.num_computed_tokens += n
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(3)
                if s.num_output_tokens >= s.params.max_tokens:
                    self.sched.finish(s, "length")
                    self.finished_at[s.seq_id] = self.step_no
        self.batches.append(batch)
        self.step_no += 1
        return batch

    def done(self) -> bool:
        return not self.pending and len(self.finished_at) == len(self.requests)


def snapshot(batch: ScheduledBatch) -> tuple:
    return ([s.seq_id for s in batch.seqs], batch.num_decodes, batch.rows.tolist(), batch.num_new.tolist(),
            batch.num_computed.tolist(), [s.seq_id for s in batch.admitted], [s.seq_id for s in batch.preempted])


def check_invariants(sched, bm: BlockManager, max_num_seqs: int, budget: int, batch: ScheduledBatch) -> None:
    """The KV pool's and the scheduler's bookkeeping after a step was applied."""
    held = [b for s in sched.running for b in s.block_table]
    assert len(held) == len(set(held)), "a block is in two block tables"
    assert not set(held) & set(bm.free_blocks), "a block is both free and held"
    assert len(set(bm.free_blocks)) == len(bm.free_blocks), "a block is twice in the free list"
    assert len(held) + len(bm.free_blocks) == bm.num_blocks, "a block leaked"
    for s in sched.waiting:
        assert s.block_table == [] and s.row == -1 and s.num_computed_tokens == 0 and s.status == SequenceStatus.WAITING
    rows = [s.row for s in sched.running]
    assert len(set(rows)) == len(rows) and sorted(rows + list(sched.free_rows)) == list(range(max_num_seqs))
    for s in sched.running:
        assert s.status == SequenceStatus.RUNNING
        need = -(-s.num_computed_tokens // bm.block_size)
        assert need <= len(s.block_table) <= -(-s.num_tokens // bm.block_size), "blocks do not match the tokens"
        assert bm.block_tables[s.row, :len(s.block_table)].tolist() == s.block_table
    assert batch.num_tokens <= budget
    assert len({id(s) for s in batch.seqs}) == len(batch.seqs)
    assert (batch.num_new[:batch.num_decodes] == 1).all() and (batch.num_new >= 1).all()


def make(policy, num_blocks, block_size, max_num_seqs, budget, max_model_len=512):
    bm = BlockManager(num_blocks, block_size, max_num_seqs, max_model_len)
    return Scheduler(bm, max_num_seqs, budget, policy), bm


# ---- fcfs: the schedule before the seam, step for step ----------------------------------------------------------
SCRIPT = [(0, 70, 5, 0), (0, 33, 9, 0), (1, 120, 3, 0), (2, 5, 12, 0), (2, 64, 4, 0), (4, 200, 6, 0),
          (4, 17, 2, 0), (5, 90, 8, 0), (9, 40, 20, 0), (9, 1, 5, 0), (10, 150, 10, 0), (15, 31, 31, 0)]


# the schedule the scheduler before the policy seam (commit afb1844) made for SCRIPT, step by step (block tables
# included), recorded once from that algorithm (kept in this file as ReferenceScheduler up to commit a7ab763)
FCFS_BEFORE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fcfs_schedule_afb1844.json")


@pytest.mark.parametrize("num_blocks,max_num_seqs,budget", [(200, 4, 48), (14, 3, 40), (16, 6, 64), (64, 8, 7)])
def test_fcfs_schedules_exactly_what_the_scheduler_did_before(num_blocks, max_num_seqs, budget):
    bs = 16
    with open(FCFS_BEFORE) as f:
        want = json.load(f)[f"{num_blocks},{max_num_seqs},{budget}"]
    sched, bm = make(make_policy("fcfs"), num_blocks, bs, max_num_seqs, budget)
    sim = Sim(sched, bm, SCRIPT, bs)
    preempted = 0
    for i, step in enumerate(want["steps"]):
        x = sim.step()
        assert list(snapshot(x)) == step[:-1], f"step {i}"
        assert [s.block_table for s in x.seqs] == step[-1], f"step {i}"
        preempted += len(x.preempted)
    assert sim.done(), f"requests left after the {len(want['steps'])} steps the scheduler took before"
    assert {str(k): v for k, v in sim.finished_at.items()} == want["finished_at"]
    if num_blocks <= 16:
        assert preempted > 0  # the tight pools exercise preemption too


# ---- fair ---------------------------------------------------------------------------------------------------------
def test_fair_gives_every_long_prompt_tokens_at_once_and_never_skips_a_decode():
    bs, budget, n_long = 16, 160, 4
    # three short requests arrive first and are decoding when four 400-token prompts arrive together at step 3
    reqs = [(0, 20, 30, 0), (0, 12, 30, 0), (0, 9, 30, 0)] + [(3, 400, 4, 0)] * n_long
    runs = {}
    for name, policy in (("fair", FairPolicy(max_partial_prefills=n_long, min_prefill_chunk=bs, block_size=bs)),
                         ("fcfs", SchedulingPolicy())):
        sched, bm = make(policy, 400, bs, 8, budget)
        sim = Sim(sched, bm, reqs, bs)
        first_tokens: dict[int, int] = {}
        while not sim.done():
            decoding = [s for s in sched.running if s.num_computed_tokens >= s.num_prompt_tokens]
            batch = sim.step()
            check_invariants(sched, bm, 8, budget, batch)
            got = {id(s) for s in batch.seqs}
            if name == "fair":  # every decode-phase row is in every step
                assert all(id(s) in got for s in decoding), f"a decode was skipped at step {sim.step_no - 1}"
            for s, n in zip(batch.seqs, batch.num_new.tolist()):
                if s.seq_id >= 3 and s.seq_id not in first_tokens:
                    first_tokens[s.seq_id] = sim.step_no - 1
            if sim.step_no == 4 and name == "fair":  # the arrival step: 3 decodes, then 157 tokens in 4 shares
                shares = sorted(n for s, n in zip(batch.seqs, batch.num_new.tolist()) if s.seq_id >= 3)
                assert shares == [32, 32, 32, 61]  # floor(157/4)=39 -> 32 (whole blocks), 125/3 -> 32, 93/2 -> 32
        runs[name] = first_tokens
    assert all(runs["fair"][i] == 3 for i in range(3, 3 + n_long))  # all four prefill from their arrival step
    assert max(runs["fcfs"].values()) > 3 + 6  # fcfs: the last one waits for three whole prefills


def test_fair_lets_short_prompts_in_beside_a_long_one():
    # one 2,000-token prompt, then a 40-token prompt arriving each step from 1 to 4; budget 256 per step
    reqs = [(0, 2000, 2, 0)] + [(k, 40, 2, 0) for k in range(1, 5)]
    first = {}
    for name, policy, short_first in (("fcfs", SchedulingPolicy(), False),
                                      ("fair", FairPolicy(max_partial_prefills=2, min_prefill_chunk=64), False),
                                      ("fair-shortest", FairPolicy(max_partial_prefills=2, min_prefill_chunk=64,
                                                                   shortest_first=True), True)):
        sched, bm = make(policy, 200, 16, 8, 256, max_model_len=2048)
        sim = Sim(sched, bm, reqs, 16)
        got = {}
        while not sim.done():
            batch = sim.step()
            check_invariants(sched, bm, 8, 256, batch)
            for s in batch.seqs:
                if s.num_output_tokens == 1 and s.seq_id not in got:
                    got[s.seq_id] = sim.step_no - reqs[s.seq_id][0]
        first[name] = got
    # fcfs: the short ones wait for the long prefill: it ends in step 8 (7 x 256 + 208), whose last 48 tokens take
    # short 1 (40, first token in step 8: 7 steps after it arrived) and 8 tokens of short 2; shorts 2-4 finish in
    # step 9 (7, 6, 5 steps after arriving). fair: each starts the step it arrives (the long one is the oldest
    # sharer, the short one the next) and is done in that step.
    assert [first["fcfs"][i] for i in range(1, 5)] == [7, 7, 6, 5]
    assert all(first["fair"][i] == 1 for i in range(1, 5)) and all(first["fair-shortest"][i] == 1
                                                                   for i in range(1, 5))
    assert first["fair"][0] <= first["fcfs"][0] + 1  # the long one loses at most a step (4 x 40 tokens)


def test_fair_shares_water_fill_and_respect_the_knobs():
    bs = 16
    seqs = []
    for i, plen in enumerate((40, 300, 300, 300, 300)):
        s = Sequence(i, str(i), 0, list(range(1, plen + 1)), SamplingParams(max_tokens=1), 0.0)
        seqs.append(s)
    p = FairPolicy(max_partial_prefills=3, min_prefill_chunk=64, block_size=bs)
    p.plan([], deque(seqs), 256, free_rows=8)
    # three sharers (cap 3, 256 // 64 = 4): the 40-token prompt takes 40, then 216 -> 108 -> 96 (blocks), 120
    assert [p.grant(s, 256) for s in seqs] == [40, 96, 120, 0, 0]
    p.plan([], deque(seqs), 100, free_rows=8)  # 100 // 64 = 1 sharer; the 60 it leaves go to the next in line
    assert [p.grant(s, 100) for s in seqs] == [40, 60, 0, 0, 0]
    p.plan([], deque(seqs), 256, free_rows=1)  # one free row: one waiting sequence can be admitted
    assert [p.grant(s, 256) for s in seqs] == [40, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="max_partial_prefills"):
        FairPolicy(max_partial_prefills=0)
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        make_policy("round-robin")


# ---- priority -------------------------------------------------------------------------------------------------------
def test_priority_admits_by_priority_then_arrival():
    bs = 16
    prios = [3, 0, 5, 0, -2, 3, 1]
    reqs = [(0, 10 + i, 2, p) for i, p in enumerate(prios)]
    sched, bm = make(PriorityPolicy(), 100, bs, 1, 64)  # one row: requests run strictly one after another
    sim = Sim(sched, bm, reqs, bs)
    while not sim.done():
        check_invariants(sched, bm, 1, 64, sim.step())
    order = sorted(sim.finished_at, key=sim.finished_at.get)
    assert order == sorted(range(len(prios)), key=lambda i: (prios[i], i)) == [4, 1, 3, 6, 0, 5, 2]
    # fcfs ignores priorities: arrival order
    sched, bm = make(SchedulingPolicy(), 100, bs, 1, 64)
    sim = Sim(sched, bm, reqs, bs)
    while not sim.done():
        sim.step()
    assert sorted(sim.finished_at, key=sim.finished_at.get) == list(range(len(prios)))


def test_priority_preempts_the_least_important_latest_arrival():
    bs = 4
    # four running requests fill a 12-block pool (admitted 1, 0, then 3, 2); the next decode needs a block: the
    # victim is the largest (priority, arrival) running one, request 0 (priority 2), not the last admitted (2)
    reqs = [(0, 11, 8, 2), (0, 11, 8, 0), (1, 11, 8, 1), (1, 11, 8, -1)]
    sched, bm = make(PriorityPolicy(), 12, bs, 4, 64, max_model_len=40)
    sim = Sim(sched, bm, reqs, bs)
    victims = []
    while not sim.done():
        batch = sim.step()
        check_invariants(sched, bm, 4, 64, batch)
        victims += [s.seq_id for s in batch.preempted]
    assert victims and victims[0] == 0
    sched, bm = make(SchedulingPolicy(), 12, bs, 4, 64, max_model_len=40)  # fcfs: the last admitted, request 3
    sim = Sim(sched, bm, reqs, bs)
    victims = []
    while not sim.done():
        victims += [s.seq_id for s in sim.step().preempted]
    assert victims and victims[0] == 3


def test_check_priority():
    assert check_priority(-7, "priority") == -7 and check_priority(0, "fcfs") == 0
    for bad in ("1", 1.0, True, None):
        with pytest.raises(ValueError, match="priority must be an integer") as e:
            check_priority(bad, "priority")
        assert e.value.param == "priority"
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        check_priority(2, "fair")


# ---- no request starves, whatever the arrivals, lengths and policy ---------------------------------------------------
request = st.tuples(st.integers(0, 30), st.integers(1, 120), st.integers(1, 25), st.integers(-2, 2))
policies = st.one_of(st.just(("fcfs", {})), st.just(("priority", {})),
                     st.tuples(st.just("fair"), st.fixed_dictionaries({"max_partial_prefills": st.integers(1, 5),
                                                                       "min_prefill_chunk": st.integers(1, 80)})))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(reqs=st.lists(request, min_size=1, max_size=12), pol=policies, bs=st.sampled_from([1, 4, 16]),
       budget=st.integers(1, 200), max_num_seqs=st.integers(1, 6), spare=st.integers(0, 60))
def test_no_request_starves(reqs, pol, bs, budget, max_num_seqs, spare):
    max_model_len = 145  # >= 120 prompt + 25 output tokens
    num_blocks = -(-max_model_len // bs) + spare  # the pool always holds one longest sequence (engine's rule)
    sched, bm = make(make_policy(pol[0], block_size=bs, **pol[1]), num_blocks, bs, max_num_seqs, budget,
                     max_model_len)
    sim = Sim(sched, bm, reqs, bs)
    work = sum(p + o for _, p, o, _ in reqs)  # tokens to compute (prompts + outputs), each once
    last_arrival = max(a for a, *_ in reqs)
    while not sim.done():
        batch = sim.step()
        check_invariants(sched, bm, max_num_seqs, budget, batch)
        assert batch.seqs or not sched.running, "a step with running sequences scheduled nothing"
        # every step computes at least one token of the outstanding work (recomputed tokens count as work again)
        assert sim.step_no <= last_arrival + 1 + work + sim.lost
        assert sim.lost <= 8 * work, "preemptions keep throwing work away"  # 2.1x at most over 2,000 examples
    assert sorted(sim.finished_at) == list(range(len(reqs)))


# ---- the same greedy tokens under every policy (tiny float32 model, chunked prefill and preemption) ----------------
PROMPTS = [[(5 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((70, 9, 130, 33, 100, 4, 61))]


def _generate(path, policy, **kw):
    from tokenfab import LLM, SamplingParams as SP
    llm = LLM(path, dtype="float32", max_model_len=160, max_num_batched_tokens=48, block_size=8, max_num_seqs=4,
              num_kv_blocks=24, scheduling_policy=policy, progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SP(temperature=0.0, max_tokens=12, min_tokens=12), use_tqdm=False, **kw)
    assert llm.llm_engine.scheduler.num_preemptions > 0  # the small pool made it recompute someone
    return llm, [o.outputs[0].token_ids for o in outs]


def test_greedy_outputs_identical_under_every_policy(tiny_model):
    path = tiny_model("llama")
    fcfs_llm, ref = _generate(path, "fcfs")
    llm, fair = _generate(path, "fair")
    assert fair == ref
    llm, prio = _generate(path, "priority", priority=[2, -1, 0, 5, 0, 1, -3])
    assert prio == ref
    llm = fcfs_llm
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate([{"prompt_token_ids": [1, 2]}], priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="priority: got 2 priorities for 1 prompts"):
        llm.generate([{"prompt_token_ids": [1, 2]}], priority=[0, 0], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_bad_scheduling_policy_names_the_setting(tiny_model):
    from tokenfab import LLM
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, fair, priority"):
        LLM(tiny_model("llama"), scheduling_policy="lifo", progress=False)


# ---- the server: the priority field ------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_server_priority_field(server_model_dir, policy):  # noqa: F811
    h = start_test_server(server_model_dir, scheduling_policy=policy)
    try:
        with httpx.Client(base_url=h.base_url, timeout=60, trust_env=False) as c:
            body = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
            for path, extra in (("/v1/completions", {}),
                                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                b = {**body, **extra}
                if extra:
                    b.pop("prompt")
                for bad in ("high", 1.5, True, None):
                    r = c.post(path, json={**b, "priority": bad})
                    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", (path, bad, r.text)
                r = c.post(path, json={**b, "priority": 0})
                assert r.status_code == 200
                r = c.post(path, json={**b, "priority": -3, "stream": True})
                if policy == "priority":
                    assert r.status_code == 200 and "[DONE]" in r.text
                else:
                    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
                    assert "priority scheduling is not enabled" in r.json()["error"]["message"]
    finally:
        h.stop()


def test_serve_flag(tiny_model, capsys):
    from tokenfab.cli import build_parser
    from tokenfab.server.launch import engine_config_from_args
    path = tiny_model("llama")
    for name in ("fcfs", "fair", "priority"):
        args = build_parser().parse_args(["serve", path, "--device", "cpu", "--scheduling-policy", name])
        assert engine_config_from_args(args).scheduling_policy == name
    assert engine_config_from_args(build_parser().parse_args(["serve", path])).scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", path, "--scheduling-policy", "lifo"])
    assert "--scheduling-policy" in capsys.readouterr().err
