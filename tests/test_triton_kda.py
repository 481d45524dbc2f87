"""The fused recurrent KDA kernel (kernels/gpu/kda.py) in Triton's interpreter on CPU against layers/kda.py's
PyTorch forms (the token-by-token recurrence and the chunked WY form), and one KDA layer on the GPU code path (the
kernel branch, the chunked fla-core branch with stand-ins, speculative rows) against its PyTorch path. The whole
engines on the GPU path: tests/test_kda_gpu_path.py.

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
    """A padded prefill group of 3 sequences (131 tokens: 64 + 64 + 3, 70 and 9 tokens; one carried
    state, the others fresh) against the chunked form and the recurrence; padding tokens are not read and their
    outputs are zeros;
    then decode steps continue from the kernel's prefill state against the recurrence from the reference state."""
    g = torch.Generator().manual_seed(3 + (lower_bound is None))
    B, Q, H, D = 3, 131, 2, 8
    state = torch.randn(5, H, D, D, generator=g) * 0.3
    qkv, g_raw, dt_bias, a_log, b_raw = raw_inputs(g, B, Q, H, D, lower_bound)
    idx = torch.arange(B * Q).view(B, Q)
    n = torch.tensor([131, 70, 9])
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
    assert (got_o[idx[~valid]] == 0).all() and torch.equal(got_s[[1, 2]], state[[1, 2]])  # padding: zero outputs
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


# ---- one layer: the kernel branch, the chunked (fla) branch and speculative rows ---------------------------------
def make_layer(lower_bound: float | None, full_rank_gate: bool, H: int = 2, D: int = 8, hidden: int = 24):
    """A KimiDeltaAttention with random weights (conv taps x 4, as tests/test_kimi_linear.py's checkpoint)."""
    from types import SimpleNamespace

    from tokenfab.layers.kda import KimiDeltaAttention
    cfg = SimpleNamespace(kda_num_heads=H, kda_head_dim=D, kda_conv_kernel=4, hidden_size=hidden, rms_norm_eps=1e-5,
                          use_full_rank_gate=full_rank_gate, gate_lower_bound=lower_bound)
    layer = KimiDeltaAttention(cfg)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.8 if "conv1d" in name else 0.3))
    return layer


def group(token_index: list[list[int]], query_pos: list[list[int]]):
    from tokenfab.layers.attention_metadata import AttentionGroup
    ti, qp = torch.tensor(token_index), torch.tensor(query_pos)
    B, Q = ti.shape
    return AttentionGroup(ti, qp, torch.zeros(B, 1, dtype=torch.int64), (qp.max(1).values + 1), Q, Q)


def two_steps(layer, plain_kept: bool = False):
    """Step 1: one carried sequence decodes (slot 2) while two fresh ones prefill 70 and 5 tokens (slots 0, 3);
    step 2: slots 2 and 3 verify two tokens each (states held) beside slot 0's plain decode, then the commit keeps
    1 and 2 of them; step 3: the three decode again, plainly. ``plain_kept``: step 2 runs only the kept tokens,
    without holding, and no commit follows (what the commit must equal). Returns the outputs and the cache."""
    import numpy as np

    from tokenfab.engine.state_commit import commit
    from tokenfab.layers.attention_metadata import AttentionMetadata
    g = torch.Generator().manual_seed(5)
    cache = layer.make_state_cache(5, torch.float32, "cpu")
    cache.recurrent[2] = torch.randn(cache.recurrent[2].shape, generator=g) * 0.3
    cache.conv[2] = torch.randn(cache.conv[2].shape, generator=g)
    x1 = torch.randn(76, 24, generator=g)
    pre = group([list(range(1, 71)), list(range(71, 76)) + [76] * 65],
                [list(range(70)), list(range(5)) + [-1] * 65])
    m1 = AttentionMetadata(torch.zeros(76, dtype=torch.int64), group([[0]], [[40]]), pre, 76, 8,
                           state_rows=torch.tensor([2, 0, 3]))
    x2 = torch.randn(5, 24, generator=g)
    rows2 = torch.tensor([2, 0, 3])
    if plain_kept:
        m2 = AttentionMetadata(torch.zeros(5, dtype=torch.int64), group([[0, 1], [2, 5], [3, 4]],
                                                                        [[41, -1], [70, -1], [5, 6]]), None, 5, 8,
                               state_rows=rows2)
    else:
        m2 = AttentionMetadata(torch.zeros(5, dtype=torch.int64), group([[0, 1], [2, 5], [3, 4]],
                                                                        [[41, 42], [70, -1], [5, 6]]), None, 5, 8,
                               state_rows=rows2, state_hold=torch.tensor([True, False, True]))
    x3 = torch.randn(3, 24, generator=g)
    m3 = AttentionMetadata(torch.zeros(3, dtype=torch.int64), group([[0], [1], [2]], [[42], [71], [7]]), None, 3, 8,
                           state_rows=torch.tensor([2, 0, 3]))
    with torch.no_grad():
        outs = [layer(None, x1, cache, m1), layer(None, x2, cache, m2)]
        if not plain_kept:
            assert len(cache.deferred) == 1
            assert commit([cache], torch.tensor([3, 2]), torch.tensor([2, 1])) == 2
            assert not cache.deferred
        outs.append(layer(None, x3, cache, m3))
    outs[1] = outs[1][[0, 2, 3, 4]]  # the dropped token (row 1): not compared
    return outs, cache


