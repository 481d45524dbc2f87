"""The fused q/k RMSNorm + RoPE + paged KV-cache write (kernels/gpu/rope_cache.py) in Triton's interpreter on CPU,
against the layers' PyTorch paths: RMSNorm (layers/norm.py), RotaryEmbedding (layers/rotary.py) and write_cache
(layers/paged_attention.py), the seam switched off.

float32 agrees to float32 rounding (the sum of squares is added in another order). bf16: the interpreter truncates
float32 to bf16 where GPUs round to nearest (tests/test_triton_norm_activation.py), so each of the chain's roundings
may be one ulp off; checked within 8 ulps of the magnitudes involved (a wrong sign, table row or weight moves
outputs by far more). Cache rows not named by a slot must stay untouched.
"""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels import dispatch
from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def reference(positions, q, k, v, rot, slots, k_cache, v_cache, qn, kn, monkeypatch):
    from tokenfab.layers.paged_attention import write_cache
    monkeypatch.setattr(dispatch, "rms_norm", lambda *a, **kw: None)
    monkeypatch.setattr(dispatch, "rope", lambda *a, **kw: None)
    if qn is not None:
        q, k = qn(q), kn(k)
    q, k = rot(positions, q, k)
    keep = slots >= 0
    write_cache(k_cache, slots[keep], k[keep])
    write_cache(v_cache, slots[keep], v[keep])
    return q


def close(got, want, mag, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert ((got.float() - want.float()).abs() <= 8 * 2.0 ** -7 * mag + 1e-6).all()


@pytest.mark.parametrize("H,Hk,D", [(4, 2, 16), (6, 3, 24), (5, 1, 10)])  # 24, 10: half not a power of two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("norm", [False, True])
def test_qk_rope_cache_matches_the_layers(interpret, monkeypatch, H, Hk, D, dtype, interleave, norm):
    from tokenfab.kernels.gpu.rope_cache import qk_rope_cache
    from tokenfab.layers.norm import RMSNorm
    from tokenfab.layers.rotary import RotaryEmbedding
    from tokenfab.model_config import RopeConfig
    g = torch.Generator().manual_seed(H * 100 + D)
    rot = RotaryEmbedding(RopeConfig(dim=D, theta=10000.0, interleave=interleave), 256, 256)
    T, blocks, page = 7, 6, 4
    qkv = (torch.randn(T, (H + 2 * Hk) * D, generator=g) * 2).to(dtype)  # the fused GEMM's output, views into it
    q, k, v = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
    q, k, v = q.view(T, H, D), k.view(T, Hk, D), v.view(T, Hk, D)
    positions = torch.tensor([0, 3, 5, 17, 100, 200, 255])
    slots = torch.tensor([0, 5, 6, -1, 13, 22, 9])  # -1: a row without a slot, written nowhere
    qn = kn = None
    if norm:
        qn, kn = RMSNorm(D, eps=1e-6).to(dtype), RMSNorm(D, eps=1e-6).to(dtype)
        with torch.no_grad():
            qn.weight.copy_(torch.randn(D, generator=g))
            kn.weight.copy_(torch.randn(D, generator=g))
    pool = torch.randn(2, blocks, page, Hk, D, generator=g).to(dtype)
    kc, vc = pool[0].clone(), pool[1].clone()
    tile = 2 if H == 5 else None  # 5 heads in tiles of 2: three q programs per token, the last one partial
    got = qk_rope_cache(q, k, v, positions, rot.cos, rot.sin, interleave, slots, kc, vc,
                        None if qn is None else qn.weight.detach(), None if kn is None else kn.weight.detach(), 1e-6,
                        heads_per_tile=tile)
    kr, vr = pool[0].clone(), pool[1].clone()
    with torch.no_grad():
        want = reference(positions, q, k, v, rot, slots, kr, vr, qn, kn, monkeypatch)
    # magnitudes of the rotated products (the normed inputs are bounded by |w| * sqrt(D))
    if norm:
        bound = float(max(qn.weight.detach().abs().max(), kn.weight.detach().abs().max())) * D ** 0.5
    else:
        bound = float(qkv.abs().max())
    mag = 2 * bound + 1e-3
    close(got, want, mag, dtype)
    close(kc, kr, mag, dtype)
    assert torch.equal(vc, vr)  # v is copied, never rounded
    assert torch.equal(kc.view(-1, Hk, D)[3], pool[0].view(-1, Hk, D)[3])  # slot 3 named by nobody


def test_qk_rope_cache_strided_cache_and_errors(interpret, monkeypatch):
    """Caches that are views with a padded head stride are written in place; shapes that do not fit raise."""
    from tokenfab.kernels.gpu.rope_cache import qk_rope_cache
    from tokenfab.layers.rotary import RotaryEmbedding
    from tokenfab.model_config import RopeConfig
    rot = RotaryEmbedding(RopeConfig(dim=8, theta=10000.0), 64, 64)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 2, 8, generator=g), torch.randn(3, 1, 8, generator=g), torch.randn(3, 1, 8, generator=g)
    big = torch.zeros(4, 2, 1, 16)
    kc, vc = big[..., :8], big[..., 8:]  # strided views of one buffer
    slots = torch.tensor([1, 2, 7])
    got = qk_rope_cache(q, k, v, torch.tensor([1, 2, 3]), rot.cos, rot.sin, False, slots, kc, vc)
    kr, vr = torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8)
    want = reference(torch.tensor([1, 2, 3]), q, k, v, rot, slots, kr, vr, None, None, monkeypatch)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(kc, kr)
    torch.testing.assert_close(vc, vr)
    with pytest.raises(ValueError, match="do not fit"):
        qk_rope_cache(q, k, v[..., :6], torch.tensor([1, 2, 3]), rot.cos, rot.sin, False, slots, kc, vc)


