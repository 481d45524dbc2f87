"""Kimi Linear (hybrid KDA + NoPE MLA) against transformers' KimiLinearForCausalLM in float32.

Covers: batched chunked-prefill greedy generation (token-exact), prompt logprobs within 1e-4, prompts spanning
several prefill chunks, mixed batches of long and short requests (decode and prefill groups in one step),
preemption in the middle of a KDA prefill, the two config dialects (published ``linear_attn_config`` with 1-indexed
layer lists and a 4-D / padded A_log vs transformers 5 ``layer_types``) and bad configs.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from conftest import load_reference, reference_logprobs
from tokenfab import LLM, SamplingParams
from tokenfab.config import ConfigError, parse_config

GEN = 8
# max |Δ logprob| measured by these tests, printed at the end (pytest -s) for the closing note.
MEASURED: dict[str, float] = {}


def _kimi_linear_kwargs(**over):
    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=16,
              qk_nope_head_dim=16, v_head_dim=24, num_local_experts=8, num_experts_per_tok=2, n_group=2,
              topk_group=1, n_shared_experts=1, routed_scaling_factor=2.446, linear_num_heads=4, linear_head_dim=16,
              linear_conv_kernel_dim=4, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1,
              pad_token_id=2, initializer_range=0.08, rms_norm_eps=1e-5,
              layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                           "full_attention"],
              mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"])
    kw.update(over)
    return kw


def make_kimi_linear(out_dir: str, tokenizer_dir: str, seed: int = 0, **over) -> str:
    """A random tiny Kimi Linear checkpoint saved by transformers (published tensor names, transformers-5 config)."""
    from transformers import AutoModelForCausalLM, KimiLinearConfig

    from tokenfab.testing.tiny_checkpoints import perturb_random_model

    cfg = KimiLinearConfig(**_kimi_linear_kwargs(**over))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    perturb_random_model(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("conv1d.weight"):
                p.mul_(4.0)  # conv taps large enough that a wrong conv state changes the tokens
    model.save_pretrained(out_dir)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), out_dir)
    return out_dir


@pytest.fixture(scope="module")
def kl_path(tmp_path_factory, tokenizer_dir):
    return make_kimi_linear(str(tmp_path_factory.mktemp("kimi_linear")), tokenizer_dir)


@pytest.fixture(scope="module")
def kl_ref(kl_path):
    return load_reference(kl_path)


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``n`` tokens with EOS treated as an ordinary token (like the engine's
    ignore_eos; conftest's helper forbids EOS through min_new_tokens instead)."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


def make_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 512, (n,), generator=g).tolist() for n in lengths]


def run_and_compare(llm: LLM, ref, prompts: list[list[int]], gen: int = GEN) -> float:
    """Generate greedily with prompt logprobs; assert tokens equal transformers'; return max |Δ logprob| over all
    prompt positions and generated tokens."""
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    worst = 0.0
    for p, o in zip(prompts, outs):
        toks = o.outputs[0].token_ids
        assert toks == reference_greedy(ref, p, gen), f"prompt of {len(p)} tokens: tokens differ"
        full = p + toks
        lp = reference_logprobs(ref, full)
        for i in range(1, len(p)):
            worst = max(worst, abs(o.prompt_logprobs[i][p[i]].logprob - lp[i - 1, p[i]].item()))
        for j, d in enumerate(o.outputs[0].logprobs):
            pos = len(p) + j
            worst = max(worst, abs(d[full[pos]].logprob - lp[pos - 1, full[pos]].item()))
    return worst


def test_chunked_prefill_mixed_batch_token_exact(kl_path, kl_ref):
    """Budget 48 tokens/step: the 150- and 97-token prompts span several prefill chunks while short requests
    decode in the same steps (decode group + padded prefill group)."""
    llm = LLM(kl_path, dtype="float32", device="cpu", max_num_batched_tokens=48, max_num_seqs=4, progress=False)
    worst = run_and_compare(llm, kl_ref, make_prompts(1, [150, 3, 97, 20, 1, 64]))
    MEASURED["chunked_mixed"] = worst
    assert worst < 1e-4


def test_single_step_prefill_and_chunk_boundaries(kl_path, kl_ref):
    """Whole prompts in one step (KDA chunk of 64 crossed at 65 and 130 tokens), several sequences batched."""
    llm = LLM(kl_path, dtype="float32", device="cpu", max_num_batched_tokens=1024, max_num_seqs=8, progress=False)
    worst = run_and_compare(llm, kl_ref, make_prompts(2, [64, 65, 130, 7]))
    MEASURED["single_step"] = worst
    assert worst < 1e-4


def test_preemption_mid_kda_prefill(kl_path, kl_ref, mid_prefill_preemptions):
    """A pool of 14 blocks x 8 tokens for four ~50-token prompts with 32-token prefill chunks: sequences are
    preempted (recompute) while still in prefill; their KDA state must restart from zero and tokens not change."""
    llm = LLM(kl_path, dtype="float32", device="cpu", max_num_batched_tokens=32, max_num_seqs=4, block_size=8,
              num_kv_blocks=14, max_model_len=96, progress=False)
    worst = run_and_compare(llm, kl_ref, make_prompts(3, [50, 47, 52, 45]), gen=12)
    MEASURED["preemption"] = worst
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert any(mid_prefill_preemptions), "no sequence was preempted in the middle of its prefill"
    assert worst < 1e-4
    assert llm.llm_engine.block_manager.num_free_blocks == 14


def _published_dialect(src: str, dst: str, a_log: str) -> str:
    """Rewrite a transformers-5 config into Moonshot's published dialect (1-indexed linear_attn_config,
    first_k_dense_replace) and A_log as ``a_log`` ("4d" as saved, "1d", or "padded" with junk beyond num_heads)."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "model.safetensors":
            shutil.copy(os.path.join(src, f), dst)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    lt = cfg.pop("layer_types")
    cfg.pop("mlp_layer_types")
    cfg["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, t in enumerate(lt) if t == "linear_attention"],
        "full_attn_layers": [i + 1 for i, t in enumerate(lt) if t == "full_attention"],
        "num_heads": cfg.pop("linear_num_heads"), "head_dim": cfg.pop("linear_head_dim"),
        "short_conv_kernel_size": cfg.pop("linear_conv_kernel_dim")}
    cfg["mlp_layer_types"] = None
    cfg.pop("mlp_layer_types")
    cfg["first_k_dense_replace"] = 0
    cfg["moe_layer_freq"] = 1
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    sd = load_file(os.path.join(src, "model.safetensors"))
    for k in list(sd):
        if k.endswith("A_log"):
            v = sd[k].reshape(-1)
            sd[k] = {"4d": sd[k], "1d": v.clone(), "padded": torch.cat([v, torch.full((4,), 7.0)])}[a_log]
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_config_dialects_read_to_the_same_model(tmp_path, tokenizer_dir):
    """transformers-5 dialect vs the published one (1-indexed lists) with 4-D, 1-D and padded A_log: same parsed
    pattern and sizes, identical logprobs."""
    src = make_kimi_linear(str(tmp_path / "t5"), tokenizer_dir, seed=3,
                           mlp_layer_types=["sparse"] * 5)  # published dialect: first_k_dense_replace = 0
    prompts = make_prompts(4, [40, 9])
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)

    def run(path):
        llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=32, progress=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return llm.llm_engine.model_config, [(o.outputs[0].token_ids, o.prompt_logprobs) for o in outs]

    c0, r0 = run(src)
    for variant in ("4d", "1d", "padded"):
        c1, r1 = run(_published_dialect(src, str(tmp_path / f"pub-{variant}"), variant))
        for f in ("layer_types", "moe_layers", "kda_num_heads", "kda_head_dim", "kda_conv_kernel", "num_experts",
                  "num_experts_per_tok", "n_group", "topk_group", "n_shared_experts", "max_position_embeddings"):
            assert getattr(c0, f) == getattr(c1, f), f
        assert r0 == r1, variant


