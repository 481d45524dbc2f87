"""MLA prefill in absorbed form (attention over the latent rows, W_UK / W_UV per head) against transformers, as the
expanded form is tested in tests/test_engine_exact.py. benchmarks/mla_prefill_forms.py measures which is faster."""
from __future__ import annotations

import pytest

from tokenfab.layers.mla import MLAttention


@pytest.fixture
def absorbed(monkeypatch):
    calls = []

    def always(self, group):
        calls.append(group.q_len)
        return True

    monkeypatch.setattr(MLAttention, "_absorb_prefill", always)
    return calls


def test_absorbed_prefill_token_exact_fp32(absorbed, tiny_model):
    """Chunked prefill (budget 24 tokens) so chunks attend to earlier chunks' latents as well as their own."""
    from test_engine_exact import check_family, make_prompts
    _, worst = check_family(tiny_model("deepseek_v3"), make_prompts(7, [37, 5, 70, 18]))
    assert absorbed and max(absorbed) > 1  # the prefill groups took the absorbed form
    assert worst < 1e-4


def test_absorbed_prefill_bf16_matches_expanded(tiny_model, monkeypatch):
    """In bf16 (the per-head GEMM kernel on CPUs with AVX512-BF16): prompt logprobs of the two forms agree to bf16
    rounding; a wrong head or weight layout would move them by whole nats."""
    from tokenfab import LLM, SamplingParams
    from test_engine_exact import make_prompts
    path = tiny_model("deepseek_v3")
    prompts = [{"prompt_token_ids": p} for p in make_prompts(8, [40, 23])]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    kw = dict(dtype="bfloat16", max_model_len=128, max_num_batched_tokens=16, block_size=8, progress=False)
    want = LLM(path, **kw).generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(MLAttention, "_absorb_prefill", lambda self, group: True)
    got = LLM(path, **kw).generate(prompts, params, use_tqdm=False)
    diffs = [abs(a[t].logprob - b[t].logprob) for w, g, p in zip(want, got, prompts)
             for a, b, t in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:], p["prompt_token_ids"][1:])]
    assert max(diffs) < 0.08 and sum(diffs) / len(diffs) < 0.015  # measured here: 0.024 and 0.005


def test_auto_rule_hand_worked():
    """C 512, nope 64, rope 64, v 64 (the default model). Q 16 of L 2048 (S = 2040.5): absorbed 16*512*128 +
    16*2040.5*1088 = 36.6M < expanded 2048*512*128 + 16*2040.5*192 = 140.5M -> absorbed. Q = L = 256 (S = 128.5):
    absorbed 16.8M + 35.8M = 52.5M > expanded 16.8M + 6.3M = 23.1M -> expanded."""
    from types import SimpleNamespace
    import torch
    cpu = torch.zeros(1, 1, dtype=torch.int64)
    attn = MLAttention.__new__(MLAttention)
    attn.prefill_form, attn.kv_lora, attn.nope, attn.rope_dim, attn.v_dim, attn.qk_dim = "auto", 512, 64, 64, 64, 128
    assert attn._absorb_prefill(SimpleNamespace(q_len=16, max_context=2048, block_tables=cpu))
    assert not attn._absorb_prefill(SimpleNamespace(q_len=256, max_context=256, block_tables=cpu))
    attn.prefill_form = "expanded"
    assert not attn._absorb_prefill(SimpleNamespace(q_len=16, max_context=2048, block_tables=cpu))
