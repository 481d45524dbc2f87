"""load_format="dummy" (seeded random weights at config.json's shapes, no weight file read) and the config-only
shape folders of benchmarks/gpu_shapes.py (tiny sizes loaded on CPU; the real sizes parsed and built on meta)."""
from __future__ import annotations

import json
import math
import os
import shutil
import sys

import pytest
import torch

from tokenfab import LLM, SamplingParams
from tokenfab.errors import EngineConfigError, UnsupportedError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

KW = dict(dtype="float32", device="cpu", max_model_len=64, progress=False)
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


def config_only(src: str, dst: str) -> str:
    """A copy of checkpoint folder ``src`` without its weight files (config.json and the tokenizer only)."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith((".safetensors", ".safetensors.index.json", ".bin")):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    return dst


def no_weight_reads(monkeypatch):
    """Make every safetensors read fail: a dummy load must not open one."""
    import tokenfab.engine.model_loader as ml

    def refuse(*a, **k):
        raise AssertionError("load_format='dummy' read a weight file")
    monkeypatch.setattr(ml, "iterate_weights", refuse)


def cache_shapes(caches) -> list:
    """Shapes of the KV pool's tensors, entry by entry ((K, V) pairs, MLA latents)."""
    return [tuple(tuple(t.shape) for t in c) if isinstance(c, (tuple, list)) else tuple(c.shape) for c in caches]


def greedy_with_logprobs(llm, n: int = 6):
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, logprobs=3), use_tqdm=False)[0]
    return out.outputs[0]


@pytest.fixture(scope="module")
def tiny_shapes(tmp_path_factory):
    from benchmarks.gpu_shapes import write_cases
    return write_cases(str(tmp_path_factory.mktemp("shapes")), tiny=True)


@pytest.mark.parametrize("case", ["llama3b", "qwen3moe", "dsv3", "k3"])
def test_config_only_folder_loads_and_generates_finite_logits(tiny_shapes, case, monkeypatch):
    """Each gpu_shapes.py family (tiny sizes, no weight file) loads with dummy weights, every parameter finite and
    filled (norm weights 1, matrices ~N(0, 0.02)), and greedy decoding gives finite logprobs; the same seed twice
    gives the same tokens."""
    folder = tiny_shapes[case]
    assert not [f for f in os.listdir(folder) if "safetensors" in f]
    no_weight_reads(monkeypatch)
    llm = LLM(folder, load_format="dummy", seed=3, **KW)
    model = llm.llm_engine.runner.model
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if p.dim() >= 2 and p.numel() >= 256:
            assert 0.015 < p.float().std().item() < 0.025, name
        if p.dim() == 1 and name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
    c = greedy_with_logprobs(llm)
    assert len(c.token_ids) == 6
    assert all(math.isfinite(lp.logprob) for step in c.logprobs for lp in step.values())
    again = greedy_with_logprobs(LLM(folder, load_format="dummy", seed=3, **KW))
    assert again.token_ids == c.token_ids


