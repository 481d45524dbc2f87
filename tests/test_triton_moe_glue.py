"""The MoE glue kernels on the GPU path in Triton's interpreter on CPU, against their PyTorch references: the pair
alignment in one launch (kernels/gpu/moe.py::align_pairs_fused vs align_pairs, bit for bit), the k-sum with the
cast (moe_sum vs a float32 sum skipping other ranks' pairs) and Qwen3-MoE's softmax top-k router
(kernels/gpu/router.py::softmax_topk vs layers/moe.py::SoftmaxTopKRouter with the seam off)."""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels import dispatch
from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


@pytest.mark.parametrize("T,k,E,start,num_local,block_m", [
    (1, 2, 8, 0, 8, 16), (3, 2, 3, 0, 3, 2), (37, 6, 60, 0, 60, 16), (200, 8, 128, 0, 128, 64),  # 1600 pairs
    (9, 3, 12, 4, 5, 4),  # expert parallel: experts 4..8 here, the rest on other ranks
])
def test_align_pairs_fused_is_the_reference(interpret, T, k, E, start, num_local, block_m):
    from tokenfab.kernels.gpu.moe import align_pairs, align_pairs_fused
    g = torch.Generator().manual_seed(T * 31 + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    want = align_pairs(ids, start, num_local, block_m)
    got = align_pairs_fused(ids, start, num_local, block_m)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k,hidden,start,num_local", [(1, 2, 64, 0, 8), (5, 3, 1500, 2, 3), (4, 1, 24, 0, 4)])
def test_moe_sum_skips_other_ranks(interpret, dtype, T, k, hidden, start, num_local):
    from tokenfab.kernels.gpu.moe import moe_sum
    g = torch.Generator().manual_seed(hidden)
    ids = torch.randint(0, 8, (T, k), generator=g)
    pairs = torch.randn(T * k, hidden, generator=g)
    local = ((ids >= start) & (ids < start + num_local)).reshape(-1, 1)
    pairs_garbage = torch.where(local, pairs, torch.full_like(pairs, float("nan")))  # never-written rows
    got = moe_sum(pairs_garbage, ids, start, num_local, dtype)
    want = (pairs * local).view(T, k, hidden).sum(1).to(dtype)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # the interpreter truncates to bf16 where PyTorch rounds: one ulp
        assert ((got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs() + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_sum_adds_plus_after_the_slots(interpret, dtype):
    """``plus`` (the shared experts' output, in the output dtype) joins the float32 k-sum after the routed slots,
    before the one rounding: float32 equals pairs summed then plus added; a strided plus (a column slice) is read
    at its row stride."""
    from tokenfab.kernels.gpu.moe import moe_sum
    g = torch.Generator().manual_seed(3)
    T, k, hidden = 5, 3, 40
    ids = torch.randint(0, 6, (T, k), generator=g)
    pairs = torch.randn(T * k, hidden, generator=g)
    wide = torch.randn(T, hidden + 8, generator=g).to(dtype)
    plus = wide[:, 4:4 + hidden]  # row stride hidden + 8
    got = moe_sum(pairs, ids, 0, 6, dtype, plus=plus)
    want = pairs.view(T, k, hidden).sum(1) + plus.float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # one rounding to bf16 (the interpreter truncates where PyTorch rounds: one ulp)
        assert ((got.float() - want).abs() <= 2.0 ** -7 * want.abs() + 1e-6).all()
    assert not torch.allclose(moe_sum(pairs, ids, 0, 6, torch.float32), want)  # plus did change the sum


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [40, 2500])  # one column block; three (1,024 wide, the last partial)
def test_moe_sum_with_the_norm_after_it(interpret, out_dtype, hidden):
    """Kimi K3's latent norm in the k-sum's launch: the RMSNorm of the float32 sum (split-K partials of 2, one
    token's pairs on other ranks' experts skipped) against the float64 formula w * y / sqrt(mean(y^2) + eps) on the
    same sum, float32 to a few float32 roundings, bf16 within one bf16 step (the interpreter truncates); the tickets
    left zero; a second launch gives the same bits; more tokens than the limit are refused."""
    from tokenfab.kernels.gpu.moe import SUM_NORM_MAX_TOKENS, moe_sum
    g = torch.Generator().manual_seed(hidden)
    T, k, S = 3, 4, 2
    ids = torch.randint(0, 6, (T, k), generator=g)
    ids[1, 2] = 9  # another rank's expert: its rows hold garbage, skipped
    pairs = torch.randn(S, T * k, hidden, generator=g)
    pairs[:, 1 * k + 2] = 1e6
    w = (torch.rand(hidden, generator=g) * 2 - 0.5).to(torch.bfloat16)
    tickets = torch.zeros(SUM_NORM_MAX_TOKENS, dtype=torch.int32)
    got = moe_sum(pairs, ids, 0, 6, out_dtype, norm=(w, 1e-6, tickets))
    here = (ids < 6).view(1, T, k, 1).double()
    y = (pairs.double().view(S, T, k, hidden) * here).sum((0, 2))
    want = w.double() * y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert got.dtype == out_dtype and tickets.eq(0).all()
    tol = 2.0 ** -20 if out_dtype == torch.float32 else 2.0 ** -7
    assert ((got.double() - want).abs() <= tol * want.abs() + 1e-6).all(), (got.double() - want).abs().max()
    assert torch.equal(moe_sum(pairs, ids, 0, 6, out_dtype, norm=(w, 1e-6, tickets)), got)
    wide = torch.full((T, hidden + 9), float("nan")).to(out_dtype)  # into a slice of a wider buffer (K3's joined
    into = moe_sum(pairs, ids, 0, 6, out_dtype, norm=(w, 1e-6, tickets, wide[:, 4:4 + hidden]))  # up | down input)
    assert into.data_ptr() == wide[:, 4:].data_ptr() and torch.equal(into, got)
    assert wide[:, :4].isnan().all() and wide[:, 4 + hidden:].isnan().all()  # nothing written beside it
    with pytest.raises(ValueError, match="up to 256 tokens"):
        moe_sum(pairs.repeat(1, 100, 1), ids.repeat(100, 1), 0, 6, out_dtype, norm=(w, 1e-6, tickets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,top_k,norm", [(8, 2, True), (60, 4, True), (12, 3, False), (5, 5, True), (128, 8, True)])
def test_softmax_topk_matches_the_router(interpret, monkeypatch, dtype, E, top_k, norm):
    from tokenfab.kernels.gpu.router import softmax_topk
    from tokenfab.layers.moe import SoftmaxTopKRouter
    g = torch.Generator().manual_seed(E * 10 + top_k)
    router = SoftmaxTopKRouter(32, E, top_k, norm).to(dtype)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, 32, generator=g))
    x = torch.randn(7, 32, generator=g).to(dtype)
    logits = torch.nn.functional.linear(x, router.weight)
    w, ids = softmax_topk(logits, top_k, norm)
    monkeypatch.setattr(dispatch, "softmax_topk", lambda *a, **kw: None)
    monkeypatch.setattr(dispatch, "softmax_router", lambda *a, **kw: None)
    w_ref, ids_ref = router(x)
    assert ids.dtype == torch.int64 and w.dtype == dtype and w.shape == (7, top_k)
    # sorted descending, as torch.topk; experts whose bf16 logits tie exactly may come in either order
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ids_ref))
    if dtype == torch.float32:
        assert torch.equal(ids, ids_ref)
    tol = 1e-6 if dtype == torch.float32 else 2.0 ** -7
    assert ((w.float() - w_ref.float()).abs() <= tol * w_ref.float().abs() + 1e-7).all()


