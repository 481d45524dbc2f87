"""One Triton kernel for what sits between the fused q|k|v GEMM and decode attention on GPUs: the per-head q / k
RMSNorm (Qwen3's q_norm / k_norm, optional), RoPE on q and k, and the paged KV-cache write of k and v at the
step's slots (SGLang's and ROCm vLLM's fused RoPE + cache write). Replaces up to six launches per layer (two norms,
two RoPE passes, two ``index_copy_``) by one read of q|k|v and one write of q, k and v.

:func:`mla_rope_cache` is MLA's counterpart (DeepSeek-V3 / Kimi): kv_a_layernorm of the latent, RoPE of the
query's rope part and of the shared rope key, and the [latent | rope key] row written at the token's slot, one
launch instead of six (norm, two RoPE passes, two cats, ``index_copy_``).

Rounding is the reference paths' (layers/norm.py, layers/rotary.py, layers/paged_attention.py::write_cache), in
q's dtype: norm y = w * round(x * rsqrt(mean(x^2) + eps)) with float32 statistics, then each RoPE product and the
sum or difference rounded, cos / sin rounded to q's dtype first. Checked in Triton's interpreter against those
paths (tests/test_triton_rope_cache.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenfab.kernels.gpu.norm_activation import rms_row


HEADS_PER_PROGRAM = 16  # heads each program rotates as one [heads, D / 2] tile (at most; fewer when there are)


def heads_per_program(n_heads: int, cap: int | None = None) -> int:
    """The power-of-two tile height (heads per program) for ``n_heads`` heads: up to :data:`HEADS_PER_PROGRAM`
    (or ``cap``, a power of two), as vLLM's rotary kernel gives one thread block all heads of a token."""
    return min(cap or HEADS_PER_PROGRAM, triton.next_power_of_2(max(1, n_heads)))


