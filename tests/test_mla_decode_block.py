"""MLA's decode-only batches as one C++ call (``cpu_kernels.mla_decode``) give bit-identical results to the Python
path of MLAttention.forward: same tokens, same logprobs, over several decode steps that read the cache rows the
block itself wrote. The Python path is tested against transformers in test_engine_exact.py / test_bf16.py."""
from __future__ import annotations

import pytest

from tokenfab.kernels import cpu_kernels
from tokenfab.layers.mla import MLAttention

pytestmark = pytest.mark.skipif(not cpu_kernels.has_bf16_dot(), reason="CPU kernels without AVX512-BF16")


def run(path, prompts, block: bool):
    from tokenfab import LLM, SamplingParams
    llm = LLM(path, dtype="bfloat16", max_model_len=256, block_size=8, progress=False)
    layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, MLAttention)]
    assert layers and all(m._block_weights is not None for m in layers)  # the block applies to this model
    for m in layers:
        m.decode_block = block
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("overrides", [{}, dict(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32)],
                         ids=["latent48", "latent96"])
def test_decode_block_is_bit_identical_to_the_python_path(tiny_model, monkeypatch, overrides):
    from test_engine_exact import make_prompts
    path = tiny_model("deepseek_v3", **overrides)
    prompts = make_prompts(3, [9, 30, 17])
    calls = []
    real = cpu_kernels.mla_decode

    def counted(x, *a, **k):
        calls.append(x.shape[0])
        return real(x, *a, **k)

    monkeypatch.setattr(cpu_kernels, "mla_decode", counted)
    want = run(path, prompts, block=False)
    assert not calls
    got = run(path, prompts, block=True)
    assert calls and max(calls) == 3  # the 3-sequence decode steps took the block
    assert got == want  # token ids and logprob dicts, exactly
