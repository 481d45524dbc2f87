"""The AVX2 kernel of packed Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K linears (kernels/cpu/csrc/gguf_gemv_avx2.cpp),
the packed path of CPUs without AVX512-BF16: its products against the float64 product with gguf's own dequantized
weight, under the bounds test_gguf_linear.py and test_gguf_kquants.py derive, for one row (quants in registers), row
pairs over the unpacked buffer, odd row counts, more than 16 rows (panels dequantized for a float32 GEMM, several
panels and the narrowest), partial tiles, biases and every nibble / int8 / high-bit / 6-bit scale pattern; and the
weight's choice at the avx2 level (every row on the kernel, no float32 copy; test_dense_fallback.py covers the copy
that formats without a kernel keep).

The kernel runs on any x86-64 CPU with AVX2 + FMA + F16C (AVX512 machines too: the tests call it directly, and
cap the kernels at the avx2 level where they test the weight's choice)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import test_gguf_kquants  # noqa: E402
from test_gguf_kquants import random_kblocks  # noqa: E402
from test_gguf_linear import check_close, quantized, random_blocks  # noqa: E402
from tokenfab.kernels.cpu import build as cpu_build  # noqa: E402
from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf  # noqa: E402
from tokenfab.quant import packed_weight  # noqa: E402
from tokenfab.quant.gguf_weight import GGUFWeight  # noqa: E402

TYPES = ["Q4_0", "Q4_1", "Q8_0"]
KTYPES = ["Q4_K", "Q5_K", "Q6_K"]
needs_kernel = pytest.mark.skipif(not getattr(cpu_build.load(), "gguf_gemv_avx2_built", False),
                                  reason="the fused CPU kernels are not built here, or without AVX2 / FMA / F16C")


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 40])  # 17+: the dequantizing GEMM
@pytest.mark.parametrize("source", ["quantize", "random"])
def test_products_within_the_exact_bound(name, rows, source):
    """40 outputs (a partial 16-row tile) x 160 inputs (5 blocks), a bias for odd row counts: float32 outputs
    within (3K + 64) u S of the float64 product with gguf's dequantized weight."""
    raw = (quantized if source == "quantize" else random_blocks)(name, 40, 160, seed=rows)
    _check_products(name, raw, 160, rows, check_close)


def _check_products(name, raw, k, rows, check):
    """rows x k random inputs (a bias for odd row counts) through the kernel: float32 [rows, n], within ``check``'s
    bound of the float64 product with gguf's weight."""
    n = raw.shape[0]
    w = GGUFWeight.from_rows(torch.from_numpy(raw), name, k)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g) if rows % 2 else None
    y = cpu_gguf.gguf_gemv_avx2(x, w.tiles, w.block.ggml_type, n, bias)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    check(y, x, raw, name, bias)


@needs_kernel
@pytest.mark.parametrize("name", KTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 40])  # 17+: the dequantizing GEMM
def test_kquant_products_within_the_exact_bound(name, rows):
    """K-quants: 40 outputs x 512 inputs (2 super-blocks of random bytes: every quant, high-bit and 6-bit scale
    pattern), a bias for odd row counts: float32 outputs within test_gguf_kquants' bound of the float64 product
    with gguf's dequantized weight."""
    _check_products(name, random_kblocks(name, 40, 512, seed=rows), 512, rows, test_gguf_kquants.check_close)


@needs_kernel
@pytest.mark.parametrize("name,n,k", [("Q4_1", 600, 256), ("Q6_K", 600, 256), ("Q8_0", 40, 8448),
                                      ("Q4_K", 40, 8448)])
@pytest.mark.parametrize("rows", [19, 131])
def test_prefill_panels(name, n, k, rows):
    """More than 16 rows across panel edges, in both GEMM forms (19 rows: 64-column panels over threads; 131: wide
    panels shared by the threads): 600 outputs at K = 256 (a 512-column wide panel, then 88 columns of a partial
    tile) and K = 8,448 (wide panels of the narrowest 64 columns): within the exact bound."""
    kq = name in KTYPES
    raw = random_kblocks(name, n, k, seed=1) if kq else random_blocks(name, n, k, seed=1)
    w = GGUFWeight.from_rows(torch.from_numpy(raw), name, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4))
    y = cpu_gguf.gguf_gemv_avx2(x, w.tiles, w.block.ggml_type, n, bias)
    (test_gguf_kquants.check_close if kq else check_close)(y, x, raw, name, bias)


