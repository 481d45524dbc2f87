"""The AVX2 kernel of FP8 block-scaled linears (kernels/cpu/csrc/fp8_linear_avx2.cpp), the FP8 path of CPUs without
AVX512-BF16: products against the published formula's float32 product (test_fp8_block_weight.py's helpers and float32
bound) for the GEMV (1-16 rows: single rows and passes of up to four) and the converted panels (17+ rows, a partial
64-row panel and partial 128-blocks), every e4m3 code decoded exactly (identity rows), named errors, and the weight's
choice at the avx2 level (no float32 copy kept); its grouped form over routed-expert stacks (fp8_experts_avx2: gate|up
parts with their own partial blocks, GEMV and panel segments, every code, named errors, the stack's choice). NaN
codes: test_fp8_block_weight.py and test_fp8_block_experts.py, for both kernels.

The kernel runs on any x86-64 CPU with AVX2 + FMA + F16C (AVX512 machines too: the tests call it directly, and cap
the kernels at the avx2 level where they test the weight's choice)."""
from __future__ import annotations

import pytest
import torch

from test_fp8_block_weight import formula, fp32_bound, random_fp8
from tokenfab.kernels.cpu import build as cpu_build
from tokenfab.kernels.cpu.ops import fp8_linear as cpu_fp8
from tokenfab.quant import packed_weight
from tokenfab.quant.fp8_block_weight import Fp8BlockWeight

needs_kernel = pytest.mark.skipif(
    cpu_build.load() is None or not getattr(cpu_build.load(), "fp8_block_linear_avx2_built", False),
    reason="the fused CPU kernels are not built here, or without AVX2 / FMA / F16C")