def test_seed_picks_the_weights_and_tied_head_shares_the_embedding(tiny_shapes):
    folder = tiny_shapes["llama3b"]  # tie_word_embeddings true
    a = LLM(folder, load_format="dummy", seed=0, **KW).llm_engine.runner.model
    b = LLM(folder, load_format="dummy", seed=0, **KW).llm_engine.runner.model
    c = LLM(folder, load_format="dummy", seed=1, **KW).llm_engine.runner.model
    name = "model.layers.0.mlp.down_proj.weight"
    pa, pb, pc = (dict(m.named_parameters())[name] for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    assert a.lm_head.weight is a.model.embed_tokens.weight


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_dummy_matches_the_real_checkpoint_in_shapes_and_memory_plan(tiny_model, tmp_path, family, monkeypatch):
    """Against the same config with its real weights: the same parameter names, shapes and dtypes, the same weight
    bytes, and the memory planner (gpu_memory_utilization over a fixed host memory) sizes the same KV pool."""
    import tokenfab.engine.engine_config as ec
    monkeypatch.setattr(ec, "host_memory_bytes", lambda: 64 << 20)
    real_dir = tiny_model(family)
    dummy_dir = config_only(real_dir, str(tmp_path / family))
    real = LLM(real_dir, gpu_memory_utilization=0.5, **KW)
    no_weight_reads(monkeypatch)
    dummy = LLM(dummy_dir, load_format="dummy", gpu_memory_utilization=0.5, **KW)

    def shapes(llm):
        return {n: (tuple(p.shape), p.dtype) for n, p in llm.llm_engine.runner.model.named_parameters()}
    assert shapes(real) == shapes(dummy)
    assert real.engine_config.num_kv_blocks == dummy.engine_config.num_kv_blocks
    assert cache_shapes(real.llm_engine.runner.kv_caches) == cache_shapes(dummy.llm_engine.runner.kv_caches)
    from benchmarks.decode_floor import weight_bytes
    assert weight_bytes(real.llm_engine.runner.model) == weight_bytes(dummy.llm_engine.runner.model)


def test_load_format_values_and_flags(tiny_model):
    llama = tiny_model("llama")
    with pytest.raises(EngineConfigError, match=r"load_format must be one of auto, dummy .* got 'random'"):
        LLM(llama, load_format="random", **KW)
    from tokenfab.cli import build_parser
    from tokenfab.server.launch import engine_config_from_args
    args = build_parser().parse_args(["serve", llama, "--device", "cpu", "--load-format", "dummy", "--seed", "4"])
    cfg = engine_config_from_args(args)
    assert (cfg.load_format, cfg.seed) == ("dummy", 4)
    assert engine_config_from_args(build_parser().parse_args(["serve", llama])).load_format == "auto"
    g = build_parser().parse_args(["generate", llama, "--load-format", "dummy", "--engine-seed", "2"])
    assert (g.load_format, g.engine_seed) == ("dummy", 2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", llama, "--load-format", "pt"])


def test_tensor_parallel_ranks_fill_their_own_shards(tiny_model, tmp_path):
    """Two gloo ranks load a config-only folder with dummy weights (each fills its shard; the worker reads no
    weight file, there is none) and decode greedily with finite logprobs, the same tokens twice."""
    folder = config_only(tiny_model("llama"), str(tmp_path / "llama"))
    runs = []
    for _ in range(2):
        llm = LLM(folder, load_format="dummy", tensor_parallel_size=2, **KW)
        try:
            runs.append(greedy_with_logprobs(llm, 4))
        finally:
            llm.llm_engine.shutdown()
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 4
    assert all(math.isfinite(lp.logprob) for step in runs[0].logprobs for lp in step.values())


def packed_layout(model) -> dict:
    """Every packed tensor a load kept, by name: FP8 Linear weights (class, codes' and scales' shapes and dtypes)
    and packed expert stacks (class, buffers' shapes and dtypes)."""
    from tokenfab.quant.packed_experts import PackedExperts
    from tokenfab.quant.packed_weight import PackedWeight
    return {n: (type(m).__name__, [(b, tuple(t.shape), t.dtype) for b, t in m.named_buffers()])
            for n, m in model.named_modules() if isinstance(m, (PackedWeight, PackedExperts))}


@pytest.mark.parametrize("fmt", ["fp8", "int4", "mxfp4"])
def test_packed_dummy_matches_the_real_packed_checkpoint(tiny_model, tmp_path, fmt, monkeypatch):
    """A config-only copy of a packed checkpoint (DeepSeek-V3 FP8 block-scaled as published; INT4 group-32 / MXFP4
    routed experts) loads with dummy weights packed exactly as the real load keeps them: the same packed modules
    with the same buffer shapes and dtypes, the same plain parameters, the same weight bytes (decode_floor's packed
    floor); the codes decode to finite weights of RMS ~0.02 and greedy decoding gives finite logprobs."""
    from benchmarks.decode_floor import weight_bytes
    from tokenfab.testing.fp8_checkpoint import write_fp8_checkpoint
    from tokenfab.testing.packed_experts_checkpoint import write_packed_experts_checkpoint
    src = tiny_model("deepseek_v3", num_hidden_layers=2, hidden_size=160, intermediate_size=224, q_lora_rank=64)
    real_dir = (write_fp8_checkpoint(src, str(tmp_path / "real")) if fmt == "fp8"
                else write_packed_experts_checkpoint(src, str(tmp_path / "real"), fmt))
    dummy_dir = config_only(real_dir, str(tmp_path / "dummy"))
    real = LLM(real_dir, **KW).llm_engine.runner.model
    no_weight_reads(monkeypatch)
    llm = LLM(dummy_dir, load_format="dummy", seed=2, **KW)
    dummy = llm.llm_engine.runner.model
    layout = packed_layout(dummy)
    assert layout == packed_layout(real) and layout
    kinds = {k for k, _ in layout.values()}
    assert kinds == ({"Fp8BlockWeight", "Fp8BlockExperts"} if fmt == "fp8" else
                     {"Int4GroupExperts" if fmt == "int4" else "Mxfp4Experts"})
    assert ({n: (tuple(p.shape), p.dtype) for n, p in real.named_parameters()}
            == {n: (tuple(p.shape), p.dtype) for n, p in dummy.named_parameters()})
    assert weight_bytes(real) == weight_bytes(dummy)
    experts = dummy.model.layers[1].mlp.experts
    for stack in (experts.q13, experts.q2):
        w = stack.dequantize_expert(stack.num_experts - 1)
        assert torch.isfinite(w).all() and 0.012 < w.pow(2).mean().sqrt().item() < 0.035, type(stack).__name__
    if fmt == "fp8":
        lin = dummy.model.layers[0].mlp.down_proj.qweight
        w = lin.dequantize_rows(0, lin.out_features)
        assert torch.isfinite(w).all() and 0.015 < w.std().item() < 0.025
    c = greedy_with_logprobs(llm, 4)
    assert len(c.token_ids) == 4 and all(math.isfinite(lp.logprob) for step in c.logprobs for lp in step.values())


def test_dummy_k3_with_its_dummy_dspark_drafter(tiny_shapes, monkeypatch):
    """The k3 case (MXFP4 experts packed) with its DSpark drafter folder (config.json only) in bfloat16: both filled
    with dummy weights (no file read), every drafter parameter finite at ~N(0, 0.02) in the engine's dtype, and a
    greedy run drafts and verifies (the drafter's proposals counted) with finite logprobs."""
    no_weight_reads(monkeypatch)
    llm = LLM(tiny_shapes["k3"], load_format="dummy", seed=1,
              speculative_config={"method": "dspark", "model": tiny_shapes["k3-dspark"],
                                  "num_speculative_tokens": 3}, **dict(KW, dtype="bfloat16"))
    drafter = llm.llm_engine.spec.proposer.drafter
    for name, p in drafter.named_parameters():
        assert p.dtype == torch.bfloat16, name  # the engine's dtype, as a loaded drafter's (no KDA draft layer)
        assert torch.isfinite(p).all(), name
        if p.dim() >= 2 and p.numel() >= 256:
            assert 0.015 < p.float().std().item() < 0.025, name
    c = greedy_with_logprobs(llm, 8)
    assert len(c.token_ids) == 8 and all(math.isfinite(lp.logprob) for step in c.logprobs for lp in step.values())
    st = llm.llm_engine.get_stats()
    assert st["spec_decode_num_drafts"] > 0 and st["spec_decode_num_draft_tokens"] >= st["spec_decode_num_drafts"]


def test_packed_dummy_refusals(tiny_shapes, tmp_path):
    """A GGUF file cannot be filled, nor can host experts be split from packed (MXFP4) experts: refused by name."""
    with pytest.raises(UnsupportedError, match="load_format='dummy' does not fill GGUF"):
        from tokenfab.loader.dummy_weights import refuse_packed
        refuse_packed(None, None, True)
    with pytest.raises(UnsupportedError, match="host experts"):
        LLM(tiny_shapes["k3"], load_format="dummy", host_experts=1, **KW)


# ---- benchmarks/gpu_shapes.py at the real shapes (meta device: no memory) --------------------------------------
def test_real_shape_folders_parse_with_the_published_sizes(tmp_path):
    from benchmarks.gpu_shapes import count_parameters, write_cases
    from tokenfab.config import load_config
    from tokenfab.spec_decode.dspark_config import check_against_target, load_dspark_config
    folders = write_cases(str(tmp_path), k3_experts=384)
    drafter = load_dspark_config(folders.pop("k3-dspark"))
    mc = {c: load_config(d) for c, d in folders.items()}
    check_against_target(drafter, mc["k3"])  # the drafter fits the k3 case (vocab, tap width, tapped layers)
    assert (drafter.layer_types, drafter.num_attention_heads, drafter.kv_lora_rank) == (["mla"] * 5, 96, 512)
    assert (mc["llama3b"].hidden_size, mc["llama3b"].num_hidden_layers, mc["llama3b"].num_key_value_heads,
            mc["llama3b"].tie_word_embeddings) == (3072, 28, 8, True)
    assert (mc["qwen3moe"].num_experts, mc["qwen3moe"].num_experts_per_tok, mc["qwen3moe"].moe_intermediate_size) \
        == (128, 8, 768)
    assert (mc["dsv3"].num_experts, mc["dsv3"].n_group, mc["dsv3"].topk_group, mc["dsv3"].kv_lora_rank,
            mc["dsv3"].q_lora_rank, mc["dsv3"].num_attention_heads) == (256, 8, 4, 512, 1536, 128)
    assert mc["k3"].num_experts == 384 and mc["k3"].hidden_size == 7168
    n3b, _ = count_parameters(folders["llama3b"])
    assert 3.20e9 < n3b < 3.22e9  # Llama-3.2-3B: 3.21e9 parameters
    ndsv3, _ = count_parameters(folders["dsv3"])
    assert 2.5e10 < ndsv3 < 2.6e10
