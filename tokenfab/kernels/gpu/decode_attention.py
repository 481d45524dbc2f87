"""Paged decode attention in Triton (CUDA/ROCm), for grouped-query attention and MLA's absorbed latent cache.

One query per sequence attends over its context read in place from the paged pool through the block table:
flash-decoding in two stages (Dao et al., "Flash-Decoding for long-context inference", 2023; the same split as
vLLM's ``triton_decode_attention.py``). Stage 1 splits each sequence's context into ``num_splits`` ranges; one
program per (sequence, KV head, block of query heads, split) keeps an online softmax over its range and writes the
partial output and its log-sum-exp. Stage 2 merges the splits per (sequence, query head).

All query heads that share a KV head are the rows of one ``tl.dot``, so each cached row is read once per KV head:
for MLA (one latent "head" shared by all query heads) every latent row is read once per sequence. The key is
split as [first Dv dims | remaining D - Dv dims] so that MLA's 576-wide rows (512 latent + 64 rope) need no
padding to 1024; when values are the first Dv dims of the key rows (MLA) the loaded key tile is reused as values.

Every ``tl.dot`` asks for ``input_precision="ieee"``: float32 runs (the fidelity checks against transformers)
must not drop to TF32, Triton's default for float32 operands on NVIDIA; bf16 operands are unaffected.

Nothing here syncs with the host and every launch shape depends only on (batch, heads, max blocks), so the
kernels run under CUDA graphs. Reference and fallback: ``layers/paged_attention.py::attention`` (gathered) and the
CPU kernel; tests compare them in Triton's interpreter (tests/test_triton_kernels.py).
"""
from __future__ import annotations

import triton
import triton.language as tl
import torch


