"""When the fused CPU kernels are built: an engine on the CPU, or one with routed experts on the host, builds them
at start; an engine on an accelerator with every expert on the device never does (not at load, not at its first
draw). The "meta" device stands in for CUDA here: it is not the CPU, and building an engine on it runs the same
load, fuse, pack and runner set-up steps without memory or a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenfab import SamplingParams
from tokenfab.kernels.cpu import build as cpu_kernels_build


@pytest.fixture
def load_calls(monkeypatch):
    """Every call of the kernels' ``load`` (through cpu_kernels.* or cpu_kernels_build) recorded; each returns None
    (kernels unavailable), so the engine keeps its PyTorch paths."""
    calls = []

    def record():
        calls.append(1)
        return None

    monkeypatch.setattr(cpu_kernels_build, "load", record)
    return calls


def _engine(path: str, device: str, **kw):
    from tokenfab.engine.engine import LLMEngine
    from tokenfab.engine.engine_config import EngineConfig
    return LLMEngine.from_config(EngineConfig(model=path, device=device, num_kv_blocks=16, max_model_len=64, **kw),
                                 progress=False)


def test_wanted_by_device_and_host_experts():
    assert cpu_kernels_build.wanted("cpu") and cpu_kernels_build.wanted(torch.device("cpu"), host_experts=True)
    assert not cpu_kernels_build.wanted("cuda") and not cpu_kernels_build.wanted(torch.device("meta"))
    assert cpu_kernels_build.wanted("cuda", host_experts=True)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_accelerator_engine_never_loads_cpu_kernels(tiny_model, load_calls, family):
    eng = _engine(tiny_model(family), "meta")  # bf16: every pack / fuse step of a CPU engine is asked
    assert eng.device.type == "meta" and load_calls == []
    # its logits come to the host for the draw: a sampled (not greedy) plain row must not build the kernels either
    rows = [SimpleNamespace(params=SamplingParams(temperature=t, seed=3), generator=torch.Generator().manual_seed(3))
            for t in (1.0, 0.7, 0.0)]
    out = eng.runner.sampler(torch.randn(3, 512), rows)
    assert out.token_ids.shape == (3,) and load_calls == []


def test_host_experts_load_cpu_kernels_at_start(tiny_model, load_calls):
    _engine(tiny_model("deepseek_v3"), "meta", host_experts="50%")
    assert load_calls  # the host side runs them: built at start, not at the first request


def test_cpu_engine_loads_cpu_kernels_at_start(tiny_model, load_calls):
    _engine(tiny_model("llama"), "cpu")
    assert load_calls
