"""GGUF files of llama.cpp's MoE architectures ``qwen3moe`` and ``deepseek2`` (tokenfab/loader/gguf_moe.py).

Tiny Qwen3-MoE and DeepSeek-V3 checkpoints are written here as llama.cpp's converter (convert_hf_to_gguf.py,
``Qwen3MoeModel`` / ``DeepseekV2Model``) lays them out, the names taken from gguf-py's own tensor map
(``gguf.get_tensor_name_map``, not tokenfab's table): experts stacked per layer [E, out, in], DeepSeek's
``kv_b_proj`` split into ``attn_k_b`` (key rows per head, transposed) and ``attn_v_b`` (or kept whole, as files
converted before that split hold it), the correction bias as ``exp_probs_b.bias``, MLA written as one KV head, and
the converter's metadata (MLA widths, expert counts, routing, YaRN with 0.1 * mscale_all_dim as the log multiplier).
Checked: every tensor stored F32 comes back bit for bit under its Hugging Face name; the config matches the
checkpoint's; Qwen3-MoE tensors equal transformers' own GGUF loader's; served by tokenfab from the file (its cached
dequantized folder), greedy tokens equal transformers' on the same weights in float32.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from conftest import load_reference, max_prompt_logprob_gap, reference_greedy  # noqa: E402
from gguf_helpers import add_hf_tokenizer, finish_gguf, generate_packed_and_reference, reference_folder  # noqa: E402
from test_gguf_kquants import random_kblocks  # noqa: E402

ARCH = {"qwen3_moe": "qwen3moe", "deepseek_v3": "deepseek2"}
DS_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707,
           "beta_fast": 4.0, "beta_slow": 1.0, "original_max_position_embeddings": 64}  # beta_fast off its default


def _header(w, arch: str, cfg: dict, kv_b: str) -> None:
    """The metadata convert_hf_to_gguf.py writes for these architectures (TextModel's base keys plus the model's)."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_expert_count(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_vocab_size(cfg["vocab_size"])
    if arch == "qwen3moe":
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        return
    w.add_head_count_kv(1)  # MLA as multi-query attention
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(cfg["kv_lora_rank"])
    rope, nope, v = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    if kv_b == "split":
        w.add_key_length(cfg["kv_lora_rank"] + rope)
        w.add_value_length(cfg["kv_lora_rank"])
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    else:  # files converted before attn_k_b / attn_v_b
        w.add_key_length(nope + rope)
        w.add_value_length(v)
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg["norm_topk_prob"]:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)
    rp = cfg["rope_parameters"]
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rp["factor"])
    w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])
    w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])


