"""Triton kernel for the DeepSeek-V3 / Kimi-K2 router's selection on GPUs (noaux_tc, layers/moe.py
``SigmoidGroupRouter``): after the router GEMM, one program per token computes the sigmoid scores, adds the
correction bias to choose, scores each group by the sum of its two best choice scores, keeps the best ``topk_group``
groups, picks the ``top_k`` best experts among them, and writes their *unbiased* scores (renormalized when asked,
times the scaling factor) and ids. The eager path is ~10 kernels (sigmoid, add, view, topk, sum, topk, scatter,
masked_fill, topk, gather, div, mul); this is one.

Selection by repeated arg-max over the token's row (``top_k`` and ``topk_group`` rounds, the chosen entry masked
each round); ties go to the lower index. The ids come out in descending choice score (the reference's topk is
unsorted: compare them as sets). Needs the expert count and the group size to be powers of two (DeepSeek-V3: 256 in
8 groups of 32); otherwise the dispatch seam returns None and the layer's PyTorch path runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _group_topk_kernel(logit_ptr, bias_ptr, w_ptr, id_ptr, stride_l, scale,
                       E: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
                       NORM: tl.constexpr):
    t = tl.program_id(0)
    idx = tl.arange(0, E)
    logits = tl.load(logit_ptr + t * stride_l + idx).to(tl.float32)
    scores = 1.0 / (1.0 + tl.exp(-logits))
    choice = scores + tl.load(bias_ptr + idx).to(tl.float32)
    neg = float("-inf")
    if G > 1:
        S: tl.constexpr = E // G
        grouped = tl.reshape(choice, (G, S))
        col = tl.arange(0, S)[None, :]
        best = tl.argmax(grouped, axis=1)
        first = tl.max(grouped, axis=1)
        second = tl.max(tl.where(col == best[:, None], neg, grouped), axis=1)
        gscore = first + second
        gidx = tl.arange(0, G)
        keep = gidx < 0  # all False
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(gscore, axis=0)
            keep = keep | (gidx == g)
            gscore = tl.where(gidx == g, neg, gscore)
        choice = tl.reshape(tl.where(keep[:, None], grouped, neg), (E,))
    kidx = tl.arange(0, K)
    ids = tl.zeros((K,), dtype=tl.int64)
    ws = tl.zeros((K,), dtype=tl.float32)
    for j in tl.static_range(K):
        e = tl.argmax(choice, axis=0)
        ids = tl.where(kidx == j, e.to(tl.int64), ids)
        ws = tl.where(kidx == j, tl.sum(tl.where(idx == e, scores, 0.0), axis=0), ws)
        choice = tl.where(idx == e, neg, choice)
    if NORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    tl.store(w_ptr + t * K + kidx, ws * scale)
    tl.store(id_ptr + t * K + kidx, ids)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def applies(num_experts: int, n_group: int, top_k: int) -> bool:
    """Whether the kernel takes this router's shape: power-of-two expert count, group count and top_k, and groups
    of at least two experts when grouped (a group's score is the sum of its best two)."""
    g = max(n_group, 1)
    return (_pow2(num_experts) and _pow2(g) and num_experts % g == 0 and (g == 1 or num_experts // g >= 2)
            and _pow2(top_k) and top_k <= num_experts)


def sigmoid_group_topk(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                       norm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's selection from float32 logits [T, E] (x W^T) and the correction bias [E]: (weights [T, top_k]
    float32, ids [T, top_k] int64), ids in descending choice score. Call where :func:`applies`."""
    T, E = logits.shape
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        _group_topk_kernel[(T,)](logits, bias, w, ids, logits.stride(0), float(scale), E=E, G=max(n_group, 1),
                                 TOPK_GROUP=topk_group if n_group > 1 else 1, K=top_k, NORM=bool(norm),
                                 num_warps=1 if E <= 64 else 4)
    return w, ids


@triton.jit
def _softmax_topk_kernel(logit_ptr, w_ptr, id_ptr, E, stride_l, K: tl.constexpr, NORM: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    idx = tl.arange(0, BLOCK_E)
    emask = idx < E
    raw = tl.load(logit_ptr + t * stride_l + idx, mask=emask, other=0.0)
    logits = tl.where(emask, raw.to(tl.float32), float("-inf"))
    ex = tl.exp(logits - tl.max(logits, axis=0))
    probs = ex / tl.sum(ex, axis=0)
    choice = tl.where(emask, probs, -1.0)  # probabilities are >= 0: padding never wins
    kidx = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    ws = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in tl.static_range(K):
        e = tl.argmax(choice, axis=0)
        ids = tl.where(kidx == j, e.to(tl.int64), ids)
        ws = tl.where(kidx == j, tl.sum(tl.where(idx == e, probs, 0.0), axis=0), ws)
        choice = tl.where(idx == e, -2.0, choice)
    if NORM:
        ws = ws / tl.sum(ws, axis=0)  # padding slots hold 0
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
