"""The DeepSeek-V3 router in one launch (kernels/gpu/router.py ``router_topk``: the float32 GEMM, sigmoid, group-
limited top-k, renormalization and scaling) and the always-chosen shared slots, in Triton's interpreter on CPU,
against SigmoidGroupRouter's PyTorch path (layers/moe.py, the kernel seam switched off): the same expert set per
token (random logits have no ties) and the same weights per expert to float32 rounding.
"""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels import dispatch
from tokenfab.kernels.gpu import support as triton_support
from tokenfab.layers.moe import SigmoidGroupRouter

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def make_router(E, hidden, n_group, topk_group, top_k, norm, seed):
    g = torch.Generator().manual_seed(seed)
    r = SigmoidGroupRouter(hidden, E, top_k, n_group, topk_group, norm, 2.5)
    r.weight.data = torch.randn(E, hidden, generator=g) / hidden ** 0.5
    r.e_score_correction_bias.data = torch.randn(E, generator=g) * 0.1
    return r, g


def same_choice(w, ids, w_ref, ids_ref, k):
    """The routed slots as sets (the reference's topk is unsorted), with their weights."""
    order, order_ref = ids[:, :k].argsort(dim=1), ids_ref[:, :k].argsort(dim=1)
    assert torch.equal(ids[:, :k].gather(1, order), ids_ref[:, :k].gather(1, order_ref))
    torch.testing.assert_close(w[:, :k].gather(1, order), w_ref[:, :k].gather(1, order_ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("E,n_group,topk_group,top_k,hidden,T", [
    (256, 8, 4, 8, 96, 3),      # DeepSeek-V3's grouping, one token tile
    (64, 1, 1, 4, 1100, 37),    # hidden 1100: 3 hidden ranges (partials summed), T 37: two token tiles, one partial
    (8, 4, 3, 2, 40, 1),        # 8 experts: a 16-wide expert tile half masked
    (896, 1, 1, 16, 64, 5),     # Kimi K3's 896 experts top-16: padded to 1,024 columns, 4 tokens a selection pass
    (384, 1, 1, 8, 72, 20),     # Kimi-K2's 384: a 32-token tile selected 8 tokens a pass, the last pass partial
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extra", [0, 2])
def test_router_in_one_launch_matches_the_router(interpret, monkeypatch, E, n_group, topk_group, top_k, hidden, T,
                                                 dtype, extra):
    from tokenfab.kernels.gpu import router
    r, g = make_router(E, hidden, n_group, topk_group, top_k, True, E + hidden)
    x = torch.randn(T, hidden + 3, generator=g).to(dtype)[:, :hidden]  # a strided view, as a norm's output may be
    tickets = torch.zeros(router.TICKETS, dtype=torch.int32)
    w, ids = router.router_topk(x, r.weight, r.e_score_correction_bias, tickets, n_group, topk_group, top_k, True,
                                2.5, extra)
    assert tickets.eq(0).all(), "the tickets must be left zero for the next launch (and CUDA-graph replays)"
    monkeypatch.setattr(dispatch, "sigmoid_group_topk", lambda *a, **k: None)
    w_ref, ids_ref = r(x, extra)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (T, top_k + extra)
    same_choice(w, ids, w_ref, ids_ref, top_k)
    assert torch.equal(ids[:, top_k:], ids_ref[:, top_k:]) and torch.equal(w[:, top_k:], w_ref[:, top_k:])
    if extra:
        assert ids[:, top_k:].tolist() == [[E + j for j in range(extra)]] * T and w[:, top_k:].eq(1.0).all()
    w2, ids2 = router.router_topk(x, r.weight, r.e_score_correction_bias, tickets, n_group, topk_group, top_k, True,
                                  2.5, extra)
    assert torch.equal(ids2, ids) and torch.equal(w2, w)  # a second launch on the reset tickets: the same result


@pytest.mark.parametrize("norm", [True, False])
def test_selection_kernel_appends_shared_slots(interpret, monkeypatch, norm):
    """The selection-only kernel (after a separate GEMM) with always-chosen slots: k + extra not a power of two."""
    from tokenfab.kernels.gpu import router
    r, g = make_router(16, 24, 4, 2, 4, norm, 5)
    x = torch.randn(9, 24, generator=g)
    w, ids = router.sigmoid_group_topk(torch.nn.functional.linear(x, r.weight), r.e_score_correction_bias, 4, 2, 4,
                                       norm, 2.5, extra=1)
    monkeypatch.setattr(dispatch, "sigmoid_group_topk", lambda *a, **k: None)
    w_ref, ids_ref = r(x, 1)
    assert ids.shape == (9, 5)
    same_choice(w, ids, w_ref, ids_ref, 4)
    assert ids[:, 4].eq(16).all() and w[:, 4].eq(1.0).all()


def test_router_dispatch_takes_the_fused_launch_for_decode_batches(monkeypatch):
    """On the GPU code path the router module keeps its tickets and runs the one-launch form up to
    FUSED_MAX_TOKENS tokens, the GEMM + selection form above."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    from tokenfab.kernels.gpu import router
    calls = []
    for name in ("router_topk", "sigmoid_group_topk"):
        orig = getattr(router, name)
        monkeypatch.setattr(router, name, lambda *a, _o=orig, _n=name, **k: calls.append(_n) or _o(*a, **k))
    monkeypatch.setattr(router, "FUSED_MAX_TOKENS", 4)
    r, g = make_router(16, 24, 4, 2, 4, True, 9)
    r(torch.randn(4, 24, generator=g))
    r(torch.randn(5, 24, generator=g))
    assert calls == ["router_topk", "sigmoid_group_topk"] and r._tickets is not None


def test_router_topk_rejects_misfits(interpret):
    from tokenfab.kernels.gpu import router
    r, _ = make_router(16, 24, 4, 2, 4, True, 1)
    tickets = torch.zeros(router.TICKETS, dtype=torch.int32)
    with pytest.raises(ValueError):
        router.router_topk(torch.randn(router.FUSED_MAX_TOKENS + 1, 24), r.weight, r.e_score_correction_bias,
                           tickets, 4, 2, 4, True, 1.0)
    with pytest.raises(ValueError):
        router.router_topk(torch.randn(2, 24), r.weight.double(), r.e_score_correction_bias, tickets, 4, 2, 4, True,
                           1.0)


def test_router_compiles_for_sm90_and_gfx942(interpret):
    """The routers' GPU forms compiled by Triton's own compiler for NVIDIA sm_90 and AMD gfx942 on this CPU
    (tokenfab/testing/target_compile.py), bf16 activations: the one-launch router for Kimi K3's 896 experts top-16
    (padded selection passes of 4 tokens; the pairs aligned in the launch) and for Qwen3-MoE's softmax top-8 of 128,
    and the softmax selection after a separate GEMM (prefills past 256 tokens). DeepSeek-V3's grouped form compiles
    in tests/test_gpu_kernels_compile.py with the engine's launches."""
    from tokenfab.kernels.gpu import router
    from tokenfab.kernels.gpu.moe import alignment_for
    from tokenfab.testing.target_compile import LaunchRecorder, compile_for_targets
    r, g = make_router(896, 512, 1, 1, 16, True, 3)
    x = torch.randn(1, 512, generator=g).to(torch.bfloat16)
    with LaunchRecorder() as rec:
        router.router_topk(x, r.weight, r.e_score_correction_bias, torch.zeros(router.TICKETS, dtype=torch.int32),
                           1, 1, 16, True, 2.5, 0, alignment_for(1, 16, 0, 896, x.device))
        qw = torch.randn(128, 512, generator=g).to(torch.bfloat16)
        router.router_softmax_topk(x, qw, torch.zeros(router.TICKETS, dtype=torch.int32), 8, True)
        router.softmax_topk(torch.nn.functional.linear(x, qw), 8, True)
    assert [(l["name"], l["constexprs"]["E"] if "E" in l["constexprs"] else None,
             l["constexprs"].get("ALIGN")) for l in rec.launches] == [
        ("_router_kernel", 896, True), ("_router_kernel", 128, False), ("_softmax_topk_kernel", None, None)]
    failures = compile_for_targets(rec.launches)
    assert not failures, "\n".join(f"{f['kernel']} on {f['target']}: {f['error']}" for f in failures)


@pytest.mark.parametrize("softmax,E,top_k,extra,T,start,num_local", [
    (False, 64, 4, 2, 37, 0, 66),     # two token tiles (the alignment's ticket), the shared slots folded (66 rows)
    (False, 896, 16, 0, 5, 0, 896),   # Kimi K3's 896 experts top-16
    (False, 64, 4, 0, 20, 16, 24),    # expert parallel: this rank's experts [16, 40); other pairs left out
    (True, 12, 4, 0, 40, 3, 6),       # Qwen3-MoE's softmax router, two tiles, expert parallel
])
def test_router_aligns_the_pairs_in_its_launch(interpret, softmax, E, top_k, extra, T, start, num_local):
    """With an Alignment, the router's launch also aligns the (token, slot) pairs by expert (the last token tile's
    selecting program, after every tile's ids are stored): the same three tensors as kernels/gpu/moe.py's
    align_pairs on the ids it returned, bit for bit, with the tile height routed_sum takes; the tickets (the
    alignment's too) left zero, and the same ids and weights as without the alignment."""
    from tokenfab.kernels.gpu import router
    from tokenfab.kernels.gpu.moe import align_pairs, alignment_for
    from tokenfab.kernels.gpu.moe_gemm import block_m_for
    r, g = make_router(E, 48, 1, 1, top_k, True, E + T)
    x = torch.randn(T, 48, generator=g).to(torch.bfloat16)
    tickets = torch.zeros(router.TICKETS, dtype=torch.int32)
    align = alignment_for(T, top_k + extra, start, num_local, x.device)
    assert align.block_m == block_m_for(T * (top_k + extra), num_local) and not align.filled

    def route(a):
        if softmax:
            return router.router_softmax_topk(x, r.weight, tickets, top_k, True, a)
        return router.router_topk(x, r.weight, r.e_score_correction_bias, tickets, 1, 1, top_k, True, 2.5, extra, a)
    w, ids = route(align)
    assert align.filled and tickets.eq(0).all()
    want = align_pairs(ids, start, num_local, align.block_m)
    for got, ref in zip((align.sorted_pairs, align.expert_of_block, align.num_post), want):
        assert got.dtype == torch.int32 and torch.equal(got, ref)
    w0, ids0 = route(None)
    assert torch.equal(ids0, ids) and torch.equal(w0, w)
    with pytest.raises(ValueError):  # filled buffers are not filled twice
        route(align)