def write_moe_gguf(hf_dir: str, path: str, kv_b: str = "split", q8: tuple[str, ...] = (),
                   drop: tuple[str, ...] = (), pre: str = "default", types: dict[str, str] | None = None,
                   ref: dict | None = None) -> dict:
    """Write the tiny Qwen3-MoE / DeepSeek-V3 checkpoint at ``hf_dir`` as llama.cpp's converter would (F32
    tensors; GGUF kinds (``attn_q``, ``ffn_gate_exps`` ...) in ``q8`` stored Q8_0, in ``types`` stored in that type:
    Q8_0 / Q4_0 / Q4_1 quantized by gguf-py, K-quants random bytes with small fp16 scales; ``drop``: GGUF names left
    out; ``pre``: the vocabulary's ``tokenizer.ggml.pre``). ``ref``, when given, receives every tensor's stored
    values (gguf's dequantization) under its Hugging Face name. Returns the config."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    arch = ARCH[cfg["model_type"]]
    sd = {k: v.float().numpy() for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE if arch == "qwen3moe" else gguf.MODEL_ARCH.DEEPSEEK2,
                                     cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(path, arch)
    _header(w, arch, cfg, kv_b)
    add_hf_tokenizer(w, hf_dir, cfg, pre)
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, tuple[int, str]] = {}  # GGUF name of an expert stack -> (layer, proj)
    hf_names: dict[str, str] = {}  # Hugging Face name -> GGUF name, one tensor each
    for layer in range(cfg["num_hidden_layers"]):  # experts stacked per layer, as the converter merges them
        for proj in ("gate_proj", "up_proj", "down_proj"):
            keys = [k for k in sd if k.startswith(f"model.layers.{layer}.mlp.experts.") and k.endswith(proj + ".weight")]
            if keys:
                stack = np.stack([sd.pop(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight")
                                  for e in range(len(keys))])
                gname = names.get_name(f"model.layers.{layer}.mlp.experts.{proj}.weight", try_suffixes=(".weight",))
                out[gname], stacks[gname] = stack, (layer, proj)
    for name, a in sd.items():
        if name.endswith("kv_b_proj.weight") and kv_b == "split":
            heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            per_head = a.reshape(heads, nope + v, a.shape[-1])
            gname = names.get_name(name.replace("kv_b_proj", "k_b_proj"), try_suffixes=(".weight",))
            out[gname] = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
            out[gname.replace("attn_k_b", "attn_v_b")] = np.ascontiguousarray(per_head[:, nope:])
            continue
        hf = name.replace("e_score_correction_bias", "e_score_correction.bias")
        hf_names[name] = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        out[hf_names[name]] = a
    types = dict(types or {}, **{k: "Q8_0" for k in q8})
    hf_of = {v: k for k, v in hf_names.items()}
    for i, (gname, a) in enumerate(out.items()):
        if gname in drop:
            continue
        a = np.ascontiguousarray(a, dtype=np.float32)
        qt = types.get(gname.rsplit(".", 2)[-2])
        if qt is None:
            w.add_tensor(gname, a)
            stored = a
        else:
            rows = a.reshape(-1, a.shape[-1])
            raw = (random_kblocks(qt, rows.shape[0], rows.shape[1], seed=i, scale=2e-4) if qt.endswith("_K")
                   else quantize(rows, getattr(Q, qt)))
            raw = raw.reshape(*a.shape[:-1], -1)
            w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=getattr(Q, qt))
            stored = gguf.quants.dequantize(raw, getattr(Q, qt)).reshape(a.shape)
        if ref is not None:
            if gname in stacks:
                layer, proj = stacks[gname]
                for e in range(stored.shape[0]):
                    ref[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = stored[e]
            elif gname in hf_of:
                ref[hf_of[gname]] = stored
    finish_gguf(w)
    return cfg


def _deepseek(tiny_model, **kw) -> str:
    return tiny_model("deepseek_v3", rope_parameters=DS_ROPE, **kw)


@pytest.mark.parametrize("kv_b", ["split", "joined"])
def test_deepseek2_f32_tensors_and_config_come_back_exactly(tiny_model, tmp_path, kv_b):
    from safetensors.torch import load_file

    from tokenfab.loader.gguf_to_hf import gguf_config, hf_state_dict

    hf_dir = _deepseek(tiny_model)
    path = str(tmp_path / "ds.gguf")
    cfg = write_moe_gguf(hf_dir, path, kv_b=kv_b)
    orig = load_file(os.path.join(hf_dir, "model.safetensors"))
    ours = hf_state_dict(path)
    assert set(ours) == set(orig)
    for k, v in orig.items():
        assert torch.equal(ours[k], v.float()), k
    got = gguf_config(path)
    for k in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "n_routed_experts", "n_shared_experts",
              "num_experts_per_tok", "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob",
              "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "vocab_size",
              "max_position_embeddings", "model_type", "architectures", "tie_word_embeddings"):
        assert got[k] == cfg[k], k
    assert got["routed_scaling_factor"] == pytest.approx(cfg["routed_scaling_factor"], rel=1e-6)  # float32
    for k, v in DS_ROPE.items():
        assert got["rope_parameters"][k] == (pytest.approx(v, rel=1e-6) if isinstance(v, float) else v), k


def test_qwen3moe_tensors_equal_transformers_gguf_loader(tiny_model, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from tokenfab.loader.gguf_to_hf import gguf_config, hf_state_dict

    hf_dir = tiny_model("qwen3_moe")
    path = str(tmp_path / "q.gguf")
    cfg = write_moe_gguf(hf_dir, path, q8=("ffn_gate_exps", "attn_q", "ffn_down_exps"))
    # transformers' GGUF config mapping has no expert_feed_forward_length: its config is the checkpoint's
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q.gguf", dtype=torch.float32,
                                               config=AutoConfig.from_pretrained(hf_dir)).state_dict()
    ours = hf_state_dict(path)
    assert set(ours) == set(load_file(os.path.join(hf_dir, "model.safetensors")))
    for e in range(cfg["num_local_experts"]):  # transformers 5 keeps experts fused: gate_up_proj [E, 2I, H], down_proj
        for layer in range(cfg["num_hidden_layers"]):
            pre = f"model.layers.{layer}.mlp.experts"
            gate_up = torch.cat([ours[f"{pre}.{e}.gate_proj.weight"], ours[f"{pre}.{e}.up_proj.weight"]])
            assert torch.equal(gate_up, ref[f"{pre}.gate_up_proj"][e]), (layer, e)
            assert torch.equal(ours[f"{pre}.{e}.down_proj.weight"], ref[f"{pre}.down_proj"][e]), (layer, e)
    for k, v in ours.items():
        if ".experts." not in k:
            assert torch.equal(v, ref[k]), k
    got = gguf_config(path)
    assert got["num_experts"] == cfg["num_local_experts"]
    for k in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "head_dim",
              "num_key_value_heads", "model_type", "architectures"):
        assert got[k] == cfg[k], k


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_served_from_the_file_matches_transformers_greedy(tiny_model, tmp_path, monkeypatch, family):
    from tokenfab import LLM, SamplingParams
    from tokenfab.loader.gguf_packed import packed_unsupported_reason

    import tokenfab.loader.gguf_to_hf as g2h

    monkeypatch.setenv("TOKENFAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(g2h, "SHARD_BYTES", 100_000)  # the dequantized folder in shards (~0.7 MB in all)
    hf_dir = _deepseek(tiny_model) if family == "deepseek_v3" else tiny_model("qwen3_moe")
    path = str(tmp_path / f"{family}.gguf")
    write_moe_gguf(hf_dir, path, q8=("ffn_up_exps", "ffn_down_shexp", "attn_kv_a_mqa", "attn_output"))
    assert packed_unsupported_reason(path) == {  # served from the dequantized folder
        "deepseek_v3": "GGUF architecture deepseek2: its MLA and expert tensors are not served packed yet",
        "qwen3_moe": "2 of 2 layers hold quantized and unquantized expert stacks, first layer 0"}[family]
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, progress=False)
    folder = llm.engine_config.model
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) >= 3 and not os.path.exists(os.path.join(folder, "model.safetensors"))
    ref = load_reference(folder)  # the same (bf16-rounded, dequantized) weights in transformers, float32
    prompts = [[5, 17, 99, 3, 250], [300, 301, 7]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == reference_greedy(ref, p, 10)


def test_kv_b_half_missing_refused_and_missing_bias_zero(tiny_model, tmp_path, monkeypatch):
    from tokenfab.errors import WeightLoadError
    from tokenfab.loader.gguf_to_hf import ensure_converted, hf_state_dict

    hf_dir = _deepseek(tiny_model)
    half = str(tmp_path / "half.gguf")
    write_moe_gguf(hf_dir, half, drop=("blk.1.attn_v_b.weight",))
    with pytest.raises(WeightLoadError, match="layer 1 holds attn_k_b.weight without its other half"):
        hf_state_dict(half)
    monkeypatch.setenv("TOKENFAB_CACHE", str(tmp_path / "cache"))  # failing mid-conversion: no folder left
    with pytest.raises(WeightLoadError, match="without its other half"):
        ensure_converted(half, quiet=True)
    assert os.listdir(tmp_path / "cache" / "models" / "gguf") == []
    nobias = str(tmp_path / "nobias.gguf")  # no correction bias: zeros, as llama.cpp adds none
    write_moe_gguf(hf_dir, nobias, drop=("blk.1.exp_probs_b.bias",))
    assert torch.equal(hf_state_dict(nobias)["model.layers.1.mlp.gate.e_score_correction_bias"], torch.zeros(8))


def test_softmax_gated_deepseek2_is_refused(tiny_model, tmp_path, monkeypatch, capsys):
    """Refused in one line by name, and by the entry points' model resolution before any line says it falls back to
    a dequantized copy (an unreadable file likewise)."""
    from tokenfab.default_model import resolve_model
    from tokenfab.errors import UnsupportedError, WeightLoadError
    from tokenfab.loader import gguf_moe
    from tokenfab.loader.gguf_to_hf import gguf_config

    path = str(tmp_path / "v2.gguf")
    monkeypatch.setattr(gguf.GGUFWriter, "add_expert_gating_func",
                        lambda self, v: self.add_uint32(f"{self.arch}.expert_gating_func", 1))
    write_moe_gguf(_deepseek(tiny_model), path)
    with pytest.raises(UnsupportedError, match=r"expert_gating_func 1 \(softmax, DeepSeek-V2\)"):
        gguf_config(path)
    monkeypatch.setenv("TOKENFAB_CACHE", str(tmp_path / "cache"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not gguf" * 8)
    for bad, err in ((path, UnsupportedError), (str(junk), WeightLoadError)):
        with pytest.raises(err):
            resolve_model(bad)
        assert capsys.readouterr().out == ""
    assert gguf_moe.GATING_SIGMOID == int(gguf.ExpertGatingFuncType.SIGMOID)


def _meta(arch: str, **keys) -> dict:
    base = {"general.architecture": arch, "block_count": 2, "embedding_length": 64, "attention.head_count": 4,
            "feed_forward_length": 96, "context_length": 256, "vocab_size": 512, "expert_count": 8,
            "expert_used_count": 2, "expert_feed_forward_length": 32}
    base.update(keys)
    return {k if k.startswith("general.") else f"{arch}.{k}": v for k, v in base.items()}


def test_config_edges_from_metadata_alone():
    """hf_config on hand-written metadata: a dense qwen3 file with YaRN (llama.cpp's beta defaults 32 / 1, no
    mscale: transformers' own YaRN attention factor applies), deepseek2 without a query LoRA, and the refusals."""
    from tokenfab.errors import UnsupportedError, WeightLoadError
    from tokenfab.loader.gguf_reader import hf_config

    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 32768}
    cfg = hf_config(_meta("qwen3", **yarn), {"output.weight"})
    assert cfg["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 32768, "beta_fast": 32.0, "beta_slow": 1.0}
    ds = _meta("deepseek2", **{"attention.head_count_kv": 1, "expert_gating_func": 2, "attention.kv_lora_rank": 32,
                               "rope.dimension_count": 16, "attention.key_length": 48, "attention.value_length": 32,
                               "attention.key_length_mla": 40, "attention.value_length_mla": 24})
    cfg = hf_config(ds, set())
    assert (cfg["q_lora_rank"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["num_key_value_heads"],
            cfg["n_group"], cfg["topk_group"], cfg["routed_scaling_factor"], cfg["norm_topk_prob"]) == \
        (None, 24, 24, 4, 1, 1, 1.0, False)
    assert cfg["tie_word_embeddings"] is True
    with pytest.raises(WeightLoadError, match="'deepseek2.rope.scaling.original_context_length' is missing"):
        hf_config(dict(ds, **{"deepseek2.rope.scaling.type": "yarn", "deepseek2.rope.scaling.factor": 40.0}), set())
    with pytest.raises(UnsupportedError, match=r"qwen3moe file with dense MLP layers \[1\]"):
        hf_config(_meta("qwen3moe"), {"blk.1.ffn_gate.weight"})


def test_deepseek_v3_pre_tokenizer_set_and_unknown_ones_said(tiny_model, tmp_path, monkeypatch, capsys):
    """transformers' GGUF conversion splits a ``deepseek-v3`` vocabulary by GPT-2's rule; tokenfab sets DeepSeek-V3's
    split (digits in threes, CJK runs apart: offsets worked out by hand from its three expressions). A name neither
    knows (``kimi-k2``) is said in one line, at conversion and again when the cached folder is used."""
    import tokenfab.loader.gguf_reader as reader
    from tokenfab.loader.gguf_to_hf import ensure_converted

    monkeypatch.setenv("TOKENFAB_CACHE", str(tmp_path / "cache"))
    hf_dir = _deepseek(tiny_model)
    path = str(tmp_path / "ds3.gguf")
    write_moe_gguf(hf_dir, path, pre="deepseek-v3")
    tok = reader.gguf_tokenizer(path)
    pieces = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("ab 12345 中文,x")
    assert [span for _, span in pieces] == [(0, 2), (2, 3), (3, 6), (6, 8), (8, 9), (9, 11), (11, 13)]
    assert "pre-tokenizer" not in capsys.readouterr().err
    kimi = str(tmp_path / "k2.gguf")
    write_moe_gguf(hf_dir, kimi, pre="kimi-k2")
    folder = ensure_converted(kimi)
    err = capsys.readouterr().err
    assert "k2.gguf: the GGUF vocabulary's pre-tokenizer 'kimi-k2'" in err and err.count("kimi-k2") == 1
    assert "kimi-k2" in json.load(open(os.path.join(folder, "gguf_source.json")))["tokenizer_warning"]
    monkeypatch.setattr(reader, "_WARNED", set())  # a new process
    assert ensure_converted(kimi) == folder and "'kimi-k2'" in capsys.readouterr().err


def test_smollm_rule_accepted_only_without_digit_tokens():
    """``smollm`` puts each digit apart before GPT-2's rule: the same tokens as GPT-2's rule alone exactly when no
    token holds a digit beside another character (SmolLM2's vocabulary), else a warning."""
    from tokenfab.loader.gguf_pretokenizer import pre_tokenizer_warning

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": ["a", "Ġb", "7"]}
    assert pre_tokenizer_warning(meta) is None
    assert "'smollm'" in pre_tokenizer_warning(dict(meta, **{"tokenizer.ggml.tokens": ["a", "Ġ7"]}))
    assert pre_tokenizer_warning(dict(meta, **{"tokenizer.ggml.pre": "qwen2"})) is None  # transformers' own split
    assert pre_tokenizer_warning(dict(meta, **{"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "x"})) is None


PACKED_SIZES = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64)  # K-quant rows need 256 inputs


def test_qwen3moe_experts_served_packed_match_dequantized_twin(tiny_model, tokenizer_dir, tmp_path):
    """A qwen3moe file with Q4_K gate / up and Q6_K down expert stacks (random blocks) and Q8_0 / Q4_1 attention:
    served packed (tokenfab/quant/gguf_experts.py: each expert's GGUF tiles, never a float copy), its float32
    greedy tokens equal those of a checkpoint holding the same weights dequantized by gguf-py, prompt logprobs within
    1e-4 (the engine's GGUF kernels sum in another order)."""
    from tokenfab import SamplingParams
    from tokenfab.layers.moe import RoutedExperts
    from tokenfab.loader.gguf_packed import packed_unsupported_reason
    from tokenfab.quant.gguf_experts import GGUFExperts

    hf_dir = tiny_model("qwen3_moe", **PACKED_SIZES)
    path = str(tmp_path / "q.gguf")
    ref: dict = {}
    types = {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K", "attn_q": "Q8_0",
             "attn_output": "Q4_1", "token_embd": "Q8_0"}
    write_moe_gguf(hf_dir, path, types=types, ref=ref)
    assert packed_unsupported_reason(path) is None
    reference = reference_folder(hf_dir, str(tmp_path / "ref"), ref)

    def check_packed(llm):
        stacks = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, RoutedExperts)]
        assert len(stacks) == 2
        for m in stacks:
            assert isinstance(m.q13, GGUFExperts) and isinstance(m.q2, GGUFExperts) and m.w13 is None
            assert (m.q13.block.name, m.q2.block.name) == ("Q4_K", "Q6_K")
            assert m.q13.nbytes == 8 * 512 * 144 and m.q2.nbytes == 8 * 256 * 210  # the file's bytes (super-blocks)

    sp = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99, 3, 250, 7, 7], [300, 301, 7], [11] * 20)]
    outs = generate_packed_and_reference(path, reference, tokenizer_dir, prompts, sp, check_packed)
    assert max_prompt_logprob_gap(outs["reference"], outs["packed"], "packed qwen3moe GGUF") < 1e-4


