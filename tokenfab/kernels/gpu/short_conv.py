"""The depthwise causal short convolution of Kimi Delta Attention (KDA) in Triton, with its rolling state, in one
launch per group: the conv + SiLU outputs of every valid token, the new conv state written in place, and each
sequence's valid-token count for the recurrence kernel that follows (kernels/gpu/kda.py).

For sequence b with conv state s (its last K - 1 inputs, zero for a fresh sequence at position 0), valid inputs
x_0 .. x_{n-1} (its token rows of the projection output) and taps w [C, K] (float32), per channel c:

    full = [s_0 .. s_{K-2}, x_0 .. x_{n-1}]
    y_t[c] = silu(sum_j w[c, j] * full[t + j][c])        t < n, float32, rounded once to the output dtype
    s'_j   = full[n + j]                                  j < K - 1 (the state after this step)

which is layers/kda.py's ``F.silu(F.conv1d(full, w, groups=C))`` and its state gather (the reference the tests
compare against). The PyTorch form takes about a dozen launches per KDA layer (gather of the inputs, padding row,
concatenations, conv, SiLU, cast, index arithmetic, state gather and scatter); this kernel is one.

Work split: one program per (sequence, block of BC channels, block of BT tokens); every load and store is along the
contiguous channel axis. Only programs of the first token block read the old state (BT >= K - 1), and they alone
write the new one, after a barrier that orders their own state loads before the stores; so no program reads a state
another one writes. Padding tokens (query position -1, after the valid ones) are neither read nor written. The
padding rows of a padded decode batch (engine/cuda_graph_runner.py) all name the spare state slot and have no valid
token: they rewrite the spare slot's own state, which no real sequence reads. Launch shapes depend on tensor sizes
only (CUDA-graph safe) and the host never reads a device value.

Bytes: a decode step reads 2 x (K - 1) x C state values and C inputs and writes C outputs and (K - 1) x C state
values per sequence: ~0.5 MB per sequence at K3's width (C = 3 x 96 x 128, K = 4, bf16), small beside the
recurrence's float32 state (6 MiB).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _short_conv_kernel(x_ptr, idx_ptr, qpos_ptr, rows_ptr, state_ptr, w_ptr, y_ptr, n_ptr, hold_ptr, Q, C,
                       stride_x, stride_qpos, stride_yb, stride_yt, K: tl.constexpr, KP: tl.constexpr,
                       BT: tl.constexpr, BC: tl.constexpr, HOLD: tl.constexpr):
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    tb = tl.program_id(2)
    offs_t = tb * BT + tl.arange(0, BT)
    mc = offs_c < C
    qpos = tl.load(qpos_ptr + b * stride_qpos + offs_t, mask=offs_t < Q, other=-1)
    mt = qpos >= 0  # valid tokens come first: mt is the prefix t < n
    pos0 = tl.load(qpos_ptr + b * stride_qpos)
    carried = (offs_t * 0 + pos0) != 0  # position 0: a fresh sequence, zero state (nothing read); a block, as
    # Triton's interpreter takes no scalar in a mask
    row = tl.load(rows_ptr + b).to(tl.int64)
    s_base = state_ptr + row * C * (K - 1)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        src = offs_t - (K - 1) + j  # index into this step's inputs; < 0: the old state's entry K - 1 + src
        from_x = mt & (src >= 0)
        tok = tl.load(idx_ptr + b * Q + src, mask=from_x, other=0).to(tl.int64)
        xv = tl.load(x_ptr + tok[:, None] * stride_x + offs_c[None, :], mask=from_x[:, None] & mc[None, :],
                     other=0.0).to(tl.float32)
        if K > 1:
            from_s = mt & (src < 0) & carried
            sv = tl.load(s_base + offs_c[None, :] * (K - 1) + (K - 1 + src)[:, None],
                         mask=from_s[:, None] & mc[None, :], other=0.0).to(tl.float32)
            xv += sv  # one of the two is zero
        w = tl.load(w_ptr + offs_c * K + j, mask=mc, other=0.0)
        acc += xv * w[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + b * stride_yb + offs_t[:, None] * stride_yt + offs_c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])
    if tb == 0:
        n = tl.zeros([], dtype=tl.int32)
        for t0 in range(0, Q, BT):
            qp = tl.load(qpos_ptr + b * stride_qpos + t0 + tl.arange(0, BT), mask=t0 + tl.arange(0, BT) < Q,
                         other=-1)
            n += tl.sum((qp >= 0).to(tl.int32), axis=0)
        if tl.program_id(1) == 0:
            tl.store(n_ptr + b, n)
        if K > 1:
            jj = tl.arange(0, KP)
            mj = jj < K - 1
            fi = n + jj  # index into full = [old state (K - 1) | inputs (n)]
            in_state = fi < K - 1
            stok = tl.load(idx_ptr + b * Q + (fi - (K - 1)), mask=mj & ~in_state, other=0).to(tl.int64)
            new_x = tl.load(x_ptr + stok[None, :] * stride_x + offs_c[:, None],
                            mask=mc[:, None] & (mj & ~in_state)[None, :], other=0.0)
            new_s = tl.load(s_base + offs_c[:, None] * (K - 1) + fi[None, :],
                            mask=mc[:, None] & (mj & in_state & ((jj * 0 + pos0) != 0))[None, :], other=0.0)
            new = new_x.to(state_ptr.dtype.element_ty) + new_s  # one of the two is zero
            tl.debug_barrier()  # every thread's loads of the old state before any store
            smask = mc[:, None] & mj[None, :]
            if HOLD:  # a held row (speculative verification) keeps its state until the commit
                smask = smask & ((jj[None, :] * 0 + tl.load(hold_ptr + b).to(tl.int32)) == 0)
            tl.store(s_base + offs_c[:, None] * (K - 1) + jj[None, :], new, mask=smask)


def short_conv(x: torch.Tensor, token_index: torch.Tensor, query_pos: torch.Tensor, rows: torch.Tensor,
               state: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
               hold: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU of one padded group, conv states updated in place (formulas in the module
    docstring).

    Args:
        x: [T, C] this step's conv inputs (the q | k | v projections), any float dtype, unit stride along C (rows
            may be strided, e.g. a slice of a wider projection output).
        token_index: [B, Q] int64 row of x of each of the group's tokens (any value at padding).
        query_pos: [B, Q] integer position of each token, -1 at padding (valid tokens first); position 0 in column 0
            marks a fresh sequence (zero initial state).
        rows: [B] int64 state slot of each sequence.
        state: [slots, C, K - 1] conv states (activation dtype), contiguous: read at ``rows`` unless fresh, written
            back there.
        weight: [C, K] float32 taps, contiguous.
        out: optional [B, Q, C] output buffer (unit stride along C).
        hold: optional [B] bool: rows whose conv state is not written (speculative verification rows, committed
            later: engine/state_commit.py); None writes every row.

    Returns:
        (y [B, Q, C] in x's dtype, written at valid tokens only; num_tokens [B] int32 valid tokens per sequence).

    Raises:
        ValueError: shapes that do not match, a strided channel axis, a non-contiguous state or weight.
    """
    B, Q = token_index.shape
    T, C = x.shape
    K = weight.shape[1]
    if (weight.shape[0] != C or tuple(state.shape[1:]) != (C, K - 1) or not state.is_contiguous()
            or not weight.is_contiguous() or weight.dtype != torch.float32 or x.stride(-1) != 1
            or tuple(query_pos.shape) != (B, Q) or query_pos.stride(-1) != 1):
        raise ValueError(f"short_conv: x {tuple(x.shape)} stride {x.stride()}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}, state {tuple(state.shape)}, query_pos {tuple(query_pos.shape)} do not "
                         "match [T, C] (unit channel stride), [C, K] float32, [slots, C, K - 1] contiguous, [B, Q].")
    if out is None:
        out = torch.empty(B, Q, C, dtype=x.dtype, device=x.device)
    num_tokens = torch.empty(B, dtype=torch.int32, device=x.device)
    if B == 0:
        return out, num_tokens
    bt = max(triton.next_power_of_2(max(K - 1, 1)), min(16, triton.next_power_of_2(Q)))
    bc = 256 if Q == 1 else 64
    grid = (B, triton.cdiv(C, bc), triton.cdiv(Q, bt))
    _short_conv_kernel[grid](x, token_index.contiguous(), query_pos, rows, state, weight, out, num_tokens,
                             rows if hold is None else hold, Q, C, x.stride(0), query_pos.stride(0), out.stride(0),
                             out.stride(1), K=K, KP=triton.next_power_of_2(max(K - 1, 1)), BT=bt, BC=bc,
                             HOLD=hold is not None, num_warps=4)
    return out, num_tokens
