"""Kimi Delta Attention on the GPU path (benchmarks/gpu_kernels.py's KDA rows): the fused recurrent kernel
(kernels/gpu/kda.py) and, optionally, fla-core's chunked prefill (kernels/gpu/kda_chunk.py) against layers/kda.py
at K3's shape, with errors, times and bandwidth over the float32 state."""
from __future__ import annotations

import json

import torch

from benchmarks.gpu_timing import time_us as _time_us


def check_kda(dev, quick: bool, bw: float, reps: int, fla: bool) -> list[dict]:
    """KDA at K3's shape (96 heads of 128, lower-bound gate -5; quick: 2 heads of 16) in float32 against
    layers/kda.py: prefill of one 6,144-token prompt (quick: 150) by the fused recurrent kernel
    (kernels/gpu/kda.py, from the raw gate / beta / conv outputs) and, with ``fla``, by fla-core's chunk_kda
    (kernels/gpu/kda_chunk.py; CUDA with fla-core only) against the chunked form, error relative to the largest
    reference output or state entry; decode steps at batch 1 / 16 / 64 against one recurrence step, time and
    bandwidth over the float32 state read and written (B x H x D x D x 4 bytes each way), and a decode-only step's
    whole core (conv, recurrence, gated norm) in one launch against three (:func:`_decode_core_rows`)."""
    from tokenfab.kernels.gpu import kda_chunk
    from tokenfab.kernels.gpu.kda import kda_recurrent
    from tokenfab.layers.kda import kda_chunked, kda_log_decay, kda_recurrent_step, l2norm
    H, D, L, lb = (96, 128, 6144, -5.0) if not quick else (2, 16, 150, -5.0)
    g = torch.Generator(device=dev).manual_seed(0)
    rn = lambda *shape: torch.randn(*shape, device=dev, generator=g)
    dt_bias, a_log = rn(H * D) * 0.1, rn(H) * 0.5 + 1.0

    def raw(B, Q):  # conv outputs q | k | v, gate pre-activation, beta logits of B x Q tokens
        return rn(B, Q, 3 * H * D), rn(B * Q, H * D), rn(B * Q, H)

    def prep(qkv, g_raw, b_raw):  # layers/kda.py's inputs to the recurrence: [B, Q, H, D], beta [B, Q, H]
        B, Q = qkv.shape[:2]
        q, k, v = qkv.view(B, Q, 3, H, D).unbind(2)
        gl = kda_log_decay((g_raw + dt_bias).view(B, Q, H, D), a_log, lb)
        return l2norm(q) * D ** -0.5, l2norm(k), v, gl, torch.sigmoid(b_raw).view(B, Q, H)

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()
    rows = []
    qkv, g_raw, b_raw = raw(1, L)
    q, k, v, gl, beta = prep(qkv, g_raw, b_raw)
    tr = lambda t: t.transpose(1, 2)
    zero = torch.zeros(1, H, D, D, device=dev)
    want_o, want_s = kda_chunked(tr(q), tr(k), tr(v), tr(gl), tr(beta), zero)
    want_o = tr(want_o)[0]
    idx, n, pos0, slot = (torch.arange(L, device=dev).view(1, L), torch.tensor([L], device=dev),
                          torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64, device=dev))
    state, out = torch.zeros(1, H, D, D, device=dev), torch.empty(L + 1, H, D, device=dev)
    run = lambda: kda_recurrent(qkv, g_raw, dt_bias, a_log, lb, b_raw, idx, n, pos0, slot, state, out, D ** -0.5)
    run()
    err = max(rel(out[:L], want_o), rel(state, want_s))
    us = _time_us(run, dev, max(2, reps // 4))
    nbytes = (qkv.numel() + g_raw.numel() + b_raw.numel() + out.numel() + state.numel()) * 4
    paths = [("KDA prefill, fused recurrent", us, err)]
    if fla and dev.type == "cuda" and kda_chunk.importable():
        fo, fs = kda_chunk.chunk_prefill(q, k, v, gl, beta, zero)
        err = max(rel(fo[0], want_o), rel(fs, want_s))
        paths.append(("KDA prefill, fla chunk_kda", _time_us(lambda: kda_chunk.chunk_prefill(q, k, v, gl, beta, zero),
                                                             dev, max(2, reps // 4)), err))
    else:
        print(json.dumps({"kda_fla_chunk": "skipped: needs --kda-fla, CUDA / ROCm and fla-core"}))
    for name, us, err in paths:
        rows.append({"kernel": name, "shape": f"L={L} H={H} D={D} float32", "max_err": err, "us": us,
                     "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)
    for B in ((1, 16, 64) if not quick else (1, 3)):
        qkv, g_raw, b_raw = raw(B, 1)
        pool = rn(B + 1, H, D, D) * 0.1  # B slots and a spare one
        q, k, v, gl, beta = prep(qkv, g_raw, b_raw)
        wo, ws = kda_recurrent_step(q[:, 0], k[:, 0], v[:, 0], gl[:, 0], beta[:, 0], pool[:B])
        idx, ones, slots = (torch.arange(B, device=dev).view(B, 1), torch.ones(B, dtype=torch.int64, device=dev),
                            torch.arange(B, device=dev))
        out = torch.empty(B + 1, H, D, device=dev)
        kda_recurrent(qkv, g_raw, dt_bias, a_log, lb, b_raw, idx, ones, ones, slots, pool, out, D ** -0.5)
        err = max(rel(out[:B], wo), rel(pool[:B], ws))
        us = _time_us(lambda: kda_recurrent(qkv, g_raw, dt_bias, a_log, lb, b_raw, idx, ones, ones, slots, pool, out,
                                            D ** -0.5), dev, reps)
        nbytes = 2 * B * H * D * D * 4
        rows.append({"kernel": "KDA decode step, fused recurrent", "shape": f"B={B} H={H} D={D} state float32",
                     "max_err": err, "us": us, "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)
        rows += _decode_core_rows(dev, rn, B, H, D, lb, dt_bias, a_log, qkv.view(B, -1), g_raw, b_raw, pool, bw, reps)
    return rows


def _decode_core_rows(dev, rn, B, H, D, lb, dt_bias, a_log, x, g_raw, b_raw, pool, bw, reps) -> list[dict]:
    """A decode-only step's KDA core at batch B: the short conv (width 4, carried sequences), the recurrence and the
    gated output norm in one launch (``kda_decode_fused`` with its norm, as the layer runs it) against the three
    launches it replaces (short_conv, kda_recurrent, gated_rms_norm), from the same states; error of the normed
    output relative to the three launches' largest, times of both, bandwidth over the float32 state."""
    from tokenfab.kernels.gpu.kda import kda_decode_fused, kda_recurrent
    from tokenfab.kernels.gpu.norm_activation import gated_rms_norm
    from tokenfab.kernels.gpu.short_conv import short_conv
    C = 3 * H * D
    conv, cw = rn(B + 1, C, 3), (rn(C, 4) * 0.5).contiguous()
    gate, nw = rn(B, H * D), torch.ones(D, device=dev)
    idx, pos, slots = (torch.arange(B, device=dev).view(B, 1), torch.full((B,), 5, device=dev),
                       torch.arange(B, device=dev))
    tickets = torch.zeros(B * H, dtype=torch.int32, device=dev)
    out, y = torch.empty(B + 1, H, D, device=dev), torch.empty(B + 1, H * D, device=dev)

    def one(st, cs):
        kda_decode_fused(x, g_raw, dt_bias, a_log, lb, b_raw, idx, pos, slots, st, cs, cw, tickets, out, D ** -0.5,
                         (gate, nw, 1e-5, y))
        return y[:B]

    def three(st, cs):
        yc, n = short_conv(x, idx, pos.view(B, 1), slots, cs, cw)
        kda_recurrent(yc, g_raw, dt_bias, a_log, lb, b_raw, idx, n, pos, slots, st, out, D ** -0.5)
        return gated_rms_norm(out[:B], gate, nw, 1e-5)

    want = three(pool.clone(), conv.clone())
    got = one(pool.clone(), conv.clone())
    err = ((got - want).abs().max() / want.abs().max()).item()
    nbytes = 2 * B * H * D * D * 4
    rows = []
    for name, fn in (("KDA decode core, conv + recurrence + norm in one launch", one),
                     ("KDA decode core, three launches", three)):
        st, cs = pool.clone(), conv.clone()
        us = _time_us(lambda: fn(st, cs), dev, reps)
        rows.append({"kernel": name, "shape": f"B={B} H={H} D={D} state float32", "max_err": err, "us": us,
                     "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)
    return rows