@pytest.mark.parametrize("dtype,E,top_k,norm,T,hidden", [
    (torch.float32, 128, 8, True, 1, 64),      # Qwen3-30B-A3B's 128 experts top-8, one token
    (torch.float32, 60, 4, True, 37, 1100),    # 60 experts (padded to 64), two token tiles, three hidden ranges
    (torch.float32, 12, 3, False, 5, 40),
    (torch.float16, 128, 8, True, 20, 96),     # k / 1024 data: float32 logits exact, then rounded to fp16 both ways
    (torch.float16, 60, 4, False, 3, 64),
    (torch.bfloat16, 128, 8, True, 4, 96),     # small integers: logits exact in bf16 (the interpreter truncates bf16)
])
def test_softmax_router_in_one_launch_matches_the_router(interpret, monkeypatch, dtype, E, top_k, norm, T, hidden):
    """Qwen3-MoE's router with its GEMM in the selection's launch (kernels/gpu/router.py ``router_softmax_topk``)
    against SoftmaxTopKRouter's PyTorch path (the seams off): the chosen experts' probabilities equal (float32: the
    same ids in the same order; 16-bit: experts whose rounded logits tie may swap), weights within float32 rounding
    (16-bit: one step of the dtype), tickets left zero; on the GPU code path the router module takes it."""
    from tokenfab.kernels.gpu import router as gpu_router
    from tokenfab.layers.moe import SoftmaxTopKRouter
    g = torch.Generator().manual_seed(E + T)
    router = SoftmaxTopKRouter(hidden, E, top_k, norm).to(dtype)
    if dtype == torch.float32:
        wt, x = torch.randn(E, hidden, generator=g) / hidden ** 0.5, torch.randn(T, hidden + 2, generator=g)
    elif dtype == torch.float16:  # multiples of 1/1024: every product and sum exact in float32; logits of up to
        # 16 significant bits, which the reference's fp16 GEMM output rounds to 11 (the kernel must round them too)
        wt = torch.randint(-64, 65, (E, hidden), generator=g) / 1024
        x = torch.randint(-8, 9, (T, hidden + 2), generator=g).float()
    else:  # small integers: every logit (|.| < 256) exact in bf16, no rounding to compare (Triton's interpreter
        # truncates to bf16 where a GPU rounds to nearest)
        wt, x = torch.randint(-2, 3, (E, hidden), generator=g), torch.randint(-1, 2, (T, hidden + 2), generator=g)
    with torch.no_grad():
        router.weight.copy_(wt.to(dtype))
    x = x.to(dtype)[:, :hidden]  # a strided view, as a norm's output may be
    tickets = torch.zeros(gpu_router.TICKETS, dtype=torch.int32)
    w, ids = gpu_router.router_softmax_topk(x, router.weight, tickets, top_k, norm)
    assert tickets.eq(0).all() and w.dtype == dtype and ids.shape == (T, top_k)
    with monkeypatch.context() as mp:
        mp.setattr(dispatch, "softmax_topk", lambda *a, **kw: None)
        mp.setattr(dispatch, "softmax_router", lambda *a, **kw: None)
        w_ref, ids_ref = router(x)
    logits = torch.nn.functional.linear(x.double(), router.weight.double()).to(dtype).double()  # exact, rounded
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(probs.gather(1, ids), probs.gather(1, ids_ref), rtol=1e-6, atol=1e-9)
    if dtype == torch.float32:
        assert torch.equal(ids, ids_ref)
    tol = {torch.float32: 1e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    assert ((w.float() - w_ref.float()).abs() <= tol * w_ref.float().abs() + 1e-7).all()
    calls = []
    orig = gpu_router.router_softmax_topk
    monkeypatch.setattr(gpu_router, "router_softmax_topk", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    w2, ids2 = router(x)
    assert calls == [1] and torch.equal(ids2, ids) and torch.equal(w2, w)


def test_softmax_topk_rejects_bad_k(interpret):
    from tokenfab.kernels.gpu.router import softmax_topk
    with pytest.raises(ValueError, match="top_k 9 of 8"):
        softmax_topk(torch.zeros(2, 8), 9, True)


def test_fused_moe_same_with_either_alignment(interpret, monkeypatch):
    """Above ALIGN_FUSED_MAX_PAIRS pairs the tensor-op alignment runs instead: the same sum, bit for bit."""
    from tokenfab.kernels.gpu import moe
    from tokenfab.layers.activation import silu_and_mul
    g = torch.Generator().manual_seed(5)
    T, E, k, H, I = 6, 5, 2, 32, 24
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    fused = moe.fused_moe(x, w13, w2, wts, ids, silu_and_mul)
    monkeypatch.setattr(moe, "ALIGN_FUSED_MAX_PAIRS", 0)
    assert torch.equal(fused, moe.fused_moe(x, w13, w2, wts, ids, silu_and_mul))
