"""TOKENFAB_CPU_ISA: which CPU path the kernels take, capped by what the CPU has (kernels/cpu/isa.py)."""
from __future__ import annotations

import pytest
import torch

from tokenfab.errors import EngineConfigError
from tokenfab.kernels.cpu import build as cpu_build
from tokenfab.kernels.cpu import isa as cpu_isa
from tokenfab.kernels.cpu.ops import attention as cpu_attention
from tokenfab.kernels.cpu.ops import fp8_linear as cpu_fp8
from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf
from tokenfab.kernels.cpu.ops import support as cpu_support
from tokenfab.kernels.cpu.ops import vnni_linear as cpu_vnni

XEON = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
EPYC = {"avx2", "avx512f", "avx512_bf16"}
OLD = {"avx2", "fma"}


def test_machine_level_from_flags():
    assert cpu_isa.machine_level(XEON) == "amx"
    assert cpu_isa.machine_level(EPYC) == "avx512_bf16"
    assert cpu_isa.machine_level(OLD) == "avx2"
    assert cpu_isa.machine_level({"amx_tile", "amx_bf16"}) == "avx2"  # AMX without AVX512-BF16 is not a level


@pytest.mark.parametrize("value,flags,want", [("native", XEON, "amx"), ("", EPYC, "avx512_bf16"),
                                              ("avx512_bf16", XEON, "avx512_bf16"), ("AVX2", XEON, "avx2"),
                                              ("avx2", EPYC, "avx2"), ("avx2", OLD, "avx2")])
def test_selected_level(monkeypatch, value, flags, want):
    monkeypatch.setenv(cpu_isa.ENV, value)
    assert cpu_isa.selected_level(flags) == want


def test_a_level_above_the_cpu_or_a_typo_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpu_isa.ENV, "amx")
    with pytest.raises(EngineConfigError, match=r"TOKENFAB_CPU_ISA=amx needs a CPU with AMX.*avx512_bf16"):
        cpu_isa.selected_level(EPYC)
    monkeypatch.setenv(cpu_isa.ENV, "avx512")
    with pytest.raises(EngineConfigError, match=r"'avx512' is not a CPU path; use native or one of avx2, "):
        cpu_isa.selected_level(EPYC)


def test_library_caps_follow_the_level_and_never_override_the_user(monkeypatch):
    monkeypatch.setattr(cpu_isa, "machine_level", lambda flags=None: "amx")  # as on a Xeon, whatever runs this
    for cap in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):  # setenv first: monkeypatch then restores the
        monkeypatch.setenv(cap, "unset-by-test")  # variable's absence, so no cap leaks into later tests' children
        monkeypatch.delenv(cap)
    monkeypatch.setenv(cpu_isa.ENV, "avx2")
    cpu_isa.apply_library_caps()
    import os
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2" and os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    cpu_isa.apply_library_caps()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv(cpu_isa.ENV, "native")  # the CPU's own path: no cap
    cpu_isa.apply_library_caps()
    assert "ONEDNN_MAX_CPU_ISA" not in os.environ


@pytest.mark.skipif(cpu_build.load() is None, reason="the fused CPU kernels are not built here")
def test_the_kernels_cap_switches_the_bf16_dot_paths_off():
    """Capped at avx2, no caller is offered an AVX512-BF16 kernel, and paged decode attention takes its float32
    path: a bf16 result equal to the PyTorch reference's arithmetic in float32 (products rounded to bf16 no more)."""
    m = cpu_build.load()
    before = m.isa_cap()
    try:
        m.set_isa_cap(cpu_isa.LEVELS.index("avx2"))
        assert not cpu_support.has_bf16_dot()
        assert not cpu_gguf.gguf_linear_applies() and not cpu_fp8.fp8_block_linear_applies()
        assert not cpu_vnni.vnni_linear_applies(torch.zeros(32, 64, dtype=torch.bfloat16))
        g = torch.Generator().manual_seed(3)
        q = torch.randn(2, 4, 64, generator=g).bfloat16()
        k = torch.randn(3, 16, 2, 64, generator=g).bfloat16()
        v = torch.randn(3, 16, 2, 64, generator=g).bfloat16()
        bt = torch.tensor([[0, 1], [2, 0]])
        cl = torch.tensor([20, 9])
        out = cpu_attention.paged_decode_attention(q, k, v, bt, cl, 0.125)
        for b in range(2):
            keys = torch.cat([k[i] for i in bt[b]])[:cl[b]].float()  # [L, 2, 64]
            vals = torch.cat([v[i] for i in bt[b]])[:cl[b]].float()
            kh = keys.repeat_interleave(2, dim=1).transpose(0, 1)  # [4, L, 64]
            p = torch.softmax(0.125 * q[b].float().unsqueeze(1) @ kh.transpose(1, 2), -1)
            ref = (p @ vals.repeat_interleave(2, dim=1).transpose(0, 1)).squeeze(1)
            torch.testing.assert_close(out[b].float(), ref, atol=1e-2, rtol=1e-2)
    finally:
        m.set_isa_cap(before)
    assert cpu_support.has_bf16_dot() == bool(m.has_bf16_dot and before >= 1)


