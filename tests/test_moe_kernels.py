"""Routed-expert kernels: grouped GEMM and the per-expert loop against a naive per-token float64 reference,
including an expert-parallel slice of the experts."""
from __future__ import annotations

import pytest
import torch

from tokenfab.layers.moe import RoutedExperts


def naive(x, w13, w2, weights, ids, start=0, end=None):
    end = w13.shape[0] + start if end is None else end
    out = torch.zeros(x.shape, dtype=torch.float64)
    I = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not start <= e < end:
                continue
            g = w13[e - start, :I].double() @ x[t].double()
            u = w13[e - start, I:].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (w2[e - start].double() @ (torch.nn.functional.silu(g) * u))
    return out


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("expert_range", [None, (3, 9)])
def test_routed_experts_match_naive(grouped, expert_range):
    if grouped and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not available")
    torch.manual_seed(0)
    E, H, I, T, k = 12, 32, 16, 9, 3
    m = RoutedExperts(E, H, I, expert_range)
    n = m.end - m.start
    with torch.no_grad():
        m.w13.copy_(torch.randn(n, 2 * I, H) * 0.3)
        m.w2.copy_(torch.randn(n, H, I) * 0.3)
    m.use_grouped_mm = grouped
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.rand(T, k)
    got = m(x, w, ids)
    ref = naive(x, m.w13, m.w2, w, ids, m.start, m.end)
    assert torch.allclose(got.double(), ref, atol=1e-5), (got.double() - ref).abs().max()


def test_packed_expert_loop_matches_naive():
    from tokenfab.layers.linear import can_pack
    if not can_pack(torch.empty(2, 2, dtype=torch.bfloat16)):
        pytest.skip("no oneDNN packing here")
    torch.manual_seed(1)
    E, H, I, T, k = 8, 64, 32, 11, 2
    m = RoutedExperts(E, H, I, (2, 7)).to(torch.bfloat16)
    with torch.no_grad():
        m.w13.copy_(torch.randn(5, 2 * I, H) * 0.3)
        m.w2.copy_(torch.randn(5, H, I) * 0.3)
    w13, w2 = m.w13.clone(), m.w2.clone()
    m.fuse()
    assert m._p13 is not None and m.w13 is None
    x = torch.randn(T, H).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.rand(T, k)
    ref = naive(x, w13, w2, w, ids, 2, 7)
    assert torch.allclose(m(x, w, ids).double(), ref, atol=0.05 * ref.abs().max().item())


def test_unaligned_intermediate_falls_back_to_the_loop():
    """float32 with intermediate 34 (136-byte rows) is refused by torch._grouped_mm: the loop runs instead."""
    torch.manual_seed(2)
    m = RoutedExperts(6, 32, 34)
    with torch.no_grad():
        m.w13.copy_(torch.randn(6, 68, 32) * 0.3)
        m.w2.copy_(torch.randn(6, 32, 34) * 0.3)
    x, ids, w = torch.randn(5, 32), torch.stack([torch.randperm(6)[:2] for _ in range(5)]), torch.rand(5, 2)
    assert torch.allclose(m(x, w, ids).double(), naive(x, m.w13, m.w2, w, ids), atol=1e-5)


@pytest.mark.parametrize("T,k,expert_range", [(1, 2, None), (16, 2, None), (11, 3, (2, 7)), (0, 2, None)])
def test_fused_dispatch_is_bit_identical_to_the_python_loop(T, k, expert_range):
    """The C++ dispatch (cpu_moe.moe_experts_packed) against RoutedExperts' packed Python loop, which the naive
    float64 test above checks: same grouping, GEMMs, rounding and summation order, so equal bits; and close to the
    naive reference itself."""
    from tokenfab.kernels.cpu import build as cpu_build
    from tokenfab.layers.linear import can_pack
    if not can_pack(torch.empty(2, 2, dtype=torch.bfloat16)) or cpu_build.load() is None:
        pytest.skip("no oneDNN packing or no fused CPU kernels here")
    torch.manual_seed(T + k)
    E, H, I = 8, 64, 40
    start, end = expert_range or (0, E)
    m = RoutedExperts(E, H, I, expert_range).to(torch.bfloat16)
    with torch.no_grad():
        m.w13.copy_(torch.randn(end - start, 2 * I, H) * 0.3)
        m.w2.copy_(torch.randn(end - start, H, I) * 0.3)
    w13, w2 = m.w13.clone(), m.w2.clone()
    m.fuse()
    x = torch.randn(T, H).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    w = torch.rand(T, k)
    m.fused_dispatch = True
    fused = m(x, w, ids)
    m.fused_dispatch = False
    loop = m(x, w, ids)
    assert fused.shape == (T, H) and fused.dtype == torch.bfloat16
    assert torch.equal(fused, loop)
    if T:
        ref = naive(x, w13, w2, w, ids, start, end)
        assert torch.allclose(fused.double(), ref, atol=0.05 * ref.abs().max().item())


