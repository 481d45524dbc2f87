"""The serving thread policy: the runner applies per-step-kind thread counts; `tokenfab serve` uses every core."""
from __future__ import annotations

import types

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
        orig = eng.runner.forward

        def spy(*a, **k):
            seen.append(torch.get_num_threads())
            return orig(*a, **k)

        eng.runner.forward = spy
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