@pytest.mark.parametrize("H,nope,R,C", [(4, 16, 16, 32), (3, 10, 12, 40), (5, 0, 8, 24)])  # odd widths; no nope
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [True, False])
def test_mla_rope_cache_matches_the_layer(interpret, monkeypatch, H, nope, R, C, dtype, interleave):
    """MLA's kv_a_layernorm + RoPE of q_rope and k_rope + [c_kv | k_rope] latent write (layers/mla.py's eager
    chain) against the fused kernel; cache rows of other slots untouched."""
    from tokenfab.kernels.gpu.rope_cache import mla_rope_cache
    from tokenfab.layers.norm import RMSNorm
    from tokenfab.layers.paged_attention import write_cache
    from tokenfab.layers.rotary import RotaryEmbedding
    from tokenfab.model_config import RopeConfig
    g = torch.Generator().manual_seed(H * 7 + C)
    rot = RotaryEmbedding(RopeConfig(dim=R, theta=10000.0, interleave=interleave), 256, 256)
    T = 6
    q = (torch.randn(T, H, nope + R, generator=g) * 2).to(dtype)
    a = (torch.randn(T, C + R + 3, generator=g) * 2).to(dtype)  # a fused projection's output: views into it
    c_kv, k_rope = a[:, :C], a[:, C:C + R]
    norm = RMSNorm(C, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(C, generator=g))
    positions = torch.tensor([0, 7, 31, 100, 200, 255])
    slots = torch.tensor([3, 0, -1, 9, 14, 5])
    pool = torch.randn(4, 4, C + R, generator=g).to(dtype)
    cache = pool.clone()
    got = mla_rope_cache(q, c_kv, k_rope, norm.weight.detach(), 1e-6, positions, rot.cos, rot.sin, interleave,
                         slots, cache, heads_per_tile=2 if H >= 4 else None)  # 4, 5 heads: whole and partial tiles
    monkeypatch.setattr(dispatch, "rms_norm", lambda *a, **kw: None)
    monkeypatch.setattr(dispatch, "rope", lambda *a, **kw: None)
    with torch.no_grad():
        q_nope, q_rope = q.split([nope, R], dim=-1)
        q_rope, kr = rot(positions, q_rope, k_rope.unsqueeze(1))
        want_q = torch.cat([q_nope, q_rope], dim=-1)
        ref = pool.clone()
        keep = slots >= 0
        write_cache(ref, slots[keep], torch.cat([norm(c_kv), kr.squeeze(1)], dim=-1)[keep])
    mag = 2 * max(float(q.float().abs().max()), float(a.float().abs().max()),
                  float(norm.weight.detach().float().abs().max()) * C ** 0.5) + 1e-3
    close(got, want_q, mag, dtype)
    close(cache, ref, mag, dtype)
    assert torch.equal(cache.view(-1, C + R)[1], pool.view(-1, C + R)[1])  # a slot nobody named
    with pytest.raises(ValueError, match="do not fit"):
        mla_rope_cache(q, c_kv[:, :C - 2], k_rope, norm.weight.detach(), 1e-6, positions, rot.cos, rot.sin,
                       interleave, slots, cache)
