"""MLA decode from the a-projection to the attention's inputs in one Triton launch (DeepSeek-V3 / Kimi, GPU path).

Between the fused a-projection GEMM [q_a | c_kv | k_rope] and decode attention, an MLA layer with a query LoRA
computes q_a_layernorm, the q_b GEMM, the absorbed queries [q_nope W_UK | RoPE(q_rope)] per head, and writes the
latent row [RMSNorm(c_kv) | RoPE(k_rope)] to the paged pool. kernels/gpu/mla_decode_glue.py does that in three
launches (norms + latent write, cuBLAS's q_b GEMM, the absorbed queries); :func:`mla_queries_cache` chains them in
one, for decode batches:

* programs (h, j, t-tile), j < d_split: the head's q_nope = RMSNorm(q_a) W_qb[h, :nope]^T for the token tile (the
  norm recomputed on the way: a first pass over q_a's row for the statistics, then each K tile normed as it is
  loaded; [tokens, q_lora] is a few KB a token against the head's 1536 x 192 weights), rounded to the dtype as
  the q_b GEMM stores it, then times W_UK[h] (float32 sums rounded once, as ``torch.bmm``). With one program a
  head (d_split 1: DeepSeek-V3's 128 heads on one GPU) q_nope stays in registers; with few heads (a rank's share
  under tensor parallel) d_split programs each compute nope / d_split of its columns into a scratch [H, T, nope]
  and take an atomic ticket per (head, token tile); the last to arrive reads the whole rounded q_nope back and
  multiplies it by W_UK[h], then resets the ticket (the same sums whichever program is last);
* programs (h, d_split, t-tile): the head's q_rope = RMSNorm(q_a) W_qb[h, nope:]^T, rounded, then rotated into
  the last R columns (DeepSeek-V3's interleaved pairs read as two row sets of W_qb, written as halves);
* programs (H, 0, t-tile): the token tile's latent rows normed, the rope keys rotated, both written at their slots.

W_qb may be FP8 block-scaled as DeepSeek-V3's checkpoints ship it: its e4m3 codes are decoded exactly in the
activations' dtype (by the hardware where Triton has it, else with integer operations) and each K tile's partial
product (64 or 128 inputs, inside one block) is scaled per row by its 128 x 128 block's scale, as
kernels/gpu/fp8_linear.py's Triton kernel does (the activations stay exact; the block-scaled scaled_mm path would
quantize them). K tiles, warps and stages are autotuned on a GPU (:func:`_configs`).

Bytes: W_qb and W_UK are read once per token tile (decode batches up to 64 tokens: once), plus q_a's rows once
per program. The chain keeps the roundings of the three-launch path (layers/mla.py's reference math: norm
w * round(x * rsqrt(mean(x^2) + eps)) rounded; the q_b output rounded; q_nope W_UK and the RoPE as
mla_decode_glue.py rounds them); only the float32 summation order of the norm's statistics and of the q_b dot
products differs from cuBLAS's. Checked in Triton's interpreter against
the reference paths (tests/test_triton_mla_query_chain.py). CUDA-graph safe: no host reads, grids from sizes only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenfab.kernels.gpu import split_k
from tokenfab.kernels.gpu.fp8_linear import e4m3_to_f32, native_fp8
from tokenfab.kernels.gpu.mla_decode_glue import LATENT_BLOCK_C, dot_acc, latent_rows, rotate_pair
from tokenfab.kernels.gpu.support import autotune_configs, interpreting, quick_bench


@triton.jit
def _normed_tile(qa_ptr, qw_ptr, t, tmask, k0, QL, rstd, s_qa, BLOCK_K: tl.constexpr):
    """RMSNorm(q_a) for rows t and inputs k0 .. k0 + BLOCK_K, in q_a's dtype as the norm stores it."""
    k = k0 + tl.arange(0, BLOCK_K)
    km = k < QL
    x = tl.load(qa_ptr + t.to(tl.int64)[:, None] * s_qa + k[None, :], mask=tmask[:, None] & km[None, :], other=0.0)
    w = tl.load(qw_ptr + k, mask=km, other=0.0).to(tl.float32)
    return (w[None, :] * (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype)


@triton.jit
def _rows_dot(qa_ptr, qw_ptr, wq_ptr, sq_ptr, t, tmask, rows, rmask, QL, rstd, s_qa, s_wq, s_sq, IEEE: tl.constexpr,
              FP8: tl.constexpr, NATIVE_FP8: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """RMSNorm(q_a)[t] W_qb[rows]^T over all q_lora inputs: [BLOCK_T, BLOCK_N] float32. FP8: W_qb's e4m3 codes
    (uint8) decoded exactly into the activations' dtype and each K tile's partial product times its rows' block
    scales (BLOCK_K divides 128: one scale per row and tile), as kernels/gpu/fp8_linear.py's Triton kernel."""
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, QL, BLOCK_K):
        a = _normed_tile(qa_ptr, qw_ptr, t, tmask, k0, QL, rstd, s_qa, BLOCK_K)
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(wq_ptr + rows.to(tl.int64)[None, :] * s_wq + k[:, None],
                    mask=rmask[None, :] & (k < QL)[:, None], other=0)
        if FP8:
            if NATIVE_FP8:
                w = w.to(tl.float8e4nv, bitcast=True)
            else:
                w = e4m3_to_f32(w.to(tl.int32))
            sc = tl.load(sq_ptr + (rows // 128) * s_sq + k0 // 128, mask=rmask, other=0.0)
            acc += dot_acc(a, w, tl.zeros([BLOCK_T, BLOCK_N], tl.float32), IEEE) * sc[None, :]
        else:
            acc = dot_acc(a, w, acc, IEEE)
    return acc


@triton.jit
def _latent_tiles(qn, wuk_ptr, o_rows, h, d, dmask, tmask, C, s_wuh, s_wud, IEEE: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_C: tl.constexpr):
    """q_nope [BLOCK_T, BLOCK_D] (rounded) times W_UK[h] for every latent tile, each rounded once into its row."""
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cmask = c < C
        w = tl.load(wuk_ptr + h * s_wuh + d[:, None] * s_wud + c[None, :], mask=dmask[:, None] & cmask[None, :],
                    other=0.0)
        acc = dot_acc(qn, w, tl.zeros([BLOCK_T, BLOCK_C], tl.float32), IEEE)
        tl.store(o_rows + c[None, :], acc.to(o_rows.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])


def _configs() -> list:
    """BLOCK_K (64 or 128: a divisor of FP8's 128-input blocks), warps, stages: the first is what runs untuned (and
    in the interpreter); a GPU with ``TOKENFAB_TRITON_AUTOTUNE=1`` times them all per shape (kernels/gpu/support.py)."""
    space = [(64, 4, 3), (128, 4, 3), (64, 8, 4), (128, 8, 3)]
    return autotune_configs([triton.Config({"BLOCK_K": bk}, num_warps=w, num_stages=st) for bk, w, st in space])


@triton.autotune(configs=_configs(), key=["H", "QL", "NOPE", "C", "t_bucket"], do_bench=quick_bench)
@triton.jit
def _mla_queries_cache_kernel(qa_ptr, qw_ptr, wq_ptr, sq_ptr, wuk_ptr, ckv_ptr, kr_ptr, kw_ptr, pos_ptr, slot_ptr,
                              cos_ptr, sin_ptr, out_ptr, c_ptr, qn_ptr, tick_ptr, T, H, QL, NOPE, C, half, eps_q,
                              eps_kv, page, t_bucket, s_qa, s_wq, s_sq, s_wuh, s_wud, s_oh, s_ot, s_ct, s_kt, s_c,
                              s_cb, s_co,
                              D_SPLIT: tl.constexpr, FP8: tl.constexpr, NATIVE_FP8: tl.constexpr,
                              ROTATE: tl.constexpr, INTERLEAVE: tl.constexpr, IEEE: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr):
    h = tl.program_id(0)
    j = tl.program_id(1)
    tt = tl.program_id(2)
    t = tt * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    DT: tl.constexpr = out_ptr.dtype.element_ty
    if h == H:  # the token tile's latent rows [RMSNorm(c_kv) | RoPE(k_rope)] to their pool slots
        if j == 0:
            for r0 in tl.static_range(0, BLOCK_T, 16):  # 16 rows at a time: a [16, C] float32 block in registers
                rows = tt * BLOCK_T + r0 + tl.arange(0, 16)
                latent_rows(rows, rows < T, ckv_ptr, kr_ptr, kw_ptr, pos_ptr, slot_ptr,
                            cos_ptr, sin_ptr, c_ptr, C, half, eps_kv, page, s_ct, s_kt, s_c, s_cb, s_co, ROTATE,
                            INTERLEAVE, BLOCK_R, BLOCK_L)
        return
    # q_a_layernorm's statistics for the token tile (float32, as rms_row)
    ss = tl.zeros([BLOCK_T], tl.float32)
    for k0 in range(0, QL, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(qa_ptr + t.to(tl.int64)[:, None] * s_qa + k[None, :],
                    mask=tmask[:, None] & (k < QL)[None, :], other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(ss / QL + eps_q)
    head = h * (NOPE + 2 * half)  # the head's first row of W_qb
    o_rows = out_ptr + h * s_oh + t.to(tl.int64)[:, None] * s_ot
    if j < D_SPLIT:  # q_nope (rounded as the q_b GEMM stores it), then times W_UK[h]
        if D_SPLIT == 1:  # the whole q_nope in this program
            d = tl.arange(0, BLOCK_D)
            dmask = d < NOPE
            qn = _rows_dot(qa_ptr, qw_ptr, wq_ptr, sq_ptr, t, tmask, head + d, dmask, QL, rstd, s_qa, s_wq, s_sq,
                           IEEE, FP8, NATIVE_FP8, BLOCK_T, BLOCK_D, BLOCK_K).to(DT)
            _latent_tiles(qn, wuk_ptr, o_rows, h, d, dmask, tmask, C, s_wuh, s_wud, IEEE, BLOCK_T, BLOCK_C)
        else:  # this program's share of q_nope's columns to the scratch rows; the head's last program takes W_UK
            BD: tl.constexpr = BLOCK_D // D_SPLIT
            db = j * BD + tl.arange(0, BD)
            dbm = db < NOPE
            part = _rows_dot(qa_ptr, qw_ptr, wq_ptr, sq_ptr, t, tmask, head + db, dbm, QL, rstd, s_qa, s_wq, s_sq,
                             IEEE, FP8, NATIVE_FP8, BLOCK_T, BD, BLOCK_K).to(DT)
            qn_rows = qn_ptr + (h * T + t.to(tl.int64))[:, None] * NOPE
            tl.store(qn_rows + db[None, :], part, mask=tmask[:, None] & dbm[None, :])
            tl.debug_barrier()  # every thread's columns stored before the ticket (released at GPU scope)
            ticket = tl.atomic_add(tick_ptr + h * tl.num_programs(2) + tt, 1, sem="acq_rel")
            if ticket == D_SPLIT - 1:
                tl.debug_barrier()  # the acquired ticket seen by every thread before they read the other columns
                d = tl.arange(0, BLOCK_D)
                dmask = d < NOPE
                qn = tl.load(qn_rows + d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0, volatile=True)
                _latent_tiles(qn, wuk_ptr, o_rows, h, d, dmask, tmask, C, s_wuh, s_wud, IEEE, BLOCK_T, BLOCK_C)
                tl.atomic_xchg(tick_ptr + h * tl.num_programs(2) + tt, 0)
    else:  # q_rope (rounded) rotated into columns C .. C + R: its two halves as two row sets of W_qb
        r = tl.arange(0, BLOCK_R)
        rmask = r < half
        if INTERLEAVE and ROTATE:
            rows1 = head + NOPE + 2 * r
            rows2 = rows1 + 1
        else:
            rows1 = head + NOPE + r
            rows2 = rows1 + half
        x1 = _rows_dot(qa_ptr, qw_ptr, wq_ptr, sq_ptr, t, tmask, rows1, rmask, QL, rstd, s_qa, s_wq, s_sq, IEEE,
                       FP8, NATIVE_FP8, BLOCK_T, BLOCK_R, BLOCK_K).to(DT)
        x2 = _rows_dot(qa_ptr, qw_ptr, wq_ptr, sq_ptr, t, tmask, rows2, rmask, QL, rstd, s_qa, s_wq, s_sq, IEEE,
                       FP8, NATIVE_FP8, BLOCK_T, BLOCK_R, BLOCK_K).to(DT)
        m = tmask[:, None] & rmask[None, :]
        if ROTATE:
            p = tl.load(pos_ptr + t, mask=tmask, other=0)[:, None]
            x1, x2 = rotate_pair(x1, x2, p, cos_ptr, sin_ptr, r[None, :], m, s_c)
        tl.store(o_rows + C + r[None, :], x1.to(DT), mask=m)
        tl.store(o_rows + C + half + r[None, :], x2.to(DT), mask=m)


CHAIN_MAX_TOKENS = 256  # decode batches the chained launch takes (tickets: heads x token tiles of 64)
MIN_ROWS = 32  # rows of W_qb's q_nope part per program at the most split


def d_split_for(heads: int, token_tiles: int, nope: int, device: torch.device) -> int:
    """Programs sharing each (head, token tile)'s q_nope columns: 1 when heads x token tiles already give half the
    SMs / CUs a program (DeepSeek-V3's 128 heads on one GPU), else the power of two that comes closest to one
    program per SM with at least MIN_ROWS rows each (16 heads a rank under tensor parallel 8: 4 programs of 32
    rows; each reads its rows of W_qb once, the head's last then reads W_UK[h])."""
    programs = heads * token_tiles
    sms = split_k.sm_count(device)
    if 2 * programs >= sms:
        return 1
    most = max(1, triton.next_power_of_2(max(nope, 1)) // MIN_ROWS)
    split = 1
    while split < most and programs * split < sms:
        split *= 2
    return split


def tickets_needed(heads: int) -> int:
    """How many int32 tickets :func:`mla_queries_cache` takes for ``heads`` heads: one per head and 64-token tile up
    to CHAIN_MAX_TOKENS (a layer keeps them zeroed: tokenfab.kernels.dispatch.gpu_tickets)."""
    return heads * triton.cdiv(CHAIN_MAX_TOKENS, 64)


def mla_queries_cache(q_a: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, q_norm: torch.Tensor,
                      kv_norm: torch.Tensor, eps_q: float, eps_kv: float, w_qb: torch.Tensor, w_uk: torch.Tensor,
                      positions: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, interleave: bool,
                      slot_mapping: torch.Tensor, cache: torch.Tensor, tickets: torch.Tensor | None = None,
                      d_split: int | None = None, qb_scale: torch.Tensor | None = None) -> torch.Tensor:
    """An MLA decode step's queries and latent write in one launch: q_a_layernorm, the q_b GEMM, the absorbed
    queries [q_nope W_UK | RoPE(q_rope)] of every head, and the latent rows [RMSNorm(c_kv) | RoPE(k_rope)] written to
    the pool (the module docstring gives the work split and roundings).

    Args:
        q_a: [T, QL], c_kv: [T, C], k_rope: [T, R] (unit last strides; views of the fused a-projection's output
            are fine), R even, T <= CHAIN_MAX_TOKENS; one dtype with every weight.
        q_norm: [QL], kv_norm: [C]; eps_q, eps_kv: their epsilons.
        w_qb: [H * (nope + R), QL] q_b_proj's weight (unit last stride): of q_a's dtype, or with ``qb_scale`` its
            float8_e4m3fn codes (DeepSeek-V3's FP8 checkpoints; quant/fp8_block_weight.py); w_uk: [H, nope, C]
            (layers/mla.py's ``_w_uk``, unit last stride).
        positions: [T] int64; cos, sin: float32 [P, R / 2] tables, or None for a NoPE layer (the rope parts copied
            as they are); interleave: DeepSeek-V3's pair layout (pairs (2i, 2i + 1) rotated, written as halves).
        slot_mapping: [T] int64 flat pool slots; negative: not written.
        cache: [num_blocks, block_size, C + R], any float dtype (written cast to it), unit last stride.
        tickets: int32 zeros owned by the caller, at least H x ceil(CHAIN_MAX_TOKENS / 64) of them (left zero), which
            let programs share a head's q_nope columns; None: one program per head and token tile.
        d_split: programs sharing a head's q_nope columns (a power of two up to nope / 16; needs ``tickets``;
            tests), None: :func:`d_split_for` (1 without tickets).
        qb_scale: float32 [ceil(rows / 128), ceil(QL / 128)] block scales of an FP8 ``w_qb`` (W = code x scale of its
            128 x 128 block), or None.

    Returns:
        [T, H, C + R] of q_a's dtype: the transposed view of a new head-major [H, T, C + R] buffer (as the decode
        attention kernel reads it).

    Raises:
        ValueError: shapes, dtypes, strides, a token count or a split the kernel does not take.
    """
    T, QL = q_a.shape
    C = c_kv.shape[1]
    H, nope, _ = w_uk.shape
    R = k_rope.shape[-1]
    rotate = cos is not None
    dt = q_a.dtype
    block_d = max(16, triton.next_power_of_2(max(nope, 1)))
    block_t = 16 if T <= 16 else (32 if T <= 32 else 64)
    t_tiles = triton.cdiv(T, block_t)
    if d_split is None:
        d_split = 1 if tickets is None else d_split_for(H, t_tiles, nope, q_a.device)
    if (R % 2 or c_kv.shape[0] != T or k_rope.shape != (T, R) or w_uk.shape != (H, nope, C)
            or w_qb.shape != (H * (nope + R), QL) or q_norm.shape != (QL,) or kv_norm.shape != (C,)
            or any(t.dtype != dt for t in (c_kv, k_rope, q_norm, kv_norm, w_uk))
            or w_qb.dtype != (dt if qb_scale is None else torch.float8_e4m3fn)
            or (qb_scale is not None and (qb_scale.dtype != torch.float32
                                          or qb_scale.shape != (-(-w_qb.shape[0] // 128), -(-QL // 128))))
            or any(t.stride(-1) != 1 for t in (q_a, c_kv, k_rope, w_qb, w_uk, cache))
            or cache.shape[-1] != C + R or (rotate and (cos.shape[-1] * 2 != R or sin is None))
            or T > CHAIN_MAX_TOKENS or d_split < 1 or d_split & (d_split - 1) or block_d // d_split < 16
            or (d_split > 1 and (tickets is None or tickets.dtype != torch.int32
                                 or tickets.numel() < H * t_tiles))):
        raise ValueError(f"mla_queries_cache: q_a {tuple(q_a.shape)}, c_kv {tuple(c_kv.shape)}, k_rope "
                         f"{tuple(k_rope.shape)}, w_qb {tuple(w_qb.shape)}, w_uk {tuple(w_uk.shape)}, cache "
                         f"{tuple(cache.shape)}, split {d_split} do not fit (at most {CHAIN_MAX_TOKENS} tokens; a "
                         "split a power of two with int32 tickets for every head and token tile)")
    out = torch.empty(H, T, C + R, dtype=dt, device=q_a.device)
    if T == 0:
        return out.transpose(0, 1)
    qn = torch.empty(H, T, nope, dtype=dt, device=q_a.device) if d_split > 1 else out  # the shared q_nope columns
    # float32 activations multiply in IEEE float32 (no TF32); Triton's interpreter has no bf16 tiles (numpy):
    # there bf16 runs the float32 dot on the same (exact) values
    ieee = dt == torch.float32 or (interpreting() and dt == torch.bfloat16)
    grid = (H + 1, d_split + (1 if R else 0), t_tiles)
    _mla_queries_cache_kernel[grid](
        q_a, q_norm, w_qb if qb_scale is None else w_qb.view(torch.uint8), q_a if qb_scale is None else qb_scale,
        w_uk, c_kv, k_rope, kv_norm, positions, slot_mapping, cos if rotate else q_a,
        sin if rotate else q_a, out, cache, qn, tickets if d_split > 1 else slot_mapping, T, H, QL, nope, C, R // 2,
        float(eps_q), float(eps_kv), cache.shape[1], block_t, q_a.stride(0), w_qb.stride(0),
        0 if qb_scale is None else qb_scale.stride(0), w_uk.stride(0), w_uk.stride(1),
        out.stride(0), out.stride(1), c_kv.stride(0), k_rope.stride(0), cos.stride(0) if rotate else 0,
        cache.stride(0), cache.stride(1), D_SPLIT=d_split, FP8=qb_scale is not None,
        NATIVE_FP8=qb_scale is not None and native_fp8(q_a.device), ROTATE=rotate, INTERLEAVE=interleave, IEEE=ieee,
        BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_C=LATENT_BLOCK_C,
        BLOCK_R=max(16, triton.next_power_of_2(max(1, R // 2))), BLOCK_L=triton.next_power_of_2(C))
    return out.transpose(0, 1)
