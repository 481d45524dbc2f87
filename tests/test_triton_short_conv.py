"""KDA's short-conv kernel (kernels/gpu/short_conv.py) and gated RMSNorm kernel (kernels/gpu/norm_activation.py) in
Triton's interpreter on CPU against formulas written here: per sequence, full = [old state (zero when fresh) |
valid inputs], y_t = silu(sum_j w[:, j] * full[t + j]) and the new state full[n:n + K - 1] (layers/kda.py's
conv1d form), and (w * x / sqrt(mean(x^2) + eps)) * sigmoid(gate). float32 (the interpreter has no bfloat16) and
float16; padding tokens and other slots must stay untouched.
"""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def conv_reference(x, idx, qpos, rows, state, w):
    """Per sequence, the conv by its definition (a loop over taps); returns (y [B, Q, C] NaN at padding, new state
    pool, n [B])."""
    B, Q = idx.shape
    C, K = w.shape
    y = torch.full((B, Q, C), float("nan"), dtype=x.dtype)
    new = state.clone()
    ns = []
    for b in range(B):
        n = int((qpos[b] >= 0).sum())
        ns.append(n)
        old = torch.zeros(C, K - 1) if int(qpos[b, 0]) == 0 else state[rows[b]].float()
        full = torch.cat([old, x[idx[b, :n]].float().T], dim=1)  # [C, K - 1 + n]
        for t in range(n):
            acc = torch.zeros(C)
            for j in range(K):
                acc += w[:, j] * full[:, t + j]
            y[b, t] = torch.nn.functional.silu(acc).to(x.dtype)
        new[rows[b]] = full[:, n:n + K - 1].to(state.dtype)

    return y, new, torch.tensor(ns, dtype=torch.int32)


@pytest.mark.parametrize("K", [4, 3, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Q", [1, 2, 23])
def test_short_conv_matches_definition(interpret, K, dtype, Q):
    """A group of 5 sequences: carried and fresh, full and ragged (valid tokens fewer than the state width among
    them), and a padding row on the spare slot (no valid token), over strided input rows and 70 channels (a
    partial channel block)."""
    from tokenfab.kernels.gpu.short_conv import short_conv
    g = torch.Generator().manual_seed(K * 100 + Q)
    C, slots = 70, 7
    counts = [Q, max(Q - 1, 1), min(Q, 2), Q, 0]
    fresh = [False, True, False, Q > 1, False]
    B = len(counts)
    T = sum(counts)
    wide = (torch.randn(T, C + 9, generator=g)).to(dtype)
    x = wide[:, 3:3 + C]  # rows strided by C + 9
    idx = torch.full((B, Q), T, dtype=torch.int64)
    qpos = torch.full((B, Q), -1, dtype=torch.int64)
    start = 0
    for b, n in enumerate(counts):
        perm = torch.randperm(n, generator=g) + start  # token rows in any order
        idx[b, :n] = perm
        p0 = 0 if fresh[b] else 9 + b
        qpos[b, :n] = torch.arange(p0, p0 + n)
        start += n
    rows = torch.tensor([3, 0, 5, 1, 6])  # slot 6: the spare slot of the padding row
    state = torch.randn(slots, C, K - 1, generator=g).to(dtype)
    w = torch.randn(C, K, generator=g)
    want_y, want_state, want_n = conv_reference(x, idx, qpos, rows, state, w)
    out = torch.full((B, Q, C), float("nan"), dtype=dtype)
    got_state = state.clone()
    y, n = short_conv(x, idx, qpos, rows, got_state, w, out=out)
    assert y is out
    assert torch.equal(n, want_n)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(y, want_y, equal_nan=True, **tol)  # NaN where padding: never written
    torch.testing.assert_close(got_state, want_state, **tol)
    untouched = [s for s in range(slots) if s not in rows.tolist()]
    assert torch.equal(got_state[untouched], state[untouched])


def test_short_conv_rejects_bad_layouts(interpret):
    from tokenfab.kernels.gpu.short_conv import short_conv
    x, idx, qpos = torch.randn(2, 6), torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64)
    rows, state, w = torch.zeros(1, dtype=torch.int64), torch.zeros(2, 6, 3), torch.randn(6, 4)
    with pytest.raises(ValueError, match="short_conv"):
        short_conv(x, idx, qpos, rows, state, w.double())
    with pytest.raises(ValueError, match="short_conv"):
        short_conv(x, idx, qpos, rows, torch.zeros(2, 6, 2), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_rms_norm_matches_formula(interpret, dtype):
    """3 tokens x 5 heads of 24 (a partial block), the gate a strided column slice of a wider tensor."""
    from tokenfab.kernels import dispatch
    from tokenfab.kernels.gpu.norm_activation import gated_rms_norm
    g = torch.Generator().manual_seed(3)
    T, H, D, eps = 3, 5, 24, 1e-5
    x = (torch.randn(T, H, D, generator=g) * 3).to(dtype)
    gate = (torch.randn(T, H * D + 7, generator=g) * 2).to(dtype)[:, 7:]
    w = (torch.randn(D, generator=g)).to(dtype)
    xf = x.float()
    want = (w.float() * xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            * torch.sigmoid(gate.float().view(T, H, D))).to(dtype).reshape(T, H * D)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(gated_rms_norm(x, gate, w, eps), want, **tol)
    assert dispatch.gated_rms_norm(x, gate, w, eps) is None  # CPU tensors off the GPU path: the layer's PyTorch form
