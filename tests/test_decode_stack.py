"""The whole decoder stack of decode-only CPU bf16 steps as one C++ call (engine/cpu_decode_stack.py) is
bit-identical to the module path (``CausalLM.forward``): same tokens and logprobs over decode steps that read the
cache rows the stack wrote, for DeepSeek-V3 (MLA, a dense layer, group-limited MoE with a shared expert), Llama
(with biases, MQA), Qwen3 (q/k norms) and Qwen3-MoE (softmax top-k router). Mixed prefill + decode steps keep the
module path. Models the stack does not cover get no stack and still run. The module path is tested against transformers in
test_engine_exact.py / test_bf16.py."""
from __future__ import annotations

import pytest

from decode_stack_ab import generate_through
from tokenfab.engine.cpu_decode_stack import CpuDecodeStack
from tokenfab.kernels.cpu.ops import support as cpu_support

pytestmark = pytest.mark.skipif(not cpu_support.has_bf16_dot(), reason="CPU kernels without AVX512-BF16")


def make_llm(path, **kw):
    from tokenfab import LLM
    return LLM(path, dtype="bfloat16", max_model_len=256, block_size=8, progress=False, **kw)


def generate(llm, prompts, use_stack: bool, monkeypatch):
    return generate_through(llm, prompts, use_stack, monkeypatch)


@pytest.mark.parametrize("family,overrides", [
    ("deepseek_v3", {}),
    ("deepseek_v3", dict(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, n_group=1, topk_group=1)),
    ("deepseek_v3", dict(n_shared_experts=0)),
    ("llama", {}), ("llama", {"attention_bias": True, "num_key_value_heads": 1}), ("qwen3", {}), ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": False})],
    ids=["deepseek", "deepseek-latent96-one-group", "deepseek-no-shared", "llama", "llama-bias-mqa", "qwen3",
         "qwen3-moe", "qwen3-moe-unnormalized"])
def test_decode_stack_is_bit_identical_to_the_module_path(tiny_model, monkeypatch, family, overrides):
    from test_engine_exact import make_prompts
    llm = make_llm(tiny_model(family, **overrides), max_num_batched_tokens=40)
    prompts = make_prompts(5, [9, 30, 17])
    want, sizes = generate(llm, prompts, use_stack=False, monkeypatch=monkeypatch)
    assert not sizes
    got, sizes = generate(llm, prompts, use_stack=True, monkeypatch=monkeypatch)
    assert sizes and max(sizes) == 3  # the 3-sequence decode steps ran through the stack
    assert got == want  # token ids and logprob dicts, exactly


def test_stack_leaves_mixed_steps_to_the_modules(tiny_model, monkeypatch):
    """A prompt admitted while others decode makes mixed steps (chunked prefill + decode): those take the module
    path, and results still equal the module path alone."""
    from tokenfab import SamplingParams
    from test_engine_exact import make_prompts
    llm = make_llm(tiny_model("deepseek_v3"), max_num_batched_tokens=16)
    eng = llm.llm_engine
    prompts = make_prompts(6, [5, 40])
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True)

    def run(use_stack: bool):
        stack = eng.runner.cpu_decode_stack
        eng.runner.cpu_decode_stack = stack if use_stack else None
        eng.add_request("a", None, prompts[0], params)
        for _ in range(3):
            eng.step()
        eng.add_request("b", None, prompts[1], params)  # 40 tokens in chunks of <= 16 next to a's decodes
        outs = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].logprobs)
        eng.runner.cpu_decode_stack = stack
        return outs

    assert run(True) == run(False)


def test_models_outside_the_stack_get_none(tiny_model):
    """A MoE layer whose experts run the Python dispatch (not the packed C++ one) is outside the stack: build says
    None and the engine keeps generating through the modules."""
    llm = make_llm(tiny_model("qwen3_moe"))
    runner = llm.llm_engine.runner
    assert runner.cpu_decode_stack is not None
    for layer in runner.model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.fused_dispatch = False
    assert CpuDecodeStack.build(runner.model, runner.kv_caches, runner.block_size) is None
    runner.cpu_decode_stack = None
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0


