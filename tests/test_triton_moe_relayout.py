"""The GPU layouts of INT4 group-32, MXFP4 and FP8 block-scaled expert stacks (kernels/gpu/moe_relayout.py) and the
grouped GEMM over them (kernels/gpu/moe_gemm.py, ``relaid``) in Triton's interpreter on CPU.

The layouts are checked bit by bit against their definitions written out here (INT4: input 8w + 2i of a row in bits
4i..4i+3 of word w, 8w + 2i + 1 in bits 16 + 4i..; MXFP4: the rotations of the module docstring give each pair's
bf16 bit patterns, compared with the E2M1 values; K padded to a multiple of 512 with zeros) and their inverses
against the checkpoint layouts; the fused MoE over re-laid stacks is compared with the routed-expert sum in float64
from weights dequantized by the formats' formulas (tests/test_triton_packed_moe.py's make / reference) over odd
shapes: K not a multiple of the K tile (hidden 96, intermediate 160), expert counts that are not powers of two, a
top-16 of 28 routing, split-K 1 / 3, float32 (exact to float32 rounding), fp16 (the 16-bit decodes and the swapped
MMA, as on a GPU) and bf16 (the interpreter's float32 path on the same values; moe_gemm.grouped_gemm). The bf16
decodes themselves (bf16 bit casts) run on GPUs only; their integer steps are the fp16 decodes'."""
from __future__ import annotations

import pytest
import torch