def test_qwen3moe_stacks_packed_only_in_one_type_for_gate_and_up(tiny_model, tmp_path):
    """gate Q4_K beside up Q8_0 cannot share one packed stack: the file is served from its dequantized copy, the
    reason said in one line."""
    from tokenfab.loader.gguf_packed import packed_expert_stacks, packed_unsupported_reason

    path = str(tmp_path / "mixed.gguf")
    write_moe_gguf(tiny_model("qwen3_moe", **PACKED_SIZES), path,
                   types={"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q8_0"})
    assert packed_unsupported_reason(path) == ("2 of 2 layers hold ffn_gate_exps and ffn_up_exps in two block types, "
                                               "first layer 0: Q4_K / Q8_0; packed experts need one type for gate "
                                               "and up")
    assert packed_expert_stacks(path) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}


def test_gguf_expert_stacks_keep_cuda_decode_off_graphs(monkeypatch):
    """GGUF experts read their routed counts on the host (one kernel call per active expert), so a model holding
    them decodes on CUDA without graphs (decided before any device is touched: checked here without a GPU); INT4
    stacks, whose Triton kernel routes on the device, stay graph-safe; the padded buffers without capture still run."""
    from torch import nn

    from tokenfab.engine import cuda_graph_runner as cgr
    from tokenfab.layers.moe import RoutedExperts

    monkeypatch.delenv("TOKENFAB_DECODE_GRAPHS", raising=False)
    models = {}
    for fmt in ("int4_group", "gguf"):
        experts = RoutedExperts(4, 64, 32)
        experts.use_packed(fmt)
        models[fmt] = nn.ModuleList([experts])
    assert cgr.experts_graph_safe(models["int4_group"]) and not cgr.experts_graph_safe(models["gguf"])
    assert cgr.decode_graph_mode(torch.device("cuda"), models["gguf"], enforce_eager=False) is None
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    assert cgr.decode_graph_mode(torch.device("cuda"), models["gguf"], enforce_eager=False) == "eager"


def test_qwen3moe_with_f32_experts_served_by_the_packed_loader(tiny_model, tokenizer_dir, tmp_path):
    """Unquantized expert stacks go through the packed loader into the dense stacks (one float32 expert at a time):
    greedy tokens equal transformers' on the original checkpoint (every tensor F32: the same weights)."""
    from tokenfab import LLM, SamplingParams
    from tokenfab.loader.gguf_packed import packed_expert_stacks, packed_unsupported_reason

    hf_dir = tiny_model("qwen3_moe")
    path = str(tmp_path / "f32.gguf")
    write_moe_gguf(hf_dir, path)
    assert packed_unsupported_reason(path) is None and packed_expert_stacks(path) == frozenset()
    llm = LLM(path, dtype="float32", tokenizer=tokenizer_dir, progress=False)
    assert llm.engine_config.model == os.path.abspath(path)
    prompt = [5, 17, 99, 3, 250]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == reference_greedy(load_reference(hf_dir), prompt, 8)