def tile_warps(rows: int, cols: int) -> int:
    """Warps for a [rows, cols] element tile: about 8 elements per thread, 1 to 8 warps."""
    return max(1, min(8, rows * cols // 256))


@triton.jit
def _rotate(a1, a2, c, s, dt: tl.constexpr):
    """RoPE of the halves (a1, a2) (float32, values of dtype ``dt``) by cos / sin (rounded to ``dt``): each product
    and the sum or difference rounded to ``dt``, as layers/rotary.py. Returns (r1, r2) in ``dt``."""
    r1 = ((a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)).to(dt)
    r2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
    return r1, r2


@triton.jit
def _load_halves(base, offs, mask, half, INTERLEAVE: tl.constexpr):
    """The two RoPE halves at ``base + offs`` (any broadcastable shapes): pairs (2i, 2i + 1) when ``INTERLEAVE``,
    else (i, half + i); masked entries 0."""
    if INTERLEAVE:
        x1 = tl.load(base + 2 * offs, mask=mask, other=0.0)
        x2 = tl.load(base + 2 * offs + 1, mask=mask, other=0.0)
    else:
        x1 = tl.load(base + offs, mask=mask, other=0.0)
        x2 = tl.load(base + half + offs, mask=mask, other=0.0)
    return x1, x2


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, p, s_c, offs, mask, dt: tl.constexpr):
    """Row ``p`` of the float32 cos / sin tables at ``offs``, rounded to ``dt`` (as layers/rotary.py casts them),
    returned in float32."""
    c = tl.load(cos_ptr + p * s_c + offs, mask=mask, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + p * s_c + offs, mask=mask, other=0.0).to(dt).to(tl.float32)
    return c, s


@triton.jit
def _qk_rope_cache_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr,
                          qo_ptr, kc_ptr, vc_ptr, H, Hk, QB, half, D, eps, page,
                          s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_c, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch,
                          HAS_NORM: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr,
                          HB: tl.constexpr):
    # program (t, j): token t; j < QB: q heads j*HB .. j*HB + HB - 1, else k (and v) heads (j - QB)*HB ...
    t = tl.program_id(0)
    j = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    rows = tl.arange(0, HB)
    is_q = j < QB
    if is_q:
        head = j * HB + rows
        n_heads = H
        base = q_ptr + t * s_qt + head * s_qh
        w_ptr = qn_ptr
    else:
        head = (j - QB) * HB + rows
        n_heads = Hk
        base = k_ptr + t * s_kt + head * s_kh
        w_ptr = kn_ptr
    rmask = head < n_heads
    cmask = offs < half
    mask = rmask[:, None] & cmask[None, :]
    x1, x2 = _load_halves(base[:, None], offs[None, :], mask, half, INTERLEAVE)
    dt = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    if HAS_NORM:  # per-head RMSNorm: the sum of squares over the whole head, both halves
        rstd = 1.0 / tl.sqrt((tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)) / D + eps)
        w1, w2 = _load_halves(w_ptr, offs, cmask, half, INTERLEAVE)
        w1 = w1.to(tl.float32)
        w2 = w2.to(tl.float32)
        a1 = (w1[None, :] * (a1 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        a2 = (w2[None, :] * (a2 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    c, s = _cos_sin(cos_ptr, sin_ptr, tl.load(pos_ptr + t), s_c, offs, cmask, dt)
    r1, r2 = _rotate(a1, a2, c[None, :], s[None, :], dt)
    if is_q:
        out = qo_ptr + (t * H + head[:, None]) * D + offs[None, :]
        tl.store(out, r1, mask=mask)
        tl.store(out + half, r2, mask=mask)
    else:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:  # negative slots: not written (rows that own no KV slot)
            blk = slot // page
            off = slot % page
            kout = kc_ptr + blk * s_kcb + off * s_kco + head[:, None] * s_kch + offs[None, :]
            tl.store(kout, r1.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(kout + half, r2.to(kc_ptr.dtype.element_ty), mask=mask)
            voffs = tl.arange(0, 2 * BLOCK)
            vmask = rmask[:, None] & (voffs < D)[None, :]
            v = tl.load(v_ptr + t * s_vt + head[:, None] * s_vh + voffs[None, :], mask=vmask, other=0.0)
            tl.store(vc_ptr + blk * s_vcb + off * s_vco + head[:, None] * s_vch + voffs[None, :],
                     v.to(vc_ptr.dtype.element_ty), mask=vmask)


def qk_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, interleave: bool, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  eps: float = 0.0, heads_per_tile: int | None = None) -> torch.Tensor:
    """Optional per-head RMSNorm of q and k, RoPE of both, and the cache write of k and v, in one launch: one
    program per token and tile of up to :data:`HEADS_PER_PROGRAM` heads (q heads and k / v heads in separate tiles).

    Args:
        q: [T, H, D]; k, v: [T, Hk, D] (any strides with a unit last one, e.g. views of the q|k|v GEMM output),
            one dtype; D even.
        positions: [T] int64 positions (rows of cos / sin); cos, sin: float32 [P, D / 2] tables.
        interleave: rotate pairs (2i, 2i + 1) written as halves (DeepSeek-V3's layout); else halves.
        slot_mapping: [T] int64 flat KV-pool slots (block * block_size + offset); a negative slot writes nothing.
        k_cache, v_cache: [num_blocks, block_size, Hk, D] of any float dtype (written cast to it; any strides
            with a unit last one).
        q_norm, k_norm: [D] RMSNorm weights in q's dtype applied per head before RoPE (both or neither).
        eps: the norms' epsilon.
        heads_per_tile: a power of two below :data:`HEADS_PER_PROGRAM` for smaller tiles (tests split the heads
            over several programs with it); None: the default.

    Returns:
        the rotated q as a new contiguous [T, H, D] of q's dtype; k and v are only written to the caches.

    Raises:
        ValueError: shapes, dtypes or strides the kernel does not take.
    """
    T, H, D = q.shape
    Hk = k.shape[1]
    if (k.shape != (T, Hk, D) or v.shape != (T, Hk, D) or D % 2 or k.dtype != q.dtype or v.dtype != q.dtype
            or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or cos.shape[-1] * 2 != D
            or (q_norm is None) != (k_norm is None) or k_cache.shape[2:] != (Hk, D) or v_cache.shape[2:] != (Hk, D)
            or k_cache.shape[1] != v_cache.shape[1]
            or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
        raise ValueError(f"qk_rope_cache: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cos "
                         f"{tuple(cos.shape)}, caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit")
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    has_norm = q_norm is not None
    qn = q_norm if has_norm else q
    kn = k_norm if has_norm else q
    hb = heads_per_program(max(H, Hk), heads_per_tile)
    block = triton.next_power_of_2(max(1, D // 2))
    qb = triton.cdiv(H, hb)
    if T:
        _qk_rope_cache_kernel[(T, qb + triton.cdiv(Hk, hb))](
            q, k, v, positions, slot_mapping, cos, sin, qn, kn, out, k_cache, v_cache, H, Hk, qb, D // 2, D,
            float(eps), k_cache.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
            v_cache.stride(1), v_cache.stride(2),
            HAS_NORM=has_norm, INTERLEAVE=interleave, BLOCK=block, HB=hb, num_warps=tile_warps(hb, 2 * block))
    return out


@triton.jit
def _mla_rope_cache_kernel(q_ptr, ckv_ptr, kr_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, w_ptr, qo_ptr, c_ptr,
                           H, QB, NOPE, C, half, eps, page, s_qt, s_qh, s_ct, s_kt, s_c, s_cb, s_co,
                           INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_C: tl.constexpr, HB: tl.constexpr):
    # program (t, j): token t; j < QB: query heads j*HB ... as [q_nope | rotated q_rope] into the new q; j == QB:
    # the latent row, normalized c_kv and the rotated shared rope key, at the token's slot
    t = tl.program_id(0)
    j = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cmask = offs < half
    p = tl.load(pos_ptr + t)
    if j < QB:
        head = j * HB + tl.arange(0, HB)
        rmask = head < H
        src = q_ptr + t * s_qt + head[:, None] * s_qh
        dst = qo_ptr + (t * H + head[:, None]) * (NOPE + 2 * half)
        n = tl.arange(0, BLOCK_N)[None, :]
        nmask = rmask[:, None] & (n < NOPE)
        tl.store(dst + n, tl.load(src + n, mask=nmask, other=0.0), mask=nmask)
        mask = rmask[:, None] & cmask[None, :]
        x1, x2 = _load_halves(src + NOPE, offs[None, :], mask, half, INTERLEAVE)
        dt = x1.dtype
        c, s = _cos_sin(cos_ptr, sin_ptr, p, s_c, offs, cmask, dt)
        r1, r2 = _rotate(x1.to(tl.float32), x2.to(tl.float32), c[None, :], s[None, :], dt)
        tl.store(dst + NOPE + offs[None, :], r1, mask=mask)
        tl.store(dst + NOPE + half + offs[None, :], r2, mask=mask)
    else:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:  # negative slots: not written
            x1, x2 = _load_halves(kr_ptr + t * s_kt, offs, cmask, half, INTERLEAVE)
            dt = x1.dtype
            c, s = _cos_sin(cos_ptr, sin_ptr, p, s_c, offs, cmask, dt)
            r1, r2 = _rotate(x1.to(tl.float32), x2.to(tl.float32), c, s, dt)
            dst = c_ptr + (slot // page) * s_cb + (slot % page) * s_co + C
            tl.store(dst + offs, r1.to(c_ptr.dtype.element_ty), mask=cmask)
            tl.store(dst + half + offs, r2.to(c_ptr.dtype.element_ty), mask=cmask)
            cc = tl.arange(0, BLOCK_C)
            ccmask = cc < C
            x = tl.load(ckv_ptr + t * s_ct + cc, mask=ccmask, other=0.0)
            y = rms_row(x, w_ptr, cc, ccmask, C, eps, dt).to(dt)
            tl.store(dst - C + cc, y.to(c_ptr.dtype.element_ty), mask=ccmask)


def mla_rope_cache(q: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, kv_norm: torch.Tensor, eps: float,
                   positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                   slot_mapping: torch.Tensor, cache: torch.Tensor,
                   heads_per_tile: int | None = None) -> torch.Tensor:
    """MLA's glue between its projections and attention in one launch: the query [q_nope | RoPE(q_rope)], and the
    latent row [RMSNorm(c_kv) | RoPE(k_rope)] written to the pool at each token's slot (layers/mla.py's
    kv_a_layernorm, rotary, torch.cat and write_cache; the same roundings). One program per token and tile of up
    to :data:`HEADS_PER_PROGRAM` query heads, and one per token for its latent row.

    Args:
        q: [T, H, nope + R] (unit stride along the last dim), R = the rope width, even.
        c_kv: [T, C] and k_rope: [T, R] (views of the fused a-projection's output are fine), q's dtype.
        kv_norm: [C] RMSNorm weight (q's dtype); eps its epsilon.
        positions: [T] int64; cos, sin: float32 [P, R / 2]; interleave: DeepSeek-V3's pair layout.
        slot_mapping: [T] int64 flat slots (negative: not written); cache: [num_blocks, block_size, C + R] (unit
            stride along the last dim; written cast to its dtype).
        heads_per_tile: as :func:`qk_rope_cache`'s.

    Returns:
        the new contiguous q [T, H, nope + R] with its rope part rotated.

    Raises:
        ValueError: shapes, dtypes or strides the kernel does not take.
    """
    T, H, D = q.shape
    C, R = c_kv.shape[-1], k_rope.shape[-1]
    nope = D - R
    if (R % 2 or nope < 0 or c_kv.shape != (T, C) or k_rope.shape != (T, R) or cos.shape[-1] * 2 != R
            or c_kv.dtype != q.dtype or k_rope.dtype != q.dtype or kv_norm.shape != (C,)
            or cache.shape[-1] != C + R or q.stride(-1) != 1 or c_kv.stride(-1) != 1 or k_rope.stride(-1) != 1
            or cache.stride(-1) != 1):
        raise ValueError(f"mla_rope_cache: q {tuple(q.shape)}, c_kv {tuple(c_kv.shape)}, k_rope "
                         f"{tuple(k_rope.shape)}, cos {tuple(cos.shape)}, cache {tuple(cache.shape)} do not fit")
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    hb = heads_per_program(H, heads_per_tile)
    qb = triton.cdiv(H, hb)
    block_n = triton.next_power_of_2(max(1, nope))
    if T:
        _mla_rope_cache_kernel[(T, qb + 1)](
            q, c_kv, k_rope, positions, slot_mapping, cos, sin, kv_norm, out, cache, H, qb, nope, C, R // 2,
            float(eps), cache.shape[1], q.stride(0), q.stride(1), c_kv.stride(0), k_rope.stride(0), cos.stride(0),
            cache.stride(0), cache.stride(1), INTERLEAVE=interleave, BLOCK=triton.next_power_of_2(max(1, R // 2)),
            BLOCK_N=block_n, BLOCK_C=triton.next_power_of_2(C), HB=hb,
            num_warps=max(tile_warps(hb, block_n), 1 if C <= 128 else 4))
    return out