def test_float32_and_onednn_models_get_no_stack(tiny_model, monkeypatch):
    from tokenfab import LLM
    path = tiny_model("deepseek_v3")
    assert LLM(path, dtype="float32", max_model_len=64, progress=False).llm_engine.runner.cpu_decode_stack is None
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", "onednn")
    assert make_llm(path).llm_engine.runner.cpu_decode_stack is None


def sampled(path, prompts, params, fused: bool):
    """Tokens of one fresh engine (same seed each time), with the LM head and the draw fused into the stack's call
    or left to compute_logits and the Sampler; and how many steps took the fused call."""
    llm = make_llm(path)
    stack = llm.llm_engine.runner.cpu_decode_stack
    assert stack is not None and stack.vocab_size is not None  # untied LM head: the fused draw applies
    if not fused:
        stack.vocab_size = None
    calls = []
    real = stack.run_sample

    def counted(*a):
        calls.append(1)
        return real(*a)

    stack.run_sample = counted
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], len(calls)


def test_fused_lm_head_and_draw_give_the_samplers_tokens(tiny_model):
    """Greedy, temperature and seeded rows in one batch: the fused call draws the same uniforms in the same order as
    the Sampler would, so every token matches, across steps that consume the engine's RNG."""
    from tokenfab import SamplingParams
    from test_engine_exact import make_prompts
    path = tiny_model("deepseek_v3")
    prompts = make_prompts(7, [9, 30, 17, 4])
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.9, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=1.3, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.7, ignore_eos=True)]
    want, n_unfused = sampled(path, prompts, params, fused=False)
    got, n_fused = sampled(path, prompts, params, fused=True)
    assert n_unfused == 0 and n_fused >= 9  # every decode-only step took the fused call
    assert got == want
    assert len({tuple(t) for t in got}) == 4


def test_rows_wanting_logprobs_or_top_k_keep_the_sampler(tiny_model):
    from tokenfab import SamplingParams
    from test_engine_exact import make_prompts
    path = tiny_model("deepseek_v3")
    prompts = make_prompts(8, [9, 12])
    for odd in (SamplingParams(max_tokens=6, temperature=0.8, logprobs=1, ignore_eos=True),
                SamplingParams(max_tokens=6, temperature=0.8, top_k=5, ignore_eos=True),
                SamplingParams(max_tokens=6, temperature=0.8, min_tokens=6, ignore_eos=True)):
        params = [SamplingParams(max_tokens=6, temperature=0.8, ignore_eos=True), odd]
        want, _ = sampled(path, prompts, params, fused=False)
        got, n = sampled(path, prompts, params, fused=True)
        assert got == want and n == 0  # (min_tokens 6 of max_tokens 6: below it until the end)


def test_slots_computed_in_cpp_match_the_runners(tiny_model):
    """``run`` without slots computes them in C++ from positions and block tables: the same cache rows written and
    the same hidden states as with ModelRunner._slots; a position past its block table is a clear error."""
    import numpy as np
    import torch
    llm = make_llm(tiny_model("deepseek_v3"))
    runner = llm.llm_engine.runner
    stack = runner.cpu_decode_stack
    bs = runner.block_size
    pos = np.array([3, 17, 40], dtype=np.int64)  # block 0, 2 and 5 of each row
    bt = np.array([[4, 9, 2, 7, 1, 3], [5, 0, 8, 6, 11, 10], [12, 13, 14, 15, 16, 17]], dtype=np.int64)
    ids = np.array([11, 12, 13], dtype=np.int64)
    before = [c.clone() for c in stack._caches]
    want = stack.run(ids, pos, runner._slots(bt, np.arange(3), pos), bt, pos + 1)
    written = [c.clone() for c in stack._caches]
    for c, b in zip(stack._caches, before):
        c.copy_(b)
    got = stack.run(ids, pos, None, bt, pos + 1)
    assert torch.equal(got, want)
    assert all(torch.equal(c, w) for c, w in zip(stack._caches, written))
    assert not all(torch.equal(w, b) for w, b in zip(written, before))  # rows were written
    with pytest.raises(RuntimeError, match="past its block table"):
        stack.run(ids, np.array([3, 17, 6 * bs], dtype=np.int64), None, bt, pos + 1)
