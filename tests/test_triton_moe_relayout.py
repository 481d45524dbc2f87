"""The GPU layout of INT4 group-32 expert stacks (kernels/gpu/moe_relayout.py) and the grouped GEMM over it
(kernels/gpu/moe_gemm.py, ``relaid``) in Triton's interpreter on CPU.

The layout is checked bit by bit against its definition written out here (input 8w + 2i of a row in bits 4i..4i+3
of word w, 8w + 2i + 1 in bits 16 + 4i.., K padded with nibble 8 and scale 0 to a multiple of 512) and its inverse
against the checkpoint layout; the fused MoE over re-laid stacks is compared with the routed-expert sum in float64
from weights dequantized by the INT4 formula (tests/test_triton_packed_moe.py's make / reference) over odd shapes:
K not a multiple of the K tile (hidden 96, intermediate 160), expert counts that are not powers of two, a top-16 of
28 routing, split-K 1 / 3, float32 (exact to float32 rounding), fp16 (the 16-bit decode and the swapped MMA, as
on a GPU) and bf16 (the interpreter's float32 path on the same values; moe_gemm.grouped_gemm)."""
from __future__ import annotations

import pytest
import torch

from test_triton_packed_moe import make, reference
from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def _checkpoint_codes(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint words [..., W] -> nibbles [..., 8 W] in K order (bits 4 (k % 8) of word k / 8)."""
    return torch.stack([(packed >> (4 * t)) & 0xF for t in range(8)], -1).flatten(-2)


def test_layout_bits_padding_and_inverse():
    """Every nibble of the GPU layout sits where the layout says, the padding decodes to 0 (nibble 8, scale 0),
    and restore_int4 gives back the checkpoint tensors exactly."""
    from tokenfab.kernels.gpu.moe_relayout import padded_k, relayout_int4, restore_int4
    g = torch.Generator().manual_seed(0)
    E, N, K = 3, 5, 160
    packed = torch.randint(-2 ** 31, 2 ** 31, (E, N, K // 8), dtype=torch.int32, generator=g)
    scale = torch.randn(E, N, K // 32, generator=g).to(torch.bfloat16)
    words, sc = relayout_int4(packed, scale)
    kp = padded_k(K)
    assert kp == 512 and words.shape == (E, N, kp // 8) and sc.shape == (E, N, kp // 32) and sc.dtype == scale.dtype
    codes = _checkpoint_codes(packed)  # [E, N, K]
    for w in (0, 7, K // 8 - 1):
        for i in range(4):
            lo = (words[..., w] >> (4 * i)) & 0xF
            hi = (words[..., w] >> (16 + 4 * i)) & 0xF
            assert torch.equal(lo, codes[..., 8 * w + 2 * i]) and torch.equal(hi, codes[..., 8 * w + 2 * i + 1])
    assert bool((words[..., K // 8:] == -0x77777778).all())  # 0x88888888: eight nibbles 8
    assert torch.equal(sc[..., :K // 32], scale) and bool((sc[..., K // 32:] == 0).all())
    back, back_s = restore_int4(words, sc, K)
    assert torch.equal(back, packed) and torch.equal(back_s, scale)


def _config(monkeypatch, bn: int, bk: int, split: int) -> None:
    from tokenfab.kernels.gpu import moe_gemm
    monkeypatch.setattr(moe_gemm, "INTERPRET_CONFIG", {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split})


@pytest.mark.parametrize("dtype,scale_dtype,bn,bk,split", [
    (torch.float32, torch.bfloat16, 32, 64, 3), (torch.float16, torch.float16, 64, 128, 1),
    (torch.float16, torch.bfloat16, 32, 64, 3), (torch.bfloat16, torch.bfloat16, 64, 64, 1)])
def test_relaid_fused_moe_matches_dequantized_twin(interpret, monkeypatch, dtype, scale_dtype, bn, bk, split):
    """hidden 96, intermediate 160 (K tiles ending mid-group range, partial N tiles), 7 experts, 5 tokens top-3:
    the re-laid stacks give the dequantized twin's sum (float32: to float32 rounding)."""
    from tokenfab.kernels.gpu.moe_relayout import relayout_int4
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.layers.activation import silu_and_mul
    _config(monkeypatch, bn, bk, split)
    H, I, E, T, k = 96, 160, 7, 5, 3
    g = torch.Generator().manual_seed(bn + bk + split)
    p13, s13, w13 = make("int4_group", E, 2 * I, H, g, scale_dtype)
    p2, s2, w2 = make("int4_group", E, H, I, g, scale_dtype)
    x = (torch.randn(T, H, generator=g) * (0.02 if dtype == torch.float16 else 1.0)).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    r13, r2 = relayout_int4(p13, s13), relayout_int4(p2, s2)
    got = fused_moe_packed(x, "int4_group", *r13, *r2, wts, ids, silu_and_mul, relaid=True)
    want = reference(x.float(), w13, w2, wts, ids, 0)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype], err
    with pytest.raises(ValueError):  # the checkpoint layout is not taken for the GPU one
        fused_moe_packed(x, "int4_group", p13, s13, p2, s2, wts, ids, silu_and_mul, relaid=True)


