"""Attention of decode-only batches as one C++ call gives bit-identical results to the Python paths: MLA
(``cpu_decode_blocks.mla_decode`` vs MLAttention.forward) and grouped-query attention
(``cpu_decode_blocks.gqa_decode`` vs LlamaAttention.forward, Llama and Qwen3 with its q/k norms, with and without biases). Same tokens, same logprobs,
over several decode steps that read the cache rows the block itself wrote. The Python paths are tested against
transformers in test_engine_exact.py / test_bf16.py."""
from __future__ import annotations

import pytest

from tokenfab.kernels.cpu.ops import decode_blocks as cpu_decode_blocks
from tokenfab.kernels.cpu.ops import support as cpu_support
from tokenfab.layers.mla import MLAttention
from tokenfab.models.llama import LlamaAttention

pytestmark = pytest.mark.skipif(not cpu_support.has_bf16_dot(), reason="CPU kernels without AVX512-BF16")


def run(path, prompts, block: bool):
    from tokenfab import LLM, SamplingParams
    llm = LLM(path, dtype="bfloat16", max_model_len=256, block_size=8, progress=False)
    layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, (MLAttention, LlamaAttention))]
    assert layers and all(m._block_weights is not None if isinstance(m, MLAttention) else m._block_ok
                          for m in layers)  # the block applies to this model
    for m in layers:
        m.decode_block = block
    llm.llm_engine.runner.cpu_decode_stack = None  # the layers' own path (the stack: test_decode_stack.py)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def counting(monkeypatch, name):
    calls = []
    real = getattr(cpu_decode_blocks, name)

    def counted(x, *a, **k):
        calls.append(x.shape[0])
        return real(x, *a, **k)

    monkeypatch.setattr(cpu_decode_blocks, name, counted)
    return calls


@pytest.mark.parametrize("overrides", [{}, dict(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32)],
                         ids=["latent48", "latent96"])
def test_decode_block_is_bit_identical_to_the_python_path(tiny_model, monkeypatch, overrides):
    from test_engine_exact import make_prompts
    path = tiny_model("deepseek_v3", **overrides)
    prompts = make_prompts(3, [9, 30, 17])
    calls = counting(monkeypatch, "mla_decode")
    want = run(path, prompts, block=False)
    assert not calls
    got = run(path, prompts, block=True)
    assert calls and max(calls) == 3  # the 3-sequence decode steps took the block
    assert got == want  # token ids and logprob dicts, exactly


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen3", {}), ("llama", {"attention_bias": True}),
                                              ("llama", {"head_dim": 32, "num_key_value_heads": 1})],
                         ids=["llama", "qwen3-qk-norm", "llama-bias", "llama-mqa-d32"])
def test_gqa_decode_block_is_bit_identical_to_the_python_path(tiny_model, monkeypatch, family, overrides):
    from test_engine_exact import make_prompts
    path = tiny_model(family, **overrides)
    prompts = make_prompts(4, [9, 30, 17])
    calls = counting(monkeypatch, "gqa_decode")
    want = run(path, prompts, block=False)
    assert not calls
    got = run(path, prompts, block=True)
    assert calls and max(calls) == 3
    assert got == want
