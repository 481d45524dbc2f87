"""A KDA decode group in one launch (kernels/gpu/kda.py ``kda_decode_fused``: the short conv, its state update and
the gated delta rule) in Triton's interpreter on CPU, against the two launches it replaces (kernels/gpu/short_conv.py
then ``kda_recurrent``, each checked against layers/kda.py in tests/test_triton_short_conv.py and
tests/test_triton_kda.py) on the same inputs: every output row, every conv-state slot (bit for bit: the state
holds copies of the inputs) and every recurrent-state slot.

Rows: a fresh sequence (position 0: zero states read), two carried ones in permuted slots and a padding row
(position -1: nothing read or written, a zero output). Value blocks narrower than the head (3 and 2 per head), so
several programs share a head's q / k conv state and the ticket that lets the last of them write it is exercised;
the tickets must be left zero. float32 (to float32 rounding: the conv sums in another order) and bf16 (the conv
outputs rounded to bf16 as the conv kernel stores them; within a few bf16 steps), conv widths 4 and 2; with the
layer's gated output norm in the same launch (decode-only steps) and without it.
"""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def _inputs(dtype, H, D, K, seed):
    g = torch.Generator().manual_seed(seed)
    C, slots, T = 3 * H * D, 5, 6
    x = (torch.randn(T, C + 5, generator=g) * 2).to(dtype)[:, :C]  # rows strided, as a projection's slice
    conv_state = (torch.randn(slots, C, K - 1, generator=g) * 2).to(dtype)
    w = torch.randn(C, K, generator=g) * 0.6
    state = torch.randn(slots, H, D, D, generator=g)
    g_raw = (torch.randn(T, H * D, generator=g) * 3).to(dtype)
    b_raw = (torch.randn(T, H, generator=g) * 2).to(dtype)
    dt_bias, a_log = torch.randn(H * D, generator=g) * 0.5, torch.randn(H, generator=g) * 0.5
    idx = torch.tensor([[3], [0], [5], [1]])
    qpos = torch.tensor([[0], [5], [-1], [9]])  # fresh, carried, padding, carried
    rows = torch.tensor([2, 0, 4, 1])
    return x, conv_state, w, state, g_raw, b_raw, dt_bias, a_log, idx, qpos, rows


@pytest.mark.parametrize("dtype,H,D,K,bv,norm", [(torch.float32, 2, 12, 4, 4, True),
                                                  (torch.bfloat16, 3, 16, 4, 8, True),
                                                  (torch.float32, 2, 16, 2, 8, False)])
def test_fused_decode_equals_conv_then_recurrence(interpret, monkeypatch, dtype, H, D, K, bv, norm):
    """``norm``: the launch also applies the layer's gated output norm (a decode-only step), which must equal
    kernels/gpu/norm_activation.py's ``gated_rms_norm`` launch on the stored outputs bit for bit (the same formula
    on the same values) and on the two launches' outputs to rounding."""
    from tokenfab.kernels.gpu import kda
    from tokenfab.kernels.gpu.norm_activation import gated_rms_norm
    from tokenfab.kernels.gpu.short_conv import short_conv
    monkeypatch.setattr(kda, "value_block", lambda *a: (bv, 1))  # several value blocks per head
    x, conv_state, w, state, g_raw, b_raw, dt_bias, a_log, idx, qpos, rows = _inputs(dtype, H, D, K, H * D + K)
    T = x.shape[0]
    # the two launches
    cs_ref, st_ref = conv_state.clone(), state.clone()
    out_ref = torch.full((T + 1, H, D), float("nan")).to(dtype)
    y, n = short_conv(x, idx, qpos, rows, cs_ref, w)
    kda.kda_recurrent(y, g_raw, dt_bias, a_log, None, b_raw, idx, n, qpos[:, 0], rows, st_ref, out_ref, D ** -0.5)
    # one launch
    cs, st = conv_state.clone(), state.clone()
    out = torch.full((T + 1, H, D), float("nan")).to(dtype)
    tickets = torch.zeros(rows.numel() * H, dtype=torch.int32)
    gn = torch.Generator().manual_seed(D)
    gate = (torch.randn(T, H * D + 3, generator=gn) * 2).to(dtype)[:, :H * D]  # rows strided: a projection's slice
    nw = torch.rand(D, generator=gn) + 0.5
    normed = torch.full((T + 1, H * D), float("nan")).to(dtype)
    kda.kda_decode_fused(x, g_raw, dt_bias, a_log, None, b_raw, idx, qpos[:, 0], rows, st, cs, w, tickets, out,
                         D ** -0.5, (gate, nw, 1e-5, normed) if norm else None)
    assert tickets.eq(0).all(), "the tickets must be left zero for the next launch (and CUDA-graph replays)"
    assert torch.equal(cs, cs_ref)  # shifted copies of the inputs: bit for bit, the padding row's slot untouched
    assert torch.equal(cs[4], conv_state[4]) and not torch.equal(cs[2], conv_state[2])
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=4e-2, atol=4e-2)
    real = idx[[0, 1, 3], 0]
    torch.testing.assert_close(out[real].float(), out_ref[real].float(), **tol)
    assert out[5].eq(0).all() and out_ref[5].eq(0).all()  # the padding row's output: zeros
    torch.testing.assert_close(st, st_ref, **tol)
    assert torch.equal(st[4], state[4])  # the padding row's slot: nothing written
    assert out[real].float().abs().max() > 0.05  # something was computed
    if norm:
        want = gated_rms_norm(out[real], gate[real], nw, 1e-5)
        assert torch.equal(normed[real], want)
        torch.testing.assert_close(normed[real].float(), gated_rms_norm(out_ref[real], gate[real], nw, 1e-5).float(),
                                   **tol)
        assert normed[5].eq(0).all()  # the padding row: the norm of its zero output
        assert normed[real].float().abs().max() > 0.05
    else:
        assert normed.isnan().all()  # nothing stored without a norm


