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
