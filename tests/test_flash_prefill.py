"""CPU flash prefill attention against causal attention computed in float64: tokenfab's kernel
(kernels/cpu/csrc/flash_prefill.cpp) and the PyTorch-kernel mapping (tokenfab/layers/flash_prefill.py); and inside the
engine against transformers (token-exact in float32, bf16 greedy tokens as the fused path's, chunked prefill so chunks
start after cached keys).

The reference scores every query against every key of its sequence with the mask written out (key j visible to a
query at position p when j <= p) and a float64 softmax. float32 outputs agree to accumulation error (< 1e-5 for
outputs of size ~1); bf16 inputs and outputs to a few bf16 ulps of the output scale.
"""
from __future__ import annotations

import pytest
import torch

from test_engine_exact import check_family, make_prompts
from tokenfab.kernels import dispatch
from tokenfab.layers import flash_prefill
from tokenfab.layers.attention_metadata import AttentionGroup


def group(seqs: list[tuple[int, int]]) -> AttentionGroup:
    """A prefill group of sequences (first query position, queries), padded to the longest, keys up to the end."""
    Q = max(n for _, n in seqs)
    qp = torch.full((len(seqs), Q), -1, dtype=torch.long)
    for b, (s, n) in enumerate(seqs):
        qp[b, :n] = torch.arange(s, s + n)
    g = AttentionGroup.__new__(AttentionGroup)
    g.query_pos, g.q_len, g.max_context = qp, Q, max(s + n for s, n in seqs) + 3
    return g


def reference(q, k, v, g, scale):
    """float64 causal attention with the mask written out: [B, H, Q, Dv]."""
    B, H, Q, _ = q.shape
    L = k.shape[2]
    G = H // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = q.double() @ k.transpose(-1, -2) * scale
    visible = torch.arange(L).view(1, 1, -1) <= g.query_pos.clamp(min=0).unsqueeze(-1)
    s = s.masked_fill(~visible.unsqueeze(1), float("-inf"))
    return torch.softmax(s, -1) @ v


CASES = [
    ([(0, 7), (0, 5)], 6, 2),               # whole prompts, GQA, one causal call
    ([(3, 4), (0, 6), (9, 2)], 4, 1),       # chunks after different prefixes, one with none (MQA)
    ([(5, 3), (5, 3)], 4, 2),               # the same prefix length: no key-padding mask
    ([(0, 5), (4, 5)], 4, 4),               # MHA, a prefix and a whole prompt
]


