"""The fused C++ decode stack (engine/cpu_decode_stack.py) on GGUF weights kept packed: a tiny llama GGUF file (written
by test_gguf_packed_loader's writer with gguf-py's quantizer) served in bf16 runs its decode-only steps through one
C++ call whose projections, SiLU-GLU, embedding and LM head are the packed GGUF kernels, bit-identical to the module
path on the same packed weights (same tokens and logprobs over steps that read the cache rows the stack wrote), with
q|k|v and gate|up joined where their block types match and separate where not. The module path is tested against
the dequantized reference model in test_gguf_packed_loader.py; the packed embedding lookup against gguf-py's own
``dequantize`` here."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenfab.kernels.cpu import build as cpu_build
from tokenfab.kernels.cpu.ops import support as cpu_support

gguf = pytest.importorskip("gguf")

from decode_stack_ab import stack_switched  # noqa: E402
from test_gguf_packed_loader import write_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_support.has_bf16_dot(), reason="CPU kernels without AVX512-BF16")

ALL_Q4_1_EMB_Q8 = {**{k: "Q4_1" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                           "ffn_down")}, "token_embd": "Q8_0", "output": "Q8_0"}
MIXED = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_0",
         "ffn_up": "Q4_1", "ffn_down": "Q8_0", "output": "Q4_0", "token_embd": "Q4_1"}
ALL_Q4_0 = {k: "Q4_0" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                                "token_embd")}


def generate(llm, prompts, use_stack: bool, monkeypatch):
    from tokenfab import SamplingParams
    with stack_switched(llm, use_stack, monkeypatch, method="run_sample") as sizes:
        greedy = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        # plain sampled rows (no logprobs) take run_sample: the LM head and the draw inside the C++ call
        sampled = SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True)
        drawn = llm.generate([{"prompt_token_ids": p} for p in prompts], sampled, use_tqdm=False)
    return ([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs],
            [o.outputs[0].token_ids for o in drawn], sizes)


def packed_llm(tiny_model, tokenizer_dir, tmp_path, types: dict, tie: bool, dtype: str, **engine_kw):
    """A tiny llama written as a GGUF file (``types``: the block type per tensor kind; ``tie``: a tied head) and
    served packed in ``dtype`` (``engine_kw``: more EngineConfig fields), its load checked: embedding and LM head
    packed (no dense copy of the table), q|k|v and gate|up joined exactly where their block types match, and the
    decode stack built, LM head included."""
    from tokenfab import LLM
    from tokenfab.layers.packed_embedding import PackedEmbedding
    from tokenfab.quant.gguf_weight import GGUFWeight
    ckpt = tiny_model("llama", tie_word_embeddings=tie) if tie else tiny_model("llama")
    path = str(tmp_path / "tiny.gguf")
    write_gguf(ckpt, path, types)
    llm = LLM(path, dtype=dtype, tokenizer=tokenizer_dir, max_model_len=256, block_size=8,
              max_num_batched_tokens=40, progress=False, **engine_kw)
    runner = llm.llm_engine.runner
    model = runner.model
    assert isinstance(model.model.embed_tokens, PackedEmbedding)
    assert isinstance(model._lm_head_qweight, GGUFWeight)
    assert (model._lm_head_qweight is model.model.embed_tokens.qweight) == tie
    joined = len({types["attn_q"], types["attn_k"], types["attn_v"]}) == 1
    assert (model.model.layers[0].self_attn.qkv_proj is not None) == joined
    assert (model.model.layers[0].mlp.gate_up is not None) == (types["ffn_gate"] == types["ffn_up"])
    stack = runner.cpu_decode_stack
    assert stack is not None and stack.vocab_size == 512  # the stack covers the packed model, LM head included
    return llm


def assert_stack_matches_modules(llm, monkeypatch) -> None:
    """Three prompts decoded with and without the fused stack (greedy with logprobs, then seeded sampling): the same
    token ids and logprob dicts, exactly, the stack having run the 3-sequence decode steps."""
    prompts = [[5, 17, 33, 200, 7, 9, 11, 300, 41], [9, 4, 300] * 10, list(range(3, 20))]
    want, want_drawn, sizes = generate(llm, prompts, use_stack=False, monkeypatch=monkeypatch)
    assert not sizes
    got, got_drawn, sizes = generate(llm, prompts, use_stack=True, monkeypatch=monkeypatch)
    assert sizes and max(sizes) == 3  # the 3-sequence decode steps ran through the stack
    assert got == want  # token ids and logprob dicts, exactly
    assert got_drawn == want_drawn


@pytest.mark.parametrize("types,tie", [(ALL_Q4_1_EMB_Q8, False), (MIXED, False), (ALL_Q4_0, True)],
                         ids=["q4_1-q8_0-embedding", "mixed-unjoined", "q4_0-tied"])
def test_packed_decode_stack_is_bit_identical_to_the_module_path(tiny_model, tokenizer_dir, tmp_path, monkeypatch,
                                                                   types, tie):
    llm = packed_llm(tiny_model, tokenizer_dir, tmp_path, types, tie, "bfloat16")
    assert_stack_matches_modules(llm, monkeypatch)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_embedding_rows_match_gguf_dequantize(monkeypatch, qtype, dtype):
    from tokenfab.quant.gguf_weight import GGUFWeight
    rng = np.random.default_rng(3)
    n, k = 37, 96  # 37 rows: a partial last tile
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    q = gguf.quants.quantize(w, t)
    ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(q, t))).to(dtype)
    packed = GGUFWeight.from_rows(torch.from_numpy(np.ascontiguousarray(q)), qtype, k)
    ids = torch.tensor([[0, 36, 15], [16, 17, 5]])
    got = packed.embedding(ids, dtype)  # the C++ lookup
    assert got.dtype == dtype and got.shape == (2, 3, k)
    assert torch.equal(got, ref[ids])
    with pytest.raises(RuntimeError, match="outside"):
        packed.embedding(torch.tensor([n]), dtype)
    monkeypatch.setattr(cpu_build, "load", lambda: None)  # without built kernels: the PyTorch lookup
    assert torch.equal(packed.embedding(ids, dtype), ref[ids])
    with pytest.raises(IndexError, match="ids must lie"):
        packed.embedding(torch.tensor([n]), dtype)
