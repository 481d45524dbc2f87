"""Async scheduling (engine/async_scheduling.py, ``TOKENFAB_ASYNC_SCHEDULING``): each step is scheduled and launched
before the previous step's ids reach the host, its placeholder input ids filled from those ids where the step runs.
On by default for GPU engines only; forced on here for CPU engines, whose outputs must equal those of the same engine
scheduling in step: token ids, text, finish and stop reasons, logprobs, for greedy and seeded requests, with end
tokens found after the next step was launched (its row wasted), stop strings, min_tokens, n > 1, chunked prefill,
rows and blocks reused mid-run, preemption, a penalties request (processed in line), the padded decode-graph buffers,
a hybrid KDA model and an abort while a step is in flight.
"""
from __future__ import annotations

import pytest

from tokenfab import LLM, SamplingParams
from tokenfab.engine import cuda_graph_runner, model_runner
from tokenfab.engine.async_scheduling import async_scheduling_enabled, fill_placeholders, fill_placeholders_host
from tokenfab.errors import EngineConfigError

PROMPTS = [[5, 9, 14, 3, 7], [11, 12, 13], [7] * 30, [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [60, 61],
           [70, 71, 72, 73]]


def make_llm(monkeypatch, path: str, mode: str, **kw) -> LLM:
    monkeypatch.setenv("TOKENFAB_ASYNC_SCHEDULING", mode)
    args = dict(dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=16, max_num_seqs=3,
                progress=False)
    args.update(kw)
    llm = LLM(path, **args)
    assert (llm.llm_engine.ahead is not None) == (mode == "1")
    return llm


def summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [sorted((t, round(lp.logprob, 5)) for t, lp in d.items())
                                               for d in c.logprobs]) for c in o.outputs] for o in outs]


@pytest.fixture
def filled(monkeypatch):
    """Counts of placeholder ids filled, by path: "device" (fill_placeholders in the module and graph paths) and
    "host" (the fused CPU stack's numpy ids)."""
    seen = {"device": 0, "host": 0}

    def dev(ids, source):
        seen["device"] += int((ids < 0).sum())
        return fill_placeholders(ids, source)

    def host(ids, source):
        if source is not None:
            seen["host"] += int((ids < 0).sum())
        return fill_placeholders_host(ids, source)

    monkeypatch.setattr(model_runner, "fill_placeholders", dev)
    monkeypatch.setattr(cuda_graph_runner, "fill_placeholders", dev)
    monkeypatch.setattr(model_runner, "fill_placeholders_host", host)
    return seen


def mixed_params(probe):
    """Requests that end by a stop string, a stop token (found mid-run), length, min_tokens, n = 2 seeded, max_tokens
    1 (finished by length before its id is known), a penalty (its steps processed in line)."""
    text0, toks1 = probe[0].outputs[0].text, probe[1].outputs[0].token_ids
    assert len(text0) > 12, text0
    return [
        SamplingParams(temperature=0.0, max_tokens=24, stop=[text0[8:11]], ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[toks1[6]], ignore_eos=True),
        SamplingParams(temperature=0.9, max_tokens=17, seed=7, n=2, min_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=9, stop=[text0[8:11], "zz"], min_tokens=3),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
    ]


