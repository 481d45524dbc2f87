"""MLA decode between the GEMMs in two Triton launches (DeepSeek-V3 / Kimi, layers/mla.py, GPU code path).

A decode step of an MLA layer runs: the fused a-projection GEMM [q_a | c_kv | k_rope], q_a_layernorm, the q_b GEMM,
then the absorbed latent query [q_nope W_UK | RoPE(q_rope)] per head, attention over the latent pool, W_UV and the
o GEMM. What sits between those GEMMs is two launches here instead of four (q_a_layernorm, the kv norm + RoPE +
latent write, the W_UK batched GEMM and a copy of the rotated q_rope into the latent query):

* :func:`mla_norms_cache` reads the a-projection's output once: program (t, 0) writes RMSNorm(q_a) (the q_b GEMM's
  input), program (t, 1) writes the latent row [RMSNorm(c_kv) | RoPE(k_rope)] to the paged pool at the token's slot
  (vLLM / SGLang fuse the same norm + rope-key write on their MLA paths).
* :func:`mla_latent_query` forms the absorbed query of every head straight in the head-major buffer the decode
  kernel reads: programs (h, c-tile, t-tile) multiply q_nope [tokens, nope] by W_UK[h] [nope, C-tile] with
  ``tl.dot`` (one rounding of the float32 accumulator, as ``torch.bmm``), and one extra program column per (h,
  t-tile) rotates q_rope into the last R columns (DeepSeek-V2, arXiv:2405.04434, 2.1.3: the key up-projection
  folded into the query).
* :func:`mla_value_gate` (gated MLA, Kimi K3): the value heads o_lat W_UV with the output gate x * sigmoid(g) in
  the GEMM's epilogue, one launch instead of the batched GEMM and the gate's.

Tiles: W_UK[h] is read once per 16..64-token tile, C split in 64-wide tiles, so DeepSeek-V3's 128 heads x 512
latent give 128 x 9 programs at decode batches (enough for 132 SMs / 304 CUs) each streaming a 128 x 64 weight tile.

Rounding is the reference paths' (layers/norm.py, layers/rotary.py, layers/mla.py), in q's dtype: norm
y = w * round(x * rsqrt(mean(x^2) + eps)) with float32 statistics; each RoPE product and the sum or difference
rounded, cos / sin rounded to the dtype first; q_nope W_UK accumulated in float32 (IEEE float32 for float32 inputs,
no TF32) and rounded once. Checked in Triton's interpreter against those paths (tests/test_triton_mla_decode_glue.py).
CUDA-graph safe: no host reads, grids depend on sizes only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenfab.kernels.gpu.norm_activation import rms_row
from tokenfab.kernels.gpu.support import interpreting


@triton.jit
def rotate_pair(x1, x2, p, cos_ptr, sin_ptr, offs, mask, s_c):
    """RoPE of the halves (x1, x2) (one dtype) at position(s) ``p`` with float32 tables [P, half] (row stride s_c):
    (x1 cos - x2 sin, x2 cos + x1 sin) as layers/rotary.py rounds it in that dtype: cos / sin rounded to the dtype,
    each product and the sum or difference rounded."""
    dt = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    c = tl.load(cos_ptr + p * s_c + offs, mask=mask, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + p * s_c + offs, mask=mask, other=0.0).to(dt).to(tl.float32)
    r1 = ((a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)).to(dt)
    r2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
    return r1, r2


@triton.jit
def rope_pair(base, p, cos_ptr, sin_ptr, offs, mask, half, s_c, INTERLEAVE: tl.constexpr, ROTATE: tl.constexpr):
    """Rows ``base`` [.., 2 * half] at position(s) p rotated: (first half, second half) in the input dtype; unrotated
    (halves of the row as stored) when not ROTATE (NoPE)."""
    if INTERLEAVE and ROTATE:
        x1 = tl.load(base + 2 * offs, mask=mask, other=0.0)
        x2 = tl.load(base + 2 * offs + 1, mask=mask, other=0.0)
    else:
        x1 = tl.load(base + offs, mask=mask, other=0.0)
        x2 = tl.load(base + half + offs, mask=mask, other=0.0)
    if ROTATE:
        return rotate_pair(x1, x2, p, cos_ptr, sin_ptr, offs, mask, s_c)
    return x1, x2


@triton.jit
def latent_rows(t, valid, ckv_ptr, kr_ptr, kw_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, c_ptr, C, half, eps_kv, page,
                s_ct, s_kt, s_c, s_cb, s_co, ROTATE: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_L: tl.constexpr):
    """Latent rows of tokens t [rows] (where ``valid``) to their pool slots: [RMSNorm(c_kv) | RoPE(k_rope)], rounded
    as rms_row and :func:`rope_pair` round them; rows with a negative slot are written nowhere (the rows that own no
    KV slot). Shared by :func:`mla_norms_cache` (a row a program) and kernels/gpu/mla_query_chain.py (16 at a
    time)."""
    slot = tl.load(slot_ptr + t, mask=valid, other=-1)
    ok = slot >= 0
    dst = c_ptr + (slot // page) * s_cb + (slot % page) * s_co
    cc = tl.arange(0, BLOCK_L)
    cm = ok[:, None] & (cc < C)[None, :]
    x = tl.load(ckv_ptr + t.to(tl.int64)[:, None] * s_ct + cc[None, :], mask=cm, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / C + eps_kv)
    w = tl.load(kw_ptr + cc, mask=cc < C, other=0.0).to(tl.float32)
    y = (w[None, :] * (xf * rstd[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype)
    tl.store(dst[:, None] + cc[None, :], y.to(c_ptr.dtype.element_ty), mask=cm)
    offs = tl.arange(0, BLOCK_R)[None, :]
    rm = ok[:, None] & (offs < half)
    p = tl.load(pos_ptr + t, mask=valid, other=0)[:, None]
    r1, r2 = rope_pair(kr_ptr + t.to(tl.int64)[:, None] * s_kt, p, cos_ptr, sin_ptr, offs, rm, half, s_c, INTERLEAVE,
                       ROTATE)
    tl.store(dst[:, None] + C + offs, r1.to(c_ptr.dtype.element_ty), mask=rm)
    tl.store(dst[:, None] + C + half + offs, r2.to(c_ptr.dtype.element_ty), mask=rm)


@triton.jit
def _mla_norms_cache_kernel(qa_ptr, ckv_ptr, kr_ptr, qw_ptr, kw_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qo_ptr,
                            c_ptr, QL, C, half, eps_q, eps_kv, page, s_qa, s_ct, s_kt, s_c, s_cb, s_co,
                            HAS_Q: tl.constexpr, ROTATE: tl.constexpr, INTERLEAVE: tl.constexpr,
                            BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    if tl.program_id(1) == 0:
        if HAS_Q:  # q_a_layernorm -> the q_b GEMM's input
            cols = tl.arange(0, BLOCK_Q)
            m = cols < QL
            x = tl.load(qa_ptr + t * s_qa + cols, mask=m, other=0.0)
            tl.store(qo_ptr + t * QL + cols, rms_row(x, qw_ptr, cols, m, QL, eps_q, x.dtype).to(x.dtype), mask=m)
    else:  # the token's latent row, as a one-row block
        latent_rows(t + tl.arange(0, 1), tl.arange(0, 1) == 0, ckv_ptr, kr_ptr, kw_ptr, pos_ptr, slot_ptr, cos_ptr,
                    sin_ptr, c_ptr, C, half, eps_kv, page, s_ct, s_kt, s_c, s_cb, s_co, ROTATE, INTERLEAVE, BLOCK_R,
                    BLOCK_C)


def mla_norms_cache(q_a: torch.Tensor | None, c_kv: torch.Tensor, k_rope: torch.Tensor, q_norm: torch.Tensor | None,
                    kv_norm: torch.Tensor, eps_q: float, eps_kv: float, positions: torch.Tensor,
                    cos: torch.Tensor | None, sin: torch.Tensor | None, interleave: bool, slot_mapping: torch.Tensor,
                    cache: torch.Tensor) -> torch.Tensor | None:
    """q_a_layernorm and the latent row write of an MLA layer in one launch.

    Args:
        q_a: [T, QL] (unit stride along QL; a view of the fused a-projection's output is fine) or None (no q LoRA).
        c_kv: [T, C], k_rope: [T, R] (unit last strides), R even; one dtype with q_a and the norm weights.
        q_norm: [QL] (with q_a) or None; kv_norm: [C]; eps_q, eps_kv: their epsilons.
        positions: [T] int64; cos, sin: float32 [P, R / 2] tables, or None for a NoPE layer (k_rope stored as is);
            interleave: DeepSeek-V3's pair layout (pairs (2i, 2i + 1) rotated and written as halves).
        slot_mapping: [T] int64 flat pool slots (block * block_size + offset); negative: not written.
        cache: [num_blocks, block_size, C + R], any float dtype (written cast to it), unit last stride.

    Returns:
        RMSNorm(q_a) as a new contiguous [T, QL] of q_a's dtype, or None without q_a; the latent row
        [RMSNorm(c_kv) | RoPE(k_rope)] is written to ``cache``.

    Raises:
        ValueError: shapes, dtypes or strides the kernel does not take.
    """
    T, C = c_kv.shape
    R = k_rope.shape[-1]
    has_q = q_a is not None
    QL = q_a.shape[1] if has_q else 1
    rotate = cos is not None
    if (R % 2 or k_rope.shape != (T, R) or k_rope.dtype != c_kv.dtype or kv_norm.shape != (C,)
            or kv_norm.dtype != c_kv.dtype or cache.shape[-1] != C + R or c_kv.stride(-1) != 1
            or k_rope.stride(-1) != 1 or cache.stride(-1) != 1
            or (rotate and (cos.shape[-1] * 2 != R or sin is None))
            or (has_q and (q_a.shape[0] != T or q_a.stride(-1) != 1 or q_a.dtype != c_kv.dtype or q_norm is None
                           or q_norm.shape != (QL,) or q_norm.dtype != q_a.dtype))):
        raise ValueError(f"mla_norms_cache: q_a {None if q_a is None else tuple(q_a.shape)}, c_kv "
                         f"{tuple(c_kv.shape)}, k_rope {tuple(k_rope.shape)}, cache {tuple(cache.shape)} do not fit")
    q_out = torch.empty(T, QL, dtype=c_kv.dtype, device=c_kv.device) if has_q else None
    if T:
        block_c = triton.next_power_of_2(C)
        block_q = triton.next_power_of_2(QL)
        _mla_norms_cache_kernel[(T, 2)](
            q_a if has_q else c_kv, c_kv, k_rope, q_norm if has_q else kv_norm, kv_norm, positions, slot_mapping,
            cos if rotate else c_kv, sin if rotate else c_kv, q_out if has_q else c_kv, cache, QL, C, R // 2,
            float(eps_q), float(eps_kv), cache.shape[1], q_a.stride(0) if has_q else 0, c_kv.stride(0),
            k_rope.stride(0), cos.stride(0) if rotate else 0, cache.stride(0), cache.stride(1),
            HAS_Q=has_q, ROTATE=rotate, INTERLEAVE=interleave, BLOCK_Q=block_q, BLOCK_C=block_c,
            BLOCK_R=triton.next_power_of_2(max(1, R // 2)), num_warps=1 if max(block_c, block_q) <= 128 else 4)
    return q_out


@triton.jit
def dot_acc(a, w, acc, IEEE: tl.constexpr):
    """acc + a @ w: IEEE float32 products (float32 inputs, and bf16 in the interpreter, which has no bf16 tiles),
    else the tensor cores in a's dtype with float32 sums."""
    if IEEE:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, w.to(a.dtype), acc)


