"""The fused recurrent KDA kernel (kernels/gpu/kda.py) in Triton's interpreter on CPU against layers/kda.py's
PyTorch forms (the token-by-token recurrence and the chunked WY form), and the KDA layers of the tiny Kimi Linear
(softplus gate) and Kimi K3 (lower-bound sigmoid gate) models on the GPU code path against the CPU path.

The kernel reads the raw gate / beta projections and the conv outputs and does the gate activation, beta sigmoid,
l2norms, recurrence and output scatter itself, so every test feeds it raw inputs and builds the reference inputs
with the layer's own functions (kda_log_decay, l2norm, sigmoid). float32 throughout: outputs and states agree to
float32 rounding (sums in another order), checked at 2e-5 absolute on O(1) values; a wrong gate, normalization or
state slot moves them by far more.
"""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.gpu import support as triton_support
from tokenfab.layers.kda import kda_chunked, kda_log_decay, kda_recurrent_step, l2norm

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")
TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret")


def raw_inputs(g: torch.Generator, B: int, Q: int, H: int, D: int, lower_bound: float | None):
    """Random raw layer tensors for a group of B sequences x Q tokens: qkv [B, Q, 3HD], g_raw [T, HD], dt_bias
    [HD], a_log [H], b_raw [T, H] (T = B * Q token rows, sequence b's tokens at rows b * Q ...)."""
    T = B * Q
    qkv = torch.randn(B, Q, 3 * H * D, generator=g) * 2
    g_raw = torch.randn(T, H * D, generator=g) * 3
    g_raw[0, 0] = 25.0  # one entry on the linear branch of the softplus (x > 20)
    dt_bias = torch.randn(H * D, generator=g) * 0.5
    a_log = torch.randn(H, generator=g) * 0.5
    b_raw = torch.randn(T, H, generator=g) * 2
    return qkv, g_raw, dt_bias, a_log, b_raw


def reference(qkv, g_raw, dt_bias, a_log, lower_bound, b_raw, idx, num_tokens, fresh, rows, state, D, chunked):
    """layers/kda.py on the same raw inputs: per sequence, its valid tokens through kda_chunked (chunks of 64) or
    kda_recurrent_step; returns (o [T + 1, H, D] with rows never written left NaN, new state pool)."""
    B, H, T = idx.shape[0], state.shape[1], g_raw.shape[0]
    gl = kda_log_decay((g_raw + dt_bias).view(T, H, D), a_log, lower_bound)
    beta = torch.sigmoid(b_raw)
    out = torch.full((T + 1, H, D), float("nan"))
    new = state.clone()
    for b in range(B):
        n = int(num_tokens[b])
        S = torch.zeros(1, H, D, D) if fresh[b] else state[rows[b]].clone()[None]
        q, k, v = qkv[b, :n].view(n, 3, H, D).unbind(1)
        q, k = l2norm(q) * D ** -0.5, l2norm(k)
        tok = idx[b, :n]
        if chunked:
            tr = lambda t: t.transpose(0, 1)[None]  # [n, H, *] -> [1, H, n, *]
            o, S = kda_chunked(tr(q), tr(k), tr(v), tr(gl[tok]), beta[tok].T[None], S)
            out[tok] = o[0].transpose(0, 1)
        else:
            for t in range(n):
                o, S = kda_recurrent_step(q[t][None], k[t][None], v[t][None], gl[tok[t]][None], beta[tok[t]][None], S)
                out[tok[t]] = o[0]
        new[rows[b]] = S[0]
    return out, new


