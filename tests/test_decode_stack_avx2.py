"""The fused C++ decode stack (engine/cpu_decode_stack.py) at the avx2 ISA level, the path of CPUs without AVX512-BF16
(an AVX2-only EPYC; any x86-64 CPU with the kernels capped there): a tiny llama GGUF file served packed in float32
runs its decode-only steps through one C++ call whose projections, SiLU-GLU and LM head are the AVX2 GEMV on the
packed tiles and whose embedding rows are dequantized to float32, bit-identical to the module path on the same
packed weights (same tokens and logprobs, greedy and seeded, over steps that read the cache rows the stack wrote),
with q|k|v and gate|up joined where their block types match and separate where not. The module path is tested
against the dequantized reference model in test_gguf_packed_loader.py; the GEMV against gguf's own dequantized
weights in test_gguf_avx2_gemv.py."""
from __future__ import annotations

import pytest

from tokenfab.kernels.cpu import build as cpu_build

gguf = pytest.importorskip("gguf")

from test_decode_stack_packed import (ALL_Q4_0, ALL_Q4_1_EMB_Q8, MIXED, assert_stack_matches_modules,  # noqa: E402
                                     packed_llm)

pytestmark = pytest.mark.skipif(not getattr(cpu_build.load(), "gguf_gemv_avx2_built", False),
                                reason="the fused CPU kernels are not built here, or without AVX2 / FMA / F16C")


@pytest.fixture
def avx2_level(avx2_isa_cap, monkeypatch):
    """The kernels capped at the avx2 level and tokenfab told so (TOKENFAB_CPU_ISA), as on a CPU without AVX512."""
    monkeypatch.setenv("TOKENFAB_CPU_ISA", "avx2")
    monkeypatch.delenv("TOKENFAB_CPU_LINEAR", raising=False)


@pytest.mark.parametrize("types,tie", [(ALL_Q4_1_EMB_Q8, False), (MIXED, False), (ALL_Q4_0, True)],
                         ids=["q4_1-q8_0-embedding", "mixed-unjoined", "q4_0-tied"])
def test_avx2_decode_stack_is_bit_identical_to_the_module_path(avx2_level, tiny_model, tokenizer_dir, tmp_path,
                                                                monkeypatch, types, tie):
    import torch

    from tokenfab.engine.cpu_decode_stack import GGUF_AVX2_QTYPE
    llm = packed_llm(tiny_model, tokenizer_dir, tmp_path, types, tie, "float32")
    model = llm.llm_engine.runner.model
    assert model.model.embed_tokens.dtype == torch.float32
    head = model._lm_head_qweight
    assert head._gemv_avx2 and not head._kernel  # the AVX2 GEMV, not the AVX512 kernel
    assert GGUF_AVX2_QTYPE > 256  # its Lins' type ids cannot be mistaken for ggml's or the FP8 Lin's
    assert_stack_matches_modules(llm, monkeypatch)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_avx2_decode_stack_over_a_narrower_kv_pool(avx2_level, tiny_model, tokenizer_dir, tmp_path, monkeypatch,
                                                   kv_dtype):
    """float32 activations over a bf16 / fp16 KV pool (EngineConfig.kv_cache_dtype): the stack writes its rows
    rounded to the pool (write_slots) and its attention widens them, bit-identical to the module path (write_cache's
    cast, the same kernel through dispatch)."""
    import torch
    llm = packed_llm(tiny_model, tokenizer_dir, tmp_path, ALL_Q4_1_EMB_Q8, False, "float32", kv_cache_dtype=kv_dtype)
    runner = llm.llm_engine.runner
    assert {c.dtype for pair in runner.kv_caches for c in pair} == {getattr(torch, kv_dtype)}
    assert runner.model.model.embed_tokens.dtype == torch.float32
    assert_stack_matches_modules(llm, monkeypatch)


def test_avx2_stack_refuses_what_it_does_not_run(avx2_level, tiny_model):
    """At the avx2 level a float32 model whose linears are plain float32 weights (a safetensors folder) keeps the
    module path: the stack runs GGUF weights on the AVX2 GEMV only."""
    from tokenfab import LLM
    llm = LLM(tiny_model("llama"), dtype="float32", max_model_len=64, progress=False)
    assert llm.llm_engine.runner.cpu_decode_stack is None