@pytest.mark.parametrize("seqs,H,Hk", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("values", ["same_width", "narrower", "key_prefix"])
def test_matches_float64_causal_attention(seqs, H, Hk, dtype, values):
    torch.manual_seed(len(seqs) * 7 + H)
    g = group(seqs)
    B, Q, L, D = len(seqs), g.q_len, g.max_context, 16
    q, k = torch.randn(B, H, Q, D).to(dtype), torch.randn(B, Hk, L, D).to(dtype)
    v = {"same_width": lambda: torch.randn(B, Hk, L, D).to(dtype),
         "narrower": lambda: torch.randn(B, Hk, L, 10).to(dtype),  # MLA expanded: values zero-padded
         "key_prefix": lambda: k[..., :10]}[values]()                # MLA absorbed: values = the keys' first columns
    out = flash_prefill.flash_prefill_attention(q, k, v, g, 0.3)
    ref = reference(q, k, v, g, 0.3)
    assert out.dtype == dtype and out.shape == (B, H, Q, v.shape[-1])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b, (_, n) in enumerate(seqs):  # padding rows are discarded by the caller
        err = (out[b, :, :n].double() - ref[b, :, :n]).abs().max().item()
        assert err < tol, (seqs, b, err)


KERNEL_CASES = [
    ([(0, 70), (0, 33)], 9, 3, 64, 64),       # SmolLM2's heads, whole prompts (two tiles of 21 queries and more)
    ([(40, 30), (0, 9), (130, 5)], 4, 2, 32, 32),  # chunks after cached keys, key blocks skipped and on the diagonal
    ([(0, 12), (17, 6)], 70, 1, 40, 32),      # MLA absorbed: 70 heads on one latent head (tiles split the heads)
    ([(3, 8)], 6, 6, 24, 16),                 # MHA, values narrower than keys (MLA expanded)
]


@pytest.mark.parametrize("seqs,H,Hk,D,Dv", KERNEL_CASES)
@pytest.mark.parametrize("values", ["own", "key_prefix"])
def test_kernel_matches_float64_causal_attention(seqs, H, Hk, D, Dv, values):
    torch.manual_seed(H * 31 + D)
    g = group(seqs)
    B, Q, L = len(seqs), g.q_len, g.max_context
    q = torch.randn(B, Q, H, D).bfloat16().transpose(1, 2)  # strided, as the engine's views are
    k = torch.randn(B, L, Hk, D).bfloat16().transpose(1, 2)
    v = k[..., :Dv] if values == "key_prefix" else torch.randn(B, Hk, L, Dv).bfloat16()
    if not dispatch.flash_prefill_applies(q, k, v):
        pytest.skip("the CPU flash prefill kernel needs the built kernels with AVX512-BF16")
    out = dispatch.flash_prefill_attention(q, k, v, g.query_pos, 0.2)
    ref = reference(q, k, v, g, 0.2)
    assert out.dtype == torch.bfloat16 and out.shape == (B, H, Q, Dv)
    for b, (_, n) in enumerate(seqs):  # bf16 inputs, probabilities and output: a few bf16 ulps of values ~1
        err = (out[b, :, :n].double() - ref[b, :, :n]).abs().max().item()
        assert err < 2e-2, (seqs, b, err)


def test_applies_only_on_its_path():
    q = torch.zeros(1, 2, 3, 8)
    with_amx = flash_prefill._amx()
    from tokenfab.kernels.cpu import isa
    # float32: PyTorch's kernel on the AMX path and at the avx2 level; at the avx512_bf16 level from
    # FLOAT32_FLASH_MIN_KEYS keys (where each measured faster than the fused path)
    assert flash_prefill.applies(q, q, q) == (isa.selected_level() in ("amx", "avx2"))
    long_k = torch.zeros(1, 2, flash_prefill.FLOAT32_FLASH_MIN_KEYS, 8)
    assert flash_prefill.applies(q, long_k, long_k)
    short_k = long_k[:, :, 1:]
    assert flash_prefill.applies(q, short_k, short_k) == (isa.selected_level() in ("amx", "avx2"))
    qb = q.bfloat16()
    assert flash_prefill.applies(qb, qb, qb) == (with_amx or dispatch.flash_prefill_applies(qb, qb, qb))
    assert not flash_prefill.applies(q, q, torch.zeros(1, 2, 3, 9))  # values wider than keys
    assert not flash_prefill.applies(q.double(), q.double(), q.double())


def _counting(monkeypatch, module, name) -> list:
    calls = []
    real = getattr(module, name)

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_engine_token_exact_through_pytorch_flash(tiny_model, family, monkeypatch):
    """The engine with the PyTorch-kernel path forced on (whatever this CPU's path): greedy tokens and logprobs as
    transformers', prompts prefilled in chunks of a 24-token budget (later chunks attend to cached keys)."""
    monkeypatch.setattr(flash_prefill, "_amx", lambda: True)
    calls = _counting(monkeypatch, flash_prefill, "flash_prefill_attention")
    _, worst = check_family(tiny_model(family), make_prompts(3, [37, 5, 70, 18]))
    assert calls, "the flash path did not run"
    assert worst < 1e-4


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_engine_bf16_through_own_kernel_as_close_as_the_fused_path(tiny_model, family, monkeypatch):
    """bf16 engine with tokenfab's flash kernel (no AMX branch) and with the GEMM + fused-softmax path, each against
    the float32 engine: every prompt token's logprob (prefill in chunks of a 24-token budget, so chunks attend to
    cached keys) as close to float32 on the kernel as on the fused path (mean and max |delta| within 1.2x; a wrong
    mask, offset or merge moves them by O(1)). Tokens are not compared: a tiny random model's near-ties may flip."""
    from tokenfab import LLM, SamplingParams
    monkeypatch.setattr(flash_prefill, "_amx", lambda: False)
    probe = torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16)
    if not dispatch.flash_prefill_applies(probe, probe, probe):
        pytest.skip("the CPU flash prefill kernel needs the built kernels with AVX512-BF16")
    prompts = make_prompts(5, [37, 5, 70, 18])
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def logprobs(dtype: str) -> list[float]:
        llm = LLM(tiny_model(family), dtype=dtype, max_model_len=256, max_num_batched_tokens=24, block_size=8,
                  progress=False)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        return [o.prompt_logprobs[i][p[i]].logprob for p, o in zip(prompts, outs) for i in range(1, len(p))]
    calls = _counting(monkeypatch, dispatch, "flash_prefill_attention")
    kernel = logprobs("bfloat16")
    assert calls, "tokenfab's flash kernel did not run"
    monkeypatch.setattr(flash_prefill, "applies", lambda q, k, v: False)  # the fused path from here on
    fused, ref = logprobs("bfloat16"), logprobs("float32")
    dk = [abs(a - b) for a, b in zip(kernel, ref)]
    df = [abs(a - b) for a, b in zip(fused, ref)]
    assert sum(dk) <= 1.2 * sum(df) + 1e-3, (sum(dk) / len(dk), sum(df) / len(df))
    assert max(dk) <= 1.2 * max(df) + 1e-2, (max(dk), max(df))