@triton.jit
def _mla_latent_query_kernel(q_ptr, w_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, T, NOPE, C, half,
                             s_qt, s_qh, s_wh, s_wd, s_oh, s_ot, s_c,
                             ROTATE: tl.constexpr, INTERLEAVE: tl.constexpr, IEEE: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_R: tl.constexpr):
    h = tl.program_id(0)
    cb = tl.program_id(1)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    q_rows = q_ptr + t.to(tl.int64)[:, None] * s_qt + h * s_qh
    o_rows = out_ptr + h * s_oh + t.to(tl.int64)[:, None] * s_ot
    if cb * BLOCK_C < C:  # a latent tile: q_nope [BLOCK_T, nope] @ W_UK[h] [nope, BLOCK_C]
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < C
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for d0 in range(0, NOPE, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            dmask = d < NOPE
            a = tl.load(q_rows + d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)
            w = tl.load(w_ptr + h * s_wh + d[:, None] * s_wd + c[None, :], mask=dmask[:, None] & cmask[None, :],
                        other=0.0)
            acc = dot_acc(a, w, acc, IEEE)
        tl.store(o_rows + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])
    else:  # the last program column: q_rope rotated into columns C .. C + R
        offs = tl.arange(0, BLOCK_R)[None, :]
        m = tmask[:, None] & (offs < half)
        p = tl.load(pos_ptr + t, mask=tmask, other=0)[:, None]
        r1, r2 = rope_pair(q_rows + NOPE, p, cos_ptr, sin_ptr, offs, m, half, s_c, INTERLEAVE, ROTATE)
        tl.store(o_rows + C + offs, r1.to(out_ptr.dtype.element_ty), mask=m)
        tl.store(o_rows + C + half + offs, r2.to(out_ptr.dtype.element_ty), mask=m)


