"""The packed oneDNN bf16 linear (CPU) gives F.linear's results, and the engine really uses it."""
from __future__ import annotations

import pytest
import torch

from tokenfab.layers.linear import Linear, can_pack


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