def test_layer_takes_the_fused_launch_for_decode_groups(monkeypatch):
    """The KDA layer on the GPU code path (tests/test_triton_kda.py's three steps: decode beside prefill, held
    verification rows, plain decode) sends its decode groups without held rows to the one launch (with the output
    norm in a decode-only step) and the prefill, the held rows and the commit to the two launches; its outputs and
    states equal the PyTorch path's (to float32 rounding)."""
    from test_triton_kda import TOL, make_layer, two_steps
    from tokenfab.kernels.gpu import kda
    layer = make_layer(None, False)
    want, want_cache = two_steps(layer)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    calls = []
    for name in ("kda_decode_fused", "kda_recurrent"):
        orig = getattr(kda, name)

        def spy(*a, _o=orig, _n=name, **k):  # (kernel, token_index shape, whether the output norm was fused)
            calls.append((_n, a[6].shape, _n == "kda_decode_fused" and a[15] is not None))
            return _o(*a, **k)
        monkeypatch.setattr(kda, name, spy)
    got, got_cache = two_steps(layer)
    # step 1: the decode group fused, the prefill group; step 2: the verification rows, then the commit's rerun of
    # the kept tokens; step 3: the three decodes fused with the output norm (a decode-only step)
    assert [(n, tuple(s), nm) for n, s, nm in calls] == [
        ("kda_decode_fused", (1, 1), False), ("kda_recurrent", (2, 70), False), ("kda_recurrent", (3, 2), False),
        ("kda_recurrent", (2, 2), False), ("kda_decode_fused", (3, 1), True)], calls
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(got_cache.recurrent, want_cache.recurrent, **TOL)
    torch.testing.assert_close(got_cache.conv, want_cache.conv, **TOL)


def test_fused_decode_compiles_for_sm90_and_gfx942(interpret, monkeypatch):
    """The fused launch's GPU form (bf16 activations, K3's conv width 4, two value blocks a head: the ticket and its
    atomics; the output norm in the last program) compiled by Triton's own compiler for NVIDIA sm_90 and AMD gfx942
    on this CPU (tokenfab/testing/target_compile.py)."""
    from tokenfab.kernels.gpu import kda
    from tokenfab.testing.target_compile import LaunchRecorder, compile_for_targets
    monkeypatch.setattr(kda, "value_block", lambda *a: (64, 4))
    x, conv_state, w, state, g_raw, b_raw, dt_bias, a_log, idx, qpos, rows = _inputs(torch.bfloat16, 1, 128, 4, 1)
    out = torch.zeros(x.shape[0] + 1, 1, 128).to(torch.bfloat16)
    norm = (g_raw, torch.ones(128), 1e-5, torch.zeros(x.shape[0] + 1, 128).to(torch.bfloat16))
    with LaunchRecorder() as rec:
        kda.kda_decode_fused(x, g_raw, dt_bias, a_log, -5.0, b_raw, idx, qpos[:, 0], rows, state, conv_state, w,
                             torch.zeros(4, dtype=torch.int32), out, 128 ** -0.5, norm)
    assert [(l["constexprs"]["FUSE_CONV"], l["constexprs"]["NORM"]) for l in rec.launches] == [(True, True)]
    failures = compile_for_targets(rec.launches)
    assert not failures, "\n".join(f"{f['kernel']} on {f['target']}: {f['error']}" for f in failures)