def test_bf16_mla_decode_at_avx2_level_gathers_and_rounds_as_bf16(monkeypatch):
    """At the avx2 level bf16 MLA decode (one latent pool as keys and values) is not offered the kernel's float32
    FMAs: the gathered path runs, its GEMMs (attention, and MLA's per-head W_UK / W_UV products via dispatch.bmm) on
    float32 copies, rounding scores, weights and output to bf16 where the bf16 path does. Checked against a
    hand-written float64 computation with those three roundings (to one bf16 step); float32 MLA keeps the kernel
    for short contexts."""
    from tokenfab.kernels import dispatch
    from tokenfab.layers import paged_attention
    from tokenfab.layers.attention_metadata import AttentionGroup
    monkeypatch.setattr(cpu_isa, "selected_level", lambda flags=None: "avx2")
    monkeypatch.setattr(cpu_support, "has_bf16_dot", lambda: False)
    g = torch.Generator().manual_seed(5)
    B, H, D, Dv, bs = 2, 6, 48, 32, 4
    cache = torch.randn(7, bs, 1, D, generator=g).bfloat16()
    q = torch.randn(B, H, D, generator=g).bfloat16()
    bt = torch.tensor([[3, 0, 5], [1, 6, 2]])
    cl = torch.tensor([11, 6])
    group = AttentionGroup(token_index=(cl - 1).view(B, 1), query_pos=(cl - 1).view(B, 1), block_tables=bt,
                           context_lens=cl, q_len=1, max_context=3 * bs)
    assert dispatch.paged_decode_attention(q, cache, cache[..., :Dv], bt, cl, 3 * bs, 0.2) is None
    if cpu_support.available_for(q.float()):
        assert dispatch.paged_decode_attention(q.float(), cache.float(), cache.float()[..., :Dv], bt, cl, 3 * bs,
                                               0.2) is not None
    keys = paged_attention.gather_cache(cache[:, :, 0], group).unsqueeze(1)  # [B, 1, 12, D]
    out = paged_attention.attention(q.unsqueeze(2), keys, keys, group, 0.2)[:, :, 0, :Dv]
    for b in range(B):
        kb = keys[b, 0, :cl[b]].double()
        s = (0.2 * q[b].double() @ kb.T).bfloat16().double()  # the bf16 GEMM's rounded scores
        p = torch.softmax(s, -1).bfloat16().double()  # weights rounded to bf16
        want = (p @ kb[:, :Dv]).bfloat16().float()
        step = want.abs().clamp(min=2 ** -8) * 2 ** -7  # one bf16 step (8 significant bits)
        assert ((out[b].float() - want).abs() <= step).all()
    a, w = torch.randn(3, 5, 16, generator=g).bfloat16(), torch.randn(3, 16, 8, generator=g).bfloat16()
    want = (a.double() @ w.double()).bfloat16().float()
    assert ((dispatch.bmm(a, w).float() - want).abs() <= want.abs().clamp(min=2 ** -8) * 2 ** -7).all()


@pytest.mark.parametrize("level,device,batch_invariant,want", [
    ("avx2", "cpu", False, torch.float32), ("avx512_bf16", "cpu", False, torch.bfloat16),
    ("amx", "cpu", False, torch.bfloat16), ("avx2", "cuda", False, torch.bfloat16),
    ("avx2", "cpu", True, torch.bfloat16)])
def test_auto_dtype_is_float32_on_a_cpu_without_bf16_dot_products(monkeypatch, level, device, batch_invariant, want):
    """dtype 'auto': float32 on a CPU at the avx2 level (its bf16 GEMMs are slow paths), bfloat16 elsewhere, on a
    GPU and for batch-invariant runs (bf16 kernels); a named dtype is kept."""
    from tokenfab.engine.engine_config import resolve_dtype
    monkeypatch.setattr(cpu_isa, "selected_level", lambda flags=None: level)
    assert resolve_dtype("auto", torch.device(device), batch_invariant) == want
    assert resolve_dtype("bfloat16", torch.device(device), batch_invariant) == torch.bfloat16
