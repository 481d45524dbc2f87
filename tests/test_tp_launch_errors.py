"""A tensor-parallel rank that fails (during load, or killed mid-run) surfaces as TensorParallelError with that
rank's error: no hang (each case is bounded by a wall-clock limit)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tokenfab import LLM, SamplingParams
from tokenfab.parallel.launcher import TensorParallelError
from tokenfab.parallel.sharded_loading import FAIL_ENV

KW = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=16, block_size=8, progress=False)
LIMIT_S = 90


@pytest.fixture(scope="module")
def path(tmp_path_factory, tokenizer_dir):
    from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tperr") / "llama"), "llama", vocab_size=600,
                                tokenizer_dir=tokenizer_dir, hidden_size=48, num_attention_heads=6, num_key_value_heads=3,
                                head_dim=8, intermediate_size=50, num_hidden_layers=1)


def test_worker_load_failure_reports_rank(path, monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "2")
    monkeypatch.setenv("TOKENFAB_TP_TIMEOUT", "60")
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError) as ei:
        LLM(path, tensor_parallel_size=3, **KW)
    assert time.monotonic() - t0 < LIMIT_S
    assert ei.value.rank == 2
    assert "rank 2" in str(ei.value) and "injected load failure on rank 2" in str(ei.value)


def test_rank0_load_failure_stops_workers(path, monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "0")
    with pytest.raises(RuntimeError, match="injected load failure on rank 0"):
        LLM(path, tensor_parallel_size=2, **KW)


def test_killed_worker_is_reported(path, monkeypatch):
    monkeypatch.setenv("TOKENFAB_TP_TIMEOUT", "60")
    llm = LLM(path, tensor_parallel_size=3, **KW)
    group = llm.llm_engine.tp_group
    victim = group.procs[0]  # rank 1
    os.kill(victim.popen.pid, signal.SIGKILL)
    victim.join(10)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError) as ei:
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert time.monotonic() - t0 < LIMIT_S
    assert ei.value.rank == 1 and "exited with code -9" in str(ei.value)
    assert all(p.exitcode is not None for p in group.procs)  # the survivors were stopped too
    assert "rank 1" in (llm.llm_engine.health_error() or "")  # the server's /health turns 503 on this
    llm.llm_engine.shutdown()  # idempotent after a failure