def test_relaid_top16_of_28_float32_result(interpret, monkeypatch):
    """A K3-like routing at tiny size: top-16 of 28 experts (several on one row tile's expert), fp16 activations
    through the 16-bit decode, the k-sum kept in float32."""
    from tokenfab.kernels.gpu.moe_relayout import relayout_int4
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.layers.activation import silu_and_mul
    _config(monkeypatch, 64, 64, 2)
    H, I, E, T, k = 64, 32, 28, 3, 16
    g = torch.Generator().manual_seed(16)
    p13, s13, w13 = make("int4_group", E, 2 * I, H, g, torch.bfloat16)
    p2, s2, w2 = make("int4_group", E, H, I, g, torch.bfloat16)
    x = (torch.randn(T, H, generator=g) * 0.02).to(torch.float16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    got = fused_moe_packed(x, "int4_group", *relayout_int4(p13, s13), *relayout_int4(p2, s2), wts, ids,
                           silu_and_mul, out_dtype=torch.float32, relaid=True)
    assert got.dtype == torch.float32
    want = reference(x.float(), w13, w2, wts, ids, 0)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 5e-3


def test_relaid_decode_configs():
    """Re-laid INT4 decode tiles get their own configs (N tiles of 64 rows for the 64-row MMA), others not."""
    from tokenfab.kernels.gpu import moe_gemm as mg
    got = mg._prune(mg.CONFIGS, {"split_max": 4}, BLOCK_M=16, FMT=mg.INT4_GROUP, RELAID=True)
    assert got and all(any(c is p for p in mg.RELAID_DECODE_CONFIGS) and c.kwargs["BLOCK_N"] == 64 for c in got)
    plain = mg._prune(mg.CONFIGS, {"split_max": 4}, BLOCK_M=16, FMT=mg.INT4_GROUP, RELAID=False)
    assert all(any(c is p for p in mg.DECODE_CONFIGS) for c in plain)
    pre = mg._prune(mg.CONFIGS, {"split_max": 1}, BLOCK_M=64, FMT=mg.INT4_GROUP, RELAID=True)
    assert all(any(c is p for p in mg.PREFILL_CONFIGS) for c in pre)


def test_prepare_relays_on_the_gpu_path_only(monkeypatch):
    """Int4GroupExperts.prepare re-lays the stack on the GPU code path (here the interpreter's interpret-gpu-path)
    and dequantizes the same rows after it; on the CPU path the checkpoint layout stays, bit for bit."""
    from tokenfab.quant.int4_group import Int4GroupExperts
    g = torch.Generator().manual_seed(4)
    stack = Int4GroupExperts(3, 10, 96)
    stack.packed.copy_(torch.randint(-2 ** 31, 2 ** 31, stack.packed.shape, dtype=torch.int32, generator=g))
    stack.scale.copy_(torch.randn(stack.scale.shape, generator=g).to(stack.scale.dtype))
    before = [stack.dequantize_expert(e) for e in range(3)]
    packed0 = stack.packed.clone()
    monkeypatch.setenv("TOKENFAB_CPU_KERNELS", "0")
    stack.prepare()  # CPU path
    assert not stack.gpu_layout and torch.equal(stack.packed, packed0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    stack.prepare()
    stack.prepare()  # once only
    assert stack.gpu_layout and stack.packed.shape == (3, 10, 64) and stack.scale.shape == (3, 10, 16)
    assert all(torch.equal(stack.dequantize_expert(e), before[e]) for e in range(3))
    rows = stack.reference_grouped_linear(torch.randn(4, 96, generator=g), [2, 0], [3, 1])
    assert rows.shape == (4, 10)


def test_int4_model_on_the_gpu_path_matches_twin(monkeypatch, tiny_model, tmp_path):
    """A tiny DeepSeek-V3 INT4 checkpoint through the GPU code path in the interpreter (stacks re-laid at load)
    greedily decodes the tokens of its float32 twin on the CPU path, prompt logprobs within 1e-4."""
    from tokenfab import LLM, SamplingParams
    from tokenfab.testing.packed_experts_checkpoint import write_packed_experts_checkpoint
    src = tiny_model("deepseek_v3", num_hidden_layers=2)
    packed = write_packed_experts_checkpoint(src, str(tmp_path / "int4"), "int4", str(tmp_path / "twin"))
    prompts = [[5, 17, 99, 230, 41, 8, 77, 301, 12], [400, 3, 66]]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=0)
    monkeypatch.setenv("TOKENFAB_CPU_KERNELS", "0")
    twin = LLM(str(tmp_path / "twin"), dtype="float32", device="cpu", progress=False).generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", "torch")
    llm = LLM(packed, dtype="float32", device="cpu", progress=False)
    experts = [l.mlp.experts for l in llm.llm_engine.runner.model.model.layers if hasattr(l.mlp, "experts")]
    assert experts and all(e.q13.gpu_layout and e.q2.gpu_layout for e in experts)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for a, b in zip(got, twin):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            (ta, la), = pa.items()
            (tb, lb), = pb.items()
            assert ta == tb and abs(la.logprob - lb.logprob) < 1e-4
