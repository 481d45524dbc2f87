"""The fused recurrent gated delta rule of Kimi Delta Attention (KDA) in Triton: decode steps and short prefills of
the KDA layers (tokenfab/layers/kda.py), reading and writing the float32 state slots
(tokenfab/engine/state_cache.py) in place.

One program per (sequence, head, block of BV value columns) holds the state tile S[:, v0:v0 + BV] ([D_k, BV] float32)
in registers and walks the sequence's valid tokens in order; per token t (the layer's formulas, all float32):

    q <- q / sqrt(sum q^2 + 1e-6) * scale ;  k <- k / sqrt(sum k^2 + 1e-6)        FLA's l2norm form
    g  = -exp(A_log) * softplus(g_raw + dt_bias)        (softplus(x) = x for x > 20)
       or lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))        with a gate lower bound
    beta = sigmoid(b_raw)
    S <- diag(exp(g)) S ;  S <- S + k (beta (v - S^T k))^T ;  o = S^T q

so the layer's gate activation, beta sigmoid, q / k normalization, recurrence and output scatter are one launch
instead of dozens of small PyTorch ops. The state starts at zero for a sequence at position 0 (``fresh``: nothing is
read) and is written back to its slot after the last valid token; padding tokens (beyond ``num_tokens``) are never
read, and their outputs are stored as zeros. Launch shapes depend only on tensor sizes and the host never reads
device values, so decode steps replay under CUDA graphs; the padding rows of a padded decode batch all name the
spare slot (their writes race there, which no real sequence reads).

Bytes: a decode step of B sequences reads B * H * D_k * D_v * 4 bytes of state and writes as many (64 KiB each way
per K3 head of 128, 6 MiB per sequence and layer at 96 heads), which dominates the q / k / v / gate inputs. The
value block BV is chosen on the host from the sizes (about a thousand programs, enough to fill 132 SMs or 304 CUs
several times over, with at most 32 state elements per thread); ``triton.autotune`` is not used because its
benchmark runs would advance the in-place state (restoring it would copy the whole state pool).

A decode group (one token a row, no held rows) runs the short conv in the same launch (:func:`kda_decode_fused`,
``FUSE_CONV``): each program convolves its head's q and k channels and its value block's v channels from the
projection row and the conv-state slot, writes its v channels' new conv state, and the last of a head's
value-block programs (an atomic ticket per row and head, reset by it) writes the q / k channels' state once every
program of the head has read the old one: one launch instead of two, and no conv output round trip. In a
decode-only step that program also applies the layer's gated output norm to the head's outputs (``NORM``), so
the step's KDA core is one launch instead of three.

Checked against layers/kda.py's recurrence and chunked form in Triton's interpreter on CPU
(tests/test_triton_kda.py; the fused decode against the two launches: tests/test_triton_kda_decode_fused.py); GPU
timings come from ``benchmarks/gpu_kernels.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenfab.kernels.gpu.norm_activation import gated_norm_row

TARGET_PROGRAMS = 1024  # programs a launch should have before a wider value block is taken


@triton.jit
def _conv_taps(x_row, s_base, w_ptr, chan, mask, carried, K: tl.constexpr, KP: tl.constexpr):
    """The short conv of channels ``chan`` for one token (``x_row``: its projection row; ``s_base``: its conv-state
    slot [C, K - 1], read as one [len, KP] tile, nothing read where not ``carried``): (silu(sum_j w[c, j] full[c, j])
    in float32, the token's inputs x[c]). full = [state (K - 1) | x]."""
    j = tl.arange(0, KP)[None, :]
    jm = mask[:, None] & (j < K - 1)
    st = tl.load(s_base + chan[:, None] * (K - 1) + j, mask=jm & carried[:, None], other=0.0)
    ws = tl.load(w_ptr + chan[:, None] * K + j, mask=jm, other=0.0)
    xv = tl.load(x_row + chan, mask=mask, other=0.0)
    acc = tl.sum(st.to(tl.float32) * ws, axis=1) + xv.to(tl.float32) * tl.load(w_ptr + chan * K + (K - 1), mask=mask,
                                                                                other=0.0)
    return acc / (1.0 + tl.exp(-acc)), xv


@triton.jit
def _conv_shift(s_base, chan, mask, carried, xv, K: tl.constexpr, KP: tl.constexpr):
    """Writes the new conv state of channels ``chan`` as one [len, KP] tile: old entries 1 .. K - 2 moved down one,
    then the token's input ``xv`` (the caller has every program's reads of the old state behind it)."""
    j = tl.arange(0, KP)[None, :]
    jm = mask[:, None] & (j < K - 1)
    nxt = tl.load(s_base + chan[:, None] * (K - 1) + j + 1, mask=jm & (j < K - 2) & carried[:, None], other=0.0)
    nxt = tl.where(j == K - 2, xv[:, None].to(nxt.dtype), nxt)
    tl.debug_barrier()  # this program's threads have read the old entries before any is rewritten
    tl.store(s_base + chan[:, None] * (K - 1) + j, nxt, mask=jm)


@triton.jit
def _kda_recurrent_kernel(qkv_ptr, graw_ptr, dt_bias_ptr, a_log_ptr, braw_ptr, idx_ptr, ntok_ptr, pos0_ptr,
                          rows_ptr, state_ptr, out_ptr, hold_ptr, Q, stride_pos0, stride_qkv_b, stride_qkv_t, stride_g,
                          stride_b, stride_o, scale, lower_bound, H: tl.constexpr, D: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, HOLD: tl.constexpr,
                          cstate_ptr, cw_ptr, tickets_ptr, FUSE_CONV: tl.constexpr, CK: tl.constexpr,
                          CKP: tl.constexpr, gate_ptr, nw_ptr, y_ptr, stride_gate, stride_y, norm_eps,
                          NORM: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    mk = offs_k < D
    mv = offs_v < D
    m2 = mk[:, None] & mv[None, :]
    row = tl.load(rows_ptr + b).to(tl.int64)
    pos0 = tl.load(pos0_ptr + b * stride_pos0)  # position 0: a fresh sequence, zero state
    if FUSE_CONV:  # one token a row (decode): valid unless the row is padding (position -1)
        n = (pos0 >= 0).to(tl.int32)
    else:
        n = tl.load(ntok_ptr + b)
    carried = (offs_k[:, None] * 0 + pos0) != 0
    s_ptrs = state_ptr + (row * H + h) * (D * D) + offs_k[:, None] * D + offs_v[None, :]
    S = tl.load(s_ptrs, mask=m2 & carried, other=0.0)  # nothing read for a fresh sequence
    a = tl.exp(tl.load(a_log_ptr + h))
    dtb = tl.load(dt_bias_ptr + h * D + offs_k, mask=mk, other=0.0)
    for t in range(0, n):
        tok = tl.load(idx_ptr + b * Q + t).to(tl.int64)
        if FUSE_CONV:  # q, k (all D channels of head h) and this block's v through the short conv here
            x_row = qkv_ptr + tok * stride_qkv_t
            c_base = cstate_ptr + row * (3 * H * D) * (CK - 1)
            ck = (offs_k * 0 + pos0) > 0
            cv = (offs_v * 0 + pos0) > 0
            q, xq = _conv_taps(x_row, c_base, cw_ptr, h * D + offs_k, mk, ck, CK, CKP)
            k, xk = _conv_taps(x_row, c_base, cw_ptr, H * D + h * D + offs_k, mk, ck, CK, CKP)
            v, xv = _conv_taps(x_row, c_base, cw_ptr, 2 * H * D + h * D + offs_v, mv, cv, CK, CKP)
            DT: tl.constexpr = out_ptr.dtype.element_ty  # the conv output's rounding, as the conv kernel stores it
            q = q.to(DT).to(tl.float32)
            k = k.to(DT).to(tl.float32)
            v = v.to(DT).to(tl.float32)
            if CK > 1:  # this block's v channels are this program's alone (the q / k channels: below)
                _conv_shift(c_base, 2 * H * D + h * D + offs_v, mv, cv, xv, CK, CKP)
        else:
            base = qkv_ptr + b * stride_qkv_b + t * stride_qkv_t + h * D
            q = tl.load(base + offs_k, mask=mk, other=0.0).to(tl.float32)
            k = tl.load(base + H * D + offs_k, mask=mk, other=0.0).to(tl.float32)
            v = tl.load(base + 2 * H * D + offs_v, mask=mv, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        gp = tl.load(graw_ptr + tok * stride_g + h * D + offs_k, mask=mk, other=0.0).to(tl.float32) + dtb
        if USE_LOWER_BOUND:
            g = lower_bound * (1.0 / (1.0 + tl.exp(-(a * gp))))
        else:
            g = -a * tl.where(gp > 20.0, gp, tl.log(1.0 + tl.exp(gp)))
        braw = tl.load(braw_ptr + tok * stride_b + h).to(tl.float32)
        beta = 1.0 / (1.0 + tl.exp(-braw))
        S = S * tl.exp(g)[:, None]
        kv = tl.sum(S * k[:, None], axis=0)  # [BV] = (S^T k)[v0:v0 + BV]
        delta = (v - kv) * beta
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(out_ptr + tok * stride_o + h * D + offs_v, o.to(out_ptr.dtype.element_ty), mask=mv)
        if FUSE_CONV:
            if CK > 1 or NORM:
                # the q / k conv channels are every value block's, and the output norm needs the whole head: the
                # last of the head's programs to finish (a ticket per row and head, released at GPU scope after
                # its reads of the old conv state and its output stores) writes those channels' state and norms
                tl.debug_barrier()
                ticket = tl.atomic_add(tickets_ptr + b * H + h, 1, sem="acq_rel")
                if ticket == tl.num_programs(2) - 1:
                    tl.debug_barrier()
                    if CK > 1:
                        _conv_shift(c_base, h * D + offs_k, mk, ck, xq, CK, CKP)
                        _conv_shift(c_base, H * D + h * D + offs_k, mk, ck, xk, CK, CKP)
                    if NORM:
                        # the head's outputs as stored (by every value-block program): the norm launch's formula
                        gated_norm_row(out_ptr + tok * stride_o + h * D, gate_ptr + tok * stride_gate + h * D,
                                       nw_ptr, y_ptr + tok * stride_y + h * D, offs_k, mk, D, norm_eps, True)
                    tl.atomic_xchg(tickets_ptr + b * H + h, 0)
    for t in range(n, Q):  # tokens past the valid ones: zero outputs (the decode-graph buffers' verification
        # rows name real rows of the padded batch there, which later layers read; elsewhere they name one padding row)
        tok = tl.load(idx_ptr + b * Q + t).to(tl.int64)
        tl.store(out_ptr + tok * stride_o + h * D + offs_v, tl.zeros([BV], tl.float32).to(out_ptr.dtype.element_ty),
                 mask=mv)
        if NORM:  # the norm of a zero row is zero
            tl.store(y_ptr + tok * stride_y + h * D + offs_v, tl.zeros([BV], tl.float32).to(y_ptr.dtype.element_ty),
                     mask=mv)
    if HOLD:  # a held row (speculative verification) keeps its state until the commit reruns its kept tokens
        write = (offs_k[:, None] * 0 + tl.load(hold_ptr + b).to(tl.int32)) == 0
        tl.store(s_ptrs, S, mask=m2 & write)
    else:
        tl.store(s_ptrs, S, mask=m2)


def value_block(batch: int, heads: int, head_dim: int) -> tuple[int, int]:
    """(BV, num_warps) for a launch over ``batch`` sequences x ``heads``: the widest value block of 64 / 32 / 16
    columns that still gives TARGET_PROGRAMS programs (16 otherwise; at most the padded head dim), with warps for
    about 32 state elements per thread (1 to 8)."""
    bk = triton.next_power_of_2(head_dim)
    bv = 16
    for cand in (64, 32):
        if batch * heads * triton.cdiv(head_dim, cand) >= TARGET_PROGRAMS:
            bv = cand
            break
    bv = min(bv, bk)
    return bv, max(1, min(8, bk * bv // 1024))


def kda_recurrent(qkv: torch.Tensor, g_raw: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                  lower_bound: float | None, b_raw: torch.Tensor, token_index: torch.Tensor,
                  num_tokens: torch.Tensor, first_pos: torch.Tensor, rows: torch.Tensor, state: torch.Tensor,
                  out: torch.Tensor, scale: float, hold: torch.Tensor | None = None) -> torch.Tensor:
    """The gated delta rule over a padded group of B sequences, in one launch, state updated in place.

    Args:
        qkv: [B, Q, 3 * H * D] the short conv's outputs q | k | v (after SiLU; activation dtype, unit stride along
            the last dim), Q = the group's padded tokens per sequence, valid tokens first.
        g_raw: [T, H * D] the gate pre-activation without dt_bias (f_b(f_a x); any float dtype, read as float32).
        dt_bias: [H * D] float32; a_log: [H] float32 (this rank's heads).
        lower_bound: None for the softplus gate, else the sigmoid gate's lower bound (< 0).
        b_raw: [T, H] beta logits (b_proj x), sigmoid taken in float32.
        token_index: [B, Q] int64 row of each token in g_raw / b_raw / out.
        num_tokens: [B] valid tokens per sequence (int32 or int64); first_pos: [B] integer position of each
            sequence's first token this step (any stride; 0: a fresh sequence, zero initial state); rows: [B] int64
            state slots.
        state: [slots, H, D, D] float32 (S[k, v]), contiguous: read at ``rows`` (unless fresh), written back there.
        out: [>= T, H, D] contiguous (activation dtype): o of each valid token stored at its token_index row.
        scale: the query scale (D^-0.5).
        hold: optional [B] bool: rows whose state is not written back (speculative verification rows, committed
            later: engine/state_commit.py); None writes every row.

    Returns:
        ``out``.

    Raises:
        ValueError: a state that is not float32 / contiguous / [slots, H, D, D], a qkv other than [B, Q, 3 * H * D],
            a strided last dim of qkv / g_raw / b_raw, or a strided ``out``.
    """
    B, Q, width = qkv.shape
    H, D = state.shape[1], state.shape[2]
    if (state.dtype != torch.float32 or not state.is_contiguous() or state.shape[3] != D or width != 3 * H * D
            or qkv.stride(-1) != 1 or g_raw.stride(-1) != 1 or b_raw.stride(-1) != 1 or not out.is_contiguous()):
        raise ValueError(f"kda_recurrent: state {tuple(state.shape)} {state.dtype} / qkv {tuple(qkv.shape)} "
                         f"{qkv.stride()} do not match [slots, H, D, D] float32 contiguous and [B, Q, 3 * H * D] "
                         "with unit stride along the channels (g_raw, b_raw likewise; out contiguous).")
    if B == 0 or H == 0:
        return out
    bv, warps = value_block(B, H, D)
    grid = (B, H, triton.cdiv(D, bv))
    _kda_recurrent_kernel[grid](
        qkv, g_raw, dt_bias, a_log, b_raw, token_index.contiguous(), num_tokens, first_pos, rows, state, out,
        rows if hold is None else hold, Q,
        first_pos.stride(0), qkv.stride(0), qkv.stride(1), g_raw.stride(0), b_raw.stride(0), out.stride(0),
        float(scale), 0.0 if lower_bound is None else float(lower_bound), H=H, D=D, BK=triton.next_power_of_2(D),
        BV=bv, USE_LOWER_BOUND=lower_bound is not None, HOLD=hold is not None, cstate_ptr=state, cw_ptr=dt_bias,
        tickets_ptr=rows, FUSE_CONV=False, CK=1, CKP=1, gate_ptr=out, nw_ptr=dt_bias, y_ptr=out, stride_gate=0,
        stride_y=0, norm_eps=0.0, NORM=False, num_warps=warps)  # (conv and norm pointers unused: no FUSE_CONV)
    return out


def kda_decode_fused(x: torch.Tensor, g_raw: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                     lower_bound: float | None, b_raw: torch.Tensor, token_index: torch.Tensor,
                     first_pos: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, conv_state: torch.Tensor,
                     conv_weight: torch.Tensor, tickets: torch.Tensor, out: torch.Tensor, scale: float,
                     norm: tuple | None = None) -> torch.Tensor:
    """A decode group (one token a row) of a KDA layer in one launch: the short conv + SiLU of each token's q, k, v
    channels (kernels/gpu/short_conv.py's formulas: its conv state read and shifted in place, outputs rounded to the
    activation dtype as that kernel stores them) and the gated delta rule of :func:`kda_recurrent`.

    Each program (row, head, value block) convolves its head's q and k channels and its block's v channels; it
    writes its v channels' new conv state itself, and the last of a head's value-block programs to finish (an
    atomic ticket per row and head in ``tickets``, reset by that program) writes the q and k channels' state, after
    every program of the head has read the old one. With ``norm``, that program also applies the layer's output
    norm to the head's outputs (re-read as stored, so the same values and formula as
    kernels/gpu/norm_activation.py's ``gated_rms_norm`` launch it replaces).

    Args:
        x: [T, 3 * H * D] the q | k | v projections (activation dtype; unit stride along the channels, rows may be
            strided).
        g_raw, dt_bias, a_log, lower_bound, b_raw, rows, state, out, scale: as :func:`kda_recurrent`.
        token_index: [B, 1] int64 row of each row's token in x / g_raw / b_raw / out.
        first_pos: [B] the token's position (any stride; 0: a fresh sequence, zero states; -1: a padding row: no
            conv, its states left as they are, a zero output).
        conv_state: [slots, 3 * H * D, K - 1] (activation dtype), contiguous; conv_weight: [3 * H * D, K] float32,
            contiguous.
        tickets: int32 zeros, at least B * H of them, owned by the caller (left zero after every launch), not shared
            with a launch that may run concurrently.
        norm: optional (gate, weight, eps, y): gate [>= T, H * D] (unit stride along the last dim), weight [D], eps
            float, y [>= T, H * D] contiguous (activation dtype): each token's (w * o / sqrt(mean(o^2) + eps)) *
            sigmoid(gate) per head stored at its token_index row of y (zeros for padding rows), o as stored in out.

    Returns:
        ``out``.

    Raises:
        ValueError: shapes or layouts the kernel does not take.
    """
    B = token_index.shape[0]
    H, D = state.shape[1], state.shape[2]
    C, K = conv_weight.shape
    if (token_index.shape != (B, 1) or x.shape[-1] != 3 * H * D or C != 3 * H * D or x.stride(-1) != 1
            or tuple(conv_state.shape[1:]) != (C, K - 1) or not conv_state.is_contiguous()
            or conv_weight.dtype != torch.float32 or not conv_weight.is_contiguous() or tickets.numel() < B * H
            or tickets.dtype != torch.int32 or state.dtype != torch.float32 or not state.is_contiguous()
            or g_raw.stride(-1) != 1 or b_raw.stride(-1) != 1 or not out.is_contiguous()
            or (norm is not None and (norm[0].stride(-1) != 1 or not norm[3].is_contiguous()
                                      or norm[3].shape[-1] != H * D or norm[1].numel() != D))):
        raise ValueError(f"kda_decode_fused: x {tuple(x.shape)}, conv state {tuple(conv_state.shape)}, taps "
                         f"{tuple(conv_weight.shape)} {conv_weight.dtype}, state {tuple(state.shape)}, tickets "
                         f"{tickets.numel()} for {B} rows x {H} heads do not fit")
    if B == 0 or H == 0:
        return out
    bv, warps = value_block(B, H, D)
    grid = (B, H, triton.cdiv(D, bv))
    _kda_recurrent_kernel[grid](
        x, g_raw, dt_bias, a_log, b_raw, token_index.contiguous(), first_pos, first_pos, rows, state, out, rows, 1,
        first_pos.stride(0), 0, x.stride(0), g_raw.stride(0), b_raw.stride(0), out.stride(0), float(scale),
        0.0 if lower_bound is None else float(lower_bound), H=H, D=D, BK=triton.next_power_of_2(D), BV=bv,
        USE_LOWER_BOUND=lower_bound is not None, HOLD=False, cstate_ptr=conv_state, cw_ptr=conv_weight,
        tickets_ptr=tickets, FUSE_CONV=True, CK=K, CKP=triton.next_power_of_2(max(K - 1, 1)),
        gate_ptr=out if norm is None else norm[0], nw_ptr=dt_bias if norm is None else norm[1],
        y_ptr=out if norm is None else norm[3], stride_gate=0 if norm is None else norm[0].stride(0),
        stride_y=0 if norm is None else norm[3].stride(0), norm_eps=0.0 if norm is None else float(norm[2]),
        NORM=norm is not None, num_warps=warps)
    return out