def run_kernel(qkv, g_raw, dt_bias, a_log, lower_bound, b_raw, idx, num_tokens, first_pos, rows, state, D):
    from tokenfab.kernels.gpu.kda import kda_recurrent
    out = torch.full((g_raw.shape[0] + 1, state.shape[1], D), float("nan"))
    kda_recurrent(qkv, g_raw, dt_bias, a_log, lower_bound, b_raw, idx, num_tokens, first_pos, rows, state, out,
                  D ** -0.5)
    return out


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("D", [16, 12])  # 12: a partial key block and a partial value block
def test_decode_steps_match_recurrence(interpret, lower_bound, D):
    """Decode groups (Q = 1) over a pool of 7 slots: fresh and carried sequences, a padded batch whose padding rows
    all name the spare slot 6; real slots equal the recurrence step by step, slots no row names stay bit-identical,
    padding rows write only the spare slot."""
    g = torch.Generator().manual_seed(D + (lower_bound is None))
    H, slots, spare = 3, 7, 6
    state = torch.randn(slots, H, D, D, generator=g) * 0.3
    rows = torch.tensor([4, 1, 2, spare, spare])  # 3 real sequences, 2 padding rows
    fresh = torch.tensor([False, True, False, True, True])
    first_pos = torch.where(fresh, 0, 17).view(5, 1).expand(5, 3)[:, 0]  # a strided view, as query_pos[:, 0]
    for step in range(3):
        qkv, g_raw, dt_bias, a_log, b_raw = raw_inputs(g, 5, 1, H, D, lower_bound)
        idx = torch.arange(5).view(5, 1)
        n = torch.ones(5, dtype=torch.int64)
        want_o, want_s = reference(qkv, g_raw, dt_bias, a_log, lower_bound, b_raw, idx[:3], n[:3], fresh[:3],
                                   rows[:3], state, D, chunked=False)
        got_s = state.clone()
        got_o = run_kernel(qkv, g_raw, dt_bias, a_log, lower_bound, b_raw, idx, n, first_pos, rows, got_s, D)
        torch.testing.assert_close(got_o[:3], want_o[:3], **TOL)
        torch.testing.assert_close(got_s[:spare], want_s[:spare], **TOL)
        for untouched in (0, 3, 5):
            assert torch.equal(got_s[untouched], state[untouched])
        assert torch.isnan(got_o[5]).all(), "the padding token row was written"
        state = got_s
        fresh = torch.zeros(5, dtype=torch.bool)
        first_pos = torch.tensor([18 + step, 1 + step, 18 + step, 0, 0])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_prefill_crosses_chunks_then_decodes(interpret, lower_bound):
    """A padded prefill group of 3 sequences (150 tokens: three 64-token chunks, 70 and 9 tokens; one carried
    state, the others fresh) against the chunked form and the recurrence; padding tokens are not read or written;
    then decode steps continue from the kernel's prefill state against the recurrence from the reference state."""
    g = torch.Generator().manual_seed(3 + (lower_bound is None))
    B, Q, H, D = 3, 150, 2, 8
    state = torch.randn(5, H, D, D, generator=g) * 0.3
    qkv, g_raw, dt_bias, a_log, b_raw = raw_inputs(g, B, Q, H, D, lower_bound)
    idx = torch.arange(B * Q).view(B, Q)
    n = torch.tensor([150, 70, 9])
    fresh = torch.tensor([True, False, True])
    rows = torch.tensor([3, 0, 4])
    got_s = state.clone()
    got_o = run_kernel(qkv, g_raw, dt_bias, a_log, lower_bound, b_raw, idx, n, (~fresh).long() * 5, rows, got_s, D)
    valid = torch.arange(Q).view(1, Q) < n.view(B, 1)
    for chunked in (True, False):
        want_o, want_s = reference(qkv, g_raw, dt_bias, a_log, lower_bound, b_raw, idx, n, fresh, rows, state, D,
                                   chunked)
        torch.testing.assert_close(got_o[idx[valid]], want_o[idx[valid]], **TOL)
        torch.testing.assert_close(got_s, want_s, **TOL)
    assert torch.isnan(got_o[idx[~valid]]).all() and torch.equal(got_s[[1, 2]], state[[1, 2]])
    ref_s = want_s
    for step in range(2):  # decode from the prefill states: kernel state vs reference state, independently
        qkv, g_raw, dt_bias, a_log, b_raw = raw_inputs(g, B, 1, H, D, lower_bound)
        idx1, n1 = torch.arange(B).view(B, 1), torch.ones(B, dtype=torch.int64)
        want_o, ref_s = reference(qkv, g_raw, dt_bias, a_log, lower_bound, b_raw, idx1, n1,
                                  torch.zeros(B, dtype=torch.bool), rows, ref_s, D, chunked=False)
        got_o = run_kernel(qkv, g_raw, dt_bias, a_log, lower_bound, b_raw, idx1, n1, n + step, rows, got_s, D)
        torch.testing.assert_close(got_o[:B], want_o[:B], **TOL)
        torch.testing.assert_close(got_s, ref_s, **TOL)


def test_value_block_choice():
    """The host-side tile choice: about a thousand programs before the value block widens, never wider than the
    padded head dim, at most 32 state elements per thread."""
    from tokenfab.kernels.gpu.kda import value_block
    assert value_block(1, 96, 128) == (16, 2)  # K3 decode at batch 1: 768 programs
    assert value_block(16, 96, 128) == (64, 8)  # 3,072 programs
    assert value_block(3, 96, 128) == (32, 4)  # 1,152 programs
    assert value_block(64, 2, 12) == (16, 1)  # head dim 12: BK 16
    assert value_block(1, 2, 8) == (8, 1)