def test_commit_equals_a_plain_step_over_the_kept_tokens():
    """The PyTorch path: a held verification step then a commit of its first 1 and 2 tokens leaves the states a
    plain step over those tokens alone leaves (and so the next step's outputs); holding without the commit does
    not (the comparison can fail)."""
    layer = make_layer(None, False)
    got, got_cache = two_steps(layer)
    want, want_cache = two_steps(layer, plain_kept=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(got_cache.recurrent, want_cache.recurrent, **TOL)
    torch.testing.assert_close(got_cache.conv, want_cache.conv, **TOL)


@pytest.mark.parametrize("lower_bound,full_rank_gate", [(None, False), (-5.0, True)])
@pytest.mark.parametrize("prefill", ["kernel", "chunk_reference", "chunk_fla_conventions"])
def test_layer_gpu_path_matches_pytorch_path(monkeypatch, lower_bound, full_rank_gate, prefill):
    """The KDA layer on the GPU code path (its projections joined as after loading; the short-conv kernel, the
    recurrence kernel and the gated-norm kernel) against its PyTorch path with separate projections (the
    reference): outputs and conv and recurrent slots, through a held verification step and its commit. ``chunk_*``:
    the 70-token prefill group takes the chunked
    branch (kernels/gpu/kda_chunk.py), with fla's chunk_kda (which does not run in Triton's interpreter) replaced
    by a stand-in following its documented contract: layers/kda.py's chunked form, or fla's fused_recurrent_kda
    (it does run in the interpreter) called with the same tensor mapping (skipped without fla-core)."""
    layer = make_layer(lower_bound, full_rank_gate)
    want, want_cache = two_steps(layer)
    layer.fuse()  # as after loading: the six input projections in one GEMM
    assert layer.in_proj is not None and layer.q_proj.weight is None
    from tokenfab.kernels import dispatch
    from tokenfab.kernels.gpu import kda_chunk
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    chunked = []
    if prefill != "kernel":
        if prefill == "chunk_fla_conventions":
            fla = pytest.importorskip("fla.ops.kda")

            def stand_in(q, k, v, g, beta, s0):
                chunked.append(q.shape)
                return fla.fused_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=s0.contiguous(),
                                               output_final_state=True, use_qk_l2norm_in_kernel=False)
        else:
            def stand_in(q, k, v, g, beta, s0):
                chunked.append(q.shape)
                tr = lambda t: t.transpose(1, 2)
                o, s = kda_chunked(tr(q), tr(k), tr(v), tr(g), tr(beta), s0)
                return tr(o), s
        monkeypatch.setattr(kda_chunk, "chunk_prefill", stand_in)
        monkeypatch.setattr(dispatch, "kda_chunk_applies", lambda x, tokens: tokens >= dispatch.KDA_CHUNK_MIN_TOKENS)
    got, got_cache = two_steps(layer)
    assert chunked == ([] if prefill == "kernel" else [(2, 70, 2, 8)])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(got_cache.recurrent, want_cache.recurrent, **TOL)
    torch.testing.assert_close(got_cache.conv, want_cache.conv, **TOL)


