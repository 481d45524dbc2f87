"""The packed bf16 linears (CPU: tokenfab's VNNI blocks and oneDNN's) give F.linear's results, and the engine really
uses them."""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.cpu import isa as cpu_isa
from tokenfab.kernels.cpu.ops import support as cpu_support
from tokenfab.kernels.cpu.ops import vnni_linear as cpu_vnni
from tokenfab.layers.linear import Linear, can_pack

needs_bf16_dot = pytest.mark.skipif(not cpu_support.has_bf16_dot(), reason="CPU kernels without AVX512-BF16")


def assert_rounded_from(got: torch.Tensor, exact: torch.Tensor, mag: torch.Tensor) -> None:
    """got (bf16) is exact (float64) rounded to bf16 up to float32 accumulation error: within half a bf16 ulp of
    |exact| plus 2^-20 of sum |x w| (K <= 2048 float32 additions)."""
    ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact)[1] - 8)  # bf16 ulp at |exact|: 2^(e - 8)
    bound = ulp / 2 + mag * 2.0 ** -20
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


@needs_bf16_dot
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 70, 130])
@pytest.mark.parametrize("n,k", [(96, 64), (100, 62), (33, 128), (768, 384)])
def test_vnni_linear_rounds_the_exact_product(rows, n, k):
    """Decode GEMV (<= 4 rows) and brgemm tiles (more rows), N not a multiple of the 32-row block, K / 2 odd,
    bias, a strided input (a column slice of a wider buffer) and a 3-D input."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    wide = torch.randn(rows, k + 10, generator=g).bfloat16()
    x = wide[:, 3:3 + k]  # row stride k + 10
    packed = cpu_vnni.pack_linear_weight(w)
    assert packed.shape == (-(-n // 32), k // 2, 32, 2)
    for bias in (None, b):
        got = cpu_vnni.vnni_linear(x, packed, n, bias)
        exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        assert_rounded_from(got, exact, x.double().abs() @ w.double().abs().t())
    got3 = cpu_vnni.vnni_linear(x.contiguous().view(1, rows, k), packed, n)
    assert torch.equal(got3.view(rows, n), cpu_vnni.vnni_linear(x, packed, n))


@needs_bf16_dot
def test_vnni_linear_group_gives_each_items_vnni_linear():
    """Items of 1-4 rows share one parallel region, a 5-row item runs brgemm; different N (not multiples of the
    32-row block) and K, a strided input: every output equals its own vnni_linear call bit for bit."""
    g = torch.Generator().manual_seed(5)
    shapes = [(1, 100, 62), (2, 33, 128), (4, 768, 384), (5, 96, 64), (3, 64, 96), (1, 32, 64)]
    xs, packed, ns = [], [], []
    for rows, n, k in shapes:
        wide = torch.randn(rows, k + 6, generator=g).bfloat16()
        xs.append(wide[:, 2:2 + k])
        packed.append(cpu_vnni.pack_linear_weight(torch.randn(n, k, generator=g).bfloat16()))
        ns.append(n)
    got = cpu_vnni.vnni_linear_group(xs, packed, ns)
    assert len(got) == len(shapes)
    for x, p, n, y in zip(xs, packed, ns, got):
        assert y.shape == (x.shape[0], n)
        assert torch.equal(y, cpu_vnni.vnni_linear(x, p, n))
    with pytest.raises(RuntimeError, match="item 1"):
        cpu_vnni.vnni_linear_group(xs[:2], [packed[0], packed[0]], ns[:2])


@needs_bf16_dot
def test_vnni_linear_rejects_a_mismatched_weight():
    packed = cpu_vnni.pack_linear_weight(torch.randn(64, 32).bfloat16())
    with pytest.raises(RuntimeError, match="does not match"):
        cpu_vnni.vnni_linear(torch.randn(1, 30).bfloat16(), packed, 64)
    with pytest.raises(RuntimeError, match="does not match"):
        cpu_vnni.vnni_linear(torch.randn(1, 32).bfloat16(), packed, 100)


def test_cpu_linear_backend_typo_is_a_clear_error(monkeypatch):
    from tokenfab.errors import EngineConfigError
    from tokenfab.layers.linear import cpu_linear_backend
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", "onednnn")
    with pytest.raises(EngineConfigError, match="TOKENFAB_CPU_LINEAR='onednnn'.*tokenfab, onednn, torch"):
        cpu_linear_backend()


@pytest.mark.parametrize("backend", ["tokenfab", "onednn", "torch"])
def test_cpu_linear_backend_decides_the_packing(monkeypatch, backend):
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", backend)
    lin = Linear(64, 40, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 64))
    w = lin.weight.clone()
    lin.fuse()
    if backend == "torch" or not torch.backends.mkldnn.is_available():
        assert lin._packed is None
    elif backend == "tokenfab" and cpu_support.has_bf16_dot():
        assert not lin._packed.is_mkldnn and lin._packed.shape == (2, 32, 32, 2)
    elif cpu_isa.selected_level() == "avx2":  # oneDNN's bf16 packing needs AVX512 or AVX-NE-CONVERT: F.linear
        assert lin._packed is None
    else:
        assert lin._packed.is_mkldnn
    x = torch.randn(3, 64).bfloat16()
    assert_rounded_from(lin(x), x.double() @ w.double().t(), x.double().abs() @ w.double().abs().t())


@pytest.mark.skipif(not can_pack(torch.empty(2, 2, dtype=torch.bfloat16)), reason="no oneDNN packing here")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(bias):
    torch.manual_seed(0)
    lin = Linear(96, 200, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96))
        if bias:
            lin.bias.copy_(torch.randn(200))
    w, b = lin.weight.clone(), None if lin.bias is None else lin.bias.clone()
    lin.fuse()
    assert lin.weight is None and lin._packed is not None
    for shape in [(1, 96), (7, 96), (2, 3, 96)]:
        x = torch.randn(shape, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        got = lin(x)
        assert got.shape == ref.shape and got.dtype == torch.bfloat16
        # bf16 output rounding: half an ulp of |y| (~2^-8 relative) plus accumulation-order noise
        assert torch.allclose(got.float(), ref, rtol=1e-2, atol=1e-2)


def test_engine_packs_bf16_linears(tiny_model):
    from tokenfab import LLM
    llm = LLM(tiny_model("deepseek_v3"), dtype="bfloat16", max_model_len=64, progress=False)
    attn = llm.llm_engine.runner.model.model.layers[0].self_attn
    expected = can_pack(torch.empty(2, 2, dtype=torch.bfloat16))
    assert (attn.o_proj._packed is not None) == expected
    llm32 = LLM(tiny_model("deepseek_v3"), dtype="float32", max_model_len=64, progress=False)
    assert llm32.llm_engine.runner.model.model.layers[0].self_attn.o_proj._packed is None


def test_cpu_linear_backend_typo_fails_before_any_weight_is_read(tiny_model, monkeypatch):
    import tokenfab.engine.engine as engine_mod
    from tokenfab import LLM
    from tokenfab.errors import EngineConfigError

    def no_load(*a, **k):
        raise AssertionError("weights were loaded before the settings were checked")

    monkeypatch.setattr(engine_mod, "load_model", no_load)
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", "bogus")
    with pytest.raises(EngineConfigError, match="TOKENFAB_CPU_LINEAR='bogus'"):
        LLM(tiny_model("llama"), dtype="bfloat16", max_model_len=64, progress=False)


@pytest.mark.parametrize("bias", [False, True])
def test_concat_is_the_sources_side_by_side(bias):
    """Linear.concat (q|k|v, gate|up, q_a|kv_a): output columns equal each source's, in order; sources freed."""
    torch.manual_seed(1)
    lins = [Linear(24, n, bias=bias) for n in (8, 5, 5)]
    with torch.no_grad():
        for l in lins:
            l.weight.copy_(torch.randn_like(l.weight))
            if bias:
                l.bias.copy_(torch.randn_like(l.bias))
    x = torch.randn(3, 24)
    want = torch.cat([l(x) for l in lins], -1)
    fused = Linear.concat(lins)
    assert fused.out_features == 18 and all(l.weight is None and l.bias is None for l in lins)
    assert torch.allclose(fused(x), want, rtol=1e-5, atol=1e-5)  # same dot products; BLAS blocking may differ
    assert Linear.concat(lins) is None  # sources already consumed


