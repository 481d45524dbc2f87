"""Token-exact greedy generation and prompt logprobs against transformers, for every family, in float32.

Prompts of different lengths run together with a small token budget, so prefill is cut into several chunks and
steps mix decodes with prefill chunks. The reference generates each prompt alone.
"""
from __future__ import annotations

import random

import pytest

from conftest import load_reference, reference_greedy, reference_logprobs
from tokenfab import LLM, SamplingParams

N_NEW = 12


def make_prompts(seed: int, lengths: list[int], vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


def check_family(path: str, prompts: list[list[int]], n_new: int = N_NEW, **engine_kw):
    """Run tokenfab on all prompts at once, ``n_new`` greedy tokens each; compare each with the reference alone.
    Returns (llm, max |Δ logprob|)."""
    kw = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=24, block_size=8, progress=False)
    kw.update(engine_kw)
    llm = LLM(path, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=n_new, min_tokens=n_new, prompt_logprobs=0, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ref = load_reference(path)
    worst = 0.0
    for p, o in zip(prompts, outs):
        expected = reference_greedy(ref, p, n_new)
        assert o.outputs[0].token_ids == expected, f"prompt len {len(p)}: tokens differ"
        assert o.outputs[0].finish_reason == "length"
        full = p + expected
        lp = reference_logprobs(ref, full)
        # prompt logprobs: position i predicted from logits at i-1
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
        for i in range(1, len(p)):
            worst = max(worst, abs(o.prompt_logprobs[i][p[i]].logprob - lp[i - 1, p[i]].item()))
        # decode-path logprobs of the generated tokens
        for j, tok in enumerate(expected):
            worst = max(worst, abs(o.outputs[0].logprobs[j][tok].logprob - lp[len(p) + j - 1, tok].item()))
    return llm, worst


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_family_token_exact(tiny_model, family):
    path = tiny_model(family)
    prompts = make_prompts(1, [37, 5, 70, 1, 18])
    llm, worst = check_family(path, prompts)
    print(f"\n{family}: max |delta logprob| fp32 = {worst:.2e}")
    assert worst < 1e-4


def test_sharded_checkpoint(tiny_model):
    path = tiny_model("qwen3", max_shard_size="100KB")
    import os
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    _, worst = check_family(path, make_prompts(2, [20, 9]))
    assert worst < 1e-4


def test_deepseek_yarn_long_prompts_past_original_context(tiny_model):
    """YaRN factor 40 over original_max_position_embeddings 64, mscale = mscale_all_dim = 1: prompts of 100-150
    tokens run past the original context, where a wrong frequency blend or softmax scale shows."""
    path = tiny_model("deepseek_v3")
    _, worst = check_family(path, make_prompts(3, [150, 100]), max_num_batched_tokens=48)
    assert worst < 1e-4


def test_deepseek_q_lora_null_and_no_interleave(tiny_model):
    path = tiny_model("deepseek_v3", q_lora_rank=None, rope_interleave=False)
    _, worst = check_family(path, make_prompts(4, [30, 7]))
    assert worst < 1e-4


def test_deepseek_grouped_routing_variants(tiny_model):
    """n_group 4 / topk_group 1 with a non-zero e_score_correction_bias, 2 dense layers first, no shared expert
    renormalization (norm_topk_prob False), 3 layers."""
    path = tiny_model("deepseek_v3", n_group=4, topk_group=1, first_k_dense_replace=2, num_hidden_layers=3,
                      norm_topk_prob=False, n_shared_experts=2)
    _, worst = check_family(path, make_prompts(5, [25, 11]))
    assert worst < 1e-4


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # transformers' zero-width MLP
def test_deepseek_without_shared_experts(tiny_model):
    """n_shared_experts 0: transformers saves a zero-width shared MLP; tokenfab skips it and matches."""
    path = tiny_model("deepseek_v3", n_shared_experts=0)
    _, worst = check_family(path, make_prompts(9, [21, 8]))
    assert worst < 1e-4


def test_preemption_keeps_tokens_identical(tiny_model):
    """A KV pool of 12 blocks x 8 tokens cannot hold four ~40-token sequences at once: the scheduler preempts
    (recompute) and the tokens must not change."""
    path = tiny_model("deepseek_v3")
    prompts = make_prompts(6, [40, 35, 44, 30])
    llm, worst = check_family(path, prompts, num_kv_blocks=12, max_model_len=96)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert worst < 1e-4
    assert llm.llm_engine.block_manager.num_free_blocks == 12  # everything returned


def test_llama_gqa_tied_embeddings(tiny_model):
    path = tiny_model("llama", tie_word_embeddings=True, num_key_value_heads=1)
    _, worst = check_family(path, make_prompts(7, [16, 3]))
    assert worst < 1e-4


def test_max_model_len_past_max_position_embeddings_opt_in(tiny_model, monkeypatch):
    """vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN (or TOKENFAB_ALLOW_LONG_MAX_MODEL_LEN): max_model_len may exceed the
    model's max_position_embeddings, and prompts running past it still match transformers (plain RoPE computed for
    any position); without it the engine refuses and names the variable."""
    from tokenfab.errors import EngineConfigError
    path = tiny_model("llama", max_position_embeddings=32)
    prompts = make_prompts(11, [40, 29])  # the first prompt alone runs past position 32
    for name in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "TOKENFAB_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(EngineConfigError, match="max_position_embeddings 32.*TOKENFAB_ALLOW_LONG_MAX_MODEL_LEN=1"):
        LLM(path, dtype="float32", max_model_len=64, progress=False)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    _, worst = check_family(path, prompts, max_model_len=64)
    assert worst < 1e-4
