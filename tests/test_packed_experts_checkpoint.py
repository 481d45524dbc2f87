"""tokenfab.testing.packed_experts_checkpoint: the INT4 / MXFP4 expert writer the prefill benchmark uses.

Layouts are read back with compressed-tensors' own unpackers; the quantizers' values are checked against the
formats' definitions (nearest grid point, scale per group); the written checkpoint loads kept packed and computes
what its float32 twin computes."""
from __future__ import annotations

import pytest
import torch

from tokenfab import LLM, SamplingParams
from tokenfab.layers.mxfp4 import E2M1_VALUES
from tokenfab.testing.packed_experts_checkpoint import (quantize_int4_group, quantize_mxfp4,
                                                        write_packed_experts_checkpoint)

ct_pack = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
ct_fp4 = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")


def _weights(seed=0, out=24, inp=96):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * torch.rand(out, inp // 32, 1, generator=g).repeat(1, 1, 32).view(out, inp)
    w[3, :32] = 0.0  # an all-zero group
    return w


def test_int4_layout_and_values():
    w = _weights()
    packed, scale, real = quantize_int4_group(w)
    q = ct_pack.unpack_from_int32(packed, 4, torch.Size(w.shape)).float()
    assert torch.equal(q.view(24, -1, 32) * scale.float().unsqueeze(-1), real.view(24, -1, 32))
    # symmetric amax / 7 scale in bf16; every value the nearest multiple of its scale (clamped to [-8, 7])
    amax = w.view(24, -1, 32).abs().amax(-1)
    want_scale = torch.where(amax > 0, amax / 7, torch.ones_like(amax)).bfloat16()
    assert torch.equal(scale, want_scale)
    s = scale.float().repeat_interleave(32, 1)
    assert ((real - w).abs() <= s / 2 + 1e-6 * s).all()  # amax / 7 (rounded) never lands past q = +-7.5
    assert real[3, :32].abs().sum() == 0


def test_mxfp4_layout_and_values():
    w = _weights(1)
    packed, scale, real = quantize_mxfp4(w)
    v = ct_fp4.unpack_fp4_from_uint8(packed, 24, 96, dtype=torch.float32)
    x = 2.0 ** (scale.float() - 127)
    assert torch.equal(v.view(24, -1, 32) * x.unsqueeze(-1), real.view(24, -1, 32))
    # OCP MX: shared exponent floor(log2 amax) - 2, so the group's largest value scales into [4, 8)
    amax = w.view(24, -1, 32).abs().amax(-1)
    nz = amax > 0
    ratio = amax[nz] / x[nz]
    assert ((ratio >= 4) & (ratio < 8)).all()
    # each value the nearest E2M1 point of w / 2^e (6 for anything above)
    grid = torch.tensor(E2M1_VALUES[:8])
    y = (w.view(24, -1, 32) / x.unsqueeze(-1)).abs()
    best = (y.unsqueeze(-1) - grid).abs().min(-1).values
    got = (real.view(24, -1, 32) / x.unsqueeze(-1)).abs()
    assert torch.allclose((got - y).abs(), best, atol=1e-6)
    assert real[3, :32].abs().sum() == 0


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_checkpoint_loads_packed_and_matches_twin(fmt, tiny_model, tmp_path):
    src = tiny_model("deepseek_v3", num_hidden_layers=2)
    packed = write_packed_experts_checkpoint(src, str(tmp_path / fmt), fmt, str(tmp_path / "twin"))
    # the 96-token prompt's first step gives each of the 8 experts (top-2) about 24 tokens: past the 12 a float32
    # segment takes on the register path, so the experts' prefill path (row blocks dequantized for brgemm) runs too
    prompts = [[5, 17, 99, 230, 41, 8, 77, 301, 12], [400, 3, 66], [(7 * i + 3) % 500 for i in range(96)]]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    outs = {}
    for name, path in (("packed", packed), ("twin", str(tmp_path / "twin"))):
        llm = LLM(path, dtype="float32", device="cpu", progress=False)
        if name == "packed":
            experts = [l.mlp.experts for l in llm.llm_engine.runner.model.model.layers if hasattr(l.mlp, "experts")]
            assert experts and all(e.w13 is None and e.q13.format_name == ("int4_group" if fmt == "int4" else fmt)
                                   for e in experts)
        outs[name] = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for a, b in zip(outs["packed"], outs["twin"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            (ta, la), = pa.items()
            (tb, lb), = pb.items()
            assert ta == tb and abs(la.logprob - lb.logprob) < 1e-4
