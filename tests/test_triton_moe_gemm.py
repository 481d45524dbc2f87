"""The fused-MoE grouped GEMM (kernels/gpu/moe_gemm.py) through ``fused_moe_packed`` / ``fused_moe`` in Triton's
interpreter on CPU, against the routed-expert sum computed in float64 from weights dequantized here by the formats'
formulas (tests/test_triton_packed_moe.py's make / make_fp8: INT4 (nibble - 8) * scale, MXFP4 E2M1 * 2^(e8m0 - 127),
FP8 e4m3 * block scale), over odd shapes: expert counts that are not powers of two, several row tiles per expert
(more pairs than BLOCK_M on one expert), partial N and K tiles, SPLIT_K 1 / 2 / 3 (the down projection's partials
summed by moe_sum), float32, bf16 and fp16 activations, and a K3-style top-16 of 24 experts with a float32 result.
fp16 runs take the 16-bit decodes and dot as on a GPU; bf16 runs take the float32 path on the same values here
(the interpreter mishandles bf16 bit casts and dots; moe_gemm.grouped_gemm)."""
from __future__ import annotations

import pytest
import torch

from test_triton_packed_moe import make, make_fp8, reference
from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def _config(monkeypatch, bn: int, bk: int, split: int) -> None:
    from tokenfab.kernels.gpu import moe_gemm
    monkeypatch.setattr(moe_gemm, "INTERPRET_CONFIG", {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split})


