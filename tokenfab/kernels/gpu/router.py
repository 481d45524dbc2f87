"""Triton kernels for the MoE routers on GPUs.

DeepSeek-V3 / Kimi-K2 (noaux_tc, layers/moe.py ``SigmoidGroupRouter``): per token, the sigmoid scores, the
correction bias added to choose, each group scored by the sum of its two best choice scores, the best
``topk_group`` groups kept, the ``top_k`` best experts among them, and their *unbiased* scores (renormalized when
asked, times the scaling factor) with their ids. The eager path is ~10 kernels (sigmoid, add, view, topk, sum, topk,
scatter, masked_fill, topk, gather, div, mul) after the router GEMM and a cast of x to float32;
:func:`sigmoid_group_topk` is one launch after the GEMM, :func:`router_topk` one launch with the GEMM inside
(decode batches). Both may append always-chosen slots (ids E, E + 1, .. with weight 1.0) so that shared experts run
inside the routed experts' grouped GEMMs (layers/shared_expert_fold.py).

Selection by repeated arg-max over a tile of tokens' rows (``top_k`` and ``topk_group`` rounds, the chosen entry
masked each round); ties go to the lower index. The ids come out in descending choice score (the reference's topk
is unsorted: compare them as sets). Grouped routing needs the expert count and the group size to be powers of two
(DeepSeek-V3: 256 in 8 groups of 32); ungrouped routing takes any expert count, padded to the next power of two
with columns that never win (Kimi-K2: 384, Kimi K3: 896), in the fused launch as in the selection launch after a
separate GEMM (the fused launch's selection holds SELECT_ELEMENTS logits at a time: a few tokens' padded rows).
Otherwise the dispatch seam returns None and the layer's PyTorch path runs.

Qwen3-MoE's softmax top-k: :func:`softmax_topk` after the GEMM, or :func:`router_softmax_topk` with the GEMM in the
same launch (decode batches; the same work split, the logits rounded to the activations' dtype first as the
reference's GEMM output is).

Both one-launch forms can also align the (token, slot) pairs by expert for the experts' grouped GEMMs (``align``: a
kernels/gpu/moe.py ``Alignment``): the last token tile's selecting program (a second ticket) runs the alignment
program of kernels/gpu/moe.py over every token's ids, so a decode MoE layer has no alignment launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenfab.kernels.gpu.moe import Alignment, align_into


@triton.jit
def _take_top(choice, vals, K: tl.constexpr, KOUT: tl.constexpr):
    """K rounds of arg-max over ``choice`` [BT, EP] (ties to the lower index, each pick masked with -inf for the next
    round) -> (``vals`` at the picks [BT, KOUT] float32, their columns [BT, KOUT] int64; slots past K zero)."""
    BT: tl.constexpr = choice.shape[0]
    EP: tl.constexpr = choice.shape[1]
    idx = tl.arange(0, EP)[None, :]
    kidx = tl.arange(0, KOUT)[None, :]
    ids = tl.zeros((BT, KOUT), dtype=tl.int64)
    ws = tl.zeros((BT, KOUT), dtype=tl.float32)
    for j in tl.static_range(K):
        e = tl.argmax(choice, axis=1)[:, None]
        hit = idx == e
        ids = tl.where(kidx == j, e.to(tl.int64), ids)
        ws = tl.where(kidx == j, tl.sum(tl.where(hit, vals, 0.0), axis=1)[:, None], ws)
        choice = tl.where(hit, float("-inf"), choice)
    return ws, ids


@triton.jit
def _select_tile(logits, bias_ptr, scale, extra_base, E: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr,
                 K: tl.constexpr, EXTRA: tl.constexpr, NORM: tl.constexpr, KOUT: tl.constexpr, EP: tl.constexpr):
    """The selection for a tile of tokens: float32 logits [BT, EP] (EP: E padded to a power of two, G == 1 when
    EP > E; the padding columns never win) -> (weights [BT, KOUT] float32, ids [BT, KOUT] int64); columns
    K .. K + EXTRA - 1 are the appended always-chosen experts extra_base + j with weight 1.0, the columns past
    K + EXTRA padding. Row by row the same arithmetic as the one-token form (ties to the lower id)."""
    idx = tl.arange(0, EP)[None, :]
    neg = float("-inf")
    scores = 1.0 / (1.0 + tl.exp(-logits))
    choice = scores + tl.load(bias_ptr + idx, mask=idx < E, other=0.0).to(tl.float32)
    if EP > E:
        choice = tl.where(idx < E, choice, neg)
    BT: tl.constexpr = logits.shape[0]
    if G > 1:
        S: tl.constexpr = E // G
        grouped = tl.reshape(choice, (BT, G, S))
        col = tl.arange(0, S)[None, None, :]
        best = tl.argmax(grouped, axis=2)
        first = tl.max(grouped, axis=2)
        second = tl.max(tl.where(col == best[:, :, None], neg, grouped), axis=2)
        gscore = first + second  # [BT, G]
        gidx = tl.arange(0, G)[None, :]
        keep = gscore != gscore  # all False (scores are finite)
        for _ in tl.static_range(TOPK_GROUP):
            hit = gidx == tl.argmax(gscore, axis=1)[:, None]
            keep = keep | hit
            gscore = tl.where(hit, neg, gscore)
        choice = tl.reshape(tl.where(keep[:, :, None], grouped, neg), (BT, E))
    ws, ids = _take_top(choice, scores, K, KOUT)
    kidx = tl.arange(0, KOUT)[None, :]
    if NORM:
        ws = ws / (tl.sum(ws, axis=1)[:, None] + 1e-20)
    ws = ws * scale
    if EXTRA > 0:
        shared = (kidx >= K) & (kidx < K + EXTRA)
        ws = tl.where(shared, 1.0, ws)
        ids = tl.where(shared, (extra_base + kidx - K).to(tl.int64), ids)
    return ws, ids


@triton.jit
def _softmax_select_tile(logits, E, K: tl.constexpr, NORM: tl.constexpr, KOUT: tl.constexpr,
                         EP: tl.constexpr):
    """Qwen3-MoE's selection for a tile of tokens: float32 logits [BT, EP] (columns past E padding) -> (weights
    [BT, KOUT] float32: the softmax probabilities of the ``K`` most probable experts, renormalized when NORM;
    ids [BT, KOUT] int64), by repeated arg-max (ties to the lower index); :func:`_softmax_topk_kernel` runs it on
    one token's row."""
    valid = tl.arange(0, EP)[None, :] < E
    logits = tl.where(valid, logits, float("-inf"))
    ex = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = ex / tl.sum(ex, axis=1)[:, None]
    ws, ids = _take_top(tl.where(valid, probs, -1.0), probs, K, KOUT)  # probabilities >= 0: padding never wins
    if NORM:
        ws = ws / tl.sum(ws, axis=1)[:, None]  # padding slots hold 0
    return ws, ids


