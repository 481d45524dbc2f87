"""The Triton RMSNorm (+ residual add) and SiLU-GLU kernels (kernels/gpu/norm_activation.py) in Triton's interpreter on
CPU, against the layers' own PyTorch paths (layers/norm.py, layers/activation.py, the kernel seam switched off).

float32 outputs agree to float32 rounding (the sum of squares is added in another order). bf16 outputs round the
same float32 values at the same places, but Triton's interpreter converts float32 to bf16 by truncation where GPUs
(and PyTorch) round to nearest even, so here each bf16 rounding may be one ulp off: the residual sum within one bf16
ulp (2^-7 relative), outputs with two roundings in their chain within two (2^-6), checked at 2^-5. A wrong
statistic, weight or gate/up half moves outputs by far more.
"""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels import dispatch
from tokenfab.kernels.gpu import support as triton_support
from tokenfab.layers.activation import silu_and_mul as reference_silu_and_mul
from tokenfab.layers.norm import RMSNorm

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def reference_path(monkeypatch):
    """Switch the seam off so the layers run their PyTorch reference math."""
    monkeypatch.setattr(dispatch, "rms_norm", lambda *a, **k: None)
    monkeypatch.setattr(dispatch, "silu_and_mul", lambda *a, **k: None)


def assert_matches(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.float(), want.float()
    if want.dtype == torch.float32:
        torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-6)
        return
    assert ((g - w).abs() <= 2.0 ** -5 * w.abs() + 1e-6).all(), (g - w).abs().max()


@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96), (3, 1000)])  # 1000: not a power of two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_layer(interpret, monkeypatch, rows, hidden, dtype, with_residual):
    from tokenfab.kernels.gpu.norm_activation import rms_norm
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    res = torch.randn(rows, hidden, generator=g).to(dtype) if with_residual else None
    norm = RMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g))
    got = rms_norm(x, norm.weight.detach(), 1e-5, res)
    reference_path(monkeypatch)
    with torch.no_grad():
        want = norm(x, res)
    if with_residual:
        h, hw = got[1].float(), want[1].float()
        assert got[1].dtype == dtype and ((h - hw).abs() <= 2.0 ** -7 * hw.abs()).all()  # x + residual, one rounding
        assert_matches(got[0], want[0])
    else:
        assert_matches(got, want)


@pytest.mark.parametrize("rows,inter", [(1, 8), (4, 1500), (7, 2048)])  # 1500: a partial block of 1024
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_layer(interpret, monkeypatch, rows, inter, dtype):
    from tokenfab.kernels.gpu.norm_activation import silu_and_mul
    gate_up = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype)
    got = silu_and_mul(gate_up)
    reference_path(monkeypatch)
    assert_matches(got, reference_silu_and_mul(gate_up))


def test_seam_keeps_cpu_tensors_on_the_cpu_path(interpret):
    """In interpreter mode the Triton kernels take CPU tensors only when called directly: the seam sends CPU
    tensors to the C++ kernels (or the reference), never to Triton."""
    x = torch.randn(2, 64)
    assert not dispatch._gpu(x)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 24])  # 24: a half of 12, not a power of two
def test_rope_matches_the_layer(interpret, monkeypatch, interleave, dtype, dim):
    from tokenfab.kernels.gpu.norm_activation import rope
    from tokenfab.layers.rotary import RotaryEmbedding
    from tokenfab.model_config import RopeConfig
    rot = RotaryEmbedding(RopeConfig(dim=dim, theta=10000.0, interleave=interleave), 256, 256)
    g = torch.Generator().manual_seed(dim)
    q = (torch.randn(7, 6, dim, generator=g) * 2).to(dtype)
    k = (torch.randn(7, 2, dim, generator=g) * 2).to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 100, 200, 255])
    got = (rope(q, positions, rot.cos, rot.sin, interleave), rope(k, positions, rot.cos, rot.sin, interleave))
    monkeypatch.setattr(dispatch, "rope", lambda *a, **kw: None)
    want = rot(positions, q, k)
    if dtype == torch.float32:
        for a, b in zip(got, want):
            assert_matches(a, b)
        return
    # bf16: three roundings per output (two products, their sum), each within a bf16 ulp of |x1 c| + |x2 s| here
    # and in the reference: the difference is within 6 ulps of that magnitude (the outputs may cancel to ~0)
    c = rot.cos[positions].unsqueeze(1).to(dtype).float()
    s = rot.sin[positions].unsqueeze(1).to(dtype).float()
    for x, a, b in zip((q, k), got, want):
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else x.float().chunk(2, dim=-1)
        x1, x2 = x1.float().abs(), x2.float().abs()
        mag = torch.cat([x1 * c.abs() + x2 * s.abs(), x2 * c.abs() + x1 * s.abs()], dim=-1)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert ((a.float() - b.float()).abs() <= 6 * 2.0 ** -7 * mag + 1e-6).all()