@pytest.mark.parametrize("graphs", ["0", "eager"])
def test_async_scheduling_equals_scheduling_in_step(monkeypatch, tiny_model, filled, graphs):
    """Three rows for six requests (seven sequences): rows and blocks freed at a fill are reused by the next step
    while a wasted row of the finished sequence is in flight. With graphs "eager" the decode steps fill their
    placeholders in the padded static buffers (the CUDA graph path)."""
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", graphs)
    path = tiny_model("llama")
    sync = make_llm(monkeypatch, path, "0")
    probe = sync.generate([{"prompt_token_ids": p} for p in PROMPTS],
                          SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    params = mixed_params(probe)
    reqs = [{"prompt_token_ids": p} for p in PROMPTS]
    want = summary(sync.generate(reqs, params, use_tqdm=False))
    assert want[1][0][2:4] == ("stop", params[1].stop_token_ids[0]) and want[0][0][2] == "stop", want
    assert want[4][0][2] == "length" and len(want[4][0][0]) == 1
    llm = make_llm(monkeypatch, path, "1")
    eng = llm.llm_engine
    assert summary(llm.generate(reqs, params, use_tqdm=False)) == want
    assert eng.ahead.steps_ahead > 10  # most steps were launched before their predecessor's ids arrived
    assert filled["device"] + filled["host"] > 10
    if graphs == "eager":
        assert filled["device"] > 0 and eng.runner.decode_graphs.replays > 0
    assert eng.block_manager.usage() == 0 and len(eng.scheduler.free_rows) == 3  # nothing leaked
    assert eng.stats["step_failures_total"] == 0  # no step re-run by failure isolation on filled ids


def test_processors_schedule_ahead_unless_they_need_the_id_on_the_host(monkeypatch, tiny_model):
    """Rows with min_p, logit_bias, allowed_token_ids (greedy and seeded) or penalties (frequency, presence,
    repetition: their counts advance at the draw, draw_time_counts.py) are scheduled ahead like plain rows, every
    step of a batch made of them alone; a bad-words row (it reads the output's last ids on the host) keeps its steps
    in line. Outputs equal scheduling in step's, whose penalties count on the host."""
    path = tiny_model("llama")
    reqs = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    free = [SamplingParams(temperature=0.8, seed=3, max_tokens=12, min_p=0.2, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=0.0, max_tokens=12, logit_bias={7: 5.0, 9: -100.0}, ignore_eos=True),
            SamplingParams(temperature=0.7, seed=5, max_tokens=12, allowed_token_ids=[3, 7, 9, 11, 40, 41],
                           ignore_eos=True)]
    penalized = [SamplingParams(temperature=0.0, max_tokens=14, frequency_penalty=0.7, ignore_eos=True, logprobs=2),
                 SamplingParams(temperature=0.9, seed=11, max_tokens=14, presence_penalty=1.1, ignore_eos=True),
                 SamplingParams(temperature=0.0, max_tokens=14, repetition_penalty=1.6, frequency_penalty=-0.3,
                                ignore_eos=True)]
    bad = SamplingParams(temperature=0.0, max_tokens=12, bad_words=["a"], ignore_eos=True)
    sync = make_llm(monkeypatch, path, "0")
    want_free = summary(sync.generate(reqs, free, use_tqdm=False))
    want_pen = summary(sync.generate(reqs, penalized, use_tqdm=False))
    want_bad = summary(sync.generate(reqs[:2], [bad, bad], use_tqdm=False))
    plain = summary(sync.generate(reqs, [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)] * 3,
                                  use_tqdm=False))
    assert [w[0][0] for w in want_pen] != [p[0][0] for p in plain]  # the penalties change the tokens
    llm = make_llm(monkeypatch, path, "1")
    eng = llm.llm_engine
    assert summary(llm.generate(reqs, free, use_tqdm=False)) == want_free
    ahead = eng.ahead.steps_ahead
    assert ahead >= 10, ahead  # 12 tokens each: every decode step after the first scheduled ahead
    assert summary(llm.generate(reqs, penalized, use_tqdm=False)) == want_pen
    assert eng.ahead.steps_ahead - ahead >= 12, eng.ahead.steps_ahead - ahead
    ahead = eng.ahead.steps_ahead
    assert summary(llm.generate(reqs[:2], [bad, bad], use_tqdm=False)) == want_bad
    assert eng.ahead.steps_ahead - ahead <= 1, eng.ahead.steps_ahead - ahead  # in line (the prefill step aside)


def test_penalties_ahead_under_preemption_and_switching(monkeypatch, tiny_model):
    """Penalized requests scheduled ahead while a small pool preempts them (recomputed and re-admitted: their
    draw-time counts rebuilt from the token list), then the mode switched off and on between steps with penalized
    requests running (the counts move between the host and the draw): tokens and logprobs equal scheduling in
    step's throughout."""
    path = tiny_model("llama")
    prompts = [[3 + i, 9, 14 + i, 3, 7, 8, 9] for i in range(4)]
    sp = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=30 + i, ignore_eos=True, logprobs=1,
                         frequency_penalty=0.4 * (i + 1), presence_penalty=0.5, repetition_penalty=1.2)
          for i in range(4)]
    reqs = [{"prompt_token_ids": p} for p in prompts]
    kw = dict(num_kv_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48)
    sync = make_llm(monkeypatch, path, "0", **kw)
    want = summary(sync.generate(reqs, sp, use_tqdm=False))
    assert sync.llm_engine.scheduler.num_preemptions > 0
    llm = make_llm(monkeypatch, path, "1", **kw)
    eng = llm.llm_engine
    assert summary(llm.generate(reqs, sp, use_tqdm=False)) == want
    assert eng.scheduler.num_preemptions > 0 and eng.ahead.steps_ahead > 20
    for i, (p, s) in enumerate(zip(prompts, sp)):
        eng.add_request(f"r{i}", None, p, s)
    outs, n = {}, 0
    while eng.has_unfinished_requests():
        n += 1
        if n in (6, 14):
            eng.set_async_scheduling(False)
        elif n in (10, 18):
            eng.set_async_scheduling(True)
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert summary([outs[f"r{i}"] for i in range(4)]) == want
    assert eng.block_manager.usage() == 0


