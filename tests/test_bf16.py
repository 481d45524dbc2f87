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
    llm = LLM(path, dtype="bfloat16", max_model_len=128, max_num_batched_tokens=32, max_logprobs=-1, progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=512))
    ref = load_reference(path, torch.float32)
    kls = []
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref_lp = torch.log_softmax(ref(torch.tensor([p])).logits[0].float(), -1)
        for i in range(1, len(p)):
            d = o.prompt_logprobs[i]
            ours = torch.full((512,), float("-inf"))
            ours[list(d.keys())] = torch.tensor([e.logprob for e in d.values()])
            r = ref_lp[i - 1]
            kls.append(float((r.exp() * (r - ours)).sum()))
    mean_kl, max_kl = sum(kls) / len(kls), max(kls)
    print(f"\n{family}: bf16 vs fp32 reference KL mean {mean_kl:.2e} max {max_kl:.2e} over {len(kls)} positions")
    assert llm.llm_engine.dtype == torch.bfloat16
    assert mean_kl < 5e-2


@pytest.mark.parametrize("kind", ["kimi_linear", "k3"])
def test_bf16_hybrid_models_run_and_stay_close_to_fp32(tmp_path, tokenizer_dir, kind):
    """Kimi Linear and the K3 layout in bfloat16 (where CPU linears are repacked for oneDNN): generation runs and
    prompt distributions stay close to the same engine in float32 (mean KL printed, loosely bounded)."""
    if kind == "kimi_linear":
        from test_kimi_linear import make_kimi_linear
        path = make_kimi_linear(str(tmp_path / "m"), tokenizer_dir)
    else:
        from test_kimi_k3 import TEXT, k3_tensors, write_k3
        path = write_k3(str(tmp_path / "m"), tokenizer_dir, tensors=k3_tensors(TEXT)[0])
    rng = random.Random(5)
    prompt = [rng.randrange(5, 500) for _ in range(40)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=20)
    runs = {}
    for dt in ("float32", "bfloat16"):
        llm = LLM(path, dtype=dt, max_model_len=96, max_num_batched_tokens=16, progress=False)
        runs[dt] = llm.generate([{"prompt_token_ids": prompt}], sp)[0]
        assert len(runs[dt].outputs[0].token_ids) == 4
    kls = []
    for a, b in zip(runs["float32"].prompt_logprobs[1:], runs["bfloat16"].prompt_logprobs[1:]):
        common = [t for t in a if t in b]
        la, lb = (torch.tensor([d[t].logprob for t in common]) for d in (a, b))
        kls.append(float((la.exp() * (la - lb)).sum()))
    mean_kl = sum(kls) / len(kls)
    print(f"\n{kind}: bf16 vs fp32 (top-20 restricted) KL mean {mean_kl:.2e}")
    assert abs(mean_kl) < 5e-2
