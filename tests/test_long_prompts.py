"""Long prompts: chunked prefill over contexts past LONG_CONTEXT_TOKENS runs attention key block by key block
(tokenfab/layers/long_context_attention.py) and stays exact against transformers at positions past the YaRN
original window; no attention call ever sees more than one key block.

The 128K-token run is benchmarks/long_prompt.py (results in benchmarks/results/2026-12-01-long-prompt.md).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import load_reference
from tokenfab import LLM, SamplingParams
from tokenfab.layers import long_context_attention as lca
from tokenfab.layers import paged_attention
from tokenfab.layers.attention_metadata import AttentionGroup

ORIGINAL_WINDOW = 4096
N_PROMPT = 9000  # > LONG_CONTEXT_TOKENS (8192): the last chunks take the key-block path without any patching
CHUNK = 1024  # max_num_batched_tokens: 9 chunks
YARN_LLAMA = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0,
              "original_max_position_embeddings": ORIGINAL_WINDOW}
YARN_DSV3 = dict(YARN_LLAMA, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)
MAX_POS = ORIGINAL_WINDOW * 32  # 131,072


def dense_reference(q, k, v, qpos, scale):
    """Causal attention in float64 with an explicit mask: q [B, H, Q, D], k/v [B, Hk, L, *], qpos [B, Q]."""
    H, Hk, L = q.shape[1], k.shape[1], k.shape[2]
    k, v = k.double().repeat_interleave(H // Hk, 1), v.double().repeat_interleave(H // Hk, 1)
    s = q.double() @ k.transpose(-1, -2) * scale
    visible = torch.arange(L).view(1, 1, 1, -1) <= qpos[:, None, :, None]
    return torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v


@pytest.mark.parametrize("kernel", ["flash", "reference"])
def test_blocked_attention_matches_dense(monkeypatch, kernel):
    """Two sequences at different offsets (one padded), grouped-query heads, key blocks smaller than, across and
    larger than the chunk: the merged per-block results equal one dense softmax."""
    if kernel == "reference":  # the plain-PyTorch path (GPUs, other dtypes), with its query sub-blocks
        monkeypatch.setattr(lca, "_flash_applies", lambda q, v: False)
    monkeypatch.setattr(lca, "PARTIAL_QUERY_BLOCK", 7)
    torch.manual_seed(0)
    B, H, Hk, D, Q = 2, 4, 2, 16, 50
    num_computed, num_new = np.array([100, 37]), np.array([50, 21])
    ar = np.arange(Q)
    valid = ar[None] < num_new[:, None]
    qpos = torch.from_numpy(np.where(valid, num_computed[:, None] + ar[None], -1))
    L = 160
    q, k, v = torch.randn(B, H, Q, D), torch.randn(B, Hk, L, D), torch.randn(B, Hk, L, D)
    group = AttentionGroup(token_index=None, query_pos=qpos, block_tables=None, context_lens=None, q_len=Q,
                           max_context=L)
    ref = dense_reference(q, k, v, qpos, 0.3)
    rows = torch.from_numpy(valid)[:, None, :].expand(B, H, Q)
    for kb in (16, 48, 4096):
        out = lca.blocked_prefill_attention(q, group, lambda a, b: (k[:, :, a:b], v[:, :, a:b]), 0.3, D,
                                            key_block_tokens=kb)
        assert out.shape == (B, H, Q, D)
        assert (out.double() - ref)[rows].abs().max().item() < 1e-5, kb


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 512, n).tolist()


def _prompt_logprobs(out, prompt) -> np.ndarray:
    return np.array([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])


def _reference_logprobs(path, prompt) -> tuple[np.ndarray, int]:
    ref = load_reference(path)
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy(), int(lp[-1].argmax())


def _spy_on_key_blocks(monkeypatch) -> list[tuple[int, int]]:
    """Record (queries, keys) of every per-block attention call; fail if a long prefill group is gathered whole."""
    calls: list[tuple[int, int]] = []
    inner = lca._block_attention

    def spy(q, k, v, mask, scale):
        calls.append((q.shape[2], k.shape[2]))
        return inner(q, k, v, mask, scale)

    gather = paged_attention.gather_cache

    def no_whole_gather(cache, group):
        assert not lca.applies(group), "a long prefill group gathered its whole context"
        return gather(cache, group)

    monkeypatch.setattr(lca, "_block_attention", spy)
    monkeypatch.setattr(paged_attention, "gather_cache", no_whole_gather)
    import tokenfab.layers.mla as mla
    monkeypatch.setattr(mla, "gather_cache", no_whole_gather)
    return calls


def _check(got: np.ndarray, want: np.ndarray) -> float:
    past = np.abs(got - want)[ORIGINAL_WINDOW:]  # positions past the YaRN original window
    assert len(past) > 4000 and past.max() < 1e-4, past.max()
    assert np.abs(got - want).max() < 1e-4
    return float(past.max())


def test_llama_yarn_long_prompt_chunked_matches_transformers(tiny_model, monkeypatch):
    """A 9,000-token prompt on a 2-layer Llama with YaRN (original window 4,096, factor 32) in 1,024-token
    chunks: prompt logprobs within 1e-4 of transformers (float32, eager) at every position, greedy token equal,
    and the chunks past 8,192 context tokens attended key block by key block."""
    path = tiny_model("llama", num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=MAX_POS, rope_parameters=YARN_LLAMA)
    calls = _spy_on_key_blocks(monkeypatch)
    prompt = _prompt(N_PROMPT)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=N_PROMPT + 8, max_num_batched_tokens=CHUNK,
              progress=False)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert calls and max(k for _, k in calls) <= lca.KEY_BLOCK and max(q for q, _ in calls) <= CHUNK
    want, greedy = _reference_logprobs(path, prompt)
    worst = _check(_prompt_logprobs(out, prompt), want)
    assert out.outputs[0].token_ids == [greedy]
    print(f"\nllama YaRN {N_PROMPT} tokens: max |Δ logprob| past the original window {worst:.2e}")


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_deepseek_yarn_long_prompt_chunked_matches_transformers(tiny_model, monkeypatch, form):
    """The same on a 2-layer DeepSeek-V3 (MLA, YaRN with mscale): both prefill forms read the latent cache key
    block by key block (expanded: each block through kv_b_proj; absorbed: the latent rows as keys and values)."""
    path = tiny_model("deepseek_v3", num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=MAX_POS,
                      rope_parameters=YARN_DSV3)
    calls = _spy_on_key_blocks(monkeypatch)
    prompt = _prompt(N_PROMPT, seed=1)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=N_PROMPT + 8, max_num_batched_tokens=CHUNK,
              progress=False)
    for m in llm.llm_engine.runner.model.modules():
        if hasattr(m, "prefill_form"):
            m.prefill_form = form
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert calls and max(k for _, k in calls) <= lca.KEY_BLOCK
    want, greedy = _reference_logprobs(path, prompt)
    worst = _check(_prompt_logprobs(out, prompt), want)
    assert out.outputs[0].token_ids == [greedy]
    print(f"\ndeepseek_v3 YaRN {N_PROMPT} tokens ({form}): max |Δ logprob| past the original window {worst:.2e}")
