"""Batched decode of packed Q4_0 / Q4_1 / Q8_0 linears on int8 activations (kernels/cpu/csrc/gguf_gemv_i8.h): an
opt-in (TOKENFAB_GGUF_INT8_ACT=1; here switched on through the binding) for bf16 x of 5..16 rows, on CPUs without AMX
(or with TOKENFAB_CPU_ISA below amx).

The reference is the definition, computed here independently in PyTorch: each row of x quantized per 32 inputs
(amax = max |x|, qx = round-half-even(x * (127 / amax)) in float32, dx = amax / 127), then per block
y += d * dx * sum_k q_k qx_k (Q4_0: q - 8; Q4_1: + m * sum_k x_k; the weight's fields read from the GGUF rows
gguf-py wrote, not from the packed tiles), in float64. The kernel's integer sums are exact and each block adds three
float32 roundings (d * dx, the fma, Q4_1's fma of a float32 block sum of x), so with
S = sum_b (|d dx| sum_k |q_k qx_k| + |m| sum_k |x_k|) (+ |bias|) it is within (K + 64) u S of the reference, plus one
bf16 rounding for bf16 outputs. A wrong nibble order, pair order, scale or offset moves outputs by O(S).
Independently of the kernel, the definition is also within sum_k |w_k| dx_b / 2 of the exact product (the activation
rounding alone): checked for the kernel's outputs too.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_helpers import U, int8_activations  # noqa: E402
from test_gguf_linear import check_close  # noqa: E402
from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf  # noqa: E402
from tokenfab.quant import gguf_blocks  # noqa: E402
from tokenfab.quant.gguf_weight import GGUFWeight  # noqa: E402

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}

needs_int8 = pytest.mark.skipif(not cpu_gguf.gguf_int8_available(),
                                reason="the int8-activation GEMV does not run here (no kernels with AVX512-BF16 and "
                                       "AVX512-VNNI, or an AMX path)")


@pytest.fixture
def int8_on():
    with int8_activations(True):
        yield


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qx [M, K / 32, 32] integer-valued float32, dx [M, K / 32] float32) as the definition above."""
    xf = x.float().reshape(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(xf * inv.unsqueeze(-1)), amax / 127.0


def reference(x: torch.Tensor, raw: np.ndarray, name: str, bias: torch.Tensor | None):
    """(float64 definition [M, n], its bound's S [M, n], float64 exact product x W^T (+ b), activation bound)."""
    bt = gguf_blocks.block_type(name)
    d, m, q = gguf_blocks._fields(torch.from_numpy(raw), bt)  # [n, KB], [n, KB] | None, [n, KB, 32]
    q = q.double() - (8 if bt is gguf_blocks.Q4_0 else 0)
    qx, dx = quantize_rows(x)
    ddx = d.double().unsqueeze(0) * dx.double().unsqueeze(1)  # [M, n, KB]
    y = (torch.einsum("nbk,mbk->mnb", q, qx.double()) * ddx).sum(-1)
    s = (torch.einsum("nbk,mbk->mnb", q.abs(), qx.double().abs()) * ddx.abs()).sum(-1)
    x64 = x.double().reshape(x.shape[0], -1, 32)
    if m is not None:
        y += (m.double().unsqueeze(0) * x64.sum(-1).unsqueeze(1)).sum(-1)
        s += (m.double().abs().unsqueeze(0) * x64.abs().sum(-1).unsqueeze(1)).sum(-1)
    w = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])))
    exact = x.double() @ w.double().T
    act = (w.double().abs().reshape(w.shape[0], -1, 32).sum(-1).unsqueeze(0) * dx.double().unsqueeze(1) / 2).sum(-1)
    if bias is not None:
        y, s, exact = y + bias.double(), s + bias.double().abs(), exact + bias.double()
    return y, s, exact, act


@needs_int8
@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("rows", [5, 8, 9, 16])
def test_int8_rows_match_their_definition(int8_on, name, rows):
    n, k = 40, 192  # n: a partial last tile; k: 6 blocks
    rng = np.random.default_rng(rows)
    raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType[name])
    w = GGUFWeight.from_rows(torch.from_numpy(raw), name, k)
    w.prepare()
    torch.manual_seed(rows)
    x = torch.randn(rows, k).to(torch.bfloat16)
    x[0, 32:64] = 0  # an all-zero block: amax 0, qx 0, dx 0
    x[1, :32] *= 1000  # one large block beside small ones: scales are per block
    bias = torch.randn(n) if rows == 9 else None
    assert cpu_gguf.gguf_int8_path(TYPES[name], rows, torch.bfloat16)
    y_ref, s, exact, act = reference(x, raw, name, bias)
    tol = (k + 64) * U * s
    y32 = w.linear_f32(x, bias)
    err = (y32.double() - y_ref).abs()
    assert (err <= tol).all(), f"max err {err.max():.3g}, tol {tol.max():.3g}"
    y = w.linear(x, bias)
    assert y.dtype == torch.bfloat16
    assert ((y.double() - y_ref).abs() <= tol + 2.0 ** -8 * y_ref.abs()).all()
    # the activation rounding is the only approximation: within its bound of the exact product
    assert ((y32.double() - exact).abs() <= act + tol).all()
    # ... and it does happen (the exact GEMV's outputs are not the same values)
    assert not torch.allclose(y32.double(), exact, rtol=0, atol=1e-4)


@needs_int8
def test_int8_off_and_rows_outside_keep_the_exact_product(int8_on):
    """The setting off (the default) and row counts outside 5..16 give the exact GEMV / brgemm products: within the
    exact bound of test_gguf_linear.py, far inside the activation rounding."""
    name, n, k = "Q4_1", 24, 128
    raw = gguf.quants.quantize(np.random.default_rng(7).standard_normal((n, k)).astype(np.float32),
                               gguf.GGMLQuantizationType[name])
    w = GGUFWeight.from_rows(torch.from_numpy(raw), name, k)
    w.prepare()

    def check(rows: int) -> None:  # more than 16 rows (prefill) multiply the weight rounded once to bf16
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        check_close(w.linear_f32(x), x, raw, name, None, bf16_weight=rows > 16)

    assert cpu_gguf.gguf_int8_path(3, 8, torch.bfloat16)
    for rows in (4, 17):
        assert not cpu_gguf.gguf_int8_path(3, rows, torch.bfloat16)
        check(rows)
    assert not cpu_gguf.gguf_int8_path(3, 8, torch.float32)  # float32 x keeps float32 accuracy
    cpu_gguf.gguf_int8_activations(False)
    assert not cpu_gguf.gguf_int8_path(3, 8, torch.bfloat16)
    check(8)


def test_int8_setting_is_checked(monkeypatch):
    from tokenfab.errors import EngineConfigError
    for value, on in (("", False), ("0", False), ("1", True)):
        monkeypatch.setenv(cpu_gguf.INT8_ENV, value)
        assert cpu_gguf.gguf_int8_setting() is on
    monkeypatch.setenv(cpu_gguf.INT8_ENV, "yes")
    with pytest.raises(EngineConfigError, match="TOKENFAB_GGUF_INT8_ACT='yes'.*use 1"):
        cpu_gguf.gguf_int8_setting()