@triton.jit
def _stage1(Q, K, V, BT, CL, MID_O, MID_LSE,
            s_qb, s_qh, s_kn, s_ks, s_kh, s_vn, s_vs, s_vh, s_bt,
            scale, G, H, NUM_HB,
            DV: tl.constexpr, DR: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
            PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, NUM_SPLITS: tl.constexpr,
            VALUE_IS_KEY: tl.constexpr):
    b = tl.program_id(0)
    hk = tl.program_id(1) // NUM_HB
    hb = tl.program_id(1) % NUM_HB
    split = tl.program_id(2)

    hg = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # query head within the KV head's group
    hmask = hg < G
    heads = hk * G + hg
    dv = tl.arange(0, BLOCK_DV)
    dvmask = dv < DV
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + dv[None, :], mask=hmask[:, None] & dvmask[None, :], other=0.0)
    if DR > 0:
        dr = tl.arange(0, BLOCK_DR)
        drmask = dr < DR
        q_r = tl.load(Q + b * s_qb + heads[:, None] * s_qh + DV + dr[None, :], mask=hmask[:, None] & drmask[None, :],
                      other=0.0)

    ctx = tl.load(CL + b).to(tl.int32)
    split_len = tl.cdiv(ctx, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        blk = tl.load(BT + b * s_bt + t // PAGE, mask=tmask, other=0).to(tl.int64)
        row_k = blk * s_kn + (t % PAGE) * s_ks + hk * s_kh
        k = tl.load(K + row_k[:, None] + dv[None, :], mask=tmask[:, None] & dvmask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_H, BLOCK_N] float32
        if DR > 0:
            k_r = tl.load(K + row_k[:, None] + DV + dr[None, :], mask=tmask[:, None] & drmask[None, :], other=0.0)
            s += tl.dot(q_r, tl.trans(k_r), input_precision="ieee")
        s = tl.where(tmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if VALUE_IS_KEY:
            v = k
        else:
            row_v = blk * s_vn + (t % PAGE) * s_vs + hk * s_vh
            v = tl.load(V + row_v[:, None] + dv[None, :], mask=tmask[:, None] & dvmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    nonempty = l > 0
    out = acc / tl.where(nonempty, l, 1.0)[:, None]
    lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, l, 1.0)), float("-inf"))
    base = (b * H + heads) * NUM_SPLITS + split  # MID_O [B, H, NUM_SPLITS, DV], MID_LSE [B, H, NUM_SPLITS]
    tl.store(MID_O + base[:, None] * DV + dv[None, :], out, mask=hmask[:, None] & dvmask[None, :])
    tl.store(MID_LSE + base, lse, mask=hmask)


@triton.jit
def _stage2(MID_O, MID_LSE, O, s_ob, s_oh, H,
            DV: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < NUM_SPLITS
    dv = tl.arange(0, BLOCK_DV)
    dvmask = dv < DV
    base = (b * H + h) * NUM_SPLITS
    lse = tl.load(MID_LSE + base + sp, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)  # split 0 always holds >= 1 token, so m is finite
    w = tl.exp(lse - m)
    o = tl.load(MID_O + (base + sp)[:, None] * DV + dv[None, :], mask=smask[:, None] & dvmask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(O + b * s_ob + h * s_oh + dv, out.to(O.dtype.element_ty), mask=dvmask)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(int(n)))


def default_num_splits(batch: int, kv_programs: int, max_context: int, device: torch.device) -> int:
    """Context splits per sequence: enough programs to fill the GPU's multiprocessors about twice at small
    batch, at least 256 context tokens per split, at most 16 splits. Depends only on shapes (CUDA-graph safe)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = max(1, (2 * sms) // max(1, batch * kv_programs))
    return int(max(1, min(16, want, triton.cdiv(max_context, 256))))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           max_context: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Decode attention of one query per sequence over a paged cache.

    Args:
        q: [B, H, D] queries (the cache's dtype).
        k_cache: [num_blocks, block_size, Hk, D]; v_cache: [num_blocks, block_size, Hk, Dv] with Dv <= D and H a
            multiple of Hk. Strided views are fine as long as the last dim is contiguous; when ``v_cache`` is a
            view of the first Dv dims of ``k_cache`` (MLA's latent pool) the key tile is reused as values.
        block_tables: [B, max_blocks] int32/int64 pool block ids; context_lens: [B] tokens in each context (>= 1).
        scale: softmax scale applied to q.k.
        max_context: tokens any sequence may hold (sizes the splits; default max_blocks * block_size).
        num_splits: context splits per sequence (default :func:`default_num_splits`).

    Returns:
        [B, H, Dv] in q's dtype; softmax in float32.

    Raises:
        ValueError: mismatched dtypes or head counts, or a last dim that is not contiguous.
    """
    B, H, D = q.shape
    _, page, Hk, Dk = k_cache.shape
    Dv = v_cache.shape[-1]
    if Dk != D or Dv > D or H % Hk or v_cache.shape[2] != Hk:
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)} and "
                         f"v_cache {tuple(v_cache.shape)} do not fit (need D == Dk >= Dv, H a multiple of Hk)")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_decode_attention: dtypes differ (q {q.dtype}, k {k_cache.dtype}, "
                         f"v {v_cache.dtype}); cast q to the cache dtype")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_decode_attention: the last dim of q, k_cache and v_cache must be contiguous")
    G = H // Hk
    # query heads per program: MLA's [BLOCK_H, 512] float32 accumulator stays in registers only at 16 rows (as in
    # vLLM's MLA decode); narrow heads take up to 64 rows of a group
    BLOCK_H = 16 if Dv > 128 else _pow2(min(G, 64))
    num_hb = triton.cdiv(G, BLOCK_H)
    if max_context is None:
        max_context = block_tables.shape[1] * page
    if num_splits is None:
        num_splits = default_num_splits(B, Hk * num_hb, max_context, q.device)
    value_is_key = v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride()[:3] == k_cache.stride()[:3]
    DR = D - Dv
    mid_o = torch.empty(B, H, num_splits, Dv, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    block_n = 32 if Dv <= 128 else 16  # MLA's 512-wide value tiles: keep the accumulator in registers
    _stage1[(B, Hk * num_hb, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        float(scale), G, H, num_hb,
        DV=Dv, DR=DR, BLOCK_DV=_pow2(Dv), BLOCK_DR=_pow2(max(DR, 1)), PAGE=page, BLOCK_N=block_n, BLOCK_H=BLOCK_H,
        NUM_SPLITS=num_splits, VALUE_IS_KEY=value_is_key)
    out = torch.empty(B, H, Dv, dtype=q.dtype, device=q.device)
    _stage2[(B, H)](mid_o, mid_lse, out, out.stride(0), out.stride(1), H,
                    DV=Dv, BLOCK_DV=_pow2(Dv), NUM_SPLITS=num_splits, BLOCK_S=_pow2(num_splits, 2))
    return out