LATENT_BLOCK_C = 64  # latent columns per program (DeepSeek-V3: 512 / 64 = 8 tiles per head, plus the RoPE column)


def mla_latent_query(q: torch.Tensor, w_uk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor | None,
                     sin: torch.Tensor | None, interleave: bool) -> torch.Tensor:
    """The absorbed decode queries [q_nope W_UK | RoPE(q_rope)] of every head in one launch.

    Args:
        q: [T, H, nope + R] (the q_b GEMM's output viewed per head; unit last stride), R even.
        w_uk: [H, nope, C] of q's dtype, unit last stride (layers/mla.py's ``_w_uk``).
        positions: [T] int64; cos, sin: float32 [P, R / 2] tables, or None (NoPE: q_rope copied as is);
            interleave: DeepSeek-V3's pair layout.

    Returns:
        [T, H, C + R] of q's dtype: the transposed view of a new head-major [H, T, C + R] buffer (unit last stride,
        as the decode attention kernel reads it).

    Raises:
        ValueError: shapes, dtypes or strides the kernel does not take.
    """
    T, H, D = q.shape
    C = w_uk.shape[2]
    nope = w_uk.shape[1]
    R = D - nope
    rotate = cos is not None
    if (w_uk.shape != (H, nope, C) or w_uk.dtype != q.dtype or R < 0 or R % 2 or q.stride(-1) != 1
            or w_uk.stride(-1) != 1 or (rotate and (cos.shape[-1] * 2 != R or sin is None))):
        raise ValueError(f"mla_latent_query: q {tuple(q.shape)}, w_uk {tuple(w_uk.shape)} do not fit")
    out = torch.empty(H, T, C + R, dtype=q.dtype, device=q.device)
    if T and H:
        block_t = 16 if T <= 16 else (32 if T <= 32 else 64)
        block_c = LATENT_BLOCK_C
        # float32 activations multiply in IEEE float32 (no TF32); Triton's interpreter has no bf16 tiles (numpy):
        # there bf16 runs the float32 dot on the same (exact) values
        ieee = q.dtype == torch.float32 or (interpreting() and q.dtype == torch.bfloat16)
        grid = (H, triton.cdiv(C, block_c) + 1, triton.cdiv(T, block_t))
        _mla_latent_query_kernel[grid](
            q, w_uk, positions, cos if rotate else q, sin if rotate else q, out, T, nope, C, R // 2,
            q.stride(0), q.stride(1), w_uk.stride(0), w_uk.stride(1), out.stride(0), out.stride(1),
            cos.stride(0) if rotate else 0, ROTATE=rotate, INTERLEAVE=interleave, IEEE=ieee, BLOCK_T=block_t,
            BLOCK_C=block_c, BLOCK_D=min(64, max(16, triton.next_power_of_2(max(nope, 1)))),
            BLOCK_R=triton.next_power_of_2(max(1, R // 2)), num_warps=4)
    return out.transpose(0, 1)


@triton.jit
def _mla_value_gate_kernel(o_ptr, w_ptr, g_ptr, y_ptr, T, C, V, s_ot, s_oh, s_wh, s_wc, s_gt, s_yt, s_yh,
                           IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr):
    h = tl.program_id(0)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    vmask = v < V
    acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cmask = c < C
        a = tl.load(o_ptr + t.to(tl.int64)[:, None] * s_ot + h * s_oh + c[None, :],
                    mask=tmask[:, None] & cmask[None, :], other=0.0)
        w = tl.load(w_ptr + h * s_wh + c[:, None] * s_wc + v[None, :], mask=cmask[:, None] & vmask[None, :],
                    other=0.0)
        acc = dot_acc(a, w, acc, IEEE)
    DT: tl.constexpr = y_ptr.dtype.element_ty
    m = tmask[:, None] & vmask[None, :]
    g = tl.load(g_ptr + t.to(tl.int64)[:, None] * s_gt + h * V + v[None, :], mask=m, other=0.0)
    s = (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(g.dtype).to(tl.float32)  # sigmoid rounded, as torch stores it
    y = acc.to(DT).to(tl.float32) * s  # the product of the rounded o_lat W_UV (as torch.bmm stores it)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * s_yt + h * s_yh + v[None, :], y.to(DT), mask=m)


def mla_value_gate(o_lat: torch.Tensor, w_uv_t: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated MLA's value heads in one launch (Kimi K3, models/kimi_linear.py ``GatedMLAttention``): per head
    o = o_lat W_UV (float32 sums rounded once to the activation dtype, as ``torch.bmm``), times sigmoid(gate)
    (rounded to the dtype, then the product rounded: ``x * torch.sigmoid(g)``), instead of the batched GEMM and the
    gate's own launch. Programs (head, 64 value columns, 16..64 tokens) each stream their head's W_UV tile once.

    Args:
        o_lat: [T, H, C] the attention's latent outputs (unit last stride).
        w_uv_t: [H, C, v] of o_lat's dtype (unit last stride; layers/mla.py's ``_w_uv_t``).
        gate: [T, H * v] the gate logits (g_proj x) of o_lat's dtype (unit last stride; rows may be strided).

    Returns:
        New [T, H, v] of o_lat's dtype, token-major (o_proj reads its [T, H * v] view).

    Raises:
        ValueError: shapes, dtypes or strides the kernel does not take.
    """
    T, H, C = o_lat.shape
    V = w_uv_t.shape[2]
    if (w_uv_t.shape != (H, C, V) or w_uv_t.dtype != o_lat.dtype or gate.dtype != o_lat.dtype
            or gate.shape != (T, H * V) or o_lat.stride(-1) != 1 or w_uv_t.stride(-1) != 1 or gate.stride(-1) != 1):
        raise ValueError(f"mla_value_gate: o_lat {tuple(o_lat.shape)}, w_uv_t {tuple(w_uv_t.shape)}, gate "
                         f"{tuple(gate.shape)} do not fit")
    y = torch.empty(T, H, V, dtype=o_lat.dtype, device=o_lat.device)
    if T and H and V:
        block_t = 16 if T <= 16 else (32 if T <= 32 else 64)
        ieee = o_lat.dtype == torch.float32 or (interpreting() and o_lat.dtype == torch.bfloat16)
        grid = (H, triton.cdiv(V, 64), triton.cdiv(T, block_t))
        _mla_value_gate_kernel[grid](o_lat, w_uv_t, gate, y, T, C, V, o_lat.stride(0), o_lat.stride(1),
                                     w_uv_t.stride(0), w_uv_t.stride(1), gate.stride(0), y.stride(0), y.stride(1),
                                     IEEE=ieee, BLOCK_T=block_t, BLOCK_V=64, BLOCK_C=64, num_warps=4)
    return y