def test_draw_time_penalties_equal_the_host_form_bit_for_bit():
    """DrawTimeCounts.apply (dense, counts advanced at the draw) against apply_penalties_at (the host form over the
    seen pairs) on random logits, counts and prompt masks, the same float32 operations: equal bit for bit, tokens
    never seen untouched."""
    import numpy as np
    import torch
    from tokenfab.engine.draw_time_counts import DrawTimeCounts
    from tokenfab.engine.logits_processors import apply_penalties_at
    g = torch.Generator().manual_seed(0)
    rows, V, N = 5, 50, 4
    dc = DrawTimeCounts(rows, V, torch.device("cpu"))
    ids = [np.array([1, 2, 3, 4, 2, 2, 7], dtype=np.int64), np.array([9, 9, 9, 0], dtype=np.int64),
           np.array([5, 6, 40, 41, 42, 6, 6, 49], dtype=np.int64)]
    for r, (t, npr) in zip((4, 0, 2), zip(ids, (3, 2, 4))):
        dc.admit(r, t, npr)
    batch_rows = np.array([4, 0, 2])  # batch positions 0, 2, 3 (1 has no penalties)
    index = np.array([0, 2, 3])
    dc.advance(batch_rows, torch.tensor([7, 99, 9, 49]).clamp(max=V - 1), index)  # the step's draw
    logits = torch.randn(N, V, generator=g) * 4
    rep, freq, pres = torch.rand(N, generator=g) + 1, torch.rand(N, generator=g) - 0.2, torch.rand(N, generator=g)
    got = dc.apply(logits.clone(), index, batch_rows, rep, freq, pres)
    pairs = [(i, tok) for i, r in zip(index, batch_rows) for tok in range(V)
             if dc.prompt[r, tok] or dc.counts[r, tok] > 0]
    pi = torch.tensor([p[0] for p in pairs])
    pt = torch.tensor([p[1] for p in pairs])
    cnt = torch.stack([dc.counts[int(batch_rows[list(index).index(int(i))]), int(t)] for i, t in pairs])
    want = apply_penalties_at(logits.clone(), pi, pt, cnt, rep, freq, pres)
    assert torch.equal(got, want)
    assert dc.counts[4, 7] == 1 + 1 and dc.counts[0, 9] == 1 + 1 and dc.counts[2, 49] == 1 + 1  # drawn ids counted
    assert torch.equal(got[1], logits[1])


def test_async_scheduling_under_preemption(monkeypatch, tiny_model):
    """A pool of 12 blocks of 4 tokens for 4 sequences growing to 37-40 tokens: sequences are preempted (some
    holding a placeholder for the step in flight) and recomputed; outputs equal scheduling in step's."""
    path = tiny_model("llama")
    prompts = [[3 + i, 9, 14 + i, 3, 7, 8, 9] for i in range(4)]
    sp = [SamplingParams(temperature=0.0, max_tokens=30 + i, ignore_eos=True) for i in range(4)]
    kw = dict(num_kv_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48)
    sync = make_llm(monkeypatch, path, "0", **kw)
    want = summary(sync.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False))
    assert sync.llm_engine.scheduler.num_preemptions > 0
    from tokenfab.engine.scheduler import Scheduler
    holding = []  # per preemption: whether the victim held a placeholder (its last id not yet on the host)
    orig = Scheduler._preempt

    def spy(self, seq):
        holding.append(seq.token_ids[-1] < 0)
        orig(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    llm = make_llm(monkeypatch, path, "1", **kw)
    assert summary(llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)) == want
    assert any(holding), holding
    eng = llm.llm_engine
    assert eng.scheduler.num_preemptions > 0 and eng.ahead.steps_ahead > 0 and eng.block_manager.usage() == 0
    assert eng.stats["step_failures_total"] == 0


