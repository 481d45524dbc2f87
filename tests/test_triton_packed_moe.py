"""The Triton fused MoE over packed expert weights (kernels/gpu/packed_moe.py) in Triton's interpreter on CPU,
against the routed-expert sum computed here in float64 from the formats' formulas (INT4 group-32: (nibble - 8) *
scale, nibble k in bits 4 (k % 8) of int32 word k / 8; MXFP4: the E2M1 table times 2^(e8m0 - 127), column 2c in the
low nibble), with experts routed to another rank contributing nothing."""
from __future__ import annotations

import pytest
import torch

from test_fp8_block_weight import fp8_pair  # noqa: F401  (a fixture used below)
from test_packed_experts import _compare, _run, deepseek_int4, k3_pair  # noqa: F401  (fixtures used below)
from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)


def make(fmt: str, E: int, N: int, K: int, g: torch.Generator, scale_dtype=torch.bfloat16):
    """Random packed stack and its float64 weights [E, N, K]."""
    if fmt == "int4_group":
        nib = torch.randint(0, 16, (E, N, K), generator=g)
        words = (nib.view(E, N, K // 8, 8) << (4 * torch.arange(8))).sum(-1)
        packed = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
        scale = (torch.rand(E, N, K // 32, generator=g) * 0.05 + 0.01).to(scale_dtype)
        w = (nib - 8).double() * scale.double().repeat_interleave(32, -1)
    else:
        code = torch.randint(0, 16, (E, N, K), generator=g)
        packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
        scale = torch.randint(120, 130, (E, N, K // 32), generator=g).to(torch.uint8)
        w = E2M1[code] * torch.exp2(scale.double() - 127).repeat_interleave(32, -1)
    return packed, scale, w


def reference(x, w13, w2, weights, ids, start):
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - start
            if not 0 <= e < w13.shape[0]:
                continue
            gu = w13[e] @ x[t].double()
            g_, u = gu.chunk(2)
            out[t] += float(weights[t, j]) * (w2[e] @ (torch.nn.functional.silu(g_) * u))
    return out


@pytest.mark.parametrize("fmt,scale_dtype", [("int4_group", torch.bfloat16), ("int4_group", torch.float16),
                                              ("mxfp4", torch.uint8)])
@pytest.mark.parametrize("T,E,k,start,num_local", [(1, 4, 2, 0, 4), (6, 8, 3, 2, 4)])
def test_matches_float64_routed_sum(interpret, fmt, scale_dtype, T, E, k, start, num_local):
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.layers.activation import silu_and_mul
    H, I = 64, 32
    g = torch.Generator().manual_seed(T * 7 + E)
    p13, s13, w13 = make(fmt, num_local, 2 * I, H, g, scale_dtype)
    p2, s2, w2 = make(fmt, num_local, H, I, g, scale_dtype)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    got = fused_moe_packed(x, fmt, p13, s13, p2, s2, weights, ids, silu_and_mul, start)
    want = reference(x, w13, w2, weights, ids, start)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    scale = want.abs().max().clamp_min(1e-30)
    assert ((got.double() - want).abs().max() / scale) < 1e-5


def make_fp8(E: int, parts: int, part_rows: int, K: int, g: torch.Generator):
    """Random FP8 block-scaled stack (every e4m3 byte but the NaN codes; parts of ``part_rows`` rows, each with its own
    128 x 128 blocks, the last partial) and its float64 weights by the formula fp8 * scale_inv[block]."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    packed = codes[torch.randint(len(codes), (E, parts * part_rows, K), generator=g)]
    sb, kb = -(-part_rows // 128), -(-K // 128)
    scale = torch.rand(E, parts * sb, kb, generator=g) * 0.01 + 1e-3
    r = torch.arange(parts * part_rows)
    brow = (r // part_rows) * sb + (r % part_rows) // 128
    w = packed.view(torch.float8_e4m3fn).double() * scale.double()[:, brow][:, :, torch.arange(K) // 128]
    return packed, scale, w


@pytest.mark.parametrize("T,E,k,start,num_local", [(1, 4, 2, 0, 4), (6, 8, 3, 2, 4)])
def test_fp8_block_matches_float64_routed_sum(interpret, T, E, k, start, num_local):
    """FP8 block-scaled experts (hidden 160, intermediate 136: partial blocks in both parts and both dims)."""
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.layers.activation import silu_and_mul
    H, I = 160, 136
    g = torch.Generator().manual_seed(T * 5 + E)
    p13, s13, w13 = make_fp8(num_local, 2, I, H, g)
    p2, s2, w2 = make_fp8(num_local, 1, H, I, g)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    got = fused_moe_packed(x, "fp8_block", p13, s13, p2, s2, weights, ids, silu_and_mul, start)
    want = reference(x, w13, w2, weights, ids, start)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    scale = want.abs().max().clamp_min(1e-30)
    assert ((got.double() - want).abs().max() / scale) < 1e-5


def test_shapes_and_formats_refused(interpret):
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.layers.activation import silu_and_mul
    g = torch.Generator().manual_seed(0)
    p13, s13, _ = make("mxfp4", 2, 64, 64, g, torch.uint8)
    p2, s2, _ = make("mxfp4", 2, 64, 32, g, torch.uint8)
    ids, w = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    with pytest.raises(ValueError, match="unknown format 'nvfp4'"):
        fused_moe_packed(torch.zeros(1, 64), "nvfp4", p13, s13, p2, s2, w, ids, silu_and_mul)
    with pytest.raises(ValueError, match="do not match hidden 96"):
        fused_moe_packed(torch.zeros(1, 96), "mxfp4", p13, s13, p2, s2, w, ids, silu_and_mul)


@pytest.mark.parametrize("model", ["deepseek_int4", "k3_mxfp4", "deepseek_fp8"])
def test_engine_with_packed_experts_through_triton(interpret, monkeypatch, request, model):
    """Whole packed checkpoints (tests/test_packed_experts.py's tiny INT4 DeepSeek-V3 and MXFP4 Kimi K3,
    tests/test_fp8_block_weight.py's tiny FP8 block-scaled DeepSeek-V3) with every
    Triton kernel interpreted and the routed experts in kernels/gpu/packed_moe.py (K3: its SiTU activation and
    float32 latent sum): greedy tokens equal the dequantized float32 model's and prompt logprobs within 1e-4."""
    from tokenfab.kernels.gpu import packed_moe as triton_packed_moe
    pair = request.getfixturevalue({"deepseek_int4": "deepseek_int4", "k3_mxfp4": "k3_pair",
                                    "deepseek_fp8": "fp8_pair"}[model])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 512, (n,), generator=g).tolist() for n in (11, 5)]
    calls = []
    real = triton_packed_moe.fused_moe_packed
    monkeypatch.setattr(triton_packed_moe, "fused_moe_packed", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    _, q_outs = _run(pair[0], prompts)
    monkeypatch.setenv("TOKENFAB_TRITON", "0")
    _, ref_outs = _run(pair[1], prompts)
    assert calls and set(calls) == {{"deepseek_int4": "int4_group", "k3_mxfp4": "mxfp4",
                                     "deepseek_fp8": "fp8_block"}[model]}
    assert _compare(q_outs, ref_outs, prompts) < 1e-4
