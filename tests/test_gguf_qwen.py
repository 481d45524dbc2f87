"""qwen2 / qwen3 GGUF files with K-quant linears served packed (tokenfab/loader/gguf_packed.py): the packed model
against the same weights dequantized by gguf-py (float32 activations: greedy tokens identical, prompt logprobs
within 1e-4), and against transformers' own GGUF loader (``gguf_file=``; it dequantizes) greedy token for token.

The files are written here with ``gguf.GGUFWriter`` as llama.cpp lays out these architectures: names
``blk.N.attn_q.bias`` (qwen2) and ``blk.N.attn_q_norm.weight`` (qwen3), q/k rows in Hugging Face order (llama.cpp
permutes them for llama only), ne0 = inputs. gguf-py has no K-quant quantizer, so the K-quant tensors are random
bytes with small finite fp16 scales; norms and biases F32, one linear F16 and one BF16.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from conftest import max_prompt_logprob_gap  # noqa: E402
from gguf_helpers import (add_model_header, finish_gguf, generate_packed_and_reference, gguf_name,  # noqa: E402
                          reference_folder)
from test_gguf_kquants import random_kblocks  # noqa: E402
from tokenfab import LLM, SamplingParams  # noqa: E402
from tokenfab.loader.gguf_packed import iterate_gguf_weights  # noqa: E402
from tokenfab.quant.gguf_weight import GGUFWeight  # noqa: E402

GG = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
      "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
      "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
      "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q5_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
         "ffn_up": "F16", "ffn_down": "Q6_K", "token_embd": "Q6_K", "output": "Q4_K"}
SCALE = {"Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 4e-5}  # fp16 d (and dmin) spread: weights of order 0.05
# head_dim 128: transformers reads no qwen3.attention.key_length (Qwen3Config default 128, as real Qwen3 files)
SIZES = dict(hidden_size=256, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128)


def write_qwen_gguf(ckpt: str, out: str, arch: str, bf16_kind: str = "attn_output") -> dict[str, np.ndarray]:
    """A ``arch`` (qwen2 / qwen3) GGUF file from checkpoint ``ckpt``'s config, norms and biases, its linears
    K-quant random bytes (or F16 / BF16 of the checkpoint's values); returns the dequantized weights by HF name
    (gguf's own dequantize), the reference model's weights (qwen2: o_proj's bias zero, as Qwen2 has none)."""
    from safetensors.torch import load_file
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    sd = load_file(os.path.join(ckpt, "model.safetensors"))
    w = gguf.GGUFWriter(out, arch)
    add_model_header(w, cfg)
    ref = {}
    for i, (name, t) in enumerate(sorted(sd.items())):
        a = t.float().numpy()
        if name.endswith(".self_attn.o_proj.bias"):
            ref[name] = np.zeros_like(a)  # Qwen2 has no o_proj bias: not in the file
            continue
        gname, kind = gguf_name(name, GG)
        qt = TYPES.get(kind) if kind is not None else None
        if kind == bf16_kind:
            qt = "BF16"
        if qt is None:
            ref[name] = a
            w.add_tensor(gname, np.ascontiguousarray(a))
        elif qt == "F16":
            ref[name] = a.astype(np.float16).astype(np.float32)
            w.add_tensor(gname, a.astype(np.float16))
        elif qt == "BF16":
            bits = torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            ref[name] = torch.from_numpy(a).to(torch.bfloat16).float().numpy()
            w.add_tensor(gname, bits.copy(), raw_shape=a.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            raw = random_kblocks(qt, a.shape[0], a.shape[1], seed=i, scale=SCALE[qt])
            ref[name] = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qt])
            w.add_tensor(gname, raw, raw_dtype=gguf.GGMLQuantizationType[qt])
    finish_gguf(w)
    return ref


def tiny_qwen(tiny_model, arch: str) -> str:
    if arch == "qwen2":  # Qwen2 = Llama blocks with q/k/v biases
        return tiny_model("llama", attention_bias=True, tie_word_embeddings=True, **SIZES)
    return tiny_model("qwen3", tie_word_embeddings=False, **SIZES)


PROMPTS = ([5, 17, 33, 200, 7], [9, 4, 300], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_kquant_gguf_packed_matches_dequantized_model(tiny_model, tokenizer_dir, tmp_path, arch):
    ckpt = tiny_qwen(tiny_model, arch)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    ref = reference_folder(ckpt, str(tmp_path / "ref"), write_qwen_gguf(ckpt, path, arch))
    packed = {n: v.block.name for n, v in iterate_gguf_weights(path, progress=False) if isinstance(v, GGUFWeight)}
    assert packed["model.layers.0.self_attn.v_proj.weight"] == "Q5_K"
    assert packed["model.layers.1.mlp.down_proj.weight"] == "Q6_K"
    assert packed["model.embed_tokens.weight"] == "Q6_K"
    assert len(packed) == 2 * 5 + 1 + (arch == "qwen3")  # q k v gate down per layer, embedding, untied head
    sp = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def check_packed(llm):
        attn = llm.llm_engine.runner.model.model.layers[0].self_attn
        assert attn.qk_norm == (arch == "qwen3")
        assert attn.q_proj.qweight is not None or attn.qkv_proj.qweight is not None

    outs = generate_packed_and_reference(path, ref, tokenizer_dir, prompts, sp, check_packed)
    gap = max_prompt_logprob_gap(outs["reference"], outs["packed"], f"packed {arch} GGUF")
    assert gap < 1e-4
    # and transformers' GGUF loader on the same file (it dequantizes with gguf-py): the same greedy tokens
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    for p, o in zip(PROMPTS, outs["packed"]):
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert o.outputs[0].token_ids == g[0, len(p):].tolist()


def test_bf16_decode_stack_runs_kquant_gguf(tiny_model, tokenizer_dir, tmp_path):
    """bf16 activations: the fused CPU decode stack takes the K-quant tiles (gguf_linear from C++) and its greedy
    tokens match the module path's."""
    from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf
    if not cpu_gguf.gguf_linear_applies():
        pytest.skip("needs the CPU kernels with AVX512-BF16")
    ckpt = tiny_qwen(tiny_model, "qwen3")
    path = str(tmp_path / "tiny.gguf")
    write_qwen_gguf(ckpt, path, "qwen3", bf16_kind="none")
    sp = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm = LLM(path, dtype="bfloat16", tokenizer=tokenizer_dir, max_model_len=128, progress=False)
    assert llm.llm_engine.runner.cpu_decode_stack is not None
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    llm.llm_engine.runner.cpu_decode_stack = None
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert fused == plain


def test_moe_gguf_not_served_packed_and_incomplete_metadata_named(tmp_path):
    """deepseek2 GGUF files (tokenfab/loader/gguf_moe.py) are read through the dequantized folder, not the packed
    loader: its reason says so in one line and its iterator refuses them rather than skip tensors; a file missing a
    key the config needs names that key."""
    from tokenfab.errors import WeightLoadError
    from tokenfab.loader.gguf_packed import packed_unsupported_reason
    from tokenfab.loader.gguf_to_hf import ensure_converted

    path = str(tmp_path / "ds.gguf")
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    finish_gguf(w)
    reason = packed_unsupported_reason(path)
    assert "deepseek2.embedding_length" in reason and "missing" in reason and "\n" not in reason
    with pytest.raises(WeightLoadError, match="'deepseek2.embedding_length' is missing"):
        ensure_converted(path, quiet=True)
    full = str(tmp_path / "moe.gguf")
    w = gguf.GGUFWriter(full, "deepseek2")
    for key, v in dict(block_count=1, context_length=64, embedding_length=32, feed_forward_length=64,
                       expert_count=4, expert_used_count=2, expert_feed_forward_length=16, expert_gating_func=2,
                       vocab_size=4, **{"attention.head_count": 2, "attention.kv_lora_rank": 16,
                                        "rope.dimension_count": 8, "attention.key_length": 24,
                                        "attention.value_length": 16}).items():
        w.add_uint32(f"deepseek2.{key}", v)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    finish_gguf(w)
    reason = packed_unsupported_reason(full)
    assert reason == "GGUF architecture deepseek2: its MLA and expert tensors are not served packed yet"
    with pytest.raises(WeightLoadError, match="GGUF architecture deepseek2: its MLA and expert tensors"):
        list(iterate_gguf_weights(full, progress=False))