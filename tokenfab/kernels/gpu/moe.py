"""Fused routed experts in Triton (CUDA/ROCm): token-expert pairs grouped by expert, one grouped GEMM launch per
projection over all experts.

The layout follows the fused-MoE design of vLLM's ``fused_moe.py`` (itself from the "MegaBlocks" block-sparse
idea, Gale et al., arXiv:2211.15841): the T*k (token, slot) pairs are sorted by expert and each expert's segment is
padded to a multiple of BLOCK_M, so every BLOCK_M-row tile of the sorted list belongs to one expert. The grouped
GEMM (kernels/gpu/moe_gemm.py: autotuned tiles, split-K at decode, packed weights decoded in registers) gathers each
tile's input rows, multiplies by that expert's weight and scatters the rows back to pair order. The second
projection multiplies each row by its routing weight; the k slots of a token (and the split-K partials of each
slot) are then summed in float32, in a fixed order.

The alignment is one launch (:func:`align_pairs_fused`, :func:`align_pairs` its tensor-op reference; no
``.item()``, no data-dependent shapes): the grid covers the worst case and tiles past the real end return at once,
so the launch is CUDA-graph safe. In decode batches the router's own launch makes it instead (its last program,
into an :class:`Alignment` the experts pass in: kernels/gpu/router.py). The k-sum and the cast are one more
(:func:`moe_sum`): a decode MoE layer's routed experts are 3 launches after the router (gate|up GEMM with the gated
activation in its epilogue, down GEMM, sum: SiLU-GLU or K3's SiTU-GLU, plain or packed stacks; 4 with an activation
of another kind, run as its own launch, or with the alignment a launch of its own).
Reference and fallback: ``layers/moe.py::RoutedExperts`` (tests/test_triton_kernels.py runs both in Triton's
interpreter).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenfab.kernels.gpu.moe_gemm import (DENSE, GLU_SILU, GLU_SITU, GLU_SITU_LINEAR, block_m_for, grouped_gemm,
                                           split_slots)


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


@triton.jit
def align_into(ids_ptr, sorted_ptr, eob_ptr, npost_ptr, M, start, num_local, P, num_tiles,
               TILE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, VOLATILE: tl.constexpr):
    """The alignment in one program: counts per local expert, padded segment starts, then every pair placed at its
    expert's segment start plus its rank among that expert's earlier pairs (stable), chunk by chunk; padding rows
    hold M. ``VOLATILE``: the ids were stored by other programs of the same launch (the router's), read past the
    caches."""
    eidx = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, M, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < M, other=-1, volatile=VOLATILE) - start
        e = tl.where((offs < M) & (e >= 0) & (e < num_local), e, -1).to(tl.int32)
        counts += tl.sum((e[:, None] == eidx[None, :]).to(tl.int32), axis=0)
    padded = (counts + TILE - 1) // TILE * TILE
    seg_end = tl.cumsum(padded, axis=0)
    for r0 in range(0, P, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + r, tl.zeros((CHUNK,), dtype=tl.int32) + M, mask=r < P)
    tl.debug_barrier()  # the padding fill lands before the pairs overwrite their rows
    running = seg_end - padded
    for c0 in range(0, M, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < M, other=-1, volatile=VOLATILE) - start
        e = tl.where((offs < M) & (e >= 0) & (e < num_local), e, -1).to(tl.int32)
        onehot = (e[:, None] == eidx[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - 1 + running[None, :]
        dest = tl.sum(onehot * rank, axis=1)
        tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=e >= 0)
        running += tl.sum(onehot, axis=0)
    for b0 in range(0, num_tiles, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        ex = tl.sum((seg_end[None, :] <= (b * TILE)[:, None]).to(tl.int32), axis=1)
        tl.store(eob_ptr + b, tl.where(ex < num_local, ex, -1), mask=b < num_tiles)
    tl.store(npost_ptr, tl.sum(padded, axis=0))


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, eob_ptr, npost_ptr, M, start, num_local, P, num_tiles,
                  TILE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program: :func:`align_into`."""
    align_into(ids_ptr, sorted_ptr, eob_ptr, npost_ptr, M, start, num_local, P, num_tiles, TILE, CHUNK, BLOCK_E,
               False)


# align_pairs_fused is one program walking the pairs in chunks: one launch for decode batches, but serial over a
# long prefill's pairs, where align_pairs' ~20 parallel tensor ops should be faster (neither measured on a GPU yet)
ALIGN_FUSED_MAX_PAIRS = 4096


def align_pairs_fused(ids: torch.Tensor, start: int, num_local: int, block_m: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`align_pairs` in one Triton launch (one program; the same outputs, bit for bit): ids [T, k] int64
    (contiguous) -> (sorted_pairs [P] int32, expert_of_block [P / block_m] int32, num_post [1] int32)."""
    flat = ids.reshape(-1)
    a = Alignment.empty(flat.numel(), start, num_local, block_m, flat.device)
    _align_kernel[(1,)](flat, a.sorted_pairs, a.expert_of_block, a.num_post, a.num_pairs, start, num_local,
                        a.sorted_pairs.numel(), a.expert_of_block.numel(), **a.meta(), num_warps=4)
    return a.sorted_pairs, a.expert_of_block, a.num_post


@dataclass
class Alignment:
    """The (token, slot) pairs of one MoE layer call aligned by expert (:func:`align_pairs`' three outputs) for
    ``num_pairs`` pairs over experts [start, start + num_local) in tiles of ``block_m``, made ahead of the experts'
    GEMMs by another launch (the router's: kernels/gpu/router.py ``router_topk(align=)``), which sets ``filled``
    when it was launched; :func:`routed_sum` takes them when they match its call and aligns itself otherwise."""
    num_pairs: int
    start: int
    num_local: int
    block_m: int
    sorted_pairs: torch.Tensor  # [P] int32
    expert_of_block: torch.Tensor  # [P / block_m] int32
    num_post: torch.Tensor  # [1] int32
    filled: bool = False

    @classmethod
    def empty(cls, num_pairs: int, start: int, num_local: int, block_m: int, device) -> "Alignment":
        """Unfilled outputs for ``num_pairs`` pairs (P = the worst case, as :func:`align_pairs`)."""
        P = triton.cdiv(num_pairs + num_local * (block_m - 1), block_m) * block_m
        return cls(num_pairs, start, num_local, block_m, torch.empty(P, dtype=torch.int32, device=device),
                   torch.empty(P // block_m, dtype=torch.int32, device=device),
                   torch.empty(1, dtype=torch.int32, device=device))

    def meta(self) -> dict:
        """The alignment program's constexprs (TILE, CHUNK, BLOCK_E)."""
        block_e = triton.next_power_of_2(max(self.num_local, 1))
        return dict(TILE=self.block_m, CHUNK=max(16, min(128, 8192 // block_e)), BLOCK_E=block_e)

    def matches(self, num_pairs: int, start: int, num_local: int, block_m: int) -> bool:
        """Whether these buffers were filled for a call of ``num_pairs`` pairs over experts [start, start +
        num_local) in tiles of ``block_m`` (what :func:`routed_sum` would align itself)."""
        return self.filled and (self.num_pairs, self.start, self.num_local, self.block_m) == (
            num_pairs, start, num_local, block_m)


def alignment_for(num_tokens: int, k: int, start: int, num_local: int, device) -> Alignment | None:
    """Unfilled :class:`Alignment` buffers for a call of ``num_tokens`` tokens with ``k`` slots each over local
    experts [start, start + num_local), with the tile height :func:`routed_sum` will take; None above
    ALIGN_FUSED_MAX_PAIRS pairs (where the alignment is not one program)."""
    M = num_tokens * k
    if M > ALIGN_FUSED_MAX_PAIRS or num_local <= 0:
        return None
    return Alignment.empty(M, start, num_local, block_m_for(M, num_local), device)


@triton.jit
def _moe_sum_kernel(pairs_ptr, ids_ptr, nsplit_ptr, out_ptr, plus_ptr, hidden, start, num_local, s_ps, s_pm, s_ot,
                    s_pt, y32_ptr, ss_ptr, tick_ptr, nw_ptr, eps, K: tl.constexpr, BLOCK: tl.constexpr,
                    HAS_PLUS: tl.constexpr, HAS_NORM: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < hidden
    nsplit = tl.load(nsplit_ptr)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):
        e = tl.zeros((BLOCK,), dtype=tl.int64) + tl.load(ids_ptr + t * K + j) - start
        here = cmask & (e >= 0) & (e < num_local)  # rows of pairs routed to other ranks were never written
        for s in range(0, nsplit):  # split-K partials of the pair, in order
            acc += tl.load(pairs_ptr + s * s_ps + (t * K + j) * s_pm + cols, mask=here, other=0.0).to(tl.float32)
    if HAS_PLUS:  # e.g. the shared experts' output, added after the routed slots
        acc += tl.load(plus_ptr + t * s_pt + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_NORM:  # RMSNorm of the float32 row: each block's sum of squares, the token's last block normalizes
        nb = tl.num_programs(1)
        cb = tl.program_id(1)
        tl.store(y32_ptr + t * hidden + cols, acc, mask=cmask)
        tl.store(ss_ptr + t * nb + cb, tl.sum(acc * acc, axis=0))
        tl.debug_barrier()  # this block's row and partial stored before its ticket (released at GPU scope)
        ticket = tl.atomic_add(tick_ptr + t, 1, sem="acq_rel")
        if ticket == nb - 1:
            tl.debug_barrier()
            total = tl.zeros([], dtype=tl.float32)
            for i in range(0, nb):  # in block order: the same sum whichever block came last
                total += tl.load(ss_ptr + t * nb + i, volatile=True)
            rstd = 1.0 / tl.sqrt(total / hidden + eps)
            for c0 in range(0, hidden, BLOCK):
                cc = c0 + tl.arange(0, BLOCK)
                m = cc < hidden
                y = tl.load(y32_ptr + t * hidden + cc, mask=m, other=0.0, volatile=True)
                w = tl.load(nw_ptr + cc, mask=m, other=0.0).to(tl.float32)
                tl.store(out_ptr + t * s_ot + cc, (w * (y * rstd)).to(out_ptr.dtype.element_ty), mask=m)
            tl.atomic_xchg(tick_ptr + t, 0)
    else:
        tl.store(out_ptr + t * s_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


SUM_NORM_MAX_TOKENS = 256  # tokens up to which the k-sum takes the norm after it (decode batches; tickets a token)


def moe_sum(out_pairs: torch.Tensor, ids: torch.Tensor, start: int, num_local: int,
            out_dtype: torch.dtype, nsplit: torch.Tensor | None = None,
            plus: torch.Tensor | None = None, norm: tuple | None = None) -> torch.Tensor:
    """The k slots of each token summed in float32 in slot order (each slot's split-K partials in split order):
    out_pairs [T * k, hidden] or [S, T * k, hidden] float32 partials of which the first ``nsplit`` ([1] int32 on
    the device; default: all S) count (rows of pairs whose expert is outside [start, start + num_local) are
    skipped, whatever they hold), ids [T, k] int64 (contiguous) -> new [T, hidden] of ``out_dtype``; ``plus``
    [T, hidden] (any float dtype, unit stride along hidden; e.g. the shared experts' output) is added in float32
    after the slots, before the one rounding. One launch (the sums and the cast).

    ``norm``: (weight [hidden], eps, tickets[, out]) -> the RMSNorm of the float32 sum instead, w * (y / rms(y)) in
    float32 rounded once to ``out_dtype`` (Kimi K3's latent norm, as ``dispatch.rms_norm(y, w, eps, out_dtype=)``
    computes it; its sum of squares in column-block order), written into ``out`` when given ([T, hidden] of
    ``out_dtype``, unit stride along hidden, rows may be strided: a slice of a wider buffer) and returned. Each
    column-block program stores its float32 row block and sum of squares; the last of a token's blocks to finish
    (an atomic ticket per token in ``tickets``, int32 zeros owned by the caller, at least T of them, reset by that
    program) normalizes the row. T <= SUM_NORM_MAX_TOKENS there (a ValueError otherwise)."""
    parts = out_pairs if out_pairs.dim() == 3 else out_pairs.unsqueeze(0)
    T, k = ids.shape
    hidden = parts.shape[2]
    if nsplit is None:
        nsplit = torch.full((1,), parts.shape[0], dtype=torch.int32, device=parts.device)
    into = norm[3] if norm is not None and len(norm) > 3 else None
    if into is not None and (into.shape != (T, hidden) or into.dtype != out_dtype or into.stride(-1) != 1):
        raise ValueError(f"moe_sum: the norm's output {tuple(into.shape)} {into.dtype} is not [{T}, {hidden}] "
                         f"{out_dtype} with unit stride along hidden")
    out = torch.empty(T, hidden, dtype=out_dtype, device=parts.device) if into is None else into
    block = min(1024, triton.next_power_of_2(max(hidden, 16)))
    nb = triton.cdiv(hidden, block)
    if norm is not None:
        weight, eps, tickets = norm[:3]
        if T > SUM_NORM_MAX_TOKENS or tickets.numel() < T or tickets.dtype != torch.int32 or weight.shape != (hidden,):
            raise ValueError(f"moe_sum: the norm takes up to {SUM_NORM_MAX_TOKENS} tokens with int32 tickets for "
                             f"each and a [{hidden}] weight (got {T} tokens, {tickets.numel()} tickets, weight "
                             f"{tuple(weight.shape)})")
        y32 = torch.empty(T, hidden, dtype=torch.float32, device=parts.device)
        ss = torch.empty(T, nb, dtype=torch.float32, device=parts.device)
    else:
        weight, eps, tickets, y32, ss = out, 0.0, nsplit, out, out  # unused without the norm
    if T:
        _moe_sum_kernel[(T, nb)](parts, ids, nsplit, out, out if plus is None else plus, hidden, start, num_local,
                                 parts.stride(0), parts.stride(1), out.stride(0),
                                 0 if plus is None else plus.stride(0), y32, ss, tickets, weight, float(eps), K=k,
                                 BLOCK=block, HAS_PLUS=plus is not None, HAS_NORM=norm is not None)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              act, start: int = 0, plus: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None, norm: tuple | None = None,
              aligned: Alignment | None = None) -> torch.Tensor:
    """sum over a token's k routed experts (those in [start, start + E_local)) of weight * expert(x).

    Args:
        x: [T, hidden]; w13: [E_local, 2I, hidden] ([gate | up] rows); w2: [E_local, hidden, I];
        weights: [T, k] routing weights (float32 or x's dtype, read as float32); ids: [T, k] int64 global expert ids.
        act: the gated activation: None (SiLU-GLU) or ("situ", beta, linear_beta or None) (Kimi K3's SiTU-GLU),
            computed in the gate|up GEMM's epilogue with the separate kernels' math and roundings (one launch
            fewer; :func:`epilogue_code`); or any callable [P, 2I] -> [P, I], run as its own launch.
        start: first global expert id held in w13/w2.
        plus: [T, hidden] or None, added in the k-sum (:func:`moe_sum`; the shared experts' output).
        out_dtype: the result's dtype (default x's; K3's latent MoE keeps float32).
        norm: optional (weight, eps, tickets): the result is the RMSNorm of the float32 sum (:func:`moe_sum`).
        aligned: optional pairs aligned ahead by the router's launch (:func:`routed_sum`).

    Returns:
        [T, hidden] in ``out_dtype`` (pairs routed to other ranks contribute zero; the k-sum is in float32).
    """
    return routed_sum(x, weights, ids, DENSE, w13, None, w2, None, act, start, out_dtype, plus, norm=norm,
                      aligned=aligned)


def epilogue_code(act) -> tuple[int, float, float]:
    """(moe_gemm GLU_* code, beta, linear_beta) for the activation spec ``act`` of :func:`fused_moe`: None ->
    SiLU-GLU; ("situ", beta, linear_beta or None) -> SiTU-GLU; a callable -> (0, ...): its own launch.

    Raises:
        ValueError: a tuple naming another activation."""
    if act is None:
        return GLU_SILU, 1.0, 1.0
    if isinstance(act, tuple):
        if act[0] != "situ" or len(act) != 3:
            raise ValueError(f"fused MoE: unknown epilogue activation {act!r} (known: None for SiLU-GLU, "
                             "('situ', beta, linear_beta))")
        _, beta, lbeta = act
        return (GLU_SITU, float(beta), 1.0) if lbeta is None else (GLU_SITU_LINEAR, float(beta), float(lbeta))
    return 0, 1.0, 1.0


def routed_sum(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, fmt: int, w13: torch.Tensor,
               s13: torch.Tensor | None, w2: torch.Tensor, s2: torch.Tensor | None, act, start: int = 0,
               out_dtype: torch.dtype | None = None, plus: torch.Tensor | None = None,
               relaid: tuple[bool, bool] = (False, False), norm: tuple | None = None,
               aligned: Alignment | None = None) -> torch.Tensor:
    """The fused-MoE flow of :func:`fused_moe` (``fmt`` DENSE, no scales) and ``packed_moe.fused_moe_packed``
    (``fmt`` 0 / 1 / 2 with scales s13 / s2): pairs aligned by expert, the gate|up GEMM, ``act`` (as
    :func:`fused_moe` takes it: SiLU-GLU or SiTU-GLU in the GEMM's epilogue, else its own launch), the down GEMM times
    the routing weights, the k-sum in float32 (plus ``plus`` [T, hidden] when given), cast to ``out_dtype``
    (default x's), or its RMSNorm with ``norm`` (:func:`moe_sum`); ``relaid``: (gate|up, down) stacks in the GPU
    layout (moe_gemm.grouped_gemm); ``aligned``: the pairs already aligned by another launch (:class:`Alignment`),
    taken when filled for this call's pairs, experts and tile height (else aligned here)."""
    T, hidden = x.shape
    k = ids.shape[1]
    num_local, two_i = w13.shape[0], w13.shape[1]
    inter = two_i // 2
    M = T * k
    block_m = block_m_for(M, num_local)
    ids = ids.contiguous()
    if aligned is not None and aligned.matches(M, start, num_local, block_m):  # made by the router's launch
        sorted_pairs, expert_of_block, num_post = aligned.sorted_pairs, aligned.expert_of_block, aligned.num_post
    else:
        align = align_pairs_fused if M <= ALIGN_FUSED_MAX_PAIRS else align_pairs
        sorted_pairs, expert_of_block, num_post = align(ids, start, num_local, block_m)
    pairs = (sorted_pairs, expert_of_block, num_post, weights.reshape(-1).contiguous(), M)  # read as float32
    if x.stride(-1) != 1:  # rows may be strided (a slice of a wider GEMM's output): the GEMM reads them in place
        x = x.contiguous()
    nsplit = torch.empty(1, dtype=torch.int32, device=x.device)
    glu, beta, lbeta = epilogue_code(act)
    if glu:  # the activation in the gate|up GEMM's epilogue: h [M, I] straight out
        h = torch.empty(M, inter, dtype=x.dtype, device=x.device)
        grouped_gemm(x, w13, s13, fmt, h, nsplit, pairs, inter, hidden, k, False, inter, block_m, relaid[0], glu,
                     beta, lbeta)
    else:
        h13 = torch.empty(M, two_i, dtype=x.dtype, device=x.device)  # gate|up: no split (N = 2I: the programs)
        grouped_gemm(x, w13, s13, fmt, h13, nsplit, pairs, two_i, hidden, k, False, inter, block_m, relaid[0])
        h = act(h13)
    # rows of pairs routed elsewhere hold garbage in h; the second GEMM never reads them
    slots = split_slots(M, block_m, down=True)
    out_pairs = torch.empty(slots, M, hidden, dtype=torch.float32, device=x.device)  # idem: moe_sum skips those
    grouped_gemm(h, w2, s2, fmt, out_pairs, nsplit, pairs, hidden, inter, 1, True, hidden, block_m, relaid[1])
    return moe_sum(out_pairs, ids, start, num_local, out_dtype or x.dtype, nsplit, plus, norm)
