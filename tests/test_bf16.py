"""bfloat16 runs of every family: the KL divergence of tokenfab-bf16 from the float32 reference is printed (the
``-s`` output of this test is what the README quotes) and only loosely bounded; greedy tokens are not compared
(bf16 rounding legitimately flips near-ties)."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import load_reference
from tokenfab import LLM, SamplingParams


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_bf16_kl_against_fp32_reference(tiny_model, family):
    path = tiny_model(family)
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 512) for _ in range(n)] for n in (48, 20)]
    llm = LLM(path, dtype="bfloat16", max_model_len=128, max_num_batched_tokens=32, progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=512))
    ref = load_reference(path, torch.float32)
    kls = []
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref_lp = torch.log_softmax(ref(torch.tensor([p])).logits[0].float(), -1)
        for i in range(1, len(p)):
            d = o.prompt_logprobs[i]
            ours = torch.full((512,), float("-inf"))
            ours[list(d.keys())] = torch.tensor(list(d.values()))
            r = ref_lp[i - 1]
            kls.append(float((r.exp() * (r - ours)).sum()))
    mean_kl, max_kl = sum(kls) / len(kls), max(kls)
    print(f"\n{family}: bf16 vs fp32 reference KL mean {mean_kl:.2e} max {max_kl:.2e} over {len(kls)} positions")
    assert llm.llm_engine.dtype == torch.bfloat16
    assert mean_kl < 5e-2