def test_chunk_path_never_on_cpu(monkeypatch):
    """The fla branch is chosen only for CUDA / ROCm bf16 / fp16 tensors: CPU tensors (also on the interpreted GPU
    path) never ask whether fla-core imports."""
    from tokenfab.kernels import dispatch
    from tokenfab.kernels.gpu import kda_chunk
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    monkeypatch.setattr(kda_chunk, "importable", lambda: pytest.fail("fla-core looked up for a CPU tensor"))
    for dtype in (torch.bfloat16, torch.float32):
        assert not dispatch.kda_chunk_applies(torch.zeros(2, dtype=dtype), 4096)


def test_verification_rows_read_nothing_from_the_device(monkeypatch):
    """On the GPU path a verification step's KDA layer holds its rows' states with no host read of a device value
    (one per layer would drain a GPU's queue): the short-conv and recurrence kernels skip the held rows' stores. With
    the rows, their hold flags and token counts on the host (``state_hold_host`` / ``num_new_host`` /
    ``state_rows_host``, as the runner gives them) the commit after it selects and checks its rows without one too,
    in two kernel launches (without them it reads the device, which the counter sees). The committed states equal a
    plain step's over the kept tokens alone."""
    import numpy as np

    from tokenfab.engine.state_commit import commit
    from tokenfab.layers.attention_metadata import AttentionMetadata
    from tokenfab.testing.kernel_count import KernelCounter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    layer = make_layer(None, False)
    layer.fuse()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(7, 24, generator=g)
    state1 = torch.randn(layer.make_state_cache(1, torch.float32, "cpu").recurrent[0].shape,
                         generator=torch.Generator().manual_seed(1)) * 0.3
    rows_np, kept_np = np.array([1, 3]), np.array([2, 1])  # row 1 keeps 2 of its 3 tokens, row 3 1 of 2
    states = []
    for host in (False, True, "plain"):
        cache = layer.make_state_cache(5, torch.float32, "cpu")
        cache.recurrent[1] = state1
        hold = np.array([True, False, True])
        if host == "plain":  # the kept tokens alone, nothing held
            qp = [[9, 10, -1], [4, 5, -1], [0, -1, -1]]
            extra = {}
        else:
            qp = [[9, 10, 11], [4, 5, -1], [0, 1, -1]]
            extra = dict(state_hold=torch.from_numpy(hold), state_hold_host=hold if host else None,
                         num_new_host=np.array([3, 2, 2]) if host else None,
                         state_rows_host=np.array([1, 0, 3]) if host else None)
        meta = AttentionMetadata(torch.zeros(7, dtype=torch.int64), None,
                                 group([[0, 1, 2], [3, 4, 7], [5, 6, 7]], qp), 7, 8,
                                 state_rows=torch.tensor([1, 0, 3]), **extra)
        kc = KernelCounter()
        with kc, kc.scope("kda"), torch.no_grad():
            layer(None, x, cache, meta)
        assert not kc.syncs, kc.syncs
        assert kc.counts["kda"]["triton:_short_conv_kernel"] == kc.counts["kda"]["triton:_kda_recurrent_kernel"] == 1
        if host != "plain":
            assert torch.equal(cache.recurrent[1], state1) and not cache.recurrent[3].any()  # held: unwritten
            assert cache.recurrent[0].any()  # the plain row's state written
            kc = KernelCounter()
            with kc, kc.scope("commit"), torch.no_grad():
                done = commit([cache], torch.from_numpy(rows_np), torch.from_numpy(kept_np),
                              *((rows_np, kept_np) if host else ()))
            assert done == 2 and bool(kc.syncs) != bool(host), kc.syncs
            c = kc.counts["commit"]
            assert c["triton:_short_conv_kernel"] == c["triton:_kda_recurrent_kernel"] == 1, c
        states.append((cache.conv.clone(), cache.recurrent.clone()))
    for got in states[:2]:
        for a, b in zip(got, states[2]):
            torch.testing.assert_close(a, b, **TOL)
