"""The Triton FP8 block-scaled linear (kernels/gpu/fp8_linear.py) in Triton's interpreter on CPU: its E4M3FN
decoding against torch's own float8_e4m3fn conversion for all 256 codes, and its products against the published
formula W = weight * weight_scale_inv[n // 128, k // 128] written out here, in float64, with partial edge blocks."""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")
U = 2.0 ** -24


def test_every_e4m3fn_code_decodes_as_torch_does(interpret):
    """Row n of the weight holds code n at input 0 (zeros elsewhere), x = e_0 and scale 1: y[0, n] is code n's
    value; NaN codes (0x7f, 0xff) give NaN, -0 gives -0."""
    from tokenfab.kernels.gpu.fp8_linear import fp8_block_linear
    codes = torch.arange(256, dtype=torch.uint8)
    w = torch.zeros(256, 128, dtype=torch.uint8)
    w[:, 0] = codes
    x = torch.zeros(1, 128)
    x[0, 0] = 1.0
    y = fp8_block_linear(x, w.view(torch.float8_e4m3fn), torch.ones(2, 1))[0]
    want = codes.view(torch.float8_e4m3fn).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(y), nan) and int(nan.sum()) == 2
    assert torch.equal(y[~nan], want[~nan])


def formula(x: torch.Tensor, w8: torch.Tensor, s: torch.Tensor, bias) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = w8.shape
    r = torch.arange(N) // 128
    c = torch.arange(K) // 128
    w = w8.view(torch.float8_e4m3fn).double() * s.double()[r][:, c]
    y = x.double() @ w.T
    bound = x.double().abs() @ w.abs().T
    if bias is not None:
        y, bound = y + bias.double(), bound + bias.double().abs()
    return y, bound


def random_fp8(N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 codes [N, K] (no NaN codes: their decoding is the test above) and scales
    [ceil(N / 128), ceil(K / 128)]."""
    g = torch.Generator().manual_seed(seed)
    w8 = torch.randint(0, 256, (N, K), generator=g, dtype=torch.int64).to(torch.uint8)
    w8[(w8 & 0x7F) == 0x7F] = 0x3C
    s = torch.rand(-(-N // 128), -(-K // 128), generator=g) * 1e-2 + 1e-3
    return w8, s


@pytest.mark.parametrize("M,N,K,split", [(1, 200, 200, None), (5, 128, 256, None), (40, 70, 130, None),
                                         (1, 130, 700, 3), (3, 256, 384, 2), (17, 100, 520, 5), (70, 48, 300, 1),
                                         (70, 136, 1000, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_match_the_formula(interpret, M, N, K, split, dtype):
    """Odd shapes (partial 128 blocks in N and K, M = 1 .. 70), forced K slices (split-K with the deterministic
    reduction; a split larger than useful is lowered so no slice is empty) and the chosen split, float32 (IEEE dot:
    the float32 bound) and bf16 activations (bf16 output: plus one bf16 rounding)."""
    from tokenfab.kernels.gpu.fp8_linear import fp8_block_linear
    w8, s = random_fp8(N, K, M + K)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g) if M % 2 else None
    y = fp8_block_linear(x, w8.view(torch.float8_e4m3fn), s, bias, split=split)
    want, bound = formula(x, w8, s, bias)
    tol = (2 * K + 8) * U * bound  # float32 products and sums: one rounding each, K terms
    if dtype == torch.bfloat16:
        tol = tol + 2.0 ** -7 * want.abs()  # the output's bf16 rounding (the interpreter may truncate)
    assert y.dtype == dtype and y.shape == (M, N)
    assert ((y.double() - want).abs() <= tol).all(), (y.double() - want).abs().max()


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("M", [1, 3])
def test_hardware_conversion_path_matches_the_formula(interpret, monkeypatch, split, M):
    """The path GPUs with FP8 conversions take (the weight bitcast to float8e4nv and converted by Triton, not the
    integer decoding), here in the interpreter, in the one-row kernel and the tile kernel: the same products within
    the float32 bound."""
    from tokenfab.kernels.gpu import fp8_linear
    monkeypatch.setattr(fp8_linear, "native_fp8", lambda device: True)
    w8, s = random_fp8(150, 300, 7)
    x = torch.randn(M, 300, generator=torch.Generator().manual_seed(7))
    y = fp8_linear.fp8_block_linear(x, w8.view(torch.float8_e4m3fn), s, split=split)
    want, bound = formula(x, w8, s, None)
    assert ((y.double() - want).abs() <= (2 * 300 + 8) * U * bound).all()


def test_split_results_are_identical_run_to_run(interpret):
    """Split-K sums the slices in a fixed order: two runs give the same bits, and leading dimensions pass through."""
    from tokenfab.kernels.gpu.fp8_linear import fp8_block_linear
    w8, s = random_fp8(64, 640, 1)
    x = torch.randn(2, 3, 640, generator=torch.Generator().manual_seed(1))
    a = fp8_block_linear(x, w8, s, split=5)
    b = fp8_block_linear(x, w8, s, split=5)
    assert a.shape == (2, 3, 64) and torch.equal(a, b)
    want, bound = formula(x.reshape(6, 640), w8, s, None)
    assert ((a.reshape(6, 64).double() - want).abs() <= (2 * 640 + 8) * U * bound).all()


def test_mismatched_scales_refused(interpret):
    from tokenfab.kernels.gpu.fp8_linear import fp8_block_linear
    w = torch.zeros(200, 200, dtype=torch.uint8)
    with pytest.raises(ValueError, match="128 x 128"):
        fp8_block_linear(torch.zeros(1, 200), w, torch.ones(1, 2))


def test_fp8_block_weight_takes_the_triton_kernel_where_it_applies(interpret, monkeypatch):
    """Fp8BlockWeight.linear: with the CPU kernel off and Triton applying (the interpreter here, GPU tensors in
    serving) the product comes from kernels/gpu/fp8_linear.py and equals the formula's within the float32 bound;
    with TOKENFAB_TRITON=0 the reference path runs instead."""
    from tokenfab.kernels.gpu import fp8_linear as triton_fp8_linear
    from tokenfab.quant.fp8_block_weight import Fp8BlockWeight
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", "torch")
    g = torch.Generator().manual_seed(3)
    w8 = torch.randint(0, 256, (150, 200), generator=g, dtype=torch.int64).to(torch.uint8)
    w8[(w8 & 0x7F) == 0x7F] = 0x38
    s = torch.rand(2, 2, generator=g) * 1e-2 + 1e-3
    w = Fp8BlockWeight(w8.view(torch.float8_e4m3fn), s)
    w.prepare()
    x = torch.randn(3, 200, generator=g)
    calls = []
    real = triton_fp8_linear.fp8_block_linear
    monkeypatch.setattr(triton_fp8_linear, "fp8_block_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    y = w.linear(x, None)
    want, bound = formula(x, w8, s, None)
    assert calls and ((y.double() - want).abs() <= (2 * 200 + 8) * U * bound).all()
    monkeypatch.setenv("TOKENFAB_TRITON", "0")
    w.linear(x, None)
    assert len(calls) == 1
