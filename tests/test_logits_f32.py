"""Logits in float32 from the LM head's float32 accumulator on every path (DESIGN.md: bf16 rounding of the logits
themselves must never create ties).

Two facts are checked per path: (1) the float32 output is the accumulator the bf16 output rounds, i.e. rounding it to
bf16 gives the kernel's own bf16 output bit for bit (so it is the same sum, only not rounded); (2) it is within the
float32 summation bound of the exact float64 product (gamma_n = n u / (1 - n u), n = K + a few, u = 2^-24, times
S = sum_k |x_k w_k|), while a bf16 logit can be 2^-9 |y| away.
"""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf
from tokenfab.kernels.cpu.ops import vnni_linear as cpu_vnni
from tokenfab.layers.linear import matmul_f32

U = 2.0 ** -24


def exact(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x w^T, |x| |w|^T) in float64."""
    xd, wd = x.double(), w.double()
    return xd @ wd.T, xd.abs() @ wd.abs().T


def assert_f32_accumulator(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, terms: int):
    assert y.dtype == torch.float32
    ref, s = exact(x, w)
    bound = (terms * U / (1 - terms * U)) * s + 1e-30
    assert ((y.double() - ref).abs() <= bound).all(), float(((y.double() - ref).abs() / bound).max())


def test_matmul_f32_is_the_float32_sum_not_a_bf16_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 576, generator=g).bfloat16()
    w = torch.randn(2500, 576, generator=g).bfloat16()  # > LOGITS_CHUNK_ROWS: chunks joined
    y = matmul_f32(x, w)
    assert y.shape == (3, 2500)
    assert_f32_accumulator(y, x, w, 576)
    assert not torch.equal(y, y.bfloat16().float())  # values off the bf16 grid survive
    bias = torch.randn(2500, generator=g)
    torch.testing.assert_close(matmul_f32(x, w, bias), y + bias, rtol=0, atol=0)
    assert torch.equal(matmul_f32(x.float(), w.float()), torch.nn.functional.linear(x.float(), w.float()))


@pytest.mark.skipif(not cpu_vnni.vnni_linear_applies(torch.zeros(32, 64, dtype=torch.bfloat16)),
                    reason="tokenfab's VNNI linear needs the CPU kernels with AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 70])  # GEMV (<= 4 rows) and brgemm tiles
def test_vnni_linear_out_f32_is_the_accumulator_its_bf16_output_rounds(rows):
    g = torch.Generator().manual_seed(rows)
    n, k = 1000, 576  # n not a multiple of the 32-row block
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    p = cpu_vnni.pack_linear_weight(w)
    y32 = cpu_vnni.vnni_linear(x, p, n, out_f32=True)
    y16 = cpu_vnni.vnni_linear(x, p, n)
    assert y32.shape == y16.shape == (rows, n)
    assert torch.equal(y32.bfloat16(), y16)
    assert_f32_accumulator(y32, x, w, k)
    assert not torch.equal(y32, y16.float())
    bias = torch.randn(n, generator=g)
    assert torch.equal(cpu_vnni.vnni_linear(x, p, n, bias, out_f32=True).bfloat16(),
                       cpu_vnni.vnni_linear(x, p, n, bias))


@pytest.mark.skipif(not cpu_gguf.gguf_linear_applies(), reason="gguf_linear needs the CPU kernels with AVX512-BF16")
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 4, 9, 20])  # GEMV passes, and the prefill path above 16 rows
def test_gguf_linear_out_f32(name, rows):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from tokenfab.quant.gguf_weight import GGUFWeight
    n, k = 70, 512
    wf = np.random.default_rng(rows).standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(wf, gguf.GGMLQuantizationType[name])
    w = GGUFWeight.from_rows(torch.from_numpy(raw), name, k)
    w.prepare()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).bfloat16()
    y32 = w.linear_f32(x)
    deq = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])))
    if rows > 16:  # prefill: bf16 x times the weight rounded once to bf16 (the dequantized bf16 twin's weight)
        deq = deq.bfloat16().float()
    assert_f32_accumulator(y32, x, deq, 3 * k + 64)  # the bound of tests/test_gguf_linear.py
    from tokenfab.kernels.cpu import isa
    if rows <= 4 or rows > 16 or isa.selected_level() != "amx":  # (5..16 bf16 rows take AMX tiles there)
        assert torch.equal(y32.bfloat16(), w.linear(x, None))  # the bf16 output is this accumulator rounded once


def _head_logits(tiny_model, monkeypatch, backend: str):
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", backend)
    from tokenfab import LLM
    llm = LLM(tiny_model("llama"), dtype="bfloat16", max_model_len=64, progress=False)
    try:
        model = llm.llm_engine.runner.model
        hidden = torch.randn(5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
        with torch.no_grad():
            logits = model.compute_logits(hidden)
        return hidden, logits, getattr(model, "_lm_head_packed", None)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("backend", ["tokenfab", "onednn", "torch"])
def test_compute_logits_float32_on_every_linear_backend(tiny_model, monkeypatch, backend):
    """CausalLM.compute_logits of a bf16 model: float32 logits within the float32 bound of the exact product of
    the bf16 hidden state and head, whichever backend holds the head (VNNI-packed, plain weight)."""
    from safetensors.torch import load_file
    import glob
    import os
    path = tiny_model("llama")
    state = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        state.update(load_file(f))
    w = (state.get("lm_head.weight", state["model.embed_tokens.weight"])).bfloat16()
    hidden, logits, packed = _head_logits(tiny_model, monkeypatch, backend)
    if backend == "tokenfab" and cpu_vnni.vnni_linear_applies(w):
        assert packed is not None and not packed.is_mkldnn  # tied or not, the head is packed for the kernel
    assert logits.shape == (5, w.shape[0])
    assert_f32_accumulator(logits, hidden, w, w.shape[1])