def _routing(T: int, E: int, k: int, g: torch.Generator, skew: bool = False):
    if skew:  # most pairs on experts 0 and 1: more than one 16-row tile each
        ids = torch.stack([torch.tensor([t % 2] + list(torch.randperm(E - 2, generator=g)[:k - 1] + 2))
                           for t in range(T)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return ids, torch.rand(T, k, generator=g)


def _check(got, want, dtype):
    assert got.shape == want.shape
    err = ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    # 16-bit runs round h13 and h to their dtype (the interpreter truncates bf16)
    assert err < {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype], err


@pytest.mark.parametrize("fmt,scale_dtype,dtype,bn,bk,split", [
    ("int4_group", torch.bfloat16, torch.float32, 32, 64, 1), ("int4_group", torch.bfloat16, torch.bfloat16, 64, 64, 2),
    ("int4_group", torch.float16, torch.float32, 32, 32, 3), ("mxfp4", torch.uint8, torch.float32, 64, 64, 2),
    ("mxfp4", torch.uint8, torch.bfloat16, 32, 32, 3), ("mxfp4", torch.uint8, torch.float32, 64, 128, 1),
    ("int4_group", torch.bfloat16, torch.float16, 32, 64, 2), ("mxfp4", torch.uint8, torch.float16, 64, 64, 1)])
def test_packed4_tiles_and_splits(interpret, monkeypatch, fmt, scale_dtype, dtype, bn, bk, split):
    """INT4 / MXFP4 with hidden 96 and intermediate 96 (partial N tiles of 64, partial K tiles of 64 / 128, the
    down projection's K in 2 or 3 ranges, one ending mid-tile), 5 experts, 6 tokens top-3 (experts hit several
    times)."""
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.layers.activation import silu_and_mul
    _config(monkeypatch, bn, bk, split)
    H, I, E, T, k = 96, 96, 5, 6, 3
    g = torch.Generator().manual_seed(bn + bk + split)
    p13, s13, w13 = make(fmt, E, 2 * I, H, g, scale_dtype)
    p2, s2, w2 = make(fmt, E, H, I, g, scale_dtype)
    x = (torch.randn(T, H, generator=g) * (0.02 if dtype == torch.float16 else 1.0)).to(dtype)  # fp16: in range
    ids, wts = _routing(T, E, k, g)
    got = fused_moe_packed(x, fmt, p13, s13, p2, s2, wts, ids, silu_and_mul)
    assert got.dtype == dtype
    _check(got, reference(x.float(), w13, w2, wts, ids, 0), dtype)


@pytest.mark.parametrize("dtype,bn,bk,split", [(torch.float32, 32, 64, 1), (torch.bfloat16, 64, 128, 3),
                                               (torch.float16, 32, 128, 2)])
def test_fp8_tiles_and_splits(interpret, monkeypatch, dtype, bn, bk, split):
    """FP8 block-scaled with hidden 160 and intermediate 136 (partial 128-blocks in both dims and in both parts
    of gate|up), 3 experts, 4 tokens top-2, experts 1..3 here and 0 on another rank."""
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.layers.activation import silu_and_mul
    _config(monkeypatch, bn, bk, split)
    H, I, num_local, start, T, k = 160, 136, 3, 1, 4, 2
    g = torch.Generator().manual_seed(bk + split)
    p13, s13, w13 = make_fp8(num_local, 2, I, H, g)
    p2, s2, w2 = make_fp8(num_local, 1, H, I, g)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, wts = _routing(T, num_local + start, k, g)
    got = fused_moe_packed(x, "fp8_block", p13, s13, p2, s2, wts, ids, silu_and_mul, start)
    _check(got, reference(x.float(), w13, w2, wts, ids, start), dtype)


def test_many_rows_per_expert_and_dense(interpret, monkeypatch):
    """40 tokens top-2 over 7 experts with every token on expert 0 or 1 (20 pairs each: two 16-row tiles), split
    2: MXFP4 and the plain-weight kernel (fused_moe) on the same float64-dequantized weights."""
    from tokenfab.kernels.gpu.moe import fused_moe
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.layers.activation import silu_and_mul
    _config(monkeypatch, 32, 64, 2)
    H, I, E, T, k = 64, 96, 7, 40, 2
    g = torch.Generator().manual_seed(3)
    p13, s13, w13 = make("mxfp4", E, 2 * I, H, g, torch.uint8)
    p2, s2, w2 = make("mxfp4", E, H, I, g, torch.uint8)
    x = torch.randn(T, H, generator=g)
    ids, wts = _routing(T, E, k, g, skew=True)
    assert max(int((ids == e).sum()) for e in range(E)) > 16
    want = reference(x, w13, w2, wts, ids, 0)
    _check(fused_moe_packed(x, "mxfp4", p13, s13, p2, s2, wts, ids, silu_and_mul), want, torch.float32)
    _check(fused_moe(x, w13.float(), w2.float(), wts, ids, silu_and_mul), want, torch.float32)


@pytest.mark.parametrize("split", [1, 2])
def test_k3_top16_of_24_float32_result(interpret, monkeypatch, split):
    """K3's latent MoE form: MXFP4 experts, top-16 of 24 experts, bf16 activations, the k-sum kept in float32."""
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.layers.activation import silu_and_mul
    _config(monkeypatch, 32, 64, split)
    H, I, E, T, k = 64, 32, 24, 3, 16
    g = torch.Generator().manual_seed(16 + split)
    p13, s13, w13 = make("mxfp4", E, 2 * I, H, g, torch.uint8)
    p2, s2, w2 = make("mxfp4", E, H, I, g, torch.uint8)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, wts = _routing(T, E, k, g)
    got = fused_moe_packed(x, "mxfp4", p13, s13, p2, s2, wts, ids, silu_and_mul, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    _check(got, reference(x.float(), w13, w2, wts, ids, 0), torch.bfloat16)


def test_moe_sum_reads_only_the_used_splits(interpret):
    """moe_sum over [S, pairs, hidden] partials sums the first ``nsplit`` slices (a device int) per slot in order;
    the slices past it (NaN here) are never read."""
    from tokenfab.kernels.gpu.moe import moe_sum
    g = torch.Generator().manual_seed(1)
    T, k, hidden = 3, 2, 40
    ids = torch.randint(0, 4, (T, k), generator=g)
    parts = torch.randn(3, T * k, hidden, generator=g)
    parts[2] = float("nan")
    got = moe_sum(parts, ids, 0, 4, torch.float32, torch.tensor([2], dtype=torch.int32))
    want = (parts[0] + parts[1]).view(T, k, hidden).sum(1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_config_pruning_and_slices(monkeypatch):
    """Decode tiles get the decode configs (split-K only where the output has the slices), prefill tiles the wide
    ones, FP8 no K tile past its 128-blocks; the partial slices follow the same rule."""
    from tokenfab.kernels.gpu import moe_gemm as mg
    dec = mg._prune(mg.CONFIGS, {"split_max": 1}, BLOCK_M=16, FMT=mg.INT4_GROUP)
    assert dec and all(c.kwargs["SPLIT_K"] == 1 and c in mg.DECODE_CONFIGS for c in dec)
    dec4 = mg._prune(mg.CONFIGS, {"split_max": 4}, BLOCK_M=16, FMT=mg.MXFP4)
    assert {c.kwargs["SPLIT_K"] for c in dec4} == {1, 2, 4} and all(c.kwargs["BLOCK_K"] <= 128 for c in dec4)
    assert any(c.kwargs["BLOCK_K"] == 256 for c in dec)
    pre = mg._prune(mg.CONFIGS, {"split_max": 4}, BLOCK_M=64, FMT=mg.DENSE)
    assert pre and all(c in mg.PREFILL_CONFIGS for c in pre)
    assert all(c.kwargs["BLOCK_K"] <= 128 for c in mg._prune(mg.CONFIGS, {"split_max": 4}, BLOCK_M=16,
                                                             FMT=mg.FP8_BLOCK))
    assert mg.block_m_for(8, 64) == 16 and mg.block_m_for(64 * 17, 64) == 64
    monkeypatch.setenv("TOKENFAB_TRITON", "1")  # as on a GPU: the configs decide, not INTERPRET_CONFIG
    assert mg.split_slots(8, 16, down=True) == 4 and mg.split_slots(8, 16, down=False) == 1
    assert mg.split_slots(mg.SPLIT_MAX_PAIRS + 1, 16, down=True) == 1 and mg.split_slots(8, 64, down=True) == 1


def test_mxfp4_without_dot_scaled(interpret, monkeypatch):
    """MXFP4 with fp16 activations through the own E2M1 decode instead of tl.dot_scaled: a launch that fails with
    dot_scaled (a Triton that cannot compile it) is run again without, and later calls skip it; same sum."""
    from tokenfab.kernels.gpu import moe_gemm
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.layers.activation import silu_and_mul
    H, I, E, T, k = 64, 64, 5, 3, 2
    g = torch.Generator().manual_seed(9)
    p13, s13, w13 = make("mxfp4", E, 2 * I, H, g, torch.uint8)
    p2, s2, w2 = make("mxfp4", E, H, I, g, torch.uint8)
    x = (torch.randn(T, H, generator=g) * 0.02).to(torch.float16)
    ids, wts = _routing(T, E, k, g)
    want = reference(x.float(), w13, w2, wts, ids, 0)
    real = moe_gemm._grouped_gemm
    seen = []

    class NoDotScaled:
        def __getitem__(self, grid):
            def run(*args, **kw):
                seen.append(kw["MX_SCALED"])
                if kw["MX_SCALED"] and kw["FMT"] == moe_gemm.MXFP4:
                    raise RuntimeError("dot_scaled does not compile here")
                return real[grid](*args, **kw)
            return run

    monkeypatch.setattr(moe_gemm, "_grouped_gemm", NoDotScaled())
    monkeypatch.setattr(moe_gemm, "_MX_SCALED", [True])
    _check(fused_moe_packed(x, "mxfp4", p13, s13, p2, s2, wts, ids, silu_and_mul), want, torch.float16)
    assert seen == [True, False, False] and moe_gemm._MX_SCALED == [False]


def test_untuned_config_fills_the_sms():
    """Without tuning, a decode call takes the first of the tuner's configs whose grid gives every SM two programs,
    else the one with the most (worked by hand for Qwen3-30B-A3B at batch 1, top-8, on 132 SMs: the down
    projection's N = 2048 in tiles of 64 is 8 x 32 = 256 programs < 264, split in 2 it is 512; gate|up's 1536 in
    tiles of 64 is 192, of 32 384); batches that already fill the SMs keep the first config; re-laid stacks (N tiles
    of 64 only) take split-K where the output has the slices, else their first config."""
    from tokenfab.kernels.gpu import moe_gemm as mg
    first = mg._prune(mg.CONFIGS, {"split_max": 4}, FMT=mg.DENSE, BLOCK_M=16, RELAID=False)[0]
    down = mg.untuned_config(mg.DENSE, 16, False, 4, 8, 2048, 132)  # K tiles past 128 give way to split-K there
    assert (down.kwargs["BLOCK_N"], down.kwargs["SPLIT_K"]) == (64, 2)
    gate_up = mg.untuned_config(mg.DENSE, 16, False, 1, 8, 1536, 132)
    assert gate_up.kwargs["BLOCK_N"] == 32 and gate_up.kwargs["SPLIT_K"] == 1
    assert mg.untuned_config(mg.DENSE, 16, False, 4, 128, 2048, 132) is first  # 128 tiles x 32: full already
    relaid_down = mg.untuned_config(mg.MXFP4, 16, True, 4, 8, 2048, 132)
    assert (relaid_down.kwargs["BLOCK_N"], relaid_down.kwargs["SPLIT_K"]) == (64, 2)
    relaid_up = mg.untuned_config(mg.MXFP4, 16, True, 1, 8, 1536, 132)
    assert relaid_up is mg.RELAID_DECODE_CONFIGS[0]  # no split there and every config the same width
    assert mg.untuned_config(mg.MXFP4, 16, True, 4, 1, 2048, 304).kwargs["SPLIT_K"] == 4  # short of any: the most
    assert mg.untuned_config(mg.DENSE, 64, False, 1, 4, 2048, 132) is mg.PREFILL_CONFIGS[0]  # same widths
