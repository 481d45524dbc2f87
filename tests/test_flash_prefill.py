"""CPU flash prefill attention (tokenfab/layers/flash_prefill.py) against causal attention computed in float64, and
inside the engine against transformers (token-exact in float32, chunked prefill so chunks start after cached keys).

The reference scores every query against every key of its sequence with the mask written out (key j visible to a
query at position p when j <= p) and a float64 softmax. float32 outputs agree to accumulation error (< 1e-5 for
outputs of size ~1); bf16 inputs and outputs to a few bf16 ulps of the output scale.
"""
from __future__ import annotations

import pytest
import torch

from test_engine_exact import check_family, make_prompts
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


def test_applies_only_on_its_path():
    q = torch.zeros(1, 2, 3, 8)
    with_amx = flash_prefill._amx()
    assert flash_prefill.applies(q, q, q) == with_amx
    assert not flash_prefill.applies(q, q, torch.zeros(1, 2, 3, 9))  # values wider than keys
    assert not flash_prefill.applies(q.double(), q.double(), q.double())


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_engine_token_exact_through_flash_prefill(tiny_model, family, monkeypatch):
    """The engine with the flash path forced on (whatever this CPU's path): greedy tokens and logprobs as
    transformers', prompts prefilled in chunks of a 24-token budget (later chunks attend to cached keys)."""
    calls = []
    real = flash_prefill.flash_prefill_attention

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(flash_prefill, "_amx", lambda: True)
    monkeypatch.setattr(flash_prefill, "flash_prefill_attention", counted)
    _, worst = check_family(tiny_model(family), make_prompts(3, [37, 5, 70, 18]))
    assert calls, "the flash path did not run"
    assert worst < 1e-4
