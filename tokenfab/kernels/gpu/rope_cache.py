"""One Triton kernel for what sits between the fused q|k|v GEMM and decode attention on GPUs: the per-head q / k
RMSNorm (Qwen3's q_norm / k_norm, optional), RoPE on q and k, and the paged KV-cache write of k and v at the
step's slots (SGLang's and ROCm vLLM's fused RoPE + cache write). Replaces up to six launches per layer (two norms,
two RoPE passes, two ``index_copy_``) by one read of q|k|v and one write of q, k and v.

Rounding is the reference paths' (layers/norm.py, layers/rotary.py, layers/paged_attention.py::write_cache), in
q's dtype: norm y = w * round(x * rsqrt(mean(x^2) + eps)) with float32 statistics, then each RoPE product and the
sum or difference rounded, cos / sin rounded to q's dtype first. Checked in Triton's interpreter against those
paths (tests/test_triton_rope_cache.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_rope_cache_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr,
                          qo_ptr, kc_ptr, vc_ptr, H, half, D, eps, page,
                          s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_c, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch,
                          HAS_NORM: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    is_q = head < H
    if is_q:
        base = q_ptr + t * s_qt + head * s_qh
        w_ptr = qn_ptr
    else:
        base = k_ptr + t * s_kt + (head - H) * s_kh
        w_ptr = kn_ptr
    if INTERLEAVE:
        x1 = tl.load(base + 2 * offs, mask=mask, other=0.0)
        x2 = tl.load(base + 2 * offs + 1, mask=mask, other=0.0)
    else:
        x1 = tl.load(base + offs, mask=mask, other=0.0)
        x2 = tl.load(base + half + offs, mask=mask, other=0.0)
    dt = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    if HAS_NORM:  # per-head RMSNorm: the sum of squares over the whole head, both halves
        rstd = 1.0 / tl.sqrt((tl.sum(a1 * a1, axis=0) + tl.sum(a2 * a2, axis=0)) / D + eps)
        if INTERLEAVE:
            w1 = tl.load(w_ptr + 2 * offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
        else:
            w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        a1 = (w1 * (a1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        a2 = (w2 * (a2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    p = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + p * s_c + offs, mask=mask, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + p * s_c + offs, mask=mask, other=0.0).to(dt).to(tl.float32)
    r1 = ((a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)).to(dt)
    r2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
    if is_q:
        out = qo_ptr + (t * H + head) * D
        tl.store(out + offs, r1, mask=mask)
        tl.store(out + half + offs, r2, mask=mask)
    else:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:  # negative slots: not written (rows that own no KV slot)
            kh = head - H
            blk = slot // page
            off = slot % page
            kout = kc_ptr + blk * s_kcb + off * s_kco + kh * s_kch
            tl.store(kout + offs, r1.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(kout + half + offs, r2.to(kc_ptr.dtype.element_ty), mask=mask)
            voffs = tl.arange(0, 2 * BLOCK)
            vmask = voffs < D
            v = tl.load(v_ptr + t * s_vt + kh * s_vh + voffs, mask=vmask, other=0.0)
            tl.store(vc_ptr + blk * s_vcb + off * s_vco + kh * s_vch + voffs, v.to(vc_ptr.dtype.element_ty), mask=vmask)


def qk_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, interleave: bool, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  eps: float = 0.0) -> torch.Tensor:
    """Optional per-head RMSNorm of q and k, RoPE of both, and the cache write of k and v, in one launch.

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

    Returns:
        the rotated q as a new contiguous [T, H, D] of q's dtype; k and v are only written to the caches.

    Raises:
        ValueError: shapes, dtypes or strides the kernel does not take.
    """
    T, H, D = q.shape
    Hk = k.shape[1]
    if (k.shape != (T, Hk, D) or v.shape != (T, Hk, D) or D % 2 or k.dtype != q.dtype or v.dtype != q.dtype
            or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or cos.shape[-1] * 2 != D
            or (q_norm is None) != (k_norm is None) or k_cache.shape[2:] != (Hk, D) or v_cache.shape[2:] != (Hk, D) or k_cache.shape[1] != v_cache.shape[1]
            or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
        raise ValueError(f"qk_rope_cache: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cos "
                         f"{tuple(cos.shape)}, caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit")
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    has_norm = q_norm is not None
    qn = q_norm if has_norm else q
    kn = k_norm if has_norm else q
    if T:
        _qk_rope_cache_kernel[(T, H + Hk)](
            q, k, v, positions, slot_mapping, cos, sin, qn, kn, out, k_cache, v_cache, H, D // 2, D, float(eps),
            k_cache.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
            v_cache.stride(1), v_cache.stride(2),
            HAS_NORM=has_norm, INTERLEAVE=interleave, BLOCK=triton.next_power_of_2(max(1, D // 2)), num_warps=1)
    return out
