"""The fused CPU kernels (tokenfab/kernels) against independent float64 references and the PyTorch paths they
replace. Skipped only when the extension cannot be built here (no compiler); CI builds it."""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.cpu import build as cpu_build
from tokenfab.kernels.cpu.ops import attention as cpu_attention
from tokenfab.kernels.cpu.ops import head_gemm as cpu_head_gemm
from tokenfab.kernels.cpu.ops import norms_activations as cpu_norms
from tokenfab.kernels.cpu.ops import rotary as cpu_rotary
from tokenfab.kernels.cpu.ops import support as cpu_support

pytestmark = pytest.mark.skipif(cpu_build.load() is None,
                                reason=f"CPU kernels not built: {cpu_build.load_error()}")


def _paged_case(B, H, Hk, D, Dv, bs, lens, dtype, latent=False, seed=0):
    """Random paged pool with shuffled block ids; returns q, k_cache, v_cache, block_tables, context_lens."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max((n + bs - 1) // bs for n in lens)
    nb = B * max_blocks + 3
    perm = torch.randperm(nb, generator=g)
    bt = perm[: B * max_blocks].view(B, max_blocks).clone()
    q = torch.randn(B, H, D, generator=g).to(dtype)
    if latent:  # MLA: one pool [nb, bs, D], values = its first Dv columns
        pool = torch.randn(nb, bs, 1, D, generator=g).to(dtype)
        k_cache, v_cache = pool, pool[..., :Dv]
    else:
        k_cache = torch.randn(nb, bs, Hk, D, generator=g).to(dtype)
        v_cache = torch.randn(nb, bs, Hk, Dv, generator=g).to(dtype)
    return q, k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.int64)


def _reference_attention(q, k_cache, v_cache, bt, lens, scale):
    """float64 softmax(scale q k^T) v per sequence, written from the definition."""
    B, H, _ = q.shape
    Hk, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty(B, H, v_cache.shape[-1], dtype=torch.float64)
    for b in range(B):
        L = int(lens[b])
        blocks, offs = bt[b, torch.arange(L) // bs], torch.arange(L) % bs
        k = k_cache[blocks, offs].double()  # [L, Hk, D]
        v = v_cache[blocks, offs].double()
        for h in range(H):
            kh = h // (H // Hk)
            p = torch.softmax(scale * (k[:, kh] @ q[b, h].double()), 0)
            out[b, h] = p @ v[:, kh]
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", ["gqa", "odd", "peaked", "mha_b1", "mla"])
def test_paged_decode_attention_matches_definition(dtype, tol, case):
    sharpen = 1.0
    if case == "gqa":  # 12 query heads over 4 KV heads, ragged lengths crossing block boundaries
        args = dict(B=5, H=12, Hk=4, D=64, Dv=64, bs=16, lens=[1, 16, 17, 40, 100])
    elif case == "odd":  # head dims and a block size that are no multiple of a vector, 5 query heads per KV head
        args = dict(B=3, H=10, Hk=2, D=40, Dv=20, bs=12, lens=[1, 13, 50])
    elif case == "peaked":  # scores over a wide range: the running max moves between blocks; Dv = 1.5 vectors
        args = dict(B=2, H=6, Hk=2, D=72, Dv=56, bs=16, lens=[37, 90])
        sharpen = 6.0
    elif case == "mha_b1":  # one sequence: the kernel splits heads across threads
        args = dict(B=1, H=8, Hk=8, D=32, Dv=32, bs=8, lens=[33])
    else:  # MLA absorbed decode: one latent head of 576, values its first 512 columns
        args = dict(B=3, H=8, Hk=1, D=576, Dv=512, bs=16, lens=[5, 64, 130], latent=True)
    q, kc, vc, bt, lens = _paged_case(dtype=dtype, **args)
    scale = sharpen * args["D"] ** -0.5
    out = cpu_attention.paged_decode_attention(q, kc, vc, bt, lens, scale)
    assert out.shape == (args["B"], args["H"], args["Dv"]) and out.dtype == dtype
    ref = _reference_attention(q, kc, vc, bt, lens, scale)
    assert (out.double() - ref).abs().max().item() < tol


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("lens", [[5], [33], [300]], ids=["one-block", "3-blocks", "19-blocks"])
def test_mla_decode_attention_context_splits_match_definition(threads, lens):
    """With fewer sequences than threads the bf16 kernel splits MLA's shared latent context across threads and
    merges the partial softmax states: a context of one block leaves a split empty."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kc, vc, bt, cl = _paged_case(B=1, H=8, Hk=1, D=576, Dv=512, bs=16, lens=lens, dtype=torch.bfloat16,
                                        latent=True, seed=len(lens) + lens[0])
        out = cpu_attention.paged_decode_attention(q, kc, vc, bt, cl, 576 ** -0.5)
    finally:
        torch.set_num_threads(prev)
    ref = _reference_attention(q, kc, vc, bt, cl, 576 ** -0.5)
    assert (out.double() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("pool", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["gqa", "odd", "mla"])
def test_paged_decode_attention_float32_q_over_a_narrower_pool(pool, case):
    """float32 q over a bf16 / fp16 KV pool (EngineConfig.kv_cache_dtype): the pool's rows are widened exactly, so
    the result is float32 attention over the pool's values (reference: the definition in float64 on them), with
    head dims and a block size that are no multiple of a vector and MLA's shared latent rows."""
    args = {"gqa": dict(B=5, H=12, Hk=4, D=64, Dv=64, bs=16, lens=[1, 16, 17, 40, 100]),
            "odd": dict(B=3, H=10, Hk=2, D=40, Dv=20, bs=12, lens=[1, 13, 50]),
            "mla": dict(B=3, H=8, Hk=1, D=576, Dv=512, bs=16, lens=[5, 64, 130], latent=True)}[case]
    q, kc, vc, bt, lens = _paged_case(dtype=torch.float32, **args)
    if args.get("latent"):
        kc = kc.to(pool)
        vc = kc[..., :args["Dv"]]
    else:
        kc, vc = kc.to(pool), vc.to(pool)
    scale = args["D"] ** -0.5
    out = cpu_attention.paged_decode_attention(q, kc, vc, bt, lens, scale)
    assert out.dtype == torch.float32
    assert (out.double() - _reference_attention(q, kc, vc, bt, lens, scale)).abs().max().item() < 1e-5


def test_paged_decode_attention_refuses_other_dtype_mixes():
    q, kc, vc, bt, lens = _paged_case(B=1, H=2, Hk=1, D=16, Dv=16, bs=8, lens=[5], dtype=torch.float32)
    with pytest.raises(RuntimeError, match="float32 q over a bf16 / fp16"):
        cpu_attention.paged_decode_attention(q.bfloat16(), kc, vc, bt, lens, 0.25)  # bf16 q over a float32 pool
    with pytest.raises(RuntimeError, match="float32 q over a bf16 / fp16"):
        cpu_attention.paged_decode_attention(q, kc.bfloat16(), vc.half(), bt, lens, 0.25)  # k and v differ


@pytest.mark.parametrize("dtype,D", [(torch.float32, 16), (torch.bfloat16, 32)])
def test_paged_decode_attention_reads_only_the_context(dtype, D):
    """Tokens past context_lens (garbage in the last block) must not change the result (odd lengths: the bf16 path
    pairs tokens)."""
    q, kc, vc, bt, lens = _paged_case(B=2, H=4, Hk=2, D=D, Dv=D, bs=8, lens=[5, 11], dtype=dtype)
    a = cpu_attention.paged_decode_attention(q, kc, vc, bt, lens, 0.25)
    kc[bt[0, 0], 5:] = 1e4
    vc[bt[1, 1], 3:] = float("nan")
    b = cpu_attention.paged_decode_attention(q, kc, vc, bt, lens, 0.25)
    assert torch.equal(a, b)


def test_rms_norm_matches_pytorch_order():
    from tokenfab.layers.norm import RMSNorm
    torch.manual_seed(0)
    x = (torch.randn(7, 384) * 3).to(torch.bfloat16)
    r = torch.randn(7, 384).to(torch.bfloat16)
    w = (torch.rand(384) + 0.5).to(torch.bfloat16)
    h = x.float()
    ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)  # transformers' order
    out = cpu_norms.rms_norm(x, w, 1e-6)
    # identical up to one bf16 ulp where the float32 sum order flips a rounding
    assert (out.float() - ref.float()).abs().max().item() <= 2 ** -7 * ref.float().abs().max().item()
    assert (out == ref).float().mean().item() > 0.99
    y, s = cpu_norms.rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(s, x + r)
    norm = RMSNorm(384)
    norm.weight.data = w
    assert torch.equal(y, norm(x + r))  # the module takes the same kernel
    x32 = torch.randn(3, 64)
    ref32 = x32 / torch.sqrt(x32.double().pow(2).mean(-1, keepdim=True) + 1e-5).float()
    assert torch.allclose(cpu_norms.rms_norm(x32, torch.ones(64), 1e-5), ref32, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_pytorch(dtype):
    torch.manual_seed(1)
    x = (torch.randn(9, 2 * 100) * 4).to(dtype)
    ref = torch.nn.functional.silu(x[:, :100]) * x[:, 100:]
    out = cpu_norms.silu_and_mul(x)
    if dtype == torch.float32:
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    else:
        assert (out == ref).float().mean().item() > 0.99
        assert (out.float() - ref.float()).abs().max().item() <= 2 ** -7 * ref.float().abs().max().item()


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_definition(interleave, dtype):
    torch.manual_seed(2)
    T, H, dim, P = 6, 3, 16, 50
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).double() / dim))
    freqs = torch.outer(torch.arange(P).double(), inv)
    cos, sin = freqs.cos().float(), freqs.sin().float()
    base = torch.randn(T, H, dim + 8).to(dtype)
    x = base[..., 4:4 + dim]  # a strided view, as MLA's q_rope slice is
    pos = torch.tensor([0, 3, 7, 8, 20, 49])
    out = cpu_rotary.rope(x, pos, cos, sin, interleave)
    xd = x.double()
    x1, x2 = (xd[..., 0::2], xd[..., 1::2]) if interleave else (xd[..., : dim // 2], xd[..., dim // 2:])
    c, s = freqs.cos()[pos].unsqueeze(1), freqs.sin()[pos].unsqueeze(1)
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    assert (out.double() - ref).abs().max().item() < tol


def test_fallback_when_disabled(monkeypatch):
    """The layers keep their PyTorch paths when the kernels are off; both agree on a decode-shaped MLA step."""
    from tokenfab.layers import paged_attention
    q, kc, vc, bt, lens = _paged_case(B=2, H=4, Hk=1, D=40, Dv=32, bs=4, lens=[6, 9], dtype=torch.float32,
                                      latent=True)
    from tokenfab.layers.attention_metadata import AttentionGroup
    group = AttentionGroup(token_index=torch.arange(2).view(2, 1), query_pos=(lens - 1).view(2, 1),
                           block_tables=bt, context_lens=lens, q_len=1, max_context=bt.shape[1] * 4)
    fused = paged_attention.fused_decode(q, kc, vc, group, 0.3)
    monkeypatch.setattr(cpu_support, "available_for", lambda x: False)
    assert paged_attention.fused_decode(q, kc, vc, group, 0.3) is None
    ctx = paged_attention.gather_cache(kc[:, :, 0], group).unsqueeze(1)
    eager = paged_attention.attention(q.unsqueeze(2), ctx, ctx, group, 0.3)[:, :, 0, :32]
    assert torch.allclose(fused, eager, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_causal_softmax_matches_masked_softmax(dtype, tol):
    """Rows stacked as (head of the KV group, query); positions ragged with a padded query (-1)."""
    torch.manual_seed(3)
    B, Hx, G, Qb, L = 2, 3, 2, 5, 12
    s = (torch.randn(B, Hx, G * Qb, L) * 4).to(dtype)
    qpos = torch.tensor([[3, 4, 5, 6, 7], [7, 8, 9, 10, -1]])
    scale = 0.37
    keys = torch.arange(L)
    visible = keys.view(1, 1, L) <= qpos.clamp(min=0).unsqueeze(-1)  # [B, Qb, L]
    visible = visible.repeat(1, G, 1).unsqueeze(1)  # rows g * Qb + i
    ref = torch.softmax((s.double() * scale).masked_fill(~visible, float("-inf")), -1)
    out = cpu_attention.causal_softmax_(s.clone(), qpos, Qb, scale)
    assert (out.double() - ref).abs().max().item() < tol
    assert (out[~visible.expand_as(out)] == 0).all()


def test_fused_prefill_attention_matches_sdpa():
    """The fused prefill path (GEMMs + causal softmax) against SDPA with the causal mask, GQA and chunked context."""
    from tokenfab.layers import paged_attention as PA
    from tokenfab.layers.attention_metadata import AttentionGroup
    torch.manual_seed(4)
    B, H, Hk, Q, D, L = 2, 6, 2, 300, 16, 340  # two query blocks; sequence 1 has 40 cached tokens before the chunk
    q, k, v = torch.randn(B, H, Q, D), torch.randn(B, Hk, L, D), torch.randn(B, Hk, L, D)
    qpos = torch.stack([torch.arange(Q), torch.arange(Q) + 40])
    qpos[0, 290:] = -1  # sequence 0 has a shorter chunk (padding)
    g = AttentionGroup(token_index=torch.zeros(B, Q, dtype=torch.long), query_pos=qpos, block_tables=None,
                       context_lens=torch.tensor([290, 340]), q_len=Q, max_context=L)
    fused = PA._prefill_attention_fused(q, k, v, g, 0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=PA.additive_mask(g, q.dtype),
                                                           scale=0.25, enable_gqa=True)
    assert (fused - ref)[0, :, :290].abs().max().item() < 1e-5
    assert (fused - ref)[1].abs().max().item() < 1e-5


def test_rmsnorm_module_residual_same_with_and_without_kernel(monkeypatch):
    """RMSNorm(x, residual) = (norm(residual + x), residual + x), identical on the fused and the PyTorch path."""
    from tokenfab.layers.norm import RMSNorm
    torch.manual_seed(5)
    norm = RMSNorm(96).to(torch.bfloat16)
    norm.weight.data = (torch.rand(96) + 0.5).to(torch.bfloat16)
    x, r = torch.randn(6, 96).to(torch.bfloat16), torch.randn(6, 96).to(torch.bfloat16)
    y1, h1 = norm(x, r)
    monkeypatch.setattr(cpu_support, "available_for", lambda t: False)
    y2, h2 = norm(x, r)
    assert torch.equal(h1, r + x) and torch.equal(h2, r + x)
    assert (y1.float() - y2.float()).abs().max().item() <= 2 ** -7 * y2.float().abs().max().item()


@pytest.mark.skipif(not cpu_support.has_bf16_dot(), reason="head_gemm_ needs AVX512-BF16")
@pytest.mark.parametrize("G,K,N", [(8, 64, 512), (3, 512, 64), (2, 32, 48), (4, 16, 24), (2, 8, 70)])
@pytest.mark.parametrize("B", [1, 3, 5, 16])
def test_head_gemm_matches_definition(G, K, N, B):
    """out[b, g] = x[b, g] @ W_g against float64, with a strided x (a column slice) and out written into the first N
    columns of a wider buffer whose other columns must stay untouched; at most one bf16 rounding off."""
    g = torch.Generator().manual_seed(G * 1000 + K + B)
    w = torch.randn(G, K, N, generator=g).bfloat16()
    x = torch.randn(B, G, K + 7, generator=g).bfloat16()[..., 3: 3 + K]
    buf = torch.full((B, G, N + 16), 7.0, dtype=torch.bfloat16)
    out = cpu_head_gemm.head_gemm_(x, cpu_head_gemm.pack_head_weights(w), buf[..., :N])
    ref = torch.einsum("bgk,gkn->bgn", x.double(), w.double())
    assert out.data_ptr() == buf.data_ptr()
    assert ((out.double() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-3 * ref.abs().max()).all()
    assert (buf[..., N:] == 7.0).all()


@pytest.mark.skipif(not cpu_support.has_bf16_dot(), reason="head_gemm_ needs AVX512-BF16")
def test_mla_absorbed_decode_head_gemm_matches_bmm(tiny_model, monkeypatch):
    """bf16 DeepSeek-V3 decode with the packed per-head GEMM vs the torch.bmm path: same greedy tokens and
    logprobs equal up to bf16 rounding of the two projections."""
    from tokenfab import LLM, SamplingParams
    path = tiny_model("deepseek_v3")
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [5 + 13 * i + j for j in range(20 + 9 * i)]} for i in range(3)]
    llm = LLM(path, dtype="bfloat16", max_model_len=128, progress=False)
    fused = llm.generate(prompts, sp)
    assert any(getattr(m, "_head_gemm", False) for m in llm.llm_engine.runner.model.modules())
    monkeypatch.setattr(cpu_head_gemm, "head_gemm_applies", lambda x, w: False)
    plain = LLM(path, dtype="bfloat16", max_model_len=128, progress=False).generate(prompts, sp)
    for a, b in zip(fused, plain):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert ta == tb
        for da, db, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, ta):
            assert abs(da[t].logprob - db[t].logprob) < 0.05
