"""Shared experts folded into the routed stacks (layers/shared_expert_fold.py) on the GPU code path (Triton's
interpreter on CPU): the routed + shared sum of a DeepSeek-V3 style MoE block against its PyTorch reference
(router, RoutedExperts' loop and GatedMLP with the kernels off), for one and two shared experts' width; and the
SiLU-GLU epilogue of the gate|up grouped GEMM bit for bit against the separate activation launch in bf16.
"""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def block(E, hidden, inter, shared_inter, seed):
    from tokenfab.layers.mlp import GatedMLP
    from tokenfab.layers.moe import RoutedExperts, SigmoidGroupRouter
    g = torch.Generator().manual_seed(seed)
    gate = SigmoidGroupRouter(hidden, E, 2, 4, 2, True, 2.5)
    gate.weight.data = torch.randn(E, hidden, generator=g) / hidden ** 0.5
    gate.e_score_correction_bias.data = torch.randn(E, generator=g) * 0.1
    experts = RoutedExperts(E, hidden, inter)
    experts.w13.data = torch.randn(E, 2 * inter, hidden, generator=g) / 4
    experts.w2.data = torch.randn(E, hidden, inter, generator=g) / 4
    experts.use_grouped_mm = False
    shared = GatedMLP(hidden, shared_inter)
    for lin in (shared.gate_proj, shared.up_proj, shared.down_proj):
        lin.weight.data = torch.randn(lin.weight.shape, generator=g) / 4
    return gate, experts, shared, g


@pytest.mark.parametrize("T,shared_mult", [(1, 1), (11, 2)])
def test_folded_block_matches_routed_plus_shared(monkeypatch, T, shared_mult):
    from tokenfab.layers.shared_expert_fold import fold_shared_experts
    E, hidden, inter = 8, 32, 24
    gate, experts, shared, g = block(E, hidden, inter, shared_mult * inter, seed=T)
    x = torch.randn(T, hidden, generator=g)
    monkeypatch.setenv("TOKENFAB_TRITON", "0")
    w, ids = gate(x)
    want = experts(x, w, ids) + shared(x)
    assert fold_shared_experts(experts, shared, gate) is None  # not the GPU path: nothing folded
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    routed_w13 = experts.w13.detach().clone()
    folded = fold_shared_experts(experts, shared, gate)
    assert folded is not None and folded.slots == shared_mult
    assert folded.w13.shape == (E + shared_mult, 2 * inter, hidden)
    assert torch.equal(experts.w13, routed_w13) and experts.w13.data_ptr() == folded.w13.data_ptr()  # views
    got = folded(x, gate, experts)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fold_declines_expert_parallel_slices_and_biases(monkeypatch):
    from tokenfab.layers.linear import Linear
    from tokenfab.layers.moe import RoutedExperts
    from tokenfab.layers.shared_expert_fold import fold_shared_experts
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    gate, experts, shared, _ = block(8, 32, 24, 24, seed=1)
    ep = RoutedExperts(8, 32, 24, expert_range=(4, 8))  # ids past this rank's experts would alias the shared slots
    ep.w13.data.zero_()
    ep.w2.data.zero_()
    assert fold_shared_experts(ep, shared, gate) is None
    shared.down_proj = Linear(24, 32, True)
    assert fold_shared_experts(experts, shared, gate) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_glu_epilogue_is_the_separate_activation(interpret, dtype):
    """13 tokens top-3 of 6 experts, intermediate 40 (a partial N tile): the gate|up GEMM with SiLU-GLU in its
    epilogue against the GEMM + activation launches (the same roundings: gate and up rounded, silu rounded).
    Not bit for bit here: the interpreter's numpy dot rounds differently with the tile's row count (the two-launch
    GEMM's tiles mix gate and up rows), and it truncates float32 to bf16 in registers but rounds to nearest when
    storing, and the down GEMM's sums cancel (an ulp in h moves a small output by several of its own): so float32
    to 1e-5, 16-bit within 4 ulps of the largest output (a missing or misplaced up row is off by far more)."""
    from tokenfab.kernels.gpu.moe import fused_moe
    from tokenfab.layers.activation import silu_and_mul
    g = torch.Generator().manual_seed(4)
    T, E, k, hidden, inter = 13, 6, 3, 48, 40
    x = torch.randn(T, hidden, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, hidden, generator=g) / 4).to(dtype)
    w2 = (torch.randn(E, hidden, inter, generator=g) / 4).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    two = fused_moe(x, w13, w2, wts, ids, silu_and_mul)
    one = fused_moe(x, w13, w2, wts, ids, None)
    assert two.abs().max() > 0.1 and one.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-5)
    else:
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
        assert (one.float() - two.float()).abs().max() <= 4 * ulp * two.float().abs().max()