@needs_kernel
@pytest.mark.parametrize("n,k", [(200, 320), (256, 160), (96, 32)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 17, 70])
def test_products_within_the_float32_bound(n, k, m):
    q, s = random_fp8(n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    bias = torch.randn(n)
    y = cpu_fp8.fp8_block_linear_avx2(x, q, s, bias)
    W = formula(q, s)
    ref = torch.nn.functional.linear(x, W) + bias
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert ((y - ref).abs() <= fp32_bound(x, W) + bias.abs() * 2 ** -23).all(), (y - ref).abs().max()


@needs_kernel
@pytest.mark.parametrize("m", [1, 4, 16, 40])  # GEMV passes, then the converted panels
def test_every_e4m3_code_decodes_exactly(m):
    """x = rows of the identity: y[i, r] = W[r, i] exactly (one exact product), so the fp16 route of every code
    (subnormals, signed zeros) and the block scaling are checked bit for bit against the formula."""
    q, s = random_fp8(200, 160, seed=3)
    eye = torch.eye(160)
    y = torch.cat([cpu_fp8.fp8_block_linear_avx2(eye[i:i + m], q, s) for i in range(0, 160, m)])
    assert torch.equal(y, formula(q, s).T)


@needs_kernel
def test_errors_are_named():
    q, s = random_fp8(64, 64, seed=1)
    with pytest.raises(RuntimeError, match="x must be float32"):
        cpu_fp8.fp8_block_linear_avx2(torch.randn(2, 64).bfloat16(), q, s)
    with pytest.raises(RuntimeError, match="x has 48 inputs for w"):
        cpu_fp8.fp8_block_linear_avx2(torch.randn(2, 48), q, s)
    with pytest.raises(RuntimeError, match="scale_inv must be contiguous float32"):
        cpu_fp8.fp8_block_linear_avx2(torch.randn(2, 64), q, s.double())
    with pytest.raises(RuntimeError, match="bias has 3 values for 64 outputs"):
        cpu_fp8.fp8_block_linear_avx2(torch.randn(2, 64), q, s, torch.randn(3))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_takes_the_kernel_at_the_avx2_level(avx2_isa_cap, monkeypatch, dtype):
    """At the avx2 level an FP8 weight takes the AVX2 kernel for decode and prefill rows, keeps no float32 copy,
    rounds the float32 result once to x's dtype, and joined q_a | kv_a rows keep the choice."""
    monkeypatch.delenv("TOKENFAB_CPU_LINEAR", raising=False)
    monkeypatch.setattr(packed_weight, "_DENSE_BYTES", [0])
    parts = [Fp8BlockWeight(*random_fp8(128, 96, seed=i)) for i in range(2)]
    for p in parts:
        p.prepare()
        assert p._avx2 and not p._kernel and p._dense is None
    for m in (3, 20):
        x = torch.randn(m, 96).to(dtype)
        want = cpu_fp8.fp8_block_linear_avx2(x.float(), parts[0].weight, parts[0].scale_inv).to(dtype)
        assert torch.equal(parts[0].linear(x, None), want)
    joined = Fp8BlockWeight.concat(parts)
    assert joined._avx2
    x = torch.randn(2, 96)
    torch.testing.assert_close(joined.linear(x, None), torch.cat([p.linear(x, None) for p in parts], -1),
                               rtol=0, atol=0)


def _offsets(counts):
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    return torch.tensor(offs, dtype=torch.int64)


@needs_kernel
def test_grouped_expert_products_within_the_float32_bound():
    """fp8_experts_avx2 over a gate|up stack of 6 experts (I = 200: each part's last 128-row block partial, so a
    part's rows must take its own block rows; H = 160: a partial 32-column block) for segments of 1, 2, 3, 5 and 16
    tokens (the GEMV), 17 and 70 (converted 64-row panels, a partial last one), an empty one between: each within
    the float32 bound of the formula's weights."""
    from test_fp8_block_experts import gate_up_stack
    st, W = gate_up_stack(6, 200, 160, seed=4)
    experts, counts = [3, 0, 5, 1, 4, 2, 0, 3], [1, 2, 0, 3, 5, 16, 17, 70]
    x = torch.randn(sum(counts), 160, generator=torch.Generator().manual_seed(8))
    y = cpu_fp8.fp8_experts_avx2(x, st.packed, st.scale, torch.tensor(experts), _offsets(counts), 200)
    assert y.dtype == torch.float32 and y.shape == (sum(counts), 400)
    b = 0
    for e, n in zip(experts, counts):
        ref = x[b:b + n].double() @ W[e].double().T
        assert ((y[b:b + n].double() - ref).abs() <= fp32_bound(x[b:b + n], W[e])).all(), (e, n)
        b += n


@needs_kernel
@pytest.mark.parametrize("m", [1, 4, 16, 40])
def test_grouped_every_e4m3_code_and_part_scale_exact(m):
    """Identity rows through each expert: y = W_e^T bit for bit, every finite code in both parts' blocks."""
    from test_fp8_block_experts import gate_up_stack
    st, W = gate_up_stack(2, 200, 160, seed=5)
    eye = torch.eye(160)
    for e in range(2):
        y = torch.cat([cpu_fp8.fp8_experts_avx2(eye[i:i + m], st.packed, st.scale, torch.tensor([e]),
                                                _offsets([len(eye[i:i + m])]), 200) for i in range(0, 160, m)])
        assert torch.equal(y, W[e].T), e


@needs_kernel
def test_grouped_errors_are_named():
    from test_fp8_block_experts import gate_up_stack
    st, _ = gate_up_stack(2, 64, 64, seed=1)
    x, ids, offs = torch.randn(3, 64), torch.tensor([1]), _offsets([3])
    with pytest.raises(RuntimeError, match="x must be float32"):
        cpu_fp8.fp8_experts_avx2(x.bfloat16(), st.packed, st.scale, ids, offs, 64)
    with pytest.raises(RuntimeError, match="part_rows 48 does not divide n 128"):
        cpu_fp8.fp8_experts_avx2(x, st.packed, st.scale, ids, offs, 48)
    with pytest.raises(RuntimeError, match="is not float32 \\[E, parts"):
        cpu_fp8.fp8_experts_avx2(x, st.packed, st.scale[:, :1].contiguous(), ids, offs, 64)
    with pytest.raises(RuntimeError, match="bad expert id"):
        cpu_fp8.fp8_experts_avx2(x, st.packed, st.scale, torch.tensor([2]), offs, 64)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_stack_takes_the_kernel_at_the_avx2_level(avx2_isa_cap, monkeypatch, dtype):
    """At the avx2 level an FP8 expert stack takes the AVX2 kernel: grouped_linear gives its float32 product rounded
    once to x's dtype; TOKENFAB_PACKED_EXPERTS=torch keeps the reference path."""
    from test_fp8_block_experts import gate_up_stack
    monkeypatch.delenv("TOKENFAB_PACKED_EXPERTS", raising=False)
    monkeypatch.delenv("TOKENFAB_CPU_LINEAR", raising=False)
    st, _ = gate_up_stack(3, 72, 96, seed=2)
    st.prepare()
    assert st._avx2 and not st._kernel
    x = torch.randn(21, 96).to(dtype)
    want = cpu_fp8.fp8_experts_avx2(x.float(), st.packed, st.scale, torch.tensor([2, 0]), _offsets([4, 17]),
                                    72).to(dtype)
    assert torch.equal(st.grouped_linear(x, [2, 0], [4, 17]), want)
    monkeypatch.setenv("TOKENFAB_PACKED_EXPERTS", "torch")
    st.prepare()
    assert not st._avx2 and not st._kernel
