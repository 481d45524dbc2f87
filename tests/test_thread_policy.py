"""The serving thread policy: the runner applies per-step-kind thread counts; `tokenfab serve` uses every core."""
from __future__ import annotations

import types

import pytest

import torch

from tokenfab import LLM, SamplingParams
from tokenfab.server.launch import set_server_threads


def test_runner_switches_threads_by_step_kind(tiny_model):
    before = torch.get_num_threads()
    try:
        llm = LLM(tiny_model("llama"), max_model_len=64, progress=False)
        eng = llm.llm_engine
        eng.runner.set_thread_policy(2, 1)
        eng.add_request("a", None, list(range(5, 25)), SamplingParams(max_tokens=4, ignore_eos=True))
        seen = []

        def spied(fn):
            def spy(*a, **k):
                seen.append(torch.get_num_threads())
                return fn(*a, **k)
            return spy

        eng.runner.forward = spied(eng.runner.forward)
        stack = eng.runner.cpu_decode_stack  # CPU bf16 decode steps may run through the stack's fused call instead
        if stack is not None:
            stack.run_sample = spied(stack.run_sample)
        while eng.has_unfinished_requests():
            eng.step()
        assert seen[0] == 2 and seen[1:] == [1] * (len(seen) - 1) and len(seen) == 4  # prefill, then 3 decodes
    finally:
        torch.set_num_threads(before)


def test_server_thread_defaults():
    before = torch.get_num_threads()
    try:
        cfg = types.SimpleNamespace(tensor_parallel_size=1)
        import os
        cores = len(os.sched_getaffinity(0))
        assert set_server_threads(None, cfg) == (cores, cores) and torch.get_num_threads() == cores
        assert set_server_threads(3, cfg) == (3, 3)
        assert set_server_threads(None, types.SimpleNamespace(tensor_parallel_size=2)) is None
    finally:
        torch.set_num_threads(before)


def test_serve_token_budget_default(tiny_model):
    """`tokenfab serve` on CPU defaults to vLLM's CPU server budget (2048 tokens per step); a flag overrides it."""
    from tokenfab.cli import build_parser
    from tokenfab.server.launch import SERVE_CPU_MAX_NUM_BATCHED_TOKENS, engine_config_from_args
    path = tiny_model("llama")
    args = build_parser().parse_args(["serve", path, "--device", "cpu"])
    assert engine_config_from_args(args).max_num_batched_tokens == SERVE_CPU_MAX_NUM_BATCHED_TOKENS == 2048
    args = build_parser().parse_args(["serve", path, "--device", "cpu", "--max-num-batched-tokens", "4096"])
    assert engine_config_from_args(args).max_num_batched_tokens == 4096


def test_async_engine_is_built_on_its_own_thread(tiny_model, monkeypatch):
    """AsyncLLM.from_config builds the engine on the engine thread that later steps it, never on the caller's:
    a second OpenMP pool left by loading on the main thread made every CPU decode step ~1.4x slower (NOTES 18).
    Also: a build error is re-raised on the caller's thread, and the engine steps on the thread that built it."""
    import threading

    from tokenfab.engine.engine import LLMEngine
    from tokenfab.engine.engine_config import EngineConfig
    from tokenfab.errors import EngineConfigError
    from tokenfab.server.async_engine import AsyncLLM

    built_on, stepped_on = [], set()
    real_build, real_step = LLMEngine.from_config.__func__, LLMEngine.step

    def spy_build(cls, *a, **k):
        built_on.append(threading.get_ident())
        return real_build(cls, *a, **k)

    def spy_step(self):
        stepped_on.add(threading.get_ident())
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "from_config", classmethod(spy_build))
    monkeypatch.setattr(LLMEngine, "step", spy_step)
    llm = AsyncLLM.from_config(EngineConfig(model=tiny_model("llama"), max_model_len=64))
    try:
        assert built_on and built_on[0] != threading.get_ident()
        assert not llm.is_running  # built, not started
        llm.start()
        import asyncio

        async def one():
            outs = [o async for o in llm.generate("r", None, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))]
            return outs[-1]
        out = asyncio.run(one())
        assert len(out.outputs[0].token_ids) == 3
        assert stepped_on == {built_on[0]} == {llm._thread.ident}
    finally:
        llm.shutdown()
    with pytest.raises(EngineConfigError, match="max_model_len 100000 exceeds"):
        AsyncLLM.from_config(EngineConfig(model=tiny_model("llama"), max_model_len=100000))
