"""Fused routed experts in Triton (CUDA/ROCm): token-expert pairs grouped by expert, one grouped GEMM launch per
projection over all experts.

The layout follows the fused-MoE design of vLLM's ``fused_moe.py`` (itself from the "MegaBlocks" block-sparse
idea, Gale et al., arXiv:2211.15841): the T*k (token, slot) pairs are sorted by expert and each expert's segment is
padded to a multiple of BLOCK_M, so every BLOCK_M-row tile of the sorted list belongs to one expert. One program
computes one [BLOCK_M, BLOCK_N] output tile: it gathers its pairs' input rows, multiplies by that expert's weight
and scatters the rows back to pair order. The second projection multiplies each row by its routing weight; the
k slots of a token are then summed in float32.

Both GEMMs ask ``tl.dot`` for ``input_precision="ieee"`` (no TF32 in float32 runs). The alignment is built with
tensor ops only (no ``.item()``, no data-dependent shapes): the grid covers the worst
case T*k + E*(BLOCK_M - 1) rows and tiles past the real end return at once, so the launch is CUDA-graph safe.
Reference and fallback: ``layers/moe.py::RoutedExperts`` (tests/test_triton_kernels.py runs both in Triton's
interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_gemm(A, W, C, SORTED, EXPERT_OF_BLOCK, NUM_POST, TOPW,
              N, K, num_pairs, s_am, s_we, s_wn, s_wk, s_cm,
              A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    bm = pid // num_n
    bn = pid % num_n
    if bm * BLOCK_M >= tl.load(NUM_POST):
        return
    e = tl.load(EXPERT_OF_BLOCK + bm).to(tl.int64)
    if e < 0:
        return
    rows = bm * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SORTED + rows)
    pmask = pair < num_pairs
    a_row = (pair // A_ROW_DIV).to(tl.int64)
    n = bn * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        a = tl.load(A + a_row[:, None] * s_am + kk[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(W + e * s_we + n[None, :] * s_wn + kk[:, None] * s_wk, mask=kmask[:, None] & nmask[None, :],
                    other=0.0)
        acc += tl.dot(a, w, input_precision="ieee")
    if MUL_WEIGHT:
        acc = acc * tl.load(TOPW + pair, mask=pmask, other=0.0)[:, None]
    tl.store(C + pair.to(tl.int64)[:, None] * s_cm + n[None, :], acc.to(C.dtype.element_ty),
             mask=pmask[:, None] & nmask[None, :])


def align_pairs(ids: torch.Tensor, start: int, num_local: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by local expert and pad each expert's run to a multiple of ``block_m``.

    Args:
        ids: [T, k] int64 global expert ids; experts [start, start + num_local) live here (expert parallel).
        block_m: rows per GEMM tile.

    Returns:
        sorted_pairs: [P] int32 pair index (token * k + slot) per padded row, ``T * k`` on padding rows, where
            P = the worst case (T*k + num_local*(block_m - 1)) rounded up to block_m: a shape fixed by T alone.
        expert_of_block: [P / block_m] int32 local expert of each tile, -1 past the last used tile.
        num_post: [1] int32 rows actually used (sum of the padded runs).
    """
    flat = ids.reshape(-1)
    M, dev = flat.numel(), flat.device
    local = flat - start
    e = torch.where((local >= 0) & (local < num_local), local, num_local)  # num_local: routed to another rank
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev).scatter_add_(0, e, torch.ones_like(e))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    seg_end = torch.cumsum(padded, 0)
    order = torch.argsort(e, stable=True)
    e_sorted = e[order]
    first_of = torch.cumsum(counts, 0) - counts  # first sorted position of each expert's pairs
    rank = torch.arange(M, device=dev) - first_of[e_sorted]
    P = triton.cdiv(M + num_local * (block_m - 1), block_m) * block_m
    seg_start = torch.cat([seg_end.new_zeros(1), seg_end])[e_sorted]  # [M]; garbage for e == num_local, masked
    dest = torch.where(e_sorted < num_local, seg_start + rank, P)  # P: a dump slot cut off below
    sorted_pairs = torch.full((P + 1,), M, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    tile_start = torch.arange(0, P, block_m, device=dev)
    expert_of_block = torch.searchsorted(seg_end, tile_start, right=True)
    expert_of_block = torch.where(expert_of_block < num_local, expert_of_block, -1).to(torch.int32)
    return sorted_pairs[:P], expert_of_block, seg_end[-1:].to(torch.int32)


def _tiles(M: int, N: int, K: int) -> tuple[int, int, int]:
    block_m = 16 if M <= 256 else 64  # decode: few pairs per expert
    return block_m, max(16, min(64, triton.next_power_of_2(N))), max(16, min(64, triton.next_power_of_2(K)))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              act, start: int = 0) -> torch.Tensor:
    """sum over a token's k routed experts (those in [start, start + E_local)) of weight * expert(x).

    Args:
        x: [T, hidden]; w13: [E_local, 2I, hidden] ([gate | up] rows); w2: [E_local, hidden, I];
        weights: [T, k] float32 routing weights; ids: [T, k] int64 global expert ids.
        act: SiLU-GLU, [P, 2I] -> [P, I] (``layers/activation.py::silu_and_mul``).
        start: first global expert id held in w13/w2.

    Returns:
        [T, hidden] in x's dtype (pairs routed to other ranks contribute zero; the k-sum is in float32).
    """
    T, hidden = x.shape
    k = ids.shape[1]
    num_local, two_i, _ = w13.shape
    inter = two_i // 2
    M = T * k
    block_m, bn1, bk1 = _tiles(M, two_i, hidden)
    sorted_pairs, expert_of_block, num_post = align_pairs(ids, start, num_local, block_m)
    tiles_m = sorted_pairs.numel() // block_m
    topw = weights.reshape(-1).float().contiguous()
    x = x.contiguous()
    h13 = torch.empty(M, two_i, dtype=x.dtype, device=x.device)
    _moe_gemm[(tiles_m * triton.cdiv(two_i, bn1),)](
        x, w13, h13, sorted_pairs, expert_of_block, num_post, topw,
        two_i, hidden, M, x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), h13.stride(0),
        A_ROW_DIV=k, MUL_WEIGHT=False, BLOCK_M=block_m, BLOCK_N=bn1, BLOCK_K=bk1)
    h = act(h13)  # rows of pairs routed elsewhere hold garbage; the second GEMM never reads them
    out_pairs = torch.zeros(M, hidden, dtype=torch.float32, device=x.device)
    _, bn2, bk2 = _tiles(M, hidden, inter)
    _moe_gemm[(tiles_m * triton.cdiv(hidden, bn2),)](
        h, w2, out_pairs, sorted_pairs, expert_of_block, num_post, topw,
        hidden, inter, M, h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out_pairs.stride(0),
        A_ROW_DIV=1, MUL_WEIGHT=True, BLOCK_M=block_m, BLOCK_N=bn2, BLOCK_K=bk2)
    return out_pairs.view(T, k, hidden).sum(1).to(x.dtype)
