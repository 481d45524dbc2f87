"""The fused GPU-path glue between the GEMMs (benchmarks/gpu_kernels.py's steps 4 and 5): RMSNorm with the residual
add, SiLU-GLU, RoPE and the routers' selection; the decode glue of a Qwen3-MoE and an MLA layer (q/k norm + RoPE +
KV write, the softmax router, the MoE k-sum, MLA's latent write); Kimi K3's gated value heads and joined MoE output
GEMM beside the forms they replaced. Errors against the layers' PyTorch math, times, bandwidth over the bytes each
must move."""
from __future__ import annotations

import json

import torch

from benchmarks.gpu_timing import time_us as _time_us


def check_norm_activation(dev, dtype, quick: bool, bw: float, reps: int) -> list[dict]:
    """RMSNorm with the residual add and SiLU-GLU (kernels/gpu/norm_activation.py) at a decode batch of 16 rows
    and a prefill chunk of 2,048 (hidden 4096, intermediate 11008; quick: 5 x 96): error relative to the largest
    output of the layers' PyTorch paths, time, bandwidth over the bytes read and written."""
    from tokenfab.kernels.gpu.norm_activation import rms_norm, rope, silu_and_mul
    hidden, inter = (4096, 11008) if not quick else (96, 80)
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(hidden, device=dev, generator=g).to(dtype)
    rows = []
    for M in ((16, 2048) if not quick else (5,)):
        x = torch.randn(M, hidden, device=dev, generator=g).to(dtype)
        r = torch.randn(M, hidden, device=dev, generator=g).to(dtype)
        y, h = rms_norm(x, w, 1e-6, r)
        hw = r + x
        hf = hw.float()
        want = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        err = max(((y.float() - want.float()).abs().max() / want.float().abs().max()).item(),
                  ((h.float() - hw.float()).abs().max() / hw.float().abs().max()).item())
        us = _time_us(lambda: rms_norm(x, w, 1e-6, r), dev, reps)
        nbytes = 4 * x.numel() * x.element_size()
        rows.append({"kernel": "RMSNorm + residual add", "shape": f"M={M} hidden={hidden}", "max_err": err, "us": us,
                     "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)
        gu = torch.randn(M, 2 * inter, device=dev, generator=g).to(dtype)
        got = silu_and_mul(gu)
        want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        us = _time_us(lambda: silu_and_mul(gu), dev, reps)
        nbytes = 3 * M * inter * gu.element_size()
        rows.append({"kernel": "SiLU-GLU", "shape": f"M={M} I={inter}", "max_err": err, "us": us,
                     "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)
        heads, dim = (32, 128) if not quick else (3, 16)
        q = torch.randn(M, heads, dim, device=dev, generator=g).to(dtype)
        pos = torch.randint(0, 4096, (M,), device=dev, generator=g)
        inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, device=dev).float() / dim))
        ang = torch.outer(torch.arange(4096, device=dev).float(), inv)
        cos, sin = ang.cos(), ang.sin()
        got = rope(q, pos, cos, sin, False)
        c, s = cos[pos].unsqueeze(1).to(dtype), sin[pos].unsqueeze(1).to(dtype)
        q1, q2 = q.chunk(2, dim=-1)
        want = torch.cat([q1 * c - q2 * s, q2 * c + q1 * s], dim=-1)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        us = _time_us(lambda: rope(q, pos, cos, sin, False), dev, reps)
        nbytes = 2 * q.numel() * q.element_size()
        rows.append({"kernel": "RoPE", "shape": f"M={M} heads={heads} dim={dim}", "max_err": err, "us": us,
                     "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)
        rows.append(check_router(dev, M, g, reps, bw))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def check_decode_glue(dev, dtype, quick: bool, bw: float, reps: int) -> list[dict]:
    """The fused GPU-path glue of a Qwen3-MoE layer at Qwen3-30B-A3B's shapes (32 query / 4 KV heads of 128,
    128 experts top 8, hidden 2048; quick: 3 / 1 heads of 16, 8 experts top 2, hidden 96) at 16 and 2,048 tokens:
    q/k RMSNorm + RoPE + KV-cache write (kernels/gpu/rope_cache.py) against the layers' norm, RoPE and
    write_cache; the softmax top-k router (kernels/gpu/router.py) against SoftmaxTopKRouter's PyTorch path (weight
    error where the expert lists agree, 1.0 where not); the MoE k-sum (kernels/gpu/moe.py::moe_sum) against a
    float32 sum; MLA's kv norm + RoPE + latent write at DeepSeek-V3's shape (128 heads, nope 128, rope 64, latent
    512) against the eager norm, rotation and write_cache. Time, and bandwidth over the bytes each must read and
    write."""
    from tokenfab.kernels.gpu.moe import moe_sum
    from tokenfab.kernels.gpu.rope_cache import mla_rope_cache, qk_rope_cache
    from tokenfab.kernels.gpu.router import softmax_topk
    from tokenfab.layers.paged_attention import write_cache
    H, Hk, D, E, k, hidden = (32, 4, 128, 128, 8, 2048) if not quick else (3, 1, 16, 8, 2, 96)
    g = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for M in ((16, 2048) if not quick else (5,)):
        qkv = torch.randn(M, (H + 2 * Hk) * D, device=dev, generator=g).to(dtype)
        q, kk, v = (t.view(M, -1, D) for t in qkv.split([H * D, Hk * D, Hk * D], dim=-1))
        qn, kn = (torch.randn(D, device=dev, generator=g).to(dtype) for _ in range(2))
        pos = torch.randint(0, 4096, (M,), device=dev, generator=g)
        inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D))
        ang = torch.outer(torch.arange(4096, device=dev).float(), inv)
        cos, sin = ang.cos(), ang.sin()
        blocks = -(-M // 16) + 1
        slots = torch.randperm(blocks * 16, device=dev, generator=g)[:M]
        kc, vc = (torch.zeros(blocks, 16, Hk, D, device=dev, dtype=dtype) for _ in range(2))
        got = qk_rope_cache(q, kk, v, pos, cos, sin, False, slots, kc, vc, qn, kn, 1e-6)

        def ref_norm_rope(x, w):
            xf = x.float()
            y = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
            c, s = cos[pos].unsqueeze(1).to(dtype), sin[pos].unsqueeze(1).to(dtype)
            y1, y2 = y.chunk(2, dim=-1)
            return torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], dim=-1)
        want_q, want_k = ref_norm_rope(q, qn), ref_norm_rope(kk, kn)
        kr = torch.zeros_like(kc)
        write_cache(kr, slots, want_k)
        err = max(((got.float() - want_q.float()).abs().max() / want_q.float().abs().max()).item(),
                  ((kc.float() - kr.float()).abs().max() / kr.float().abs().max()).item())
        us = _time_us(lambda: qk_rope_cache(q, kk, v, pos, cos, sin, False, slots, kc, vc, qn, kn, 1e-6), dev, reps)
        nbytes = 2 * qkv.numel() * qkv.element_size()
        rows.append({"kernel": "q/k norm + RoPE + KV write", "shape": f"M={M} H={H} Hk={Hk} D={D}", "max_err": err,
                     "us": us, "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)

        mh, mn, mr, mc = (128, 128, 64, 512) if not quick else (3, 16, 16, 32)  # DeepSeek-V3's MLA
        mq = torch.randn(M, mh, mn + mr, device=dev, generator=g).to(dtype)
        ma = torch.randn(M, mc + mr, device=dev, generator=g).to(dtype)
        mw = torch.randn(mc, device=dev, generator=g).to(dtype)
        mang = torch.outer(torch.arange(4096, device=dev).float(),
                           1.0 / (1e4 ** (torch.arange(0, mr, 2, device=dev).float() / mr)))
        mcos, msin = mang.cos(), mang.sin()
        lat = torch.zeros(blocks, 16, mc + mr, device=dev, dtype=dtype)
        got = mla_rope_cache(mq, ma[:, :mc], ma[:, mc:], mw, 1e-6, pos, mcos, msin, False, slots, lat)
        c, s_ = mcos[pos].to(dtype), msin[pos].to(dtype)

        def rot(x, c, s_):
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1)
        want_q = torch.cat([mq[..., :mn], rot(mq[..., mn:], c.unsqueeze(1), s_.unsqueeze(1))], dim=-1)
        cf = ma[:, :mc].float()
        want_row = torch.cat([mw * (cf * torch.rsqrt(cf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype),
                              rot(ma[:, mc:], c, s_)], dim=-1)
        lr = torch.zeros_like(lat)
        write_cache(lr, slots, want_row)
        err = max(((got.float() - want_q.float()).abs().max() / want_q.float().abs().max()).item(),
                  ((lat.float() - lr.float()).abs().max() / lr.float().abs().max()).item())
        us = _time_us(lambda: mla_rope_cache(mq, ma[:, :mc], ma[:, mc:], mw, 1e-6, pos, mcos, msin, False, slots,
                                             lat), dev, reps)
        nbytes = 2 * (mq.numel() + ma.numel()) * mq.element_size()
        rows.append({"kernel": "MLA kv norm + RoPE + latent write", "shape": f"M={M} H={mh} C={mc} R={mr}",
                     "max_err": err, "us": us, "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)
        if M <= 256:  # decode batches: gated MLA's value heads (K3: 96 heads, latent 512, v 128), K3's MoE output
            rows += _value_gate_rows(dev, dtype, quick, M, g, reps, bw)
            rows += _joined_out_rows(dev, dtype, quick, M, g, reps, bw)
            for heads in ((128, 16) if not quick else (3,)):  # one GPU's heads, and a rank's under tensor parallel 8
                for tokens in (1, M):
                    for fp8 in (False, True):  # q_b in bf16, and FP8 block-scaled as DeepSeek-V3 ships it
                        rows += _query_chain_rows(dev, dtype, quick, tokens, heads, g, reps, bw, fp8)

        logits = torch.randn(M, E, device=dev, generator=g).to(dtype)
        w, ids = softmax_topk(logits, k, True)
        p_ref = torch.softmax(logits, -1, dtype=torch.float32)
        w_ref, ids_ref = p_ref.topk(k, dim=-1)
        w_ref = (w_ref / w_ref.sum(-1, keepdim=True)).to(dtype)
        err = (w.float() - w_ref.float()).abs().max().item() if torch.equal(ids, ids_ref) else 1.0
        us = _time_us(lambda: softmax_topk(logits, k, True), dev, reps)
        nbytes = logits.numel() * logits.element_size() + M * k * (8 + logits.element_size())
        rows.append({"kernel": f"softmax top-k router ({E} experts)", "shape": f"T={M} k={k}", "max_err": err,
                     "us": us, "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)

        pairs = torch.randn(M * k, hidden, device=dev, generator=g)
        ids = torch.randint(0, E, (M, k), device=dev, generator=g)
        got = moe_sum(pairs, ids, 0, E, dtype)
        want = pairs.view(M, k, hidden).sum(1).to(dtype)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        us = _time_us(lambda: moe_sum(pairs, ids, 0, E, dtype), dev, reps)
        nbytes = pairs.numel() * 4 + got.numel() * got.element_size()
        rows.append({"kernel": "MoE k-sum", "shape": f"T={M} k={k} hidden={hidden}", "max_err": err, "us": us,
                     "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _value_gate_rows(dev, dtype, quick: bool, M: int, g, reps: int, bw: float) -> list[dict]:
    """Gated MLA's value heads at Kimi K3's shape (96 heads, latent 512, v 128; quick: 3 / 32 / 24) for M tokens:
    o_lat W_UV with the output gate in one Triton launch (kernels/gpu/mla_decode_glue.py ``mla_value_gate``, as K3's
    decode runs it) against cuBLAS's batched GEMM then the gate's launch (``torch.bmm`` + ``sigmoid_mul``, the form it
    replaced); error of the one launch relative to the two's largest output, time of both, bandwidth over W_UV's
    bytes plus the activations'."""
    from tokenfab.kernels.gpu.mla_decode_glue import mla_value_gate
    from tokenfab.kernels.gpu.norm_activation import sigmoid_mul
    H, C, V = (96, 512, 128) if not quick else (3, 32, 24)
    o_lat = torch.randn(M, H, C, device=dev, generator=g).to(dtype)
    w = (torch.randn(H, C, V, device=dev, generator=g) / C ** 0.5).to(dtype)
    gate = torch.randn(M, H * V, device=dev, generator=g).to(dtype)

    def two():
        o = torch.empty(M, H, V, device=dev, dtype=dtype)
        torch.bmm(o_lat.transpose(0, 1), w, out=o.transpose(0, 1))
        return sigmoid_mul(o.view(M, H * V), gate)
    want = two().float()
    err = ((mla_value_gate(o_lat, w, gate).float().view(M, -1) - want).abs().max() / want.abs().max()).item()
    nbytes = (w.numel() + o_lat.numel() + 2 * gate.numel()) * w.element_size()
    rows = []
    for name, fn in (("gated MLA value heads + gate, one launch", lambda: mla_value_gate(o_lat, w, gate)),
                     ("gated MLA value heads, bmm + gate launch", two)):
        us = _time_us(fn, dev, reps)
        rows.append({"kernel": name, "shape": f"T={M} H={H} C={C} v={V}", "max_err": err, "us": us,
                     "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _query_chain_rows(dev, dtype, quick: bool, M: int, H: int, g, reps: int, bw: float,
                      fp8: bool = False) -> list[dict]:
    """MLA's decode queries at DeepSeek-V3's shape (q_lora 1536, nope 128, rope 64, latent 512; quick: 128 / 16 / 8
    / 40) for M tokens and H heads: q_a norm, the q_b GEMM, the absorbed queries and the latent write in one launch
    (kernels/gpu/mla_query_chain.py, as the MLA decode runs it) against the three launches it replaced (the norms
    with the latent write, the q_b GEMM: cuBLAS's, or with ``fp8`` the FP8 block-scaled linear on e4m3 codes, the
    absorbed queries: kernels/gpu/mla_decode_glue.py); error relative to the three's largest query, time of both,
    bandwidth over W_qb's (packed) and W_UK's bytes plus the activations'."""
    from tokenfab.kernels import dispatch
    from tokenfab.kernels.gpu import fp8_linear
    from tokenfab.kernels.gpu.mla_decode_glue import mla_latent_query, mla_norms_cache
    from tokenfab.kernels.gpu.mla_query_chain import mla_queries_cache
    QL, nope, R, C = (1536, 128, 64, 512) if not quick else (128, 16, 8, 40)
    a_out = torch.randn(M, QL + C + R, device=dev, generator=g).to(dtype)
    q_a, c_kv, k_rope = a_out.split([QL, C, R], dim=-1)
    qw, kw = (torch.rand(QL, device=dev, generator=g) + 0.5).to(dtype), (torch.rand(C, device=dev, generator=g)
                                                                          + 0.5).to(dtype)
    w_qb = (torch.randn(H * (nope + R), QL, device=dev, generator=g) / QL ** 0.5).to(dtype)
    scale = None
    if fp8:  # e4m3 codes of about unit size, the 1 / sqrt(QL) in the block scales
        w_qb = (w_qb.float() * QL ** 0.5).to(torch.float8_e4m3fn)
        scale = torch.full((-(-w_qb.shape[0] // 128), -(-QL // 128)), QL ** -0.5, device=dev)
    w_uk = (torch.randn(H, nope, C, device=dev, generator=g) / nope ** 0.5).to(dtype)
    ang = torch.outer(torch.arange(4096, device=dev).float(),
                      1.0 / (1e4 ** (torch.arange(0, R, 2, device=dev).float() / R)))
    cos, sin = ang.cos(), ang.sin()
    pos = torch.randint(0, 4096, (M,), device=dev, generator=g)
    slots = torch.randperm(M * 4, device=dev, generator=g)[:M]
    cache = torch.zeros(M * 4 // 16 + 1, 16, C + R, device=dev, dtype=dtype)

    tickets = torch.zeros(H * 4, dtype=torch.int32, device=dev)

    def three(exact: bool = False):  # exact: FP8 through the Triton kernel (activations kept, as the chain keeps
        q_n = mla_norms_cache(q_a, c_kv, k_rope, qw, kw, 1e-6, 1e-6, pos, cos, sin, True, slots, cache)  # them)
        if scale is None:
            q = torch.nn.functional.linear(q_n, w_qb)
        elif exact:
            q = fp8_linear.fp8_block_linear(q_n, w_qb, scale, split=1)
        else:  # what the layer's FP8 linear runs (block-scaled scaled_mm where its probe passed)
            q = dispatch.fp8_block_linear(q_n, w_qb, scale, None, False)
        return mla_latent_query(q.view(M, H, nope + R), w_uk, pos, cos, sin, True)

    def one():
        return mla_queries_cache(q_a, c_kv, k_rope, qw, kw, 1e-6, 1e-6, w_qb, w_uk, pos, cos, sin, True, slots, cache,
                                 tickets=tickets, qb_scale=scale)
    want = three(exact=True).float()
    err = ((one().float() - want).abs().max() / want.abs().max()).item()
    nbytes = (w_qb.numel() * w_qb.element_size() + (w_uk.numel() + a_out.numel() + M * H * (C + R) + M * (C + R))
              * w_uk.element_size())
    rows = []
    q_b = "FP8 q_b" if fp8 else "q_b"
    for name, fn in ((f"MLA queries ({q_b}) + latent write, one launch", one),
                     (f"MLA queries ({q_b}) + latent write, three launches", three)):
        us = _time_us(fn, dev, reps)
        rows.append({"kernel": name, "shape": f"T={M} H={H} q_lora={QL} nope={nope} C={C} R={R}", "max_err": err,
                     "us": us, "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _joined_out_rows(dev, dtype, quick: bool, M: int, g, reps: int, bw: float) -> list[dict]:
    """Kimi K3's latent MoE output at its shape (latent 3584, two shared experts of 3072, hidden 7168; quick: 24 /
    40 / 32) for M tokens: one GEMM over [normed latent | shared SiTU-GLU] with [W_up | W_shared_down] adding into
    the residual (models/kimi_moe.py ``KimiMoE.out_proj``) against the two beta = 1 GEMMs it replaced; error
    relative to the two's largest output, time of both, bandwidth over the weights' bytes."""
    L, I, H = (3584, 6144, 7168) if not quick else (24, 40, 32)
    z = torch.randn(M, L + I, device=dev, generator=g).to(dtype)
    w = (torch.randn(H, L + I, device=dev, generator=g) / (L + I) ** 0.5).to(dtype)
    w_up, w_down = w[:, :L].contiguous(), w[:, L:].contiguous()
    res = torch.randn(M, H, device=dev, generator=g).to(dtype)
    one = lambda r: r.addmm_(z, w.t())  # noqa: E731
    two = lambda r: r.addmm_(z[:, :L], w_up.t()).addmm_(z[:, L:], w_down.t())  # noqa: E731
    want = two(res.clone()).float()
    err = ((one(res.clone()).float() - want).abs().max() / want.abs().max()).item()
    nbytes = w.numel() * w.element_size()
    rows = []
    for name, fn in (("K3 MoE output, one GEMM over [latent | shared]", one),
                     ("K3 MoE output, two beta = 1 GEMMs", two)):
        r = res.clone()
        us = _time_us(lambda: fn(r), dev, reps)
        rows.append({"kernel": name, "shape": f"T={M} K={L}+{I} N={H}", "max_err": err, "us": us, "bytes": nbytes,
                     "bw_fraction": nbytes / (us * 1e-6) / bw})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def check_router(dev, M: int, g, reps: int, bw: float) -> dict:
    """DeepSeek-V3's router selection (kernels/gpu/router.py: 256 experts in 8 groups, 4 kept, top 8) after the
    router GEMM against SigmoidGroupRouter's PyTorch path: the max weight error over tokens whose expert sets agree
    (1.0 where any set differs), time of the selection alone."""
    from tokenfab.kernels import dispatch
    from tokenfab.kernels.gpu.router import sigmoid_group_topk
    from tokenfab.layers.moe import SigmoidGroupRouter
    r = SigmoidGroupRouter(64, 256, 8, 8, 4, True, 2.5).to(dev)
    r.weight.data = torch.randn(256, 64, device=dev, generator=g)
    r.e_score_correction_bias.data = torch.randn(256, device=dev, generator=g) * 0.1
    x = torch.randn(M, 64, device=dev, generator=g)
    logits = torch.nn.functional.linear(x, r.weight)
    w, ids = sigmoid_group_topk(logits, r.e_score_correction_bias, 8, 4, 8, True, 2.5)
    saved = dispatch.sigmoid_group_topk
    dispatch.sigmoid_group_topk = lambda *a, **k: None
    try:
        w_ref, ids_ref = r(x)
    finally:
        dispatch.sigmoid_group_topk = saved
    o, o_ref = ids.argsort(1), ids_ref.argsort(1)
    same = torch.equal(ids.gather(1, o), ids_ref.gather(1, o_ref))
    err = (w.gather(1, o) - w_ref.gather(1, o_ref)).abs().max().item() if same else 1.0
    us = _time_us(lambda: sigmoid_group_topk(logits, r.e_score_correction_bias, 8, 4, 8, True, 2.5), dev, reps)
    nbytes = logits.numel() * 4 + M * 8 * 12
    return {"kernel": "router selection (256 experts, 8 groups)", "shape": f"T={M}", "max_err": err, "us": us,
            "bytes": nbytes, "bw_fraction": nbytes / (us * 1e-6) / bw}
