"""Kimi K3's decode glue as Triton kernels, in Triton's interpreter on CPU: the attention-residual mix
(kernels/gpu/attn_res.py), SiTU-GLU, the gated MLA output x * sigmoid(g) and the latent norm of the float32 expert
sum cast once (kernels/gpu/norm_activation.py), each against its formula or the PyTorch path it replaces
(models/kimi_linear.py, layers/norm.py) over odd widths, float32 and bf16; and a tiny K3 on the GPU code path
against the same model on the PyTorch paths, with its per-layer launch count.
"""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def reference_mix(prefix, blocks, norm_w, proj_w, eps):
    """The float64 form of models/kimi_linear.py's attn_res_mix (an independent evaluation of the same formula)."""
    v = torch.stack([*blocks, prefix], dim=1).double()
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    p = (k * (norm_w.double() * proj_w.reshape(-1).double())).sum(-1).softmax(-1)
    return (p.unsqueeze(-1) * v).sum(1)


@pytest.mark.parametrize("n_blocks,H,T,with_delta", [(0, 96, 3, False), (1, 100, 2, False), (3, 257, 5, False),
                                                    (8, 64, 1, False), (1, 100, 2, True), (3, 257, 5, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_res_mix_kernel_matches_the_formula(interpret, n_blocks, H, T, with_delta, dtype):
    """The kernel's mix against the float64 formula: float32 within a few float32 roundings of the output's scale;
    bf16 within one bf16 step more (the interpreter truncates to bf16; a GPU rounds to nearest, half that). Blocks
    of very different scales so the softmax weights are far from uniform (a dropped source or a swapped weight moves
    the result by O(1)). With a delta (the layer's residual add in the same launch): the new prefix equals the eager
    ``prefix + delta`` to within the interpreter's bf16 truncation, and the mix is of that prefix."""
    from tokenfab.kernels.gpu import attn_res
    g = torch.Generator().manual_seed(n_blocks * 100 + H)
    blocks = [(torch.randn(T, H, generator=g) * (1 + 3 * i)).to(dtype) for i in range(n_blocks)]
    prefix = torch.randn(T, H, generator=g).to(dtype)
    norm_w, proj_w = torch.rand(H, generator=g) + 0.5, torch.randn(1, H, generator=g) * 0.3
    w = attn_res.mix_weight(norm_w, proj_w)
    if with_delta:
        delta = (torch.randn(T, H, generator=g) * 2).to(dtype)
        got, cur = attn_res.attn_res_mix(prefix, blocks, w, 1e-6, delta)
        eager = prefix + delta
        assert cur.dtype == dtype and ((cur.double() - eager.double()).abs()
                                       <= (2.0 ** -7 * eager.double().abs() if dtype == torch.bfloat16 else 0)).all()
        prefix = cur
    else:
        got = attn_res.attn_res_mix(prefix, blocks, w, 1e-6)
    want = reference_mix(prefix, blocks, norm_w, proj_w, 1e-6)
    assert got.dtype == dtype and got.shape == (T, H)
    scale = max(b.abs().max() for b in [prefix, *blocks]).double()
    tol = 64 * 2.0 ** -24 * scale + (2.0 ** -7 * want.abs() if dtype == torch.bfloat16 else 0)
    assert ((got.double() - want).abs() <= tol).all(), (got.double() - want).abs().max()


@pytest.mark.parametrize("n_blocks,H,T,with_delta", [(0, 96, 3, False), (3, 257, 5, False), (3, 257, 5, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_res_mix_kernel_with_the_next_norm(interpret, n_blocks, H, T, with_delta, dtype):
    """The mix through the layer's next RMSNorm in the same launch (``norm=(weight, eps)``) against the float64
    formula of the mix, rounded to the dtype as the eager ``.to(prefix.dtype)``, then layers/norm.py's RMSNorm (w *
    round(h * rsqrt(mean(h^2) + eps))) in float64: float32 within a few float32 roundings; bf16 within three bf16
    steps of each output (the mix's and the norm's roundings; the interpreter truncates). A norm weight far from
    uniform, so the weight missing or applied to the wrong columns fails by O(1); the new prefix with a delta is
    the eager sum as without the norm."""
    from tokenfab.kernels.gpu import attn_res
    g = torch.Generator().manual_seed(n_blocks * 10 + H)
    blocks = [(torch.randn(T, H, generator=g) * (1 + 3 * i)).to(dtype) for i in range(n_blocks)]
    prefix = torch.randn(T, H, generator=g).to(dtype)
    norm_w, proj_w = torch.rand(H, generator=g) + 0.5, torch.randn(1, H, generator=g) * 0.3
    out_w = (torch.rand(H, generator=g) * 3 - 1).to(dtype)
    w = attn_res.mix_weight(norm_w, proj_w)
    if with_delta:
        delta = (torch.randn(T, H, generator=g) * 2).to(dtype)
        got, cur = attn_res.attn_res_mix(prefix, blocks, w, 1e-6, delta, norm=(out_w, 1e-5))
        eager = (prefix + delta).double()
        assert ((cur.double() - eager).abs() <= (2.0 ** -7 * eager.abs() if dtype == torch.bfloat16 else 0)).all()
        prefix = cur
    else:
        got = attn_res.attn_res_mix(prefix, blocks, w, 1e-6, norm=(out_w, 1e-5))
    mix = reference_mix(prefix, blocks, norm_w, proj_w, 1e-6).to(dtype).double()
    normed = (mix * torch.rsqrt(mix.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).double() * out_w.double()
    assert got.dtype == dtype and got.shape == (T, H)
    tol = (2.0 ** -20 if dtype == torch.float32 else 3 * 2.0 ** -7) * normed.abs() + 1e-6
    assert ((got.double() - normed).abs() <= tol).all(), (got.double() - normed).abs().max()


def test_attn_res_mix_takes_the_kernel_on_the_gpu_path(interpret, monkeypatch):
    """models/kimi_linear.attn_res_mix runs the kernel where the GPU path applies (its result equals the kernel's)
    and its PyTorch form elsewhere; both agree to float32 rounding; past MAX_BLOCKS the reference runs."""
    from tokenfab.kernels.gpu import attn_res
    from tokenfab.layers.linear import Linear
    from tokenfab.layers.norm import RMSNorm
    from tokenfab.models import kimi_linear
    H = 48
    g = torch.Generator().manual_seed(3)
    proj, norm = Linear(H, 1), RMSNorm(H, eps=1e-6)
    proj.weight.data = torch.randn(1, H, generator=g)
    norm.weight.data = torch.rand(H, generator=g) + 0.5
    blocks = [torch.randn(2, H, generator=g) for _ in range(3)]
    prefix = torch.randn(2, H, generator=g)
    calls = []
    real = attn_res.attn_res_mix
    monkeypatch.setattr(attn_res, "attn_res_mix", lambda *a, **k: calls.append(1) or real(*a, **k))
    eager = kimi_linear.attn_res_mix(prefix, blocks, proj, norm)
    assert not calls
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    fused = kimi_linear.attn_res_mix(prefix, blocks, proj, norm)
    assert calls and torch.allclose(fused, eager, rtol=1e-5, atol=1e-6)
    delta = torch.randn(2, H, generator=g)
    with torch.no_grad():
        (y, cur), n = kimi_linear.attn_res_mix(prefix, blocks, proj, norm, delta=delta), len(calls)
        monkeypatch.setenv("TOKENFAB_TRITON", "interpret")  # CPU tensors: the PyTorch form
        y_eager, cur_eager = kimi_linear.attn_res_mix(prefix, blocks, proj, norm, delta=delta)
    scale = max(float(b.abs().max()) for b in [cur_eager, *blocks])  # float32 roundings of sums of that size
    assert len(calls) == n and torch.equal(cur, cur_eager) and float((y - y_eager).abs().max()) <= 1e-5 * scale
    out_norm = RMSNorm(H, eps=1e-5)  # the layer's next norm, in the same launch on the GPU path
    out_norm.weight.data = torch.rand(H, generator=g) * 3 - 1
    with torch.no_grad():
        normed_eager = kimi_linear.attn_res_mix(prefix, blocks, proj, norm, out_norm=out_norm)
        assert len(calls) == n and torch.allclose(normed_eager, out_norm(eager), rtol=0, atol=0)
        monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
        normed = kimi_linear.attn_res_mix(prefix, blocks, proj, norm, out_norm=out_norm)
    assert len(calls) == n + 1 and torch.allclose(normed, normed_eager, rtol=1e-5, atol=1e-5)
    n += 1
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    many = [torch.randn(2, H, generator=g) for _ in range(attn_res.MAX_BLOCKS + 1)]
    kimi_linear.attn_res_mix(prefix, many, proj, norm)
    assert len(calls) == n


@pytest.mark.parametrize("linear_beta", [None, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_situ_and_mul_kernel_matches_situ_glu(interpret, linear_beta, dtype):
    """SiTU-GLU in one launch against the float64 formula (beta tanh(g / beta) sigmoid(g) * (lb tanh(u / lb) or
    u)): float32 within a few roundings, bf16 within one bf16 step of the output (the interpreter truncates); gates
    wide enough that tanh saturates and sigmoid spans (0, 1)."""
    from tokenfab.kernels.gpu.norm_activation import situ_and_mul
    g = torch.Generator().manual_seed(7)
    gu = (torch.randn(5, 2 * 1100, generator=g) * 4).to(dtype)
    got = situ_and_mul(gu, 1.5, linear_beta)
    gate, up = gu.double().chunk(2, dim=-1)
    up = linear_beta * torch.tanh(up / linear_beta) if linear_beta else up
    want = 1.5 * torch.tanh(gate / 1.5) * torch.sigmoid(gate) * up
    assert got.dtype == dtype and got.shape == (5, 1100)
    tol = 16 * 2.0 ** -24 * want.abs() + 1e-6 + (2.0 ** -7 * want.abs() if dtype == torch.bfloat16 else 0)
    assert ((got.double() - want).abs() <= tol).all(), (got.double() - want).abs().max()
    wide = torch.full((5, 1100 + 30), float("nan")).to(dtype)  # into a slice of a wider buffer (K3's joined input)
    into = situ_and_mul(gu, 1.5, linear_beta, out=wide[:, 30:])
    assert into.data_ptr() == wide[:, 30:].data_ptr() and torch.equal(into, got) and wide[:, :30].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_mul_kernel_matches_the_eager_ops(interpret, dtype):
    """x * sigmoid(g) in one launch against ``x * torch.sigmoid(g)``: float32 to a few roundings; bf16 within one
    bf16 step per rounding (the sigmoid's and the product's; the interpreter truncates)."""
    from tokenfab.kernels.gpu.norm_activation import sigmoid_mul
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 1500, generator=g).to(dtype)
    gate = (torch.randn(3, 1500, generator=g) * 4).to(dtype)
    got = sigmoid_mul(x, gate)
    want = x.double() * torch.sigmoid(gate.double())
    assert got.dtype == dtype and got.shape == x.shape
    tol = 8 * 2.0 ** -24 * want.abs() + (2 * 2.0 ** -7 * want.abs() if dtype == torch.bfloat16 else 0)
    assert ((got.double() - want).abs() <= tol + 1e-30).all(), (got.double() - want).abs().max()


def test_rms_norm_to_matches_norm_then_cast(interpret):
    """K3's latent norm: RMSNorm of the float32 expert sum with the bf16 weight, then the cast to bf16, in one
    launch: within one bf16 step of the float64 formula (the interpreter truncates), and the output bf16."""
    from tokenfab.kernels.gpu.norm_activation import rms_norm
    g = torch.Generator().manual_seed(12)
    y = torch.randn(4, 300, generator=g) * 3
    w = (torch.rand(300, generator=g) + 0.5).to(torch.bfloat16)
    got = rms_norm(y, w, 1e-6, out_dtype=torch.bfloat16)
    yd = y.double()
    want = w.double() * yd * torch.rsqrt(yd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == y.shape
    assert ((got.double() - want).abs() <= 2.0 ** -7 * want.abs() + 1e-6).all()


# a tiny K3's decode layers on the GPU code path, counted as tests/test_gpu_kernel_count.py counts: layer 0 KDA +
# dense SiTU MLP, layer 1 gated MLA + latent MoE, layers 2-3 KDA + latent MoE (test_kimi_k3.py's TEXT). Were 39 /
# 85 / 80 / 81 before the attention-residual mix, SiTU-GLU, gated output and latent norm kernels (2026-12-07), then
# 13 / 28 / 24 / 25 until the residual add moved into the second mix's launch where a layer does not close a block
# and the shared experts' sum into their down projection's GEMM, then 13 / 26 / 23 / 23 until the routed experts'
# SiTU-GLU moved into their gate|up GEMM's epilogue, then 13 / 25 / 22 / 22 until each mix took the norm after it
# and the MLP's last GEMM the residual add, then 11 / 22 / 19 / 19 until g_proj joined the MLA a-projection's GEMM and
# the latent down-projection the shared experts' gate|up GEMM, then 11 / 20 / 18 / 18 until KDA's decode groups ran
# the short conv inside the recurrence's launch, then 10 / 20 / 17 / 17 until the latent norm joined the k-sum's
# launch (2026-12-07), then 10 / 19 / 16 / 16 until KDA's gated output norm joined the fused decode launch, then
# 9 / 19 / 15 / 15 until the MoE alignment joined the router's launch, then 9 / 18 / 14 / 14 until MLA's output gate
# joined the value heads' GEMM (a Triton launch instead of cuBLAS's batched GEMM), then 9 / 17 / 14 / 14 until the
# latent up-projection and the shared experts' down projection became one GEMM over their joined inputs, then
# 9 / 16 / 13 / 13 until the MLA queries (q_a norm, q_b GEMM, absorbed queries) and the latent write became one launch
K3_DENSE_MAX, K3_MLA_MOE_MAX, K3_KDA_MOE_MAX = 9, 14, 13


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_forward_add_accumulates_in_the_gemm_on_the_gpu_path(monkeypatch, dtype):
    """Linear.forward_add_ (the shared experts' down projection added to the routed sum): on the GPU code path one
    in-place GEMM into the residual (the same storage returned), equal to residual + x W^T in float64 to one rounding
    of the output (float32: a few float32 roundings); elsewhere, or with a bias, the two eager ops and a new
    tensor."""
    from tokenfab.layers.linear import Linear
    g = torch.Generator().manual_seed(5)
    lin = Linear(40, 24)
    lin.weight.data = torch.randn(24, 40, generator=g).to(dtype)
    x, res = torch.randn(3, 40, generator=g).to(dtype), (torch.randn(3, 24, generator=g) * 4).to(dtype)
    want = res.double() + x.double() @ lin.weight.detach().double().t()
    tol = (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20) * (want.abs() + 8)
    with torch.no_grad():
        eager = lin.forward_add_(x, res.clone())  # CPU tensors, no GPU path: residual + self(x)
        monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        r = res.clone()
        got = lin.forward_add_(x, r)
        assert got.data_ptr() == r.data_ptr() and got.dtype == dtype
        assert ((got.double() - want).abs() <= tol).all() and ((eager.double() - want).abs() <= tol).all()
        lin.bias = torch.nn.Parameter(torch.zeros(24, dtype=dtype))
        r = res.clone()
        assert lin.forward_add_(x, r).data_ptr() != r.data_ptr()  # a bias: the eager ops


def test_latent_moe_adds_the_residual_in_its_gemms_on_the_gpu_path(monkeypatch):
    """K3's MoE block with ``residual`` (the layer's partial sum): ``residual`` + the block. Off the GPU path exactly
    the eager sum in a new tensor (the reference's order); on the GPU code path after the load-time fusions (the
    latent down-projection and the shared experts' gate|up in one GEMM), in float32 to float32 rounding of it, the
    sum made in the latent up-projection's and the shared experts' down GEMMs, in the residual's own storage (the
    returned tensor is it)."""
    from test_kimi_k3 import TEXT
    from tokenfab.config import parse_config
    from tokenfab.models.kimi_moe import KimiMoE
    cfg = parse_config({"architectures": ["KimiK3ForConditionalGeneration"], "text_config": TEXT})
    torch.manual_seed(0)
    moe = KimiMoE(cfg)
    assert moe.latent and moe.shared_experts is not None
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
        moe.experts.w13.copy_(torch.randn(moe.experts.w13.shape) * 0.2)
        moe.experts.w2.copy_(torch.randn(moe.experts.w2.shape) * 0.2)
        x, r = torch.randn(3, cfg.hidden_size), torch.randn(3, cfg.hidden_size) * 4
        want = r + moe(x)
        res = r.clone()
        eager = moe(x, residual=res)
        assert eager.data_ptr() != res.data_ptr() and torch.equal(eager, want)  # the reference's order
        monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        for m in moe.modules():  # as CausalLM.post_load: the latent down and shared gate|up rows join one GEMM
            if hasattr(m, "fuse"):
                m.fuse()
        sh_inter = moe.shared_experts.down_proj.in_features
        assert moe.x_proj is not None and moe.x_proj.out_features == moe.latent + 2 * sh_inter
        res = r.clone()
        got = moe(x, residual=res)
    assert got.data_ptr() == res.data_ptr() and torch.allclose(got, want, rtol=1e-5, atol=1e-4)


def test_k3_on_the_gpu_path_matches_the_pytorch_paths(tmp_path, tokenizer_dir, monkeypatch):
    """A tiny K3 (KDA, gated NoPE MLA, attention residuals, latent MoE with SiTU experts) in float32 on the GPU code
    path (every Triton kernel interpreted, no C++ kernels) against the same checkpoint on the PyTorch paths: the
    same greedy tokens, prompt logprobs within 1e-4; and each decode layer within its launch count in bfloat16, with
    no host read in the decode step."""
    from conftest import max_prompt_logprob_gap
    from test_gpu_kernel_count import count_decode_layers, report
    from test_kimi_k3 import TEXT, k3_tensors, write_k3
    from tokenfab import LLM, SamplingParams
    from tokenfab.kernels.cpu import build as cpu_build
    stored, _ = k3_tensors(TEXT)
    path = write_k3(str(tmp_path / "k3"), tokenizer_dir, tensors=stored)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 33, 200, 7, 9, 11, 40], [9, 4, 300])]
    sp = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, prompt_logprobs=0)
    ref = LLM(path, dtype="float32", device="cpu", max_model_len=64, progress=False).generate(prompts, sp,
                                                                                              use_tqdm=False)
    for k, v in (("TRITON_INTERPRET", "1"), ("TOKENFAB_TRITON", "interpret-gpu-path"), ("TOKENFAB_CPU_KERNELS", "0"),
                 ("TOKENFAB_CPU_LINEAR", "torch")):
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(cpu_build, "load", lambda: None)
    out = LLM(path, dtype="float32", device="cpu", max_model_len=64, progress=False).generate(prompts, sp,
                                                                                              use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert max_prompt_logprob_gap(ref, out, "K3 GPU path") < 1e-4
    totals, kc = count_decode_layers(path, "bfloat16")  # the serving dtype: the latent norm's float32 sum is cast
    counts = kc.counts
    assert not kc.syncs, f"host syncs in the decode step: {kc.syncs}\n{report(kc)}"  # what a CUDA graph captures
    assert all(counts[f"layer{i}"]["triton:_attn_res_mix_kernel"] >= 1 for i in range(4)), report(kc)
    # gated MLA's value heads with the output gate in one launch: no batched GEMM, no gate launch of its own
    assert counts["layer1"]["triton:_mla_value_gate_kernel"] == 1 and counts["layer1"]["aten:bmm"] == 0, report(kc)
    assert counts["layer1"]["triton:_sigmoid_mul_kernel"] == 0, report(kc)
    # the MoE block's routed and shared outputs from one GEMM adding into the residual (KimiMoE.out_proj)
    assert all(counts[f"layer{i}"]["aten:addmm_"] == 1 for i in (1, 2, 3)), report(kc)
    assert (totals["layer0"] <= K3_DENSE_MAX and totals["layer1"] <= K3_MLA_MOE_MAX
            and max(totals["layer2"], totals["layer3"]) <= K3_KDA_MOE_MAX), f"{totals}\n{report(kc)}"


def test_k3_glue_kernels_compile_for_sm90_and_gfx942(interpret):
    """The K3 glue kernels' GPU forms (bf16 and float32 rows; the mix with 0, 3 and 8 blocks at K3's width, with the
    residual add and the next norm; the k-sum with the latent norm; the gated value heads) compiled by
    Triton's own compiler for NVIDIA sm_90 and AMD gfx942 on this CPU (tokenfab/testing/target_compile.py)."""
    from tokenfab.kernels.gpu import attn_res
    from tokenfab.kernels.gpu.norm_activation import rms_norm, sigmoid_mul, situ_and_mul
    from tokenfab.testing.target_compile import LaunchRecorder, compile_for_targets, gpu_variants
    H = 7168
    with LaunchRecorder() as rec:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(1, H).to(dtype)
            w = attn_res.mix_weight(torch.ones(H), torch.ones(1, H))
            for n in (0, 3, 8):
                attn_res.attn_res_mix(x, [x.clone() for _ in range(n)], w, 1e-6)
            attn_res.attn_res_mix(x, [x.clone()], w, 1e-6, x.clone())  # with the residual add
            nw = (torch.ones(H).to(dtype), 1e-6)  # through the layer's next norm, with and without the add
            attn_res.attn_res_mix(x, [x.clone()], w, 1e-6, x.clone(), norm=nw)
            attn_res.attn_res_mix(x, [x.clone() for _ in range(3)], w, 1e-6, norm=nw)
            situ_and_mul(torch.randn(1, 64).to(dtype), 1.5, 2.0)
            situ_and_mul(torch.randn(1, 64).to(dtype), 1.5, None)
            sigmoid_mul(x[:, :64], x[:, 64:128].contiguous())
        rms_norm(torch.randn(1, 3584), torch.ones(3584).to(torch.bfloat16), 1e-6, out_dtype=torch.bfloat16)
        from tokenfab.kernels.gpu.moe import SUM_NORM_MAX_TOKENS, moe_sum  # the latent norm in the k-sum's launch
        moe_sum(torch.randn(2, 16, 3584), torch.randint(0, 8, (1, 16)), 0, 8, torch.bfloat16,
                norm=(torch.ones(3584).to(torch.bfloat16), 1e-6, torch.zeros(SUM_NORM_MAX_TOKENS, dtype=torch.int32)))
        from tokenfab.kernels.gpu.mla_decode_glue import mla_value_gate  # gated MLA's value heads with the gate
        b = torch.bfloat16
        mla_value_gate(torch.randn(2, 4, 512).to(b), torch.randn(4, 512, 128).to(b), torch.randn(2, 512).to(b))
    names = {v["name"] for v in rec.launches}
    assert {"_attn_res_mix_kernel", "_situ_and_mul_kernel", "_sigmoid_mul_kernel", "_rms_norm_kernel",
            "_moe_sum_kernel", "_mla_value_gate_kernel"} <= names
    launches = gpu_variants(rec.launches)  # the value heads' bf16 tensor-core form too (IEEE float32 interpreted)
    assert any(l["name"] == "_mla_value_gate_kernel" and not l["constexprs"]["IEEE"] for l in launches)
    failures = compile_for_targets(launches)
    assert not failures, "\n".join(f"{f['kernel']} on {f['target']}: {f['error']}" for f in failures)
