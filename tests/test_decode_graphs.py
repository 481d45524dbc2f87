"""The decode graph runner's padded static-buffer path (engine/cuda_graph_runner.py) without capture, on CPU:
the same buffers, padding rows and pad block a captured CUDA graph replays, checked token for token against
transformers. Capture itself needs a GPU (benchmarks/gpu_check.sh)."""
from __future__ import annotations

import pytest

from tokenfab.engine.cuda_graph_runner import capture_sizes, decode_graph_mode


def test_capture_sizes():
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1000)[-3:] == [240, 248, 256]


def test_mode_choice(monkeypatch):
    import torch

    class Dense:
        tp = None

    class Hybrid(Dense):
        def make_state_cache(self):
            pass

    cpu = torch.device("cpu")
    monkeypatch.delenv("TOKENFAB_DECODE_GRAPHS", raising=False)
    assert decode_graph_mode(cpu, Dense(), enforce_eager=False) is None  # no graphs on CPU
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    assert decode_graph_mode(cpu, Dense(), enforce_eager=False) == "eager"
    assert decode_graph_mode(cpu, Dense(), enforce_eager=True) is None  # the user's flag wins
    assert decode_graph_mode(cpu, Hybrid(), enforce_eager=False) is None  # KDA state rows live outside the graph
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "0")
    assert decode_graph_mode(cpu, Dense(), enforce_eager=False) is None
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "off")  # a typo must not silently mean "auto"
    with pytest.raises(Exception, match="TOKENFAB_DECODE_GRAPHS='off'.*use 0"):
        decode_graph_mode(cpu, Dense(), enforce_eager=False)


@pytest.mark.parametrize("family", ["deepseek_v3", "llama"])
def test_padded_decode_token_exact(monkeypatch, tiny_model, family):
    """5 prompts decode together, padded to the size-8 buffers; prefill and mixed steps stay on the normal path."""
    from test_engine_exact import check_family, make_prompts
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    llm, worst = check_family(tiny_model(family), make_prompts(5, [30, 3, 12, 7, 19]))
    runner = llm.llm_engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.replays > 0
    pad = graphs.pad_block
    assert pad == llm.llm_engine.block_manager.num_blocks  # one block past what the block manager hands out
    first = runner.kv_caches[0][0] if isinstance(runner.kv_caches[0], tuple) else runner.kv_caches[0]
    assert first.shape[0] == pad + 1 and first[pad].abs().sum() > 0  # padding rows wrote there, nowhere else
    assert worst < 1e-4


def test_padded_decode_with_triton_kernels(monkeypatch, tiny_model):
    """The combination a GPU runs under graphs: padded buffers + Triton attention and MoE (interpreted)."""
    from tokenfab.kernels.gpu import support as triton_support
    if not triton_support.triton_importable():
        pytest.skip("triton is not installed")
    from test_engine_exact import check_family, make_prompts
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret")
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    llm, worst = check_family(tiny_model("deepseek_v3"), make_prompts(6, [9, 25, 4]))
    assert llm.llm_engine.runner.decode_graphs.replays > 0
    assert worst < 1e-4