from test_fp8_block_weight import fp8_pair  # noqa: F401  (a fixture used below)
from test_triton_packed_moe import make, make_fp8, reference
from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def _checkpoint_codes(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint words [..., W] -> nibbles [..., 8 W] in K order (bits 4 (k % 8) of word k / 8)."""
    return torch.stack([(packed >> (4 * t)) & 0xF for t in range(8)], -1).flatten(-2)


def test_layout_bits_padding_and_inverse(monkeypatch):
    """Every nibble of the GPU layout sits where the layout says, the padding decodes to 0 (nibble 8, scale 0),
    restore_int4 gives back the checkpoint tensors exactly, and one expert per pass (in place or not) gives the
    same words as all at once."""
    from tokenfab.kernels.gpu import moe_relayout
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
    monkeypatch.setattr(moe_relayout, "_CHUNK_WEIGHTS", 1)
    assert torch.equal(relayout_int4(packed, scale)[0], words)
    wide = torch.randint(-2 ** 31, 2 ** 31, (E, N, 64), dtype=torch.int32, generator=g)  # K = 512: in place
    want = relayout_int4(wide, torch.zeros(E, N, 16))[0]
    got, _ = relayout_int4(wide, torch.zeros(E, N, 16), in_place=True)
    assert got is wide and torch.equal(got, want)


def _rotr(w: torch.Tensor, r: int) -> torch.Tensor:
    u = w.to(torch.int64) & 0xFFFFFFFF
    return ((u >> r) | (u << (32 - r))) & 0xFFFFFFFF


def test_mxfp4_layout_gives_bf16_pairs_and_inverse():
    """Each pair of re-laid MXFP4 inputs comes out of the documented rotations and masks as the bf16 bits of its
    E2M1 value times 2^-126 (sign bit 15, magnitude bits 6..8 of each half), the padding as +0, scales padded with
    127; restore_mxfp4 gives the checkpoint bytes back; plain_e8m0 spots 0 and 255."""
    from tokenfab.kernels.gpu.moe_relayout import plain_e8m0, relayout_mxfp4, restore_mxfp4
    from tokenfab.layers.mxfp4 import E2M1_VALUES
    g = torch.Generator().manual_seed(1)
    E, N, K = 2, 6, 96
    packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(1, 255, (E, N, K // 32), dtype=torch.uint8, generator=g)
    words, sc = relayout_mxfp4(packed, scale)
    assert words.dtype == torch.int32 and words.shape == (E, N, 64) and sc.shape == (E, N, 16)
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2).long()  # [E, N, K] in K order
    codes = torch.cat([codes, torch.zeros(E, N, 512 - K, dtype=torch.long)], -1)
    bf16_of = torch.tensor(E2M1_VALUES, dtype=torch.float32).mul(2.0 ** -126).to(torch.bfloat16).view(torch.int16)
    want = bf16_of.long() & 0xFFFF  # bf16 bits of each code's value times 2^-126
    M = 0x81C081C0
    for w in (0, 5, 11, 63):
        pairs = [_rotr(words[..., w], 0) & M, _rotr(words[..., w], 4) & M, _rotr(words[..., w], 10) & M,
                 (_rotr(words[..., w], 14) & 0x00400040) | (_rotr(words[..., w], 6) & 0x81808180)]
        for i, v in enumerate(pairs):
            assert torch.equal(v & 0xFFFF, want[codes[..., 8 * w + 2 * i]])
            assert torch.equal(v >> 16, want[codes[..., 8 * w + 2 * i + 1]])
    assert torch.equal(sc[..., :3], scale) and bool((sc[..., 3:] == 127).all())
    back, back_s = restore_mxfp4(words, sc, K)
    assert torch.equal(back, packed) and torch.equal(back_s, scale)
    assert plain_e8m0(scale) and not plain_e8m0(torch.tensor([3, 0])) and not plain_e8m0(torch.tensor([255]))


def _config(monkeypatch, bn: int, bk: int, split: int) -> None:
    from tokenfab.kernels.gpu import moe_gemm
    monkeypatch.setattr(moe_gemm, "INTERPRET_CONFIG", {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split})


def _relayout(fmt: str, packed: torch.Tensor, scale: torch.Tensor):
    from tokenfab.kernels.gpu.moe_relayout import relayout_int4, relayout_mxfp4
    return relayout_int4(packed, scale) if fmt == "int4_group" else relayout_mxfp4(packed, scale)


@pytest.mark.parametrize("fmt,dtype,scale_dtype,bn,bk,split", [
    ("int4_group", torch.float32, torch.bfloat16, 32, 64, 3), ("int4_group", torch.float16, torch.float16, 64, 128, 1),
    ("int4_group", torch.float16, torch.bfloat16, 32, 64, 3), ("int4_group", torch.bfloat16, torch.bfloat16, 64, 64, 1),
    ("mxfp4", torch.float32, torch.uint8, 64, 64, 3), ("mxfp4", torch.float16, torch.uint8, 32, 128, 1),
    ("mxfp4", torch.float16, torch.uint8, 64, 64, 3), ("mxfp4", torch.bfloat16, torch.uint8, 32, 64, 1)])
def test_relaid_fused_moe_matches_dequantized_twin(interpret, monkeypatch, fmt, dtype, scale_dtype, bn, bk, split):
    """hidden 96, intermediate 160 (K tiles ending mid-group range, partial N tiles), 7 experts, 5 tokens top-3:
    the re-laid stacks give the dequantized twin's sum (float32: to float32 rounding); gate|up re-laid with the
    down projection in the checkpoint layout works too."""
    from tokenfab.kernels.gpu import moe_gemm
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.layers.activation import silu_and_mul
    _config(monkeypatch, bn, bk, split)
    monkeypatch.setattr(moe_gemm, "_RELAID_SWAP", [True])  # a failed 16-bit launch would turn it off: checked below
    H, I, E, T, k = 96, 160, 7, 5, 3
    g = torch.Generator().manual_seed(bn + bk + split)
    p13, s13, w13 = make(fmt, E, 2 * I, H, g, scale_dtype)
    p2, s2, w2 = make(fmt, E, H, I, g, scale_dtype)
    x = (torch.randn(T, H, generator=g) * (0.02 if dtype == torch.float16 else 1.0)).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    r13, r2 = _relayout(fmt, p13, s13), _relayout(fmt, p2, s2)
    want = reference(x.float(), w13, w2, wts, ids, 0)
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    for stacks, relaid in (((*r13, *r2), True), ((*r13, p2, s2), (True, False))):
        got = fused_moe_packed(x, fmt, *stacks, wts, ids, silu_and_mul, relaid=relaid)
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < tol, (relaid, err)
    assert moe_gemm._RELAID_SWAP == [True]  # fp16: the 16-bit decodes and the swapped MMA ran, no fallback
    with pytest.raises(ValueError):  # the checkpoint layout is not taken for the GPU one
        fused_moe_packed(x, fmt, p13, s13, p2, s2, wts, ids, silu_and_mul, relaid=True)


@pytest.mark.parametrize("fmt,scale_dtype", [("int4_group", torch.bfloat16), ("mxfp4", torch.uint8)])
def test_relaid_top16_of_28_float32_result(interpret, monkeypatch, fmt, scale_dtype):
    """A K3-like routing at tiny size: top-16 of 28 experts (several on one row tile's expert), fp16 activations
    through the 16-bit decodes, the k-sum kept in float32."""
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.layers.activation import silu_and_mul
    _config(monkeypatch, 64, 64, 2)
    H, I, E, T, k = 64, 32, 28, 3, 16
    g = torch.Generator().manual_seed(16)
    p13, s13, w13 = make(fmt, E, 2 * I, H, g, scale_dtype)
    p2, s2, w2 = make(fmt, E, H, I, g, scale_dtype)
    x = (torch.randn(T, H, generator=g) * 0.02).to(torch.float16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    got = fused_moe_packed(x, fmt, *_relayout(fmt, p13, s13), *_relayout(fmt, p2, s2), wts, ids,
                           silu_and_mul, out_dtype=torch.float32, relaid=True)
    assert got.dtype == torch.float32
    want = reference(x.float(), w13, w2, wts, ids, 0)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 5e-3


def test_relaid_swap_falls_back(interpret, monkeypatch):
    """A re-laid launch whose swapped 16-bit path does not compile (simulated) runs again with the float32 decode
    of the same layout, and later calls skip the swapped path; the same sum."""
    from tokenfab.kernels.gpu import moe_gemm
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.layers.activation import silu_and_mul
    _config(monkeypatch, 32, 64, 1)
    H, I, E, T, k = 64, 32, 5, 3, 2
    g = torch.Generator().manual_seed(9)
    p13, s13, w13 = make("int4_group", E, 2 * I, H, g, torch.bfloat16)
    p2, s2, w2 = make("int4_group", E, H, I, g, torch.bfloat16)
    x = (torch.randn(T, H, generator=g) * 0.02).to(torch.float16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    real = moe_gemm._grouped_gemm
    seen = []

    class NoSwap:
        def __getitem__(self, grid):
            def run(*args, **kw):
                seen.append(kw["RELAID_SWAP"])
                if kw["RELAID_SWAP"]:
                    raise RuntimeError("the swapped dot does not compile here")
                return real[grid](*args, **kw)
            return run

    monkeypatch.setattr(moe_gemm, "_grouped_gemm", NoSwap())
    monkeypatch.setattr(moe_gemm, "_RELAID_SWAP", [True])
    got = fused_moe_packed(x, "int4_group", *_relayout("int4_group", p13, s13), *_relayout("int4_group", p2, s2),
                           wts, ids, silu_and_mul, relaid=True)
    want = reference(x.float(), w13, w2, wts, ids, 0)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 5e-3
    assert seen == [True, False, False] and moe_gemm._RELAID_SWAP == [False]


def test_relaid_decode_configs():
    """Re-laid decode tiles get their own configs (N tiles of 64 rows for the 64-row MMA; K tiles to 512 without
    split-K), others not; checkpoint-layout FP8 keeps K tiles within one 128-block."""
    from tokenfab.kernels.gpu import moe_gemm as mg
    for fmt in (mg.INT4_GROUP, mg.MXFP4, mg.FP8_BLOCK):
        got = mg._prune(mg.CONFIGS, {"split_max": 4}, BLOCK_M=16, FMT=fmt, RELAID=True)
        assert got and all(any(c is p for p in mg.RELAID_DECODE_CONFIGS) and c.kwargs["BLOCK_N"] == 64 for c in got)
        wide = mg._prune(mg.CONFIGS, {"split_max": 1}, BLOCK_M=16, FMT=fmt, RELAID=True)
        assert max(c.kwargs["BLOCK_K"] for c in wide) == 512  # FP8 re-laid: 128-input sub-tiles
    fp8 = mg._prune(mg.CONFIGS, {"split_max": 1}, BLOCK_M=16, FMT=mg.FP8_BLOCK, RELAID=False)
    assert fp8 and all(c.kwargs["BLOCK_K"] <= 128 for c in fp8)  # the checkpoint layout: one 128-block a tile
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


def test_mxfp4_prepare_relays_unless_special_scales(monkeypatch):
    """Mxfp4Experts.prepare re-lays (in place: K = 512) on the GPU code path with the same dequantized rows after
    it, and keeps the checkpoint layout when a scale is E8M0 0 (2^-127)."""
    from tokenfab.quant.mxfp4_experts import Mxfp4Experts
    monkeypatch.setenv("TOKENFAB_CPU_KERNELS", "0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    g = torch.Generator().manual_seed(5)
    stacks = []
    for special in (False, True):
        stack = Mxfp4Experts(2, 6, 512)
        stack.packed.copy_(torch.randint(0, 256, stack.packed.shape, dtype=torch.uint8, generator=g))
        stack.scale.copy_(torch.randint(100, 150, stack.scale.shape, dtype=torch.uint8, generator=g))
        stack.scale[1, 2, 3] = 0 if special else 120
        before = [stack.dequantize_expert(e) for e in range(2)]
        ptr = stack.packed.data_ptr()
        stack.prepare()
        assert stack.gpu_layout != special
        assert all(torch.equal(stack.dequantize_expert(e), before[e]) for e in range(2))
        stacks.append((stack, ptr))
    relaid, ptr = stacks[0]
    assert relaid.packed.dtype == torch.int32 and relaid.packed.shape == (2, 6, 64) and relaid.packed.data_ptr() == ptr


def test_int4_model_on_the_gpu_path_matches_twin(monkeypatch, tiny_model, tmp_path):
    """A tiny DeepSeek-V3 INT4 checkpoint through the GPU code path in the interpreter (stacks re-laid at load)
    greedily decodes the tokens of its float32 twin on the CPU path, prompt logprobs within 1e-4."""
    from tokenfab.testing.packed_experts_checkpoint import write_packed_experts_checkpoint
    src = tiny_model("deepseek_v3", num_hidden_layers=2)
    packed = write_packed_experts_checkpoint(src, str(tmp_path / "int4"), "int4", str(tmp_path / "twin"))
    gpu_path_matches_twin(monkeypatch, packed, str(tmp_path / "twin"))


def gpu_path_matches_twin(monkeypatch, packed: str, twin_dir: str, **kw) -> None:
    """The packed checkpoint through the GPU code path in the interpreter (every expert stack re-laid at load)
    greedily decodes its float32 twin's tokens on the CPU path, prompt logprobs within 1e-4."""
    from tokenfab import LLM, SamplingParams
    prompts = [[5, 17, 99, 230, 41, 8, 77, 301, 12], [400, 3, 66]]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=0)
    monkeypatch.setenv("TOKENFAB_CPU_KERNELS", "0")
    twin = LLM(twin_dir, dtype="float32", device="cpu", progress=False, **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", "torch")
    llm = LLM(packed, dtype="float32", device="cpu", progress=False, **kw)
    experts = [l.mlp.experts for l in llm.llm_engine.runner.model.model.layers if hasattr(l.mlp, "experts")]
    assert experts and all(e.q13.gpu_layout and e.q2.gpu_layout for e in experts)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for a, b in zip(got, twin):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            (ta, la), = pa.items()
            (tb, lb), = pb.items()
            assert ta == tb and abs(la.logprob - lb.logprob) < 1e-4


# ---- FP8 block-scaled -------------------------------------------------------------------------------------------
FP8_CODES = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # all but NaN


def test_fp8_layout_bytes_padding_and_inverse():
    """Each e4m3 byte of the GPU layout sits where the layout says (word w: inputs 4w, 4w + 2, 4w + 1, 4w + 3 in
    bytes 0..3), K pads with byte 0 and scale columns with 0, restore_fp8 gives the checkpoint tensors back exactly,
    and K = 512 re-lays in place."""
    from tokenfab.kernels.gpu.moe_relayout import relayout_fp8, restore_fp8
    g = torch.Generator().manual_seed(6)
    E, N, K = 3, 5, 160
    packed = FP8_CODES[torch.randint(len(FP8_CODES), (E, N, K), generator=g)]
    scale = torch.rand(E, 1, 2, generator=g)
    words, sc = relayout_fp8(packed, scale)
    assert words.dtype == torch.int32 and words.shape == (E, N, 128) and sc.shape == (E, 1, 4)
    u = words.to(torch.int64) & 0xFFFFFFFF
    for w in (0, 1, K // 4 - 1):
        got = [(u[..., w] >> (8 * j)) & 0xFF for j in range(4)]
        for j, t in enumerate((0, 2, 1, 3)):
            assert torch.equal(got[j], packed[..., 4 * w + t].to(torch.int64))
    assert bool((words[..., K // 4:] == 0).all()) and bool((sc[..., 2:] == 0).all())
    assert torch.equal(sc[..., :2], scale)
    back, back_s = restore_fp8(words, sc, K)
    assert torch.equal(back, packed) and torch.equal(back_s, scale)
    wide = FP8_CODES[torch.randint(len(FP8_CODES), (2, 3, 512), generator=g)]
    want = relayout_fp8(wide.clone(), torch.ones(2, 1, 4))[0]
    ptr = wide.data_ptr()
    got, _ = relayout_fp8(wide, torch.ones(2, 1, 4), in_place=True)
    assert got.data_ptr() == ptr and torch.equal(got, want)


@pytest.mark.parametrize("dt,mult", [(torch.bfloat16, 2.0 ** 120), (torch.float16, 2.0 ** 8)])
def test_fp8_layout_gives_16_bit_pairs(dt, mult):
    """The decode's integer steps (kernels/gpu/moe_relaid_decode.fp8_relaid16, written out here in PyTorch) on
    words of every non-NaN e4m3 code give, per 16-bit half, the value times 2^-120 (bf16) / 2^-8 (fp16) exactly:
    pair (4w, 4w + 1) from bytes 0 and 2, pair (4w + 2, 4w + 3) from bytes 1 and 3."""
    from tokenfab.kernels.gpu.moe_relayout import relayout_fp8
    n = len(FP8_CODES)
    packed = torch.stack([FP8_CODES, FP8_CODES.roll(1), FP8_CODES.roll(2), FP8_CODES.roll(3)], -1).view(1, 1, 4 * n)
    words = relayout_fp8(torch.cat([packed, torch.zeros(1, 1, 512 - 4 * n % 512, dtype=torch.uint8)], -1),
                         torch.ones(1, 1, 4 * (-(-4 * n // 512))))[0][0, 0, :n].to(torch.int64)
    if dt == torch.bfloat16:
        lo = ((words << 8) & 0x80008000) | ((words << 4) & 0x07F007F0)
        hi = (words & 0x80008000) | ((words >> 4) & 0x07F007F0)
    else:
        lo = ((words << 8) & 0x80008000) | ((words << 7) & 0x3F803F80)
        hi = (words & 0x80008000) | ((words >> 1) & 0x3F803F80)

    def halves(v):
        return [((v >> s) & 0xFFFF).to(torch.int32).to(torch.int16).view(dt).double() * mult for s in (0, 16)]

    got = torch.stack(halves(lo) + halves(hi), -1)  # inputs 4w, 4w + 1, 4w + 2, 4w + 3
    want = packed.view(n, 4).view(torch.float8_e4m3fn).double()
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype,bn,bk,split", [(torch.float32, 32, 64, 3), (torch.float16, 64, 128, 1),
                                               (torch.float16, 32, 64, 3), (torch.bfloat16, 64, 64, 1),
                                               (torch.float16, 64, 512, 1), (torch.float32, 32, 256, 1)])
def test_fp8_relaid_fused_moe_matches_float64(interpret, monkeypatch, dtype, bn, bk, split):
    """FP8 block-scaled stacks re-laid (hidden 160, intermediate 136: partial 128-blocks in both parts and both dims, K
    padded to 512), 7 experts, 5 tokens top-3, K tiles of 64 to 512 (past 128: a block scale per 128): the float64
    routed sum by the published formula (float32 to 1e-5; fp16 through the 16-bit decode and the swapped MMA as on a
    GPU); gate|up re-laid beside the down projection in the checkpoint layout too; the checkpoint layout is refused
    where the GPU one is declared."""
    from tokenfab.kernels.gpu import moe_gemm
    from tokenfab.kernels.gpu.moe_relayout import relayout_fp8
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.layers.activation import silu_and_mul
    _config(monkeypatch, bn, bk, split)
    monkeypatch.setattr(moe_gemm, "_RELAID_SWAP", [True])  # a failed 16-bit launch would turn it off: checked below
    H, I, E, T, k = 160, 136, 7, 5, 3
    g = torch.Generator().manual_seed(bn + bk + split + 1)
    p13, s13, w13 = make_fp8(E, 2, I, H, g)
    p2, s2, w2 = make_fp8(E, 1, H, I, g)
    x = (torch.randn(T, H, generator=g) * (0.5 if dtype == torch.float16 else 1.0)).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    r13, r2 = relayout_fp8(p13, s13), relayout_fp8(p2, s2)
    want = reference(x.float(), w13, w2, wts, ids, 0)
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    for stacks, relaid in (((*r13, *r2), True), ((*r13, p2, s2), (True, False))):
        got = fused_moe_packed(x, "fp8_block", *stacks, wts, ids, silu_and_mul, relaid=relaid)
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < tol, (relaid, err)
    assert moe_gemm._RELAID_SWAP == [True]  # fp16: the 16-bit decode and the swapped MMA ran, no fallback
    with pytest.raises(ValueError):
        fused_moe_packed(x, "fp8_block", p13, s13, p2, s2, wts, ids, silu_and_mul, relaid=True)


def test_fp8_prepare_relays_on_the_gpu_path_only(monkeypatch):
    """Fp8BlockExperts.prepare keeps the checkpoint bytes on the CPU path and re-lays them on the GPU code path
    (in place: in_features 512), with the same dequantized rows after it."""
    from tokenfab.quant.fp8_block_experts import Fp8BlockExperts
    g = torch.Generator().manual_seed(7)
    stack = Fp8BlockExperts.for_parts(2, [136, 136], 512)
    stack.packed.copy_(FP8_CODES[torch.randint(len(FP8_CODES), stack.packed.shape, generator=g)])
    stack.scale.copy_(torch.rand(stack.scale.shape, generator=g))
    before = [stack.dequantize_expert(e) for e in range(2)]
    packed0, ptr = stack.packed.clone(), stack.packed.data_ptr()
    monkeypatch.setenv("TOKENFAB_CPU_KERNELS", "0")
    stack.prepare()
    assert not stack.gpu_layout and torch.equal(stack.packed, packed0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    stack.prepare()
    stack.prepare()  # once only
    assert stack.gpu_layout and stack.packed.dtype == torch.int32 and stack.packed.shape == (2, 272, 128)
    assert stack.packed.data_ptr() == ptr
    assert all(torch.equal(stack.dequantize_expert(e), before[e]) for e in range(2))


def test_fp8_model_on_the_gpu_path_matches_twin(monkeypatch, fp8_pair):
    """The tiny FP8 block-scaled DeepSeek-V3 (partial 128-blocks) through the GPU code path in the interpreter, its
    expert stacks re-laid at load: greedy tokens of the dequantized float32 twin on the CPU path, prompt logprobs
    within 1e-4."""
    gpu_path_matches_twin(monkeypatch, *fp8_pair, max_model_len=128)
