"""The pieces of the block-scaled scaled_mm path (kernels/gpu/fp8_scaled_mm.py) that run without a GPU: the 1 x 128
activation quantization kernel in Triton's interpreter against the formula written out in PyTorch (bit for bit),
the scale layouts against the shapes and strides torch's scaled_mm checks for BlockWise1x128 x BlockWise128x128,
the formula those scales feed against the published FP8 block formula, and the probe's refusal off NVIDIA GPUs.
scaled_mm itself needs an SM90 GPU: benchmarks/gpu_kernels.py compares it there."""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def act_quant_formula(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's act_quant per 1 x 128 block: s = amax / 448 (1 for an all-zero block), q = e4m3(x / s)."""
    M, K = x.shape
    kb = -(-K // 128)
    xp = torch.nn.functional.pad(x.float(), (0, kb * 128 - K)).reshape(M, kb, 128)
    amax = xp.abs().amax(-1)
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (xp / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(M, kb * 128)[:, :K]
    return q, s


@pytest.mark.parametrize("M,K", [(1, 128), (3, 200), (17, 384), (70, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_matches_the_formula(interpret, M, K, dtype):
    from tokenfab.kernels.gpu.fp8_scaled_mm import quantize_activation
    g = torch.Generator().manual_seed(M)
    x = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 10).to(dtype)
    x[0, :min(K, 128)] = 0  # an all-zero block: scale 1, codes 0
    q, s = quantize_activation(x)
    qw, sw = act_quant_formula(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (M, K)
    assert s.shape == (M, -(-K // 128)) and s.stride() == (1, M)  # scaled_mm's BlockWise1x128 layout
    assert torch.equal(s, sw)
    assert torch.equal(q.view(torch.uint8), qw.view(torch.uint8))
    # the dequantized activation is within half an e4m3 step (2^-4 relative) of x
    kb = torch.arange(K) // 128
    xd = q.float() * s[:, kb]
    assert ((xd - x.float()).abs() <= 2.0 ** -4 * x.float().abs() + 2.0 ** -9 * s[:, kb]).all()


def test_every_code_and_every_midpoint_rounds_as_torch_does(interpret):
    """Blocks whose amax is 448 (scale exactly 1): every finite e4m3 value, its negative, and every midpoint between
    neighbouring values (ties to even) and points just off them give torch's float8_e4m3fn conversion codes."""
    from tokenfab.kernels.gpu.fp8_scaled_mm import quantize_activation
    vals = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # codes 0..126: 0 .. 448
    mids = (vals[:-1] + vals[1:]) / 2
    rows = [vals, -vals, mids, mids * (1 + 2.0 ** -20), mids * (1 - 2.0 ** -20)]
    x = torch.stack([torch.cat([torch.tensor([448.0]), r, torch.zeros(127 - r.numel())]) for r in rows])
    q, s = quantize_activation(x)
    assert torch.equal(s, torch.ones(5, 1))
    assert torch.equal(q.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_weight_scale_layout_is_what_scaled_mm_checks():
    """[N/128, K/128] -> [L4, N/128] with strides [1, L4], L4 = K/128 rounded up to 4; the real entries unchanged."""
    from tokenfab.kernels.gpu.fp8_scaled_mm import activation_scale_layout, weight_scale_layout
    s = torch.rand(3, 5)
    b = weight_scale_layout(s)
    assert b.shape == (8, 3) and b.stride() == (1, 8)
    assert torch.equal(b[:5], s.t())
    a = activation_scale_layout(torch.rand(7, 5))
    assert a.shape == (7, 5) and a.stride() == (1, 7)


def test_block_formula_equals_the_published_one(interpret):
    """reference(): the quantized activation times the dequantized weight equals the float64 product of the
    dequantized activation and W = weight * scale_inv[n // 128, k // 128] within float32 rounding."""
    from tokenfab.kernels.gpu.fp8_scaled_mm import quantize_activation, reference
    g = torch.Generator().manual_seed(0)
    N, K = 256, 384
    w = (torch.randn(N, K, generator=g) * 0.05).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=g) + 0.5
    x = torch.randn(5, K, generator=g)
    q, sa = quantize_activation(x)
    xd = q.double() * sa.double().repeat_interleave(128, 1)
    wd = w.double() * s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    want = xd @ wd.T
    got = reference(x, w, s)
    assert ((got.double() - want).abs() <= (2 * K + 8) * 2.0 ** -24 * (xd.abs() @ wd.abs().T)).all()


def test_probe_refuses_off_nvidia_and_env_is_checked(monkeypatch):
    from tokenfab.kernels.gpu import fp8_scaled_mm
    assert fp8_scaled_mm.probe_result(torch.device("cpu")) == "not an NVIDIA CUDA device"
    assert not fp8_scaled_mm.applies(torch.zeros(1, 128, dtype=torch.bfloat16), 128, 128)
    monkeypatch.setenv("TOKENFAB_FP8_GEMM", "cublas")
    with pytest.raises(ValueError, match="TOKENFAB_FP8_GEMM"):
        fp8_scaled_mm.scaled_mm_ready(torch.device("cpu"))