@triton.jit
def _group_topk_kernel(logit_ptr, bias_ptr, w_ptr, id_ptr, stride_l, scale, extra_base,
                       E: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
                       EXTRA: tl.constexpr, NORM: tl.constexpr, KOUT: tl.constexpr, EP: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.arange(0, EP)[None, :]
    logits = tl.load(logit_ptr + t * stride_l + cols, mask=cols < E, other=0.0).to(tl.float32)
    ws, ids = _select_tile(logits, bias_ptr, scale, extra_base, E, G, TOPK_GROUP, K, EXTRA, NORM, KOUT, EP)
    kidx = tl.arange(0, KOUT)[None, :]
    kmask = kidx < K + EXTRA
    tl.store(w_ptr + t * (K + EXTRA) + kidx, ws, mask=kmask)
    tl.store(id_ptr + t * (K + EXTRA) + kidx, ids, mask=kmask)


@triton.jit(do_not_specialize=["T"])
def _router_kernel(x_ptr, rw_ptr, bias_ptr, part_ptr, count_ptr, w_ptr, id_ptr, T, HID, s_x, s_rw, scale,
                   extra_base, sorted_ptr, eob_ptr, npost_ptr, a_start, a_num_local, a_P, a_tiles,
                   E: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
                   EXTRA: tl.constexpr, NORM: tl.constexpr, KOUT: tl.constexpr, EP: tl.constexpr,
                   SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   SEL_T: tl.constexpr, SOFTMAX: tl.constexpr, ALIGN: tl.constexpr, TILE: tl.constexpr,
                   CHUNK: tl.constexpr, A_BLOCK_E: tl.constexpr, A_SLOT: tl.constexpr):
    """Program (i, j): the float32 logits of token tile j for experts tile i // SPLIT over hidden range i % SPLIT,
    stored as a partial; the tile's last program to finish (a ticket per token tile) sums the partials in split
    order and runs the selection for the tile, SEL_T tokens at a time (their rows of EP logits in registers), then
    resets the ticket for the next launch. SOFTMAX: Qwen3-MoE's selection instead, on the logits rounded to x's
    dtype first (the router GEMM's output dtype in the reference), weights stored in w_ptr's dtype. ALIGN: the
    last token tile's selecting program (a second ticket, ``count_ptr[A_SLOT]``) then aligns every token's pairs by
    expert for the experts' GEMMs (kernels/gpu/moe.py ``align_into``, over experts [a_start, a_start +
    a_num_local))."""
    pid = tl.program_id(0)
    tb = tl.program_id(1)
    eb = pid // SPLIT
    sk = pid % SPLIT
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < E
    k_per = tl.cdiv(tl.cdiv(HID, SPLIT), BLOCK_K) * BLOCK_K
    k_lo = sk * k_per
    k_hi = tl.minimum(HID, k_lo + k_per)
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < k_hi
        xa = tl.load(x_ptr + t.to(tl.int64)[:, None] * s_x + kk[None, :], mask=tmask[:, None] & kmask[None, :],
                     other=0.0).to(tl.float32)
        wa = tl.load(rw_ptr + e.to(tl.int64)[:, None] * s_rw + kk[None, :], mask=emask[:, None] & kmask[None, :],
                     other=0.0)
        acc = tl.dot(xa, tl.trans(wa.to(tl.float32)), acc, input_precision="ieee")  # float32 FMA, no TF32
    tl.store(part_ptr + (sk * T + t.to(tl.int64))[:, None] * E + e[None, :], acc,
             mask=tmask[:, None] & emask[None, :])
    tl.debug_barrier()  # every thread's partial stored before the ticket (released at GPU scope)
    ticket = tl.atomic_add(count_ptr + tb, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:  # (the barrier / release / acquire / barrier of Inductor's grid barrier)
        tl.debug_barrier()  # the acquired ticket seen by every thread before they read the other partials
        cols = tl.arange(0, EP)[None, :]
        kidx = tl.arange(0, KOUT)[None, :]
        for r0 in range(0, BLOCK_T, SEL_T):  # a loop, not unrolled: each pass is the whole selection
            ts = tb * BLOCK_T + r0 + tl.arange(0, SEL_T)
            smask = ts < T
            logits = tl.zeros([SEL_T, EP], tl.float32)
            for s in range(SPLIT):  # in split order: the same sum whichever program came last
                logits += tl.load(part_ptr + (s * T + ts.to(tl.int64))[:, None] * E + cols,
                                  mask=smask[:, None] & (cols < E), other=0.0, volatile=True)
            if SOFTMAX:
                logits = logits.to(x_ptr.dtype.element_ty).to(tl.float32)
                ws, ids = _softmax_select_tile(logits, E, K, NORM, KOUT, EP)
            else:
                ws, ids = _select_tile(logits, bias_ptr, scale, extra_base, E, G, TOPK_GROUP, K, EXTRA, NORM, KOUT,
                                       EP)
            omask = smask[:, None] & (kidx < K + EXTRA)
            tl.store(w_ptr + ts[:, None] * (K + EXTRA) + kidx, ws.to(w_ptr.dtype.element_ty), mask=omask)
            tl.store(id_ptr + ts[:, None] * (K + EXTRA) + kidx, ids, mask=omask)
        tl.atomic_xchg(count_ptr + tb, 0)
        if ALIGN:  # every tile's ids stored (each selector released them with its ticket): the last one aligns
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + A_SLOT, 1, sem="acq_rel")
            if done == tl.num_programs(1) - 1:
                tl.debug_barrier()
                align_into(id_ptr, sorted_ptr, eob_ptr, npost_ptr, T * (K + EXTRA), a_start, a_num_local, a_P,
                           a_tiles, TILE, CHUNK, A_BLOCK_E, True)
                tl.atomic_xchg(count_ptr + A_SLOT, 0)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def applies(num_experts: int, n_group: int, top_k: int) -> bool:
    """Whether the selection kernel takes this router's shape: a power-of-two top_k; ungrouped, any expert count;
    grouped, power-of-two expert and group counts with groups of at least two experts (a group's score is the sum
    of its best two)."""
    g = max(n_group, 1)
    if not (_pow2(top_k) and top_k <= num_experts):
        return False
    return g == 1 or (_pow2(num_experts) and _pow2(g) and num_experts % g == 0 and num_experts // g >= 2)


def fused_applies(num_experts: int, n_group: int, top_k: int) -> bool:
    """Whether :func:`router_topk` (GEMM and selection in one launch) takes this shape: what :func:`applies` takes
    (any expert count ungrouped, padded to a power of two in the selection: Kimi K3's 896)."""
    return applies(num_experts, n_group, top_k)


SELECT_ELEMENTS = 4096  # logits the fused launch's selection holds in registers at once (SEL_T tokens x EP)


def _meta(E: int, n_group: int, topk_group: int, top_k: int, norm: bool, extra: int) -> dict:
    return dict(E=E, G=max(n_group, 1), TOPK_GROUP=topk_group if n_group > 1 else 1, K=top_k, EXTRA=extra,
                NORM=bool(norm), KOUT=triton.next_power_of_2(top_k + extra), EP=triton.next_power_of_2(E))


def sigmoid_group_topk(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                       norm: bool, scale: float, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's selection from float32 logits [T, E] (x W^T) and the correction bias [E]: (weights
    [T, top_k + extra] float32, ids [T, top_k + extra] int64), ids in descending choice score, then ``extra``
    always-chosen slots (ids E, E + 1, .. with weight 1.0: shared experts run as routed ones). Call where
    :func:`applies`."""
    T, E = logits.shape
    w = torch.empty(T, top_k + extra, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k + extra, dtype=torch.int64, device=logits.device)
    if T:
        _group_topk_kernel[(T,)](logits, bias, w, ids, logits.stride(0), float(scale), E,
                                 **_meta(E, n_group, topk_group, top_k, norm, extra),
                                 num_warps=1 if E <= 64 else 4 if E <= 512 else 8)
    return w, ids


FUSED_MAX_TOKENS = 256  # tokens up to which :func:`router_topk` runs the GEMM inside the launch (decode batches)
TICKETS = triton.cdiv(FUSED_MAX_TOKENS, 32) + 1  # one per token tile of the fused launch, one for the alignment


def router_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, tickets: torch.Tensor, n_group: int,
                topk_group: int, top_k: int, norm: bool, scale: float, extra: int = 0,
                align: Alignment | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole router in one launch: float32 logits x W^T (x cast in registers, IEEE float32 products), the
    sigmoid, group-limited top-k selection, renormalization and scaling (layers/moe.py ``SigmoidGroupRouter``).

    Work split (decode batches hit one 7 MB float32 router weight at DeepSeek-V3's 256 x 7168): programs over
    (16-expert tile x hidden range, 32-token tile), about 200 at that shape so every SM streams its slice once;
    each stores a float32 partial, and the last program of a token tile to take its ticket (an atomic counter in
    ``tickets``, reset by that program) sums the partials in a fixed order and selects; no host sync, the grid a
    function of sizes only (CUDA-graph safe); the sums are deterministic.

    Args:
        x: [T, hidden] float32 / bf16 / fp16 (unit last stride), T <= FUSED_MAX_TOKENS.
        weight: [E, hidden] float32 (unit last stride); bias: [E] float32.
        tickets: [TICKETS] int32 zeros owned by the caller (left zero after every launch), not shared with a
            launch that may run concurrently.
        extra: always-chosen slots appended (as :func:`sigmoid_group_topk`).
        align: optional unfilled kernels/gpu/moe.py ``Alignment`` for T * (top_k + extra) pairs: the last token
            tile's selecting program also aligns the pairs by expert into it (the alignment launch of the experts'
            GEMMs, one launch fewer), and ``align.filled`` is set.

    Returns:
        (weights [T, top_k + extra] float32, ids [T, top_k + extra] int64), as :func:`sigmoid_group_topk`.

    Raises:
        ValueError: more than FUSED_MAX_TOKENS tokens, shapes or dtypes the kernel does not take.
    """
    T, hidden = x.shape
    E = weight.shape[0]
    if (T > FUSED_MAX_TOKENS or weight.shape != (E, hidden) or weight.dtype != torch.float32 or x.stride(-1) != 1
            or weight.stride(-1) != 1 or tickets.numel() < TICKETS or tickets.dtype != torch.int32
            or not fused_applies(E, n_group, top_k)):
        raise ValueError(f"router_topk: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype} do not fit")
    w = torch.empty(T, top_k + extra, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k + extra, dtype=torch.int64, device=x.device)
    _launch_fused(x, weight, bias, tickets, w, ids, scale, _meta(E, n_group, topk_group, top_k, norm, extra), False,
                  align)
    return w, ids


def _align_args(align: Alignment | None, num_pairs: int) -> tuple[list, dict]:
    """The router launch's alignment arguments (pointers and sizes, constexprs) for ``align``, or placeholders."""
    if align is None:
        return [None, None, None, 0, 0, 0, 0], dict(ALIGN=False, TILE=16, CHUNK=16, A_BLOCK_E=16, A_SLOT=0)
    if align.filled or align.num_pairs != num_pairs:
        raise ValueError(f"router: the alignment buffers are for {align.num_pairs} pairs (filled: {align.filled}), "
                         f"the launch has {num_pairs}")
    return ([align.sorted_pairs, align.expert_of_block, align.num_post, align.start, align.num_local,
             align.sorted_pairs.numel(), align.expert_of_block.numel()],
            dict(ALIGN=True, TILE=align.block_m, CHUNK=align.meta()["CHUNK"], A_BLOCK_E=align.meta()["BLOCK_E"],
                 A_SLOT=TICKETS - 1))


def _launch_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, tickets: torch.Tensor, w: torch.Tensor,
                  ids: torch.Tensor, scale: float, meta: dict, softmax: bool, align: Alignment | None = None) -> None:
    """One launch of ``_router_kernel`` for x [T, hidden] and weight [E, hidden] into w / ids [T, k] (the work split
    of :func:`router_topk`'s docstring), aligning the pairs into ``align`` when given."""
    T, hidden = x.shape
    E = weight.shape[0]
    a_args, a_meta = _align_args(align, T * ids.shape[1])
    if a_args[0] is None:
        a_args[:3] = [ids, ids, ids]  # unused without ALIGN
    if T:
        block_e = 16  # tl.dot's smallest tile side
        block_k = 128
        split = max(1, min(triton.cdiv(hidden, 512), 256 // triton.cdiv(E, block_e)))
        block_t = max(16, min(32, triton.next_power_of_2(T)))
        sel_t = max(1, min(block_t, SELECT_ELEMENTS // meta["EP"]))  # K3's 1,024 padded experts: 4 tokens a pass
        part = torch.empty(split, T, E, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(E, block_e) * split, triton.cdiv(T, block_t))
        _router_kernel[grid](x, weight, bias, part, tickets, w, ids, T, hidden, x.stride(0), weight.stride(0),
                             float(scale), E, *a_args, **meta, SPLIT=split, BLOCK_T=block_t, BLOCK_E=block_e,
                             BLOCK_K=block_k, SEL_T=sel_t, SOFTMAX=softmax, num_warps=4, **a_meta)
        if align is not None:
            align.filled = True


def router_softmax_topk(x: torch.Tensor, weight: torch.Tensor, tickets: torch.Tensor, top_k: int,
                        norm: bool, align: Alignment | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's whole router in one launch (layers/moe.py ``SoftmaxTopKRouter``): the logits x W^T (float32
    products and sums, rounded to x's dtype as the reference's GEMM output is), softmax in float32, the ``top_k``
    most probable experts (descending, ties to the lower index), renormalized when ``norm``; the work split and
    tickets of :func:`router_topk`.

    Args:
        x: [T, hidden] float32 / bf16 / fp16 (unit last stride), T <= FUSED_MAX_TOKENS.
        weight: [E, hidden] (any float dtype, unit last stride; read as float32).
        tickets: [TICKETS] int32 zeros owned by the caller, left zero (as :func:`router_topk`).
        align: optional alignment buffers filled in the same launch (as :func:`router_topk`).

    Returns:
        (weights [T, top_k] in x's dtype, rounded once from float32; ids [T, top_k] int64).

    Raises:
        ValueError: more than FUSED_MAX_TOKENS tokens, top_k outside [1, E], shapes the kernel does not take.
    """
    T, hidden = x.shape
    E = weight.shape[0]
    if (T > FUSED_MAX_TOKENS or weight.shape != (E, hidden) or x.stride(-1) != 1 or weight.stride(-1) != 1
            or tickets.numel() < TICKETS or tickets.dtype != torch.int32 or not 1 <= top_k <= E):
        raise ValueError(f"router_softmax_topk: x {tuple(x.shape)}, weight {tuple(weight.shape)}, top_k {top_k} "
                         "do not fit")
    w = torch.empty(T, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    meta = dict(E=E, G=1, TOPK_GROUP=1, K=top_k, EXTRA=0, NORM=bool(norm), KOUT=triton.next_power_of_2(top_k),
                EP=triton.next_power_of_2(E))
    _launch_fused(x, weight, weight, tickets, w, ids, 1.0, meta, True, align)
    return w, ids


@triton.jit
def _softmax_topk_kernel(logit_ptr, w_ptr, id_ptr, E, stride_l, K: tl.constexpr, NORM: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    idx = tl.arange(0, BLOCK_E)[None, :]
    logits = tl.load(logit_ptr + t * stride_l + idx, mask=idx < E, other=0.0).to(tl.float32)  # [1, BLOCK_E]
    ws, ids = _softmax_select_tile(logits, E, K, NORM, BLOCK_K, BLOCK_E)
    kidx = tl.arange(0, BLOCK_K)[None, :]
    kmask = kidx < K
    tl.store(w_ptr + t * K + kidx, ws.to(w_ptr.dtype.element_ty), mask=kmask)
    tl.store(id_ptr + t * K + kidx, ids, mask=kmask)


def softmax_topk(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's router selection (layers/moe.py ``SoftmaxTopKRouter``) in one launch, one program per token:
    softmax over the experts in float32, the ``top_k`` largest probabilities by repeated arg-max (descending, ties to
    the lower index, as sorted ``torch.topk``), renormalized to sum 1 when ``norm``.

    Args:
        logits: [T, E] router logits (any float dtype, unit stride along E; any E up to 65,536).
        top_k: experts per token, 1 <= top_k <= E.

    Returns:
        (weights [T, top_k] in logits' dtype, rounded once from float32; ids [T, top_k] int64).

    Raises:
        ValueError: top_k outside [1, E] or a strided last dim.
    """
    T, E = logits.shape
    if not 1 <= top_k <= E or logits.stride(-1) != 1:
        raise ValueError(f"softmax_topk: top_k {top_k} of {E} experts (unit stride needed along E)")
    w = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        block_e = triton.next_power_of_2(E)
        _softmax_topk_kernel[(T,)](logits, w, ids, E, logits.stride(0), K=top_k, NORM=bool(norm), BLOCK_E=block_e,
                                   BLOCK_K=triton.next_power_of_2(top_k), num_warps=1 if block_e <= 64 else 4)
    return w, ids