def _base_published(**over):
    cfg = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 512,
           "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
           "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 24,
           "model_max_length": 1024, "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 32,
           "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 4, "head_dim": 16,
                                  "short_conv_kernel_size": 4}}
    cfg.update(over)
    return cfg


def test_published_config_parses_one_indexed():
    mc = parse_config(_base_published())
    assert mc.layer_types == ["kda", "kda", "kda", "mla"]
    assert mc.moe_layers == [1, 2, 3]  # first_k_dense_replace defaults to 1 (transformers)
    assert mc.kv_cache_bytes_per_token(2) == (32 + 16) * 1 * 2  # MLA layers only
    assert mc.kda_state_bytes_per_request(2) == 3 * (3 * 64 * 3 * 2 + 4 * 16 * 16 * 4)


@pytest.mark.parametrize("over, field", [
    ({"linear_attn_config": {"kda_layers": [0, 1, 2], "full_attn_layers": [3], "num_heads": 4, "head_dim": 16}},
     "kda_layers"),
    ({"linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [5], "num_heads": 4, "head_dim": 16}},
     "full_attn_layers"),
    ({"linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [4], "num_heads": 4, "head_dim": 16}},
     "neither"),
    ({"linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [3, 4], "num_heads": 4, "head_dim": 16}},
     "both"),
    ({"linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 16}}, "num_heads"),
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_experts_per_token": None}, "num_experts_per_token"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_kimi_linear_config(over, field):
    with pytest.raises(ConfigError, match=field):
        parse_config(_base_published(**over))


def test_report_measured(capsys):
    """Print the measured max |Δ logprob| of this module (run with -s to see it)."""
    with capsys.disabled():
        print("\nKimi Linear fp32 max |Δ logprob| vs transformers:", {k: f"{v:.2e}" for k, v in MEASURED.items()})
