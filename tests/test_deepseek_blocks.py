"""DeepSeek-V3's blocks as one C++ call each give bit-identical results to their Python paths: MLA's decode-only
batches (``cpu_kernels.mla_decode``) and the MoE block (``cpu_kernels.deepseek_moe``, every batch). Same tokens,
same logprobs, over several decode steps that read the cache rows the MLA block itself wrote. The Python paths are
tested against transformers in test_engine_exact.py / test_bf16.py."""
from __future__ import annotations

import pytest

from tokenfab.kernels import cpu_kernels
from tokenfab.layers.mla import MLAttention
from tokenfab.models.deepseek_v3 import DeepseekV3MoE

pytestmark = pytest.mark.skipif(not cpu_kernels.has_bf16_dot(), reason="CPU kernels without AVX512-BF16")


def run(path, prompts, mla_block: bool = True, moe_block: bool = True):
    from tokenfab import LLM, SamplingParams
    llm = LLM(path, dtype="bfloat16", max_model_len=256, block_size=8, max_num_batched_tokens=24, progress=False)
    modules = list(llm.llm_engine.runner.model.modules())
    mla = [m for m in modules if isinstance(m, MLAttention)]
    moe = [m for m in modules if isinstance(m, DeepseekV3MoE)]
    assert mla and all(m._block_weights is not None for m in mla)  # the blocks apply to this model
    assert moe and all(m._block_ok for m in moe)
    for m in mla:
        m.decode_block = mla_block
    for m in moe:
        m.fused_block = moe_block
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


def counting(monkeypatch, name):
    calls = []
    real = getattr(cpu_kernels, name)

    def counted(x, *a, **k):
        calls.append(x.shape[0])
        return real(x, *a, **k)

    monkeypatch.setattr(cpu_kernels, name, counted)
    return calls


@pytest.mark.parametrize("overrides", [{}, dict(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32)],
                         ids=["latent48", "latent96"])
def test_decode_block_is_bit_identical_to_the_python_path(tiny_model, monkeypatch, overrides):
    from test_engine_exact import make_prompts
    path = tiny_model("deepseek_v3", **overrides)
    prompts = make_prompts(3, [9, 30, 17])
    calls = counting(monkeypatch, "mla_decode")
    want = run(path, prompts, mla_block=False)
    assert not calls
    got = run(path, prompts, mla_block=True)
    assert calls and max(calls) == 3  # the 3-sequence decode steps took the block
    assert got == want  # token ids, logprob dicts and prompt logprobs, exactly


def test_moe_block_is_bit_identical_to_the_python_path(tiny_model, monkeypatch):
    """Prefill chunks of up to 24 tokens and decode steps of 3 sequences through the MoE block."""
    from test_engine_exact import make_prompts
    path = tiny_model("deepseek_v3", num_hidden_layers=3)
    prompts = make_prompts(5, [9, 30, 17])
    calls = counting(monkeypatch, "deepseek_moe")
    want = run(path, prompts, moe_block=False)
    assert not calls
    got = run(path, prompts, moe_block=True)
    assert 3 in calls and max(calls) > 3  # decode steps and prefill chunks took the block
    assert got == want