@pytest.mark.parametrize("T", [1, 3, 9])
def test_fused_shared_expert_is_routed_plus_shared(T):
    """moe_experts_packed with a shared expert (its GEMVs in the routed experts' parallel regions) equals the routed
    experts' call + the shared SiLU-GLU as separate bf16 ops (DeepseekV3MoE.forward's order), bit for bit; at T 9
    the GEMMs run brgemm tiles instead."""
    from tokenfab.kernels.cpu import build as cpu_build
    from tokenfab.kernels.cpu.ops import moe as cpu_moe
    from tokenfab.kernels.cpu.ops import norms_activations as cpu_norms
    from tokenfab.kernels.cpu.ops import support as cpu_support
    from tokenfab.kernels.cpu.ops import vnni_linear as cpu_vnni
    if cpu_build.load() is None or not cpu_support.has_bf16_dot():
        pytest.skip("no fused CPU kernels with AVX512-BF16 here")
    g = torch.Generator().manual_seed(T)
    E, H, I, Is, k = 6, 64, 48, 96, 2
    pack = cpu_vnni.pack_linear_weight
    p13 = [pack((torch.randn(2 * I, H, generator=g) * 0.3).bfloat16()) for _ in range(E)]
    p2 = [pack((torch.randn(H, I, generator=g) * 0.3).bfloat16()) for _ in range(E)]
    sgu, sd = (torch.randn(2 * Is, H, generator=g) * 0.3).bfloat16(), (torch.randn(H, Is, generator=g) * 0.3).bfloat16()
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    routed = cpu_moe.moe_experts_packed(x, w, ids, p13, p2, 0)
    shared = cpu_vnni.vnni_linear(cpu_norms.silu_and_mul(cpu_vnni.vnni_linear(x, pack(sgu), 2 * Is)),
                                  pack(sd), H)
    fused = cpu_moe.moe_experts_packed(x, w, ids, p13, p2, 0, pack(sgu), pack(sd))
    assert torch.equal(fused, routed + shared)
    # and the shared part is really there: the float64 SiLU-GLU of x, within bf16 rounding of the sum
    xs = x.double()
    h = xs @ sgu.double().t()
    ref_shared = (torch.nn.functional.silu(h[:, :Is]) * h[:, Is:]) @ sd.double().t()
    assert torch.allclose((fused.double() - routed.double()), ref_shared, atol=0.05 * ref_shared.abs().max().item())


@pytest.mark.parametrize("T,E,k,n_group,topk_group,norm", [(1, 16, 2, 4, 2, True), (64, 256, 8, 8, 4, True),
                                                          (33, 64, 6, 1, 1, False), (7, 12, 3, 3, 1, True)])
def test_sigmoid_group_router_kernel_matches_pytorch_path(T, E, k, n_group, topk_group, norm):
    """cpu_moe.sigmoid_group_topk against SigmoidGroupRouter's PyTorch path (transformers' order, checked token
    for token against transformers in test_engine_exact): the same experts per token and weights within float32
    rounding, on logits spread so that group choice matters."""
    from tokenfab.kernels.cpu import build as cpu_build
    from tokenfab.kernels.cpu.ops import support as cpu_support
    from tokenfab.layers.moe import SigmoidGroupRouter
    if cpu_build.load() is None:
        pytest.skip("no fused CPU kernels here")
    g = torch.Generator().manual_seed(T * 7 + E)
    r = SigmoidGroupRouter(48, E, k, n_group, topk_group, norm, 2.5)
    with torch.no_grad():
        r.weight.copy_(torch.randn(E, 48, generator=g) * 0.3)
        r.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.2)
    x = torch.randn(T, 48, generator=g)
    w_k, ids_k = r(x)
    assert cpu_support.available_for(x)
    orig = cpu_support.available_for
    try:
        cpu_support.available_for = lambda t: False
        w_p, ids_p = r(x)
    finally:
        cpu_support.available_for = orig
    sk, sp = ids_k.sort(-1), ids_p.sort(-1)
    assert torch.equal(sk.values, sp.values)
    assert torch.allclose(w_k.gather(1, sk.indices), w_p.gather(1, sp.indices), rtol=1e-6, atol=1e-7)
    if n_group > 1:  # every chosen expert lies in one of topk_group groups
        assert all(len({int(e) // (E // n_group) for e in row}) <= topk_group for row in ids_k)
