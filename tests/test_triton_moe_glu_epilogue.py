"""The gated activation in the fused MoE's gate|up GEMM epilogue (kernels/gpu/moe_gemm.py ``GLU``), in Triton's
interpreter on CPU, for every stack kind the engine serves: plain, INT4 group-32, MXFP4 and FP8 block-scaled, in
the checkpoint layout and re-laid for the GPU (kernels/gpu/moe_relayout.py), SiLU-GLU and Kimi K3's SiTU-GLU (with
and without the linear branch's tanh).

Each program's weight rows interleave gate row j and up row I + j, and the epilogue pairs the two columns, so the
checks are (a) against the routed-expert sum in float64 from the dequantized weights and the activation's formula
(models/kimi_moe.py ``situ_glu``: beta tanh(g / beta) sigmoid(g) * u), which a gate paired with the wrong up row,
a misplaced output column or a dropped partial tile fails by far more than the tolerance; and (b) against the same
GEMM with the activation as its own launch (the callable), which rounds the same way. Shapes: intermediate 96
(BLOCK_N 128 weight rows give 64 outputs a program, the second tile partial), hidden 64 or 160 (FP8: partial
128-blocks), 5 experts, 6 tokens top-2; float32 (IEEE dots) and fp16 (the 16-bit decodes and, re-laid, the swapped
MMA whose accumulator is C^T, as on a GPU)."""
from __future__ import annotations

import math

import pytest
import torch

from test_triton_packed_moe import make, make_fp8
from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")

ACTS = {"silu": None, "situ": ("situ", 1.5, None), "situ-linear": ("situ", 1.5, 2.0)}


