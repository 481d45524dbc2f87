"""Tensor + expert parallel over N CPU processes (gloo) against one process, float32.

Tiny models whose heads (8), KV heads (2), routed experts (16 in 4 groups), intermediate sizes (100, 36) and
vocabulary (1000) do not divide by 3 or 6. A batch of prompts of different lengths with a small token budget makes
chunked prefill and mixed decode/prefill steps happen. Greedy tokens must be identical to N = 1 and prompt
logprobs within 1e-4.
"""
from __future__ import annotations

import os
import random

import pytest

from conftest import max_prompt_logprob_gap, tp_generate
from tokenfab import LLM, SamplingParams

os.environ.setdefault("TOKENFAB_TP_TIMEOUT", "120")  # a broken test fails instead of hanging

VOCAB = 1000
N_NEW = 6
ENGINE_KW = dict(dtype="float32", max_model_len=96, max_num_batched_tokens=16, block_size=8, progress=False)
OVERRIDES = {
    "deepseek_v3": dict(num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, n_group=4, topk_group=2,
                        intermediate_size=100, moe_intermediate_size=36, num_hidden_layers=3),
    "qwen3": dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=100, num_hidden_layers=2),
    "qwen3_moe": dict(num_attention_heads=8, num_key_value_heads=2, num_experts=16, moe_intermediate_size=36,
                      intermediate_size=100, num_hidden_layers=2),
}
_REF: dict[str, list] = {}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tokenizer_dir):
    from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("tp")

    def make(family: str) -> str:
        return make_tiny_checkpoint(str(root / family), family, vocab_size=VOCAB, tokenizer_dir=tokenizer_dir,
                                    **OVERRIDES[family])
    return make


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, VOCAB) for _ in range(n)] for n in (3, 21, 11, 30)]


def run(path: str, n: int):
    return tp_generate(path, n, prompts(), N_NEW, **ENGINE_KW)


def reference(family: str, path: str):
    if family not in _REF:
        _REF[family] = run(path, 1)
    return _REF[family]


@pytest.mark.parametrize("family,n", [("deepseek_v3", 2), ("deepseek_v3", 3), ("deepseek_v3", 6),
                                      ("qwen3", 2), ("qwen3", 3), ("qwen3", 6), ("qwen3_moe", 3)])
def test_tp_matches_single_rank(ckpt, family, n):
    path = ckpt(family)
    ref, got = reference(family, path), run(path, n)
    worst = max_prompt_logprob_gap(ref, got, f"{family} N={n}")
    assert worst < 1e-4, f"{family} N={n}: max |d prompt logprob| = {worst}"


def test_each_rank_loads_only_its_slices(ckpt):
    """In-process, no group: the shards of 6 ranks tile every split dimension exactly (no rank holds it all)."""
    from tokenfab.engine.engine_config import EngineConfig
    from tokenfab.parallel.worker import build_rank

    path = ckpt("deepseek_v3")
    cfg = EngineConfig(model=path, dtype="float32", max_model_len=96)
    rows = {"lm": 0, "qb": 0, "kvb": 0, "o": 0, "experts": 0, "shared": 0, "dense": 0}
    for r in range(6):
        _, loaded = build_rank(cfg, r, 6)
        sd = dict(loaded.model.named_parameters())
        assert sd["lm_head.weight"].shape[0] < VOCAB
        rows["lm"] += sd["lm_head.weight"].shape[0]
        rows["qb"] += sd["model.layers.1.self_attn.q_b_proj.weight"].shape[0]
        rows["kvb"] += sd["model.layers.1.self_attn.kv_b_proj.weight"].shape[0]
        rows["o"] += sd["model.layers.1.self_attn.o_proj.weight"].shape[1]
        rows["experts"] += sd["model.layers.1.mlp.experts.w2"].shape[0]
        rows["dense"] += loaded.model.model.layers[0].mlp.down_proj.weight.shape[1]
        rows["shared"] += loaded.model.model.layers[1].mlp.shared_experts.down_proj.weight.shape[1]
        # replicated: the latent projections (q_a_proj and kv_a_proj_with_mqa, fused into one after loading)
        assert sd["model.layers.1.self_attn.qkv_a_proj.weight"].shape[0] == 48 + 32 + 16
    assert rows == {"lm": VOCAB, "qb": 8 * 32, "kvb": 8 * (16 + 24), "o": 8 * 24, "experts": 16, "shared": 36,
                    "dense": 100}


def test_bad_tensor_parallel_size(ckpt):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(ckpt("qwen3"), tensor_parallel_size=0, **ENGINE_KW)


def test_more_ranks_than_heads(tiny_model):
    """6 ranks on the 4-head tiny DeepSeek-V3 (MLA) and a 2-KV-head Llama: ranks without attention heads add zeros;
    greedy tokens and prompt logprobs equal one rank's."""
    rng = random.Random(3)
    ps = [[rng.randrange(5, 512) for _ in range(n)] for n in (17, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, min_tokens=N_NEW, prompt_logprobs=0)
    for family in ("deepseek_v3", "llama"):
        path = tiny_model(family)
        outs = []
        for n in (1, 6):
            llm = LLM(path, tensor_parallel_size=n, **ENGINE_KW)
            try:
                outs.append(llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False))
            finally:
                llm.llm_engine.shutdown()
        for r, g in zip(*outs):
            assert g.outputs[0].token_ids == r.outputs[0].token_ids, f"{family}: greedy tokens differ"
            for a, b in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:]):
                assert max(abs(a[k].logprob - b[k].logprob) for k in a) < 1e-4
