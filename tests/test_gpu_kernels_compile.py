"""Every Triton kernel the GPU code path launches, compiled for NVIDIA sm_90 and AMD gfx942 on this CPU (no GPU):
Triton's interpreter, which runs them in the other tests, accepts code the compiler refuses, so a kernel checked only
there could fail its first launch on a GPU (tokenfab/testing/target_compile.py). Launches over 16-bit tensors that
used float32 dots only because the interpreter has no bfloat16 also compile in the GPU's 16-bit form. The launches are recorded from
short greedy runs of tiny models on the GPU code path (tests/test_gpu_kernel_count.py's setting: dense Llama, Qwen3-
MoE, DeepSeek-V3 with MLA and a shared expert, Kimi Linear with KDA, DeepSeek-V3 with FP8 block-scaled weights and
with INT4 / MXFP4 routed experts), prefill and decode of two
sequences (and of one for FP8's one-row linears), in float32 and bfloat16; Kimi Linear also with speculation (random
drafts), so its KDA kernels compile in the form that holds verification rows' states (engine/state_commit.py).
The decode steps run through the graph runner's padded buffers uncaptured (``TOKENFAB_DECODE_GRAPHS=eager``), and
the first decode step's forward of every model, what a CUDA graph captures, is checked to read no device value on
the host (a read there fails the capture on a GPU).
"""
from __future__ import annotations

import pytest

from tokenfab.kernels.gpu import support as triton_support
from tokenfab.testing.kernel_count import decode_step_syncs
from tokenfab.testing.target_compile import LaunchRecorder, compile_for_targets, gpu_variants

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def test_gpu_path_kernels_compile_for_sm90_and_gfx942(monkeypatch, tiny_model, tmp_path, tokenizer_dir):
    from spec_helpers import NGRAM, RandomProposer
    from test_kimi_linear import make_kimi_linear
    from tokenfab import LLM, SamplingParams
    from tokenfab.kernels.cpu import build as cpu_build

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    monkeypatch.setenv("TOKENFAB_CPU_KERNELS", "0")
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", "torch")
    monkeypatch.setattr(cpu_build, "load", lambda: None)
    from tokenfab.testing.fp8_checkpoint import write_fp8_checkpoint
    from tokenfab.testing.packed_experts_checkpoint import write_packed_experts_checkpoint
    ds = tiny_model("deepseek_v3", num_hidden_layers=2)
    kl = make_kimi_linear(str(tmp_path / "kl"), tokenizer_dir, seed=3)
    models = [(tiny_model("llama", num_hidden_layers=2), "float32"), (tiny_model("qwen3_moe", num_hidden_layers=2),
              "bfloat16"), (ds, "bfloat16"), (kl, "bfloat16"), (kl, "bfloat16-ngram"),
              (write_fp8_checkpoint(ds, str(tmp_path / "fp8")), "bfloat16")]
    models += [(write_packed_experts_checkpoint(ds, str(tmp_path / fmt), fmt), "bfloat16") for fmt in ("int4", "mxfp4")]
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")  # decode steps through the graph buffers, uncaptured
    syncs = {}
    with LaunchRecorder() as rec:
        for path, dtype in models:
            spec = NGRAM if dtype.endswith("-ngram") else None
            llm = LLM(path, dtype=dtype.removesuffix("-ngram"), max_model_len=64, block_size=8, progress=False,
                      speculative_config=spec)
            if spec is not None:  # drafts at every step
                llm.llm_engine.spec.proposer = RandomProposer(2, llm.llm_engine.model_config.vocab_size)
            sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            with decode_step_syncs(llm, syncs.setdefault(f"{path} {dtype}", [])):
                llm.generate([{"prompt_token_ids": [5, 9, 14, 3, 7]}, {"prompt_token_ids": [6, 2]}], sp)
            if spec is not None:
                assert llm.llm_engine.get_stats()["spec_decode_num_drafts"] > 0
            if "fp8" in path:  # one row: the FP8 linears' GEMV path
                llm.generate([{"prompt_token_ids": list(range(3, 40))}], sp)
    # the first decode step's forward (what a CUDA graph captures) reads no device value on the host
    assert all(len(v) == 1 and v[0]["syncs"] == [] and v[0]["launches"] > 0 for v in syncs.values()), syncs
    names = {l["name"] for l in rec.launches}
    assert {"_rms_norm_kernel", "_short_conv_kernel", "_kda_recurrent_kernel", "_grouped_gemm"} <= names, names
    held = {l["name"] for l in rec.launches if l["constexprs"].get("HOLD")}
    assert held == {"_short_conv_kernel", "_kda_recurrent_kernel"}, held
    print(f"{len(rec.launches)} distinct launches of {len(names)} kernels: {sorted(names)}")
    launches = gpu_variants(rec.launches)  # + the 16-bit dots a GPU runs where the interpreter used float32 ones
    print(f"{len(launches)} launches compiled per target")
    failures = compile_for_targets(launches)
    assert not failures, "\n".join(f"{f['kernel']} on {f['target']}: {f['error']} (constexprs {f['constexprs']})"
                                   for f in failures)
