"""MLA's decode glue kernels (kernels/gpu/mla_decode_glue.py) in Triton's interpreter on CPU, against PyTorch
written here: RMSNorm as layers/norm.py rounds it, RoPE through layers/rotary.py's RotaryEmbedding (seam off), the
latent row as layers/paged_attention.py's write_cache stores it, q_nope W_UK as ``torch.bmm``.

float32 agrees to float32 rounding (sums in another order). bf16: the interpreter truncates float32 to bf16 where
GPUs round to nearest, so each rounding of the chain may be an ulp off: checked within 8 ulps of the magnitudes
involved (a wrong row, head, table entry or weight moves values by far more). Pool rows not named by a slot stay
untouched.
"""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels import dispatch
from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def rms(x, w, eps):
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return w * normed


def close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        mag = want.float().abs().max().item() + 1.0
        assert ((got.float() - want.float()).abs() <= 8 * 2.0 ** -7 * mag).all()


def rotary(R, interleave):
    from tokenfab.layers.rotary import RotaryEmbedding
    from tokenfab.model_config import RopeConfig
    return RotaryEmbedding(RopeConfig(dim=R, theta=10000.0, interleave=interleave), 256, 256)


@pytest.mark.parametrize("QL,C,R", [(24, 40, 6), (32, 64, 16), (None, 20, 10)])  # odd widths; None: no q LoRA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["half", "interleave", "nope"])
def test_norms_cache_matches_the_layers(interpret, monkeypatch, QL, C, R, dtype, mode):
    from tokenfab.kernels.gpu.mla_decode_glue import mla_norms_cache
    from tokenfab.layers.paged_attention import write_cache
    monkeypatch.setattr(dispatch, "rope", lambda *a, **kw: None)
    g = torch.Generator().manual_seed(C + R)
    T, blocks, page = 5, 4, 3
    a_out = (torch.randn(T, (QL or 0) + C + R, generator=g) * 2).to(dtype)  # the fused a-projection's output
    q_a, c_kv, k_rope = a_out.split([QL or 0, C, R], dim=-1)
    q_a = q_a if QL else None
    qw = (torch.rand(QL, generator=g) + 0.5).to(dtype) if QL else None
    kw = (torch.rand(C, generator=g) + 0.5).to(dtype)
    positions = torch.tensor([0, 7, 3, 100, 255])
    slots = torch.tensor([4, 0, -1, 11, 7])  # -1: written nowhere
    cache = torch.full((blocks, page, C + R), 9.0, dtype=dtype)
    rot = rotary(R, mode == "interleave")
    tables = (None, None) if mode == "nope" else (rot.cos, rot.sin)
    got_q = mla_norms_cache(q_a, c_kv, k_rope, qw, kw, 1e-6, 1e-5, positions, *tables, mode == "interleave", slots,
                            cache)
    k_ref = k_rope if mode == "nope" else rot(positions, k_rope.unsqueeze(1), k_rope.unsqueeze(1))[1].squeeze(1)
    want = torch.full_like(cache, 9.0)
    keep = slots >= 0
    write_cache(want, slots[keep], torch.cat([rms(c_kv, kw, 1e-5), k_ref], dim=-1)[keep])
    close(cache, want, dtype)
    if QL:
        close(got_q, rms(q_a, qw, 1e-6), dtype)
        assert got_q.is_contiguous()
    else:
        assert got_q is None


@pytest.mark.parametrize("T,H,nope,C,R", [(3, 2, 16, 40, 6), (19, 3, 24, 96, 8), (1, 1, 32, 64, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["half", "interleave", "nope"])
def test_latent_query_matches_bmm_and_rope(interpret, monkeypatch, T, H, nope, C, R, dtype, mode):
    """T 19: two token tiles (the second partial); C 40 / 96: a partial latent tile; R 0: no rope slice."""
    from tokenfab.kernels.gpu.mla_decode_glue import mla_latent_query
    monkeypatch.setattr(dispatch, "rope", lambda *a, **kw: None)
    g = torch.Generator().manual_seed(T * 10 + C)
    q_full = torch.randn(T, H * (nope + R) + 5, generator=g).to(dtype)  # a strided view, as the GEMM output is
    q = q_full[:, : H * (nope + R)].view(T, H, nope + R)
    w_uk = (torch.randn(H, nope, C, generator=g) / nope ** 0.5).to(dtype)
    positions = torch.arange(T) * 13 % 256
    rot = rotary(max(R, 2), mode == "interleave")
    tables = (None, None) if mode == "nope" else (rot.cos, rot.sin)
    if R == 0 and mode != "nope":
        tables = (rot.cos[:, :0], rot.sin[:, :0])
    got = mla_latent_query(q, w_uk, positions, *tables, mode == "interleave")
    q_nope, q_rope = q.split([nope, R], dim=-1)
    lat = torch.bmm(q_nope.transpose(0, 1).float(), w_uk.float()).transpose(0, 1).to(dtype)
    if mode != "nope" and R:
        q_rope = rot(positions, q_rope, q_rope[:, :1])[0]
    want = torch.cat([lat, q_rope], dim=-1)
    close(got, want, dtype)
    assert got.stride(-1) == 1 and got.transpose(0, 1).is_contiguous()  # head-major buffer, token-major view


def test_rejects_misfits(interpret):
    from tokenfab.kernels.gpu.mla_decode_glue import mla_latent_query, mla_norms_cache
    q = torch.randn(2, 2, 20)
    with pytest.raises(ValueError):
        mla_latent_query(q, torch.randn(2, 15, 8), torch.zeros(2, dtype=torch.long), None, None, False)  # R 5: odd
    with pytest.raises(ValueError):
        mla_norms_cache(None, torch.randn(2, 8), torch.randn(2, 4), None, torch.ones(8), 1e-6, 1e-6,
                        torch.zeros(2, dtype=torch.long), None, None, False, torch.zeros(2, dtype=torch.long),
                        torch.zeros(3, 2, 13))  # row width 13 != 8 + 4


@pytest.mark.parametrize("T,H,C,V", [(3, 5, 40, 24), (20, 2, 64, 128), (1, 3, 130, 70)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_gate_matches_bmm_then_the_gate(interpret, T, H, C, V, dtype):
    """Gated MLA's value heads in one launch (``mla_value_gate``: o_lat W_UV in the GEMM, x * sigmoid(g) in its
    epilogue) against ``torch.bmm`` then ``x * torch.sigmoid(g)`` as the layer runs them: partial latent, value and
    token tiles (C 40 / 130, v 24 / 70 / 128, T 20 over 16-token tiles), the gate a strided slice of a wider
    projection as the a-projection's output gives it."""
    from tokenfab.kernels.gpu.mla_decode_glue import mla_value_gate
    g = torch.Generator().manual_seed(T * H + C)
    o_lat = torch.randn(T, H, C, generator=g).to(dtype)
    w_uv_t = (torch.randn(H, C, V, generator=g) / C ** 0.5).to(dtype)
    gate = (torch.randn(T, H * V + 7, generator=g) * 2).to(dtype)[:, 3:3 + H * V]
    got = mla_value_gate(o_lat, w_uv_t, gate)
    o = torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)  # [T, H, V]
    want = (o.reshape(T, H * V) * torch.sigmoid(gate)).view(T, H, V)
    close(got, want, dtype)
    assert got.is_contiguous() and want.abs().max() > 0.1
    with pytest.raises(ValueError):
        mla_value_gate(o_lat, w_uv_t, gate[:, :-1])  # a gate of the wrong width