def _act64(name: str, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return torch.nn.functional.silu(g) * u
    _, beta, lbeta = ACTS[name]
    if lbeta is not None:
        u = lbeta * torch.tanh(u / lbeta)
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * u


def _reference(name, x, w13, w2, wts, ids):
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (w13[e] @ x[t].double()).chunk(2)
            out[t] += float(wts[t, j]) * (w2[e] @ _act64(name, g, u))
    return out


def _separate(name):
    from tokenfab.layers.activation import silu_and_mul
    from tokenfab.models.kimi_moe import situ_glu
    if name == "silu":
        return silu_and_mul
    _, beta, lbeta = ACTS[name]
    return lambda gu: situ_glu(gu, beta, lbeta)


def _stacks(fmt, relaid, E, I, H, g):
    from tokenfab.kernels.gpu.moe_relayout import relayout_fp8, relayout_int4, relayout_mxfp4
    if fmt == "fp8_block":
        p13, s13, w13 = make_fp8(E, 2, I, H, g)
        p2, s2, w2 = make_fp8(E, 1, H, I, g)
        lay = relayout_fp8
    else:
        p13, s13, w13 = make(fmt, E, 2 * I, H, g, torch.bfloat16 if fmt == "int4_group" else torch.uint8)
        p2, s2, w2 = make(fmt, E, H, I, g, torch.bfloat16 if fmt == "int4_group" else torch.uint8)
        lay = relayout_int4 if fmt == "int4_group" else relayout_mxfp4
    if relaid:
        (p13, s13), (p2, s2) = lay(p13, s13), lay(p2, s2)
    return (p13, s13, p2, s2), w13, w2


@pytest.mark.parametrize("dtype,act", [(torch.float32, "silu"), (torch.float32, "situ"), (torch.float32, "situ-linear"),
                                       (torch.float16, "silu"), (torch.float16, "situ-linear")])
@pytest.mark.parametrize("fmt,relaid", [("dense", False), ("int4_group", False), ("int4_group", True),
                                        ("mxfp4", False), ("mxfp4", True), ("fp8_block", False),
                                        ("fp8_block", True)])
def test_epilogue_matches_formula_and_separate_launch(interpret, monkeypatch, fmt, relaid, act, dtype):
    from tokenfab.kernels.gpu import moe_gemm
    from tokenfab.kernels.gpu.moe import fused_moe
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    monkeypatch.setattr(moe_gemm, "INTERPRET_CONFIG", {"BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1})
    monkeypatch.setattr(moe_gemm, "_RELAID_SWAP", [True])  # a failed 16-bit launch would turn it off: checked below
    E, I, T, k = 5, 96, 6, 2
    H = 160 if fmt == "fp8_block" else 64
    g = torch.Generator().manual_seed(len(fmt) + 3 * relaid + len(act))
    if fmt == "dense":
        w13, w2 = (torch.randn(E, 2 * I, H, generator=g) / 4).double(), (torch.randn(E, H, I, generator=g) / 4).double()
    else:
        stacks, w13, w2 = _stacks(fmt, relaid, E, I, H, g)
    x = (torch.randn(T, H, generator=g) * (0.5 if dtype == torch.float16 and fmt != "dense" else 1.0)).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)

    def run(a):
        if fmt == "dense":
            return fused_moe(x, w13.to(dtype), w2.to(dtype), wts, ids, a)
        return fused_moe_packed(x, fmt, *stacks, wts, ids, a, relaid=relaid)
    one, two = run(ACTS[act]), run(_separate(act))
    want = _reference(act, x.double(), w13.to(dtype).double() if fmt == "dense" else w13,
                      w2.to(dtype).double() if fmt == "dense" else w2, wts, ids)
    scale = want.abs().max().item()
    assert one.dtype == dtype and one.shape == (T, H) and scale > 1e-3
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert (one.double() - want).abs().max().item() <= tol * scale
    # the separate launch rounds gate|up and the activation the same way (16-bit: within a few ulps of the largest
    # output: the interpreter's numpy dots round with the tile's rows, and the down GEMM's sums cancel)
    ulp = 1e-5 if dtype == torch.float32 else 4 * 2.0 ** -10
    assert (one.double() - two.double()).abs().max().item() <= ulp * scale
    if dtype == torch.float16 and relaid:
        assert moe_gemm._RELAID_SWAP == [True]  # the swapped MMA's epilogue (C^T) ran, no fallback


def test_epilogue_code_reads_the_activation_spec():
    """None -> SiLU; ("situ", beta, None / linear_beta) -> SiTU (with the linear branch); a callable -> its own
    launch; another name -> a ValueError naming the known ones."""
    from tokenfab.kernels.gpu import moe_gemm
    from tokenfab.kernels.gpu.moe import epilogue_code
    assert epilogue_code(None)[0] == moe_gemm.GLU_SILU
    assert epilogue_code(("situ", 1.5, None)) == (moe_gemm.GLU_SITU, 1.5, 1.0)
    assert epilogue_code(("situ", 1.5, 2.0)) == (moe_gemm.GLU_SITU_LINEAR, 1.5, 2.0)
    assert epilogue_code(math.tanh)[0] == moe_gemm.GLU_NONE
    with pytest.raises(ValueError, match="situ"):
        epilogue_code(("gelu", 1.0, None))


def test_dense_situ_experts_take_the_grouped_gemms_on_the_gpu_path(monkeypatch):
    """K3's SiTU experts with plain stacks (a bf16 checkpoint): on the GPU code path one fused MoE (SiTU in the
    epilogue; float32 sum for the latent MoE), equal to their per-expert PyTorch loop to float32 rounding."""
    from tokenfab.kernels.gpu import moe as gpu_moe
    from tokenfab.models.kimi_moe import SituRoutedExperts
    g = torch.Generator().manual_seed(3)
    ex = SituRoutedExperts(7, 48, 40, 1.5, 2.0, accumulate_fp32=True)
    ex.w13.data = torch.randn(7, 80, 48, generator=g) / 4
    ex.w2.data = torch.randn(7, 48, 40, generator=g) / 4
    x = torch.randn(5, 48, generator=g)
    ids = torch.stack([torch.randperm(7, generator=g)[:3] for _ in range(5)])
    wts = torch.rand(5, 3, generator=g)
    want = ex(x, wts, ids)  # CPU: the per-expert loop
    calls = []
    orig = gpu_moe.fused_moe
    monkeypatch.setattr(gpu_moe, "fused_moe", lambda *a, **kw: calls.append(a[5]) or orig(*a, **kw))
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = ex(x, wts, ids)
    assert calls == [("situ", 1.5, 2.0)] and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_epilogue_compiles_for_sm90_and_gfx942(interpret):
    """The gate|up GEMM with SiTU-GLU (linear branch) in its epilogue compiled by Triton's own compiler for NVIDIA
    sm_90 and AMD gfx942 on this CPU (tokenfab/testing/target_compile.py), in the 16-bit forms a GPU runs with bf16
    activations: plain stacks, INT4 / FP8 in the checkpoint layout, MXFP4 through ``tl.dot_scaled``, and the three
    re-laid formats through the swapped MMA (accumulator C^T: the epilogue's transposed split)."""
    from tokenfab.kernels.gpu.moe import fused_moe
    from tokenfab.kernels.gpu.packed_moe import fused_moe_packed
    from tokenfab.testing.target_compile import LaunchRecorder, compile_for_targets, gpu_variants
    g = torch.Generator().manual_seed(9)
    E, I, H, T, k = 3, 64, 160, 2, 2
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, wts = torch.tensor([[0, 1], [2, 0]]), torch.rand(T, k, generator=g)
    act = ("situ", 1.5, 2.0)
    with LaunchRecorder() as rec:
        fused_moe(x, torch.randn(E, 2 * I, H).to(torch.bfloat16), torch.randn(E, H, I).to(torch.bfloat16), wts, ids,
                  act)
        for fmt in ("int4_group", "mxfp4", "fp8_block"):
            for relaid in (False, True):
                stacks, _, _ = _stacks(fmt, relaid, E, I, H if fmt == "fp8_block" else 128, g)
                xf = x if fmt == "fp8_block" else x[:, :128].contiguous()
                fused_moe_packed(xf, fmt, *stacks, wts, ids, act, relaid=relaid)
    launches = [l for l in gpu_variants(rec.launches) if l["name"] == "_grouped_gemm" and l["constexprs"]["GLU"]]
    assert len(launches) >= 7 and {l["constexprs"]["GLU"] for l in launches} == {3}
    failures = compile_for_targets(launches)
    assert not failures, "\n".join(f"{f['kernel']} on {f['target']}: {f['error']} (constexprs {f['constexprs']})"
                                   for f in failures)