def test_async_scheduling_kda_hybrid(monkeypatch, tmp_path_factory, tokenizer_dir, filled):
    """Kimi Linear (KDA + MLA) through the padded graph buffers: state slots of finished sequences are reused by new
    ones while a wasted row of the old owner is in flight; tokens and logprobs equal scheduling in step's."""
    from test_engine_exact import make_prompts
    from test_kimi_linear import make_kimi_linear
    path = make_kimi_linear(str(tmp_path_factory.mktemp("async_kimi_linear")), tokenizer_dir, seed=3)
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    prompts = make_prompts(3, [30, 3, 12, 7, 19, 25, 5, 9])
    sync = make_llm(monkeypatch, path, "0", max_num_batched_tokens=32, max_num_seqs=4)
    probe = sync.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    # each request stops at the token its greedy run makes 3rd..8th: found after the next step was launched
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0,
                             stop_token_ids=[o.outputs[0].token_ids[2 + i % 6]]) for i, o in enumerate(probe)]
    want = summary(sync.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    graph_ph = []  # placeholder ids in the decode steps the padded buffers ran
    orig = cuda_graph_runner.DecodeGraphRunner.run

    def spy(self, input_ids, *args, **kw):
        graph_ph.append(int((input_ids < 0).sum()))
        return orig(self, input_ids, *args, **kw)

    monkeypatch.setattr(cuda_graph_runner.DecodeGraphRunner, "run", spy)
    llm = make_llm(monkeypatch, path, "1", max_num_batched_tokens=32, max_num_seqs=4)
    got = summary(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    for w, g in zip(want, got):  # float32; the logprobs may differ in the last digits with the batch's makeup
        assert [c[:4] for c in g] == [c[:4] for c in w]
        assert all(abs(a[0][1] - b[0][1]) < 1e-4 for a, b in zip(g[0][4], w[0][4]))
    assert llm.llm_engine.ahead.steps_ahead > 5 and filled["device"] > 0
    assert sum(graph_ph) > 0, graph_ph
    assert llm.llm_engine.stats["step_failures_total"] == 0  # no step re-run by failure isolation on filled ids


@pytest.mark.parametrize("family,graphs", [("qwen3", "0"), ("kimi_linear", "eager")])
def test_async_scheduling_tensor_parallel(monkeypatch, tiny_model, tmp_path_factory, tokenizer_dir, family, graphs):
    """Two ranks over gloo: rank 0 schedules each step ahead and broadcasts the drawn ids its placeholders stand for
    after the step's header; the worker fills its own placeholders from them (its logits would otherwise be gathered
    from a forward over wrong ids). Qwen3 on the module path, Kimi Linear (KDA state slots reused while a wasted row
    is in flight) through the padded buffers. Token ids, finish reasons and logprobs equal the synchronous engine on
    one rank, requests stopping at a token found after the next step was launched."""
    from tokenfab.parallel.worker import StepChannel
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", graphs)
    monkeypatch.setenv("TOKENFAB_TP_TIMEOUT", "120")
    if family == "kimi_linear":  # 5 KDA heads: 3 + 2 on two ranks
        from test_kimi_linear import make_kimi_linear
        path = make_kimi_linear(str(tmp_path_factory.mktemp("async_tp_kl")), tokenizer_dir, seed=3, linear_num_heads=5)
    else:
        path = tiny_model(family)
    reqs = [{"prompt_token_ids": p} for p in PROMPTS]
    sync = make_llm(monkeypatch, path, "0")
    probe = sync.generate(reqs, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1,
                             stop_token_ids=[o.outputs[0].token_ids[3 + i % 5]]) for i, o in enumerate(probe)]
    want = summary(sync.generate(reqs, params, use_tqdm=False))
    sent = []
    orig = StepChannel.send_step

    def spy(self, *args, source=None, **kw):
        sent.append(0 if source is None else len(source))
        return orig(self, *args, source=source, **kw)

    monkeypatch.setattr(StepChannel, "send_step", spy)
    llm = make_llm(monkeypatch, path, "1", tensor_parallel_size=2)
    eng = llm.llm_engine
    try:
        got = summary(llm.generate(reqs, params, use_tqdm=False))
        ahead = eng.ahead.steps_ahead
    finally:
        eng.shutdown()
    for w, g in zip(want, got):  # float32 over two ranks: logprobs to the last digits may differ
        assert [c[:4] for c in g] == [c[:4] for c in w]
        assert all(abs(a[0][1] - b[0][1]) < 1e-4 for c, d in zip(g, w) for a, b in zip(c[4], d[4]))
    assert ahead > 5 and sum(1 for n in sent if n) > 5, (ahead, sent)


def test_abort_while_a_step_is_in_flight(monkeypatch, tiny_model):
    """A step returns its predecessor's outputs; aborting a request whose next step is in flight returns its final
    output at once (its in-flight token is dropped) and the other request goes on to the tokens it has in step."""
    path = tiny_model("llama")
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    sync = make_llm(monkeypatch, path, "0")
    want_b = sync.generate([{"prompt_token_ids": PROMPTS[1]}], sp, use_tqdm=False)[0].outputs[0].token_ids
    eng = make_llm(monkeypatch, path, "1").llm_engine
    eng.add_request("a", None, PROMPTS[0], sp)
    eng.add_request("b", None, PROMPTS[1], sp)
    assert eng.step() == []  # the prefills were launched; nothing has come back yet
    first = {o.request_id: len(o.outputs[0].token_ids) for o in eng.step()}
    assert first == {"a": 1, "b": 1}
    eng.step()
    final = eng.abort_request("a")  # its third token is in flight
    assert final.finished and final.outputs[0].finish_reason == "abort" and len(final.outputs[0].token_ids) == 2
    last = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id == "b"
            last = o
    assert last.finished and last.outputs[0].token_ids == want_b
    assert eng.block_manager.usage() == 0


def test_switching_async_scheduling_between_steps(monkeypatch, tiny_model):
    """``set_async_scheduling`` off while a step is in flight processes that step (its outputs come with the next
    step's) and on again resumes scheduling ahead; the tokens equal scheduling in step's throughout."""
    path = tiny_model("llama")
    sp = [SamplingParams(temperature=0.0, max_tokens=14 + 3 * i, ignore_eos=True) for i in range(3)]
    want = summary(make_llm(monkeypatch, path, "0").generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], sp,
                                                            use_tqdm=False))
    eng = make_llm(monkeypatch, path, "1").llm_engine
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(str(i), None, p, sp[i])
    final, n = {}, 0
    while eng.has_unfinished_requests():
        if n in (4, 9):
            eng.set_async_scheduling(n == 9)
            assert (eng.ahead is None) == (n == 4)
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
        n += 1
    assert summary([final[str(i)] for i in range(3)]) == want
    assert eng.ahead.steps_ahead > 0 and eng.block_manager.usage() == 0