@needs_kernel
def test_leading_dims_strided_rows_and_errors():
    """[2, 3, K] input gives the rows' products in that shape; a row-strided view equals its contiguous copy;
    bf16 x, a type it does not read (Q2_K) and mis-shaped tiles are refused by name."""
    raw = quantized("Q4_1", 24, 64, seed=2)
    w = GGUFWeight.from_rows(torch.from_numpy(raw), "Q4_1", 64)
    x = torch.randn(2, 3, 64)
    y = cpu_gguf.gguf_gemv_avx2(x, w.tiles, 3, 24)
    assert y.shape == (2, 3, 24)
    assert torch.equal(y.reshape(6, 24), cpu_gguf.gguf_gemv_avx2(x.reshape(6, 64), w.tiles, 3, 24))
    wide = torch.randn(4, 128)[:, :64]  # rows 128 apart
    assert torch.equal(cpu_gguf.gguf_gemv_avx2(wide, w.tiles, 3, 24),
                       cpu_gguf.gguf_gemv_avx2(wide.contiguous(), w.tiles, 3, 24))
    with pytest.raises(RuntimeError, match="x must be float32"):
        cpu_gguf.gguf_gemv_avx2(x.bfloat16(), w.tiles, 3, 24)
    with pytest.raises(RuntimeError, match="ggml type 10 is not Q4_0"):
        cpu_gguf.gguf_gemv_avx2(x, w.tiles, 10, 24)
    with pytest.raises(RuntimeError, match="does not hold 24 rows of 96 inputs"):
        cpu_gguf.gguf_gemv_avx2(torch.randn(1, 96), w.tiles, 3, 24)


@pytest.fixture
def avx2_level(avx2_isa_cap, monkeypatch):
    """The kernels capped at the avx2 level (no AVX512-BF16 GEMV), the float32 copies' budget at its default."""
    monkeypatch.delenv("TOKENFAB_CPU_LINEAR", raising=False)
    monkeypatch.delenv(packed_weight.DENSE_FALLBACK_ENV, raising=False)
    monkeypatch.setattr(packed_weight, "_DENSE_BYTES", [0])


@needs_kernel
@pytest.mark.parametrize("name", TYPES + KTYPES)
def test_weight_runs_every_row_on_the_kernel_at_the_avx2_level(avx2_level, monkeypatch, name):
    """At the avx2 level a Q4_0 / Q4_1 / Q8_0 / K-quant weight keeps no float32 copy and takes the AVX2 kernel for
    decode rows (16) and prefill rows (17) alike, bf16 x widened and the result rounded once: each result equals
    the kernel's product, within the exact bound."""
    kq = name in KTYPES
    k = 256 if kq else 96
    raw = random_kblocks(name, 40, k, seed=4) if kq else quantized(name, 40, k, seed=4)
    calls = []
    real = cpu_gguf.gguf_gemv_avx2
    monkeypatch.setattr(cpu_gguf, "gguf_gemv_avx2", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    w = GGUFWeight.from_rows(torch.from_numpy(raw), name, k)
    w.prepare()
    assert w._gemv_avx2 and not w._kernel and w._dense is None and packed_weight._DENSE_BYTES == [0]
    x16, x17 = torch.randn(16, k), torch.randn(17, k)
    assert torch.equal(w.linear(x16, None), real(x16, w.tiles, w.block.ggml_type, 40))
    y17 = w.linear(x17, None)
    assert torch.equal(y17, real(x17, w.tiles, w.block.ggml_type, 40))
    (test_gguf_kquants.check_close if kq else check_close)(y17, x17, raw, name, None)
    xb = torch.randn(3, k).bfloat16()
    assert torch.equal(w.linear(xb, None), real(xb.float(), w.tiles, w.block.ggml_type, 40).bfloat16())
    assert torch.equal(w.linear_f32(xb), real(xb.float(), w.tiles, w.block.ggml_type, 40))
    assert calls == [16, 17, 3, 3]


@needs_kernel
def test_joined_weights_keep_the_choice(avx2_level):
    """q|k|v joined after load (Linear.concat -> prepare) keep the GEMV and give the rows of the three products."""
    from tokenfab.layers.linear import Linear
    parts = []
    for i, n in enumerate((32, 16, 16)):
        lin = Linear(64, n, bias=False)
        lin.set_qweight(GGUFWeight.from_rows(torch.from_numpy(quantized("Q8_0", n, 64, seed=i)), "Q8_0", 64))
        lin.fuse()
        parts.append(lin)
    x = torch.randn(2, 64)
    want = torch.cat([p.qweight.linear(x, None) for p in parts], dim=-1)
    fused = Linear.concat(parts)
    assert fused.qweight._gemv_avx2
    torch.testing.assert_close(fused.qweight.linear(x, None), want, rtol=0, atol=0)