def test_concat_inputs_sums_the_sources(monkeypatch):
    """Linear.concat_inputs (K3's latent up-projection | shared experts' down): [x1 | x2] through the joined weight
    equals x1 W1^T + x2 W2^T (float64: exact to rounding); sources freed; biased, packed or mismatched sources
    refused with nothing changed."""
    from tokenfab.layers import linear as linear_mod
    monkeypatch.setattr(linear_mod, "can_pack", lambda w: False)  # plain weights, as on the GPU path
    torch.manual_seed(2)
    a, b = Linear(7, 5, dtype=torch.float64), Linear(11, 5, dtype=torch.float64)
    with torch.no_grad():
        a.weight.copy_(torch.randn_like(a.weight))
        b.weight.copy_(torch.randn_like(b.weight))
    x1, x2 = torch.randn(3, 7, dtype=torch.float64), torch.randn(3, 11, dtype=torch.float64)
    want = a(x1) + b(x2)
    fused = Linear.concat_inputs([a, b])
    assert fused.in_features == 18 and fused.out_features == 5 and a.weight is None and b.weight is None
    torch.testing.assert_close(fused(torch.cat([x1, x2], -1)), want, rtol=1e-12, atol=1e-12)
    c, d = Linear(4, 2, bias=True), Linear(4, 2)
    assert Linear.concat_inputs([c, d]) is None and c.weight is not None and d.weight is not None
    assert Linear.concat_inputs([Linear(4, 2), Linear(4, 3)]) is None  # output widths differ


def test_concat_refuses_mixed_biases():
    a, b = Linear(4, 2, bias=True), Linear(4, 2, bias=False)
    assert Linear.concat([a, b]) is None and a.weight is not None and b.weight is not None