def test_engine_setting_and_refusals(monkeypatch, tiny_model):
    """``async_scheduling=True`` turns it on whatever the environment says, False off; True with speculative
    decoding is refused by name before loading."""
    from tokenfab.errors import UnsupportedError
    path = tiny_model("llama")
    monkeypatch.setenv("TOKENFAB_ASYNC_SCHEDULING", "0")
    kw = dict(dtype="float32", max_model_len=64, progress=False)
    assert LLM(path, async_scheduling=True, **kw).llm_engine.ahead is not None
    monkeypatch.setenv("TOKENFAB_ASYNC_SCHEDULING", "1")
    assert LLM(path, async_scheduling=False, **kw).llm_engine.ahead is None
    with pytest.raises(UnsupportedError, match="async_scheduling=True does not run with speculative decoding"):
        LLM(path, async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **kw)
    monkeypatch.delenv("TOKENFAB_ASYNC_SCHEDULING")
    spec = LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                         "prompt_lookup_max": 3, "prompt_lookup_min": 1}, **kw).llm_engine
    assert spec.ahead is None
    with pytest.raises(UnsupportedError, match="does not run with speculative decoding"):
        spec.set_async_scheduling(True)


def test_fill_placeholders():
    import numpy as np
    import torch
    src = torch.tensor([100, 200, 300])
    ids = torch.tensor([5, -1, 7, -3, -2])
    assert fill_placeholders(ids, src).tolist() == [5, 100, 7, 300, 200]
    assert fill_placeholders_host(np.array([-2, 4]), src).tolist() == [200, 4]
    keep = np.array([1, 2])
    assert fill_placeholders_host(keep, src) is keep


def test_env_setting(monkeypatch):
    monkeypatch.setenv("TOKENFAB_ASYNC_SCHEDULING", "yes")
    with pytest.raises(EngineConfigError, match="TOKENFAB_ASYNC_SCHEDULING='yes'.*auto"):
        async_scheduling_enabled(torch_device("cpu"))
    monkeypatch.delenv("TOKENFAB_ASYNC_SCHEDULING")
    assert not async_scheduling_enabled(torch_device("cpu")) and async_scheduling_enabled(torch_device("cuda"))


def torch_device(name: str):
    import torch
    return torch.device(name)
