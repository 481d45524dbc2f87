"""The AVX2 kernel of INT4 group-32 and MXFP4 routed-expert stacks (kernels/cpu/csrc/packed_experts_avx2.cpp), the
packed expert path of CPUs without AVX512-BF16: its grouped products against a float64 matmul with the stack's
dequantized weights (test_packed_experts.py's stacks, whose values are checked there against compressed-tensors'
own unpackers) for segments of 1-16 tokens (the register GEMV, passes of one to four tokens) and longer ones (64-row
panels and a float32 GEMM), partial row blocks, bf16 and fp16 INT4 scales, E8M0's 2^-127 and NaN scales; named
errors; and the stack's choice at the avx2 level.

The kernel runs on any x86-64 CPU with AVX2 + FMA + F16C (AVX512 machines too: the tests call it directly, and cap
the kernels at the avx2 level where they test the stack's choice)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("compressed_tensors")

from test_packed_experts import _stack  # noqa: E402
from tokenfab.kernels.cpu import build as cpu_build  # noqa: E402
from tokenfab.kernels.cpu.ops import packed_experts as cpu_packed_experts  # noqa: E402

needs_kernel = pytest.mark.skipif(
    cpu_build.load() is None or not getattr(cpu_build.load(), "packed_experts_avx2_built", False),
    reason="the fused CPU kernels are not built here, or without AVX2 / FMA / F16C")
FMT = {"int4": 0, "mxfp4": 1}


def _segments(counts):
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    return torch.tensor(offs, dtype=torch.int64)


def _check(y, x, st, experts, counts):
    """y within float32 summation error of the float64 product of each segment with its expert's weight:
    |y - x W^T| <= 2 K 2^-24 |x| |W|^T (+ the smallest subnormal, for values near 2^-127 scales)."""
    K = x.shape[1]
    b = 0
    for e, n in zip(experts, counts):
        w = st.dequantize_expert(e).double()
        xs = x[b:b + n].double()
        want, scale = xs @ w.t(), xs.abs() @ w.abs().t()
        assert ((y[b:b + n].double() - want).abs() <= 2 * K * 2.0 ** -24 * scale + 2.0 ** -149).all(), \
            f"expert {e}: {(y[b:b + n].double() - want).abs().max():.3e}"
        b += n


@needs_kernel
@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("K,rows", [(96, 42), (160, 42), (64, 100)])
def test_grouped_products_within_the_float32_bound(fmt, K, rows):
    """6 experts of 42 rows (two 16-row blocks and a 10-row one; one partial 64-row panel) or 100 (a whole panel and
    a partial one): segments of 1, 2, 7, 16 tokens (register GEMV: passes of 1, 2, 4 + 3 and 4 x 4 tokens) and 17,
    70 (panels and the GEMM), an empty one between."""
    g = torch.Generator().manual_seed(K)
    st = _stack(fmt, 6, rows, K, g)
    experts, counts = [0, 2, 5, 3, 4, 1, 2], [1, 2, 0, 7, 16, 17, 70]
    x = torch.randn(sum(counts), K, generator=g)
    y = cpu_packed_experts.packed_experts_avx2(x, FMT[fmt], st.packed, st.scale, torch.tensor(experts),
                                               _segments(counts))
    assert y.dtype == torch.float32 and y.shape == (sum(counts), rows)
    _check(y, x, st, experts, counts)


@needs_kernel
def test_int4_fp16_scales():
    g = torch.Generator().manual_seed(2)
    st = _stack("int4", 2, 20, 64, g)
    st.scale = (st.scale.float() * 0.5).half()  # fp16 scales, as a checkpoint may carry
    x = torch.randn(21, 64, generator=g)
    y = cpu_packed_experts.packed_experts_avx2(x, 0, st.packed, st.scale, torch.tensor([1, 0]), _segments([3, 18]))
    _check(y, x, st, [1, 0], [3, 18])


@needs_kernel
def test_mxfp4_scale_bytes_0_and_255():
    """E8M0 0 is 2^-127 (a float32 subnormal): a row with that scale gives the exact tiny sums, nonzero; a NaN scale
    (255) gives NaN in its row alone, on the GEMV (1, 5 tokens) and the GEMM (20 tokens)."""
    g = torch.Generator().manual_seed(9)
    st = _stack("mxfp4", 1, 20, 96, g)
    st.scale[0, 3, :] = 0
    st.scale[0, 7, 1] = 255
    w = st.dequantize_expert(0).double()
    for T in (1, 5, 20):
        x = torch.randn(T, 96, generator=g)
        y = cpu_packed_experts.packed_experts_avx2(x, 1, st.packed, st.scale, torch.tensor([0]), _segments([T]))
        assert torch.isnan(y[:, 7]).all() and not torch.isnan(y[:, :7]).any() and not torch.isnan(y[:, 8:]).any()
        want = x.double() @ w[3]
        assert ((y[:, 3].double() - want).abs() <= 2 * 96 * 2.0 ** -24 * (x.double().abs() @ w[3].abs())
                + 2.0 ** -149).all()
        assert (y[:, 3] != 0).all()


@needs_kernel
def test_errors_are_named():
    g = torch.Generator().manual_seed(1)
    st = _stack("mxfp4", 2, 16, 64, g)
    x, ids, offs = torch.randn(3, 64), torch.tensor([1]), _segments([3])
    with pytest.raises(RuntimeError, match="format 2 is not int4"):
        cpu_packed_experts.packed_experts_avx2(x, 2, st.packed, st.scale, ids, offs)
    with pytest.raises(RuntimeError, match="x must be float32"):
        cpu_packed_experts.packed_experts_avx2(x.bfloat16(), 1, st.packed, st.scale, ids, offs)
    with pytest.raises(RuntimeError, match="offsets must run from 0 to N"):
        cpu_packed_experts.packed_experts_avx2(x, 1, st.packed, st.scale, ids, _segments([2]))
    with pytest.raises(RuntimeError, match="bad expert id"):
        cpu_packed_experts.packed_experts_avx2(x, 1, st.packed, st.scale, torch.tensor([2]), offs)
    with pytest.raises(RuntimeError, match="int4 packed must be int32"):
        cpu_packed_experts.packed_experts_avx2(x, 0, st.packed, st.scale, ids, offs)


@pytest.fixture
def avx2_level(avx2_isa_cap, monkeypatch):
    """The kernels capped at the avx2 level (no AVX512-BF16 expert kernel), TOKENFAB_PACKED_EXPERTS unset."""
    monkeypatch.delenv("TOKENFAB_PACKED_EXPERTS", raising=False)


@needs_kernel
@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stack_takes_the_kernel_at_the_avx2_level(avx2_level, monkeypatch, fmt, dtype):
    """At the avx2 level a stack takes the AVX2 kernel in its checkpoint layout (no tiles): grouped_linear gives
    the kernel's product rounded once to x's dtype; TOKENFAB_PACKED_EXPERTS=torch keeps the reference path."""
    g = torch.Generator().manual_seed(4)
    st = _stack(fmt, 3, 40, 128, g)
    st.prepare()
    assert st._avx2 and not st._kernel and not st.cpu_tiles
    experts, counts = [2, 0], [3, 20]
    x = torch.randn(23, 128, generator=g).to(dtype)
    got = st.grouped_linear(x, experts, counts)
    direct = cpu_packed_experts.packed_experts_avx2(x.float(), FMT[fmt], st.packed, st.scale, torch.tensor(experts),
                                                    _segments(counts))
    assert got.dtype == dtype and torch.equal(got, direct.to(dtype))
    monkeypatch.setenv("TOKENFAB_PACKED_EXPERTS", "torch")
    st.prepare()
    assert not st._avx2 and not st._kernel
    ref = st.grouped_linear(x, experts, counts)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert ((got.double() - ref.double()).abs() <= tol * (ref.double().abs() + 1)).all()
