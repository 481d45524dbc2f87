"""MLA's decode queries and latent write in one launch (kernels/gpu/mla_query_chain.py) in Triton's interpreter on
CPU, against PyTorch written here as layers/mla.py's reference path runs it: q_a_layernorm (layers/norm.py's
rounding), the q_b projection rounded to the dtype, q_nope W_UK as ``torch.bmm``, RoPE through layers/rotary.py's
RotaryEmbedding (seam off), the latent row as layers/paged_attention.py's write_cache stores it.

float32 agrees to float32 rounding (sums in another order). bf16: the interpreter truncates float32 to bf16 where
GPUs round to nearest, so each rounding of the chain may be an ulp off: checked within 8 ulps of the magnitudes
involved, as tests/test_triton_mla_decode_glue.py does (a wrong row, head, table entry or weight moves values by
far more). Pool rows not named by a slot stay untouched.
"""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels import dispatch
from tokenfab.kernels.gpu import support as triton_support
from test_triton_mla_decode_glue import close, rms, rotary

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def reference(q_a, c_kv, k_rope, qw, kw, w_qb, w_uk, positions, rot, mode, slots, cache):
    """The three-step reference: (q_lat [T, H, C + R], the pool after the latent write)."""
    from tokenfab.layers.paged_attention import write_cache
    T, dtype = q_a.shape[0], q_a.dtype
    H, nope, C = w_uk.shape
    R = k_rope.shape[1]
    q = (rms(q_a, qw, 1e-6).float() @ w_qb.float().t()).to(dtype).view(T, H, nope + R)
    q_nope, q_rope = q.split([nope, R], dim=-1)
    lat = torch.bmm(q_nope.transpose(0, 1).float(), w_uk.float()).transpose(0, 1).to(dtype)
    k_ref = k_rope
    if mode != "nope":
        q_rope, k_ref = rot(positions, q_rope, k_rope.unsqueeze(1))
        k_ref = k_ref.squeeze(1)
    want_cache = cache.clone()
    keep = slots >= 0
    write_cache(want_cache, slots[keep], torch.cat([rms(c_kv, kw, 1e-5), k_ref], dim=-1)[keep])
    return torch.cat([lat, q_rope], dim=-1), want_cache


@pytest.mark.parametrize("T,H,QL,nope,C,R,split", [
    (5, 2, 24, 16, 40, 6, None),   # odd widths, a partial latent tile, one program a head
    (19, 3, 72, 24, 96, 8, 2),     # two token tiles (the second partial), q_lora past one K tile, q_nope split 2
    (3, 1, 32, 64, 200, 10, 4),    # q_nope over 4 programs of 16 columns, 4 latent tiles
    (2, 2, 16, 16, 64, 0, 1),      # no rope slice
    (40, 2, 24, 32, 40, 6, 2),     # one 64-token tile: the latent rows written 16 at a time, the last block partial
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["half", "interleave", "nope"])
def test_chain_matches_norm_gemm_bmm_rope_and_write(interpret, monkeypatch, T, H, QL, nope, C, R, split, dtype,
                                                      mode):
    """Against the reference steps; with a split, the tickets are left zero and a second call over the same
    tickets gives the same bits (the ticket reset)."""
    from tokenfab.kernels.gpu.mla_query_chain import mla_queries_cache
    monkeypatch.setattr(dispatch, "rope", lambda *a, **kw: None)
    g = torch.Generator().manual_seed(T * 100 + C + R)
    a_out = (torch.randn(T, QL + C + R + 3, generator=g) * 2).to(dtype)  # the fused a-projection's output (+ extra)
    q_a, c_kv, k_rope, _ = a_out.split([QL, C, R, 3], dim=-1)
    qw = (torch.rand(QL, generator=g) + 0.5).to(dtype)
    kw = (torch.rand(C, generator=g) + 0.5).to(dtype)
    w_qb = (torch.randn(H * (nope + R), QL, generator=g) / QL ** 0.5).to(dtype)
    w_uk = (torch.randn(H, nope, C, generator=g) / nope ** 0.5).to(dtype)
    positions = torch.arange(T) * 37 % 256
    blocks, page = 16, 4
    slots = torch.randperm(blocks * page, generator=g)[:T]
    slots[T // 2] = -1  # a row that owns no slot: written nowhere
    cache = torch.full((blocks, page, C + R), 9.0, dtype=dtype)
    rot = rotary(max(R, 2), mode == "interleave")
    tables = (None, None) if mode == "nope" else (rot.cos, rot.sin)
    if R == 0 and mode != "nope":
        tables = (rot.cos[:, :0], rot.sin[:, :0])
    want_q, want_cache = reference(q_a, c_kv, k_rope, qw, kw, w_qb, w_uk, positions, rot,
                                   "nope" if R == 0 else mode, slots, cache)
    tickets = torch.zeros(H * 4, dtype=torch.int32)
    got = mla_queries_cache(q_a, c_kv, k_rope, qw, kw, 1e-6, 1e-5, w_qb, w_uk, positions, *tables,
                            mode == "interleave", slots, cache, tickets=tickets, d_split=split)
    close(got, want_q, dtype)
    close(cache, want_cache, dtype)
    assert not tickets.any()
    again = mla_queries_cache(q_a, c_kv, k_rope, qw, kw, 1e-6, 1e-5, w_qb, w_uk, positions, *tables,
                              mode == "interleave", slots, cache, tickets=tickets, d_split=split)
    assert torch.equal(again, got)
    assert got.stride(-1) == 1 and got.transpose(0, 1).is_contiguous()  # head-major buffer, token-major view
    assert want_q.abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 2])
def test_fp8_q_b_matches_its_dequantized_weight(interpret, dtype, split):
    """q_b_proj as DeepSeek-V3's FP8 checkpoints ship it (e4m3 codes, a float32 scale per 128 x 128 block): the
    chain against the reference on the dequantized weight (code x its block's scale, in float32), over 144 rows
    (two row blocks, a head across the boundary) and 192 inputs (a partial second block), interleaved RoPE."""
    from tokenfab.kernels.gpu.mla_query_chain import mla_queries_cache
    g = torch.Generator().manual_seed(8)
    T, H, QL, nope, C, R = 5, 3, 192, 32, 72, 16
    rows = H * (nope + R)
    codes = (torch.randn(rows, QL, generator=g) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2, generator=g) / 40 + 0.01
    deq = codes.float() * scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :QL]
    q_a, c_kv, k_rope = (torch.randn(T, n, generator=g).to(dtype) for n in (QL, C, R))
    qw, kw = (torch.rand(QL, generator=g) + 0.5).to(dtype), (torch.rand(C, generator=g) + 0.5).to(dtype)
    w_uk = (torch.randn(H, nope, C, generator=g) / nope ** 0.5).to(dtype)
    positions, slots = torch.arange(T) * 5, torch.arange(T) + 2
    rot = rotary(R, True)
    cache = torch.zeros(4, 4, C + R, dtype=dtype)
    want_q, want_cache = reference(q_a, c_kv, k_rope, qw, kw, deq, w_uk, positions, rot, "interleave", slots, cache)
    got = mla_queries_cache(q_a, c_kv, k_rope, qw, kw, 1e-6, 1e-5, codes, w_uk, positions, rot.cos, rot.sin, True,
                            slots, cache, tickets=torch.zeros(16, dtype=torch.int32), d_split=split, qb_scale=scale)
    close(got, want_q, dtype)
    close(cache, want_cache, dtype)
    assert want_q.abs().max() > 0.1


def test_chain_against_the_three_launches(interpret):
    """float32 against kernels/gpu/mla_decode_glue.py's launches with torch's q_b GEMM between them: the latent
    rows written bit for bit (the same math, per row), the queries within float32 rounding (the q_b sums run in
    another order)."""
    from tokenfab.kernels.gpu.mla_decode_glue import mla_latent_query, mla_norms_cache
    from tokenfab.kernels.gpu.mla_query_chain import mla_queries_cache
    g = torch.Generator().manual_seed(3)
    T, H, QL, nope, C, R = 4, 2, 32, 16, 48, 8
    q_a, c_kv, k_rope = torch.randn(T, QL, generator=g), torch.randn(T, C, generator=g), torch.randn(T, R, generator=g)
    qw, kw = torch.rand(QL, generator=g) + 0.5, torch.rand(C, generator=g) + 0.5
    w_qb, w_uk = torch.randn(H * (nope + R), QL, generator=g), torch.randn(H, nope, C, generator=g)
    pos, slots = torch.tensor([1, 9, 30, 4]), torch.tensor([0, 5, 2, 7])
    rot = rotary(R, False)
    c1, c2 = torch.zeros(4, 2, C + R), torch.zeros(4, 2, C + R)
    q_n = mla_norms_cache(q_a, c_kv, k_rope, qw, kw, 1e-6, 1e-6, pos, rot.cos, rot.sin, False, slots, c1)
    want = mla_latent_query((q_n @ w_qb.t()).view(T, H, nope + R), w_uk, pos, rot.cos, rot.sin, False)
    got = mla_queries_cache(q_a, c_kv, k_rope, qw, kw, 1e-6, 1e-6, w_qb, w_uk, pos, rot.cos, rot.sin, False, slots,
                            c2)
    assert torch.equal(c1, c2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_chain_rounds_q_nope_as_the_q_b_gemm_stores_it(interpret):
    """bf16: q_nope = y + 2^-12 y and y for two rows of W_qb (normed q_a all y ~ 1), which the q_b GEMM stores as y
    and y, so 512 (q_nope_0 - q_nope_1) through W_UK is 0; unrounded it would be about 0.125."""
    from tokenfab.kernels.gpu.mla_query_chain import mla_queries_cache
    bf = torch.bfloat16
    T, QL, nope, C = 2, 16, 16, 8
    w_qb = torch.zeros(nope, QL, dtype=bf)
    w_qb[0, 0], w_qb[0, 1], w_qb[1, 0] = 1.0, 2.0 ** -12, 1.0
    w_uk = torch.zeros(1, nope, C, dtype=bf)
    w_uk[0, 0, 0], w_uk[0, 1, 0], w_uk[0, 0, 1] = 512.0, -512.0, 1.0
    got = mla_queries_cache(torch.ones(T, QL, dtype=bf), torch.ones(T, C, dtype=bf), torch.zeros(T, 0, dtype=bf),
                            torch.ones(QL, dtype=bf), torch.ones(C, dtype=bf), 1e-6, 1e-6, w_qb, w_uk,
                            torch.zeros(T, dtype=torch.long), None, None, False, torch.tensor([0, 1]),
                            torch.zeros(1, 2, C, dtype=bf))
    assert got[:, 0, 0].tolist() == [0.0, 0.0]
    assert ((got[:, 0, 1].float() - 1).abs() <= 2.0 ** -7).all()  # q_nope_0 (the norm may truncate 1 - eps/2)


def test_d_split_fills_the_sms():
    from tokenfab.kernels.gpu.mla_query_chain import d_split_for
    cpu = torch.device("cpu")  # 4 "SMs" in the interpreter (kernels/gpu/split_k.py)
    assert d_split_for(128, 1, 128, cpu) == 1 and d_split_for(2, 1, 128, cpu) == 1  # half the SMs busy already
    assert d_split_for(1, 1, 128, cpu) == 4  # one head: a program per SM
    assert d_split_for(1, 1, 32, cpu) == 1  # at least 32 rows a program
    assert d_split_for(1, 1, 64, cpu) == 2


def test_d_split_of_the_default_gives_the_one_program_bits(interpret):
    """bf16, one head (the tensor-parallel shape): the default split with tickets (4 programs here) and one program
    a head give the same bits (q_nope's columns are the same dot products; W_UK multiplies the same rounded row)."""
    from tokenfab.kernels.gpu.mla_query_chain import mla_queries_cache
    g = torch.Generator().manual_seed(11)
    bf = torch.bfloat16
    T, QL, nope, C, R = 3, 48, 128, 96, 8
    args = [torch.randn(T, QL, generator=g).to(bf), torch.randn(T, C, generator=g).to(bf),
            torch.randn(T, R, generator=g).to(bf), torch.ones(QL, dtype=bf), torch.ones(C, dtype=bf), 1e-6, 1e-6,
            (torch.randn(nope + R, QL, generator=g) / 7).to(bf), (torch.randn(1, nope, C, generator=g) / 11).to(bf),
            torch.arange(T), None, None, False, torch.arange(T)]
    one = mla_queries_cache(*args, torch.zeros(2, 2, C + R, dtype=bf))
    tickets = torch.zeros(4, dtype=torch.int32)
    split = mla_queries_cache(*args, torch.zeros(2, 2, C + R, dtype=bf), tickets=tickets)
    assert torch.equal(one, split) and not tickets.any()


def test_rejects_misfits(interpret):
    from tokenfab.kernels.gpu.mla_query_chain import mla_queries_cache
    T, H, QL, nope, C, R = 2, 2, 16, 16, 32, 4
    args = [torch.randn(T, QL), torch.randn(T, C), torch.randn(T, R), torch.ones(QL), torch.ones(C), 1e-6, 1e-6,
            torch.randn(H * (nope + R), QL), torch.randn(H, nope, C), torch.zeros(T, dtype=torch.long), None, None,
            False, torch.zeros(T, dtype=torch.long), torch.zeros(3, 2, C + R)]
    mla_queries_cache(*args)  # fits
    bad = list(args)
    bad[7] = torch.randn(H * (nope + R) - 1, QL)  # a q_b weight one row short
    with pytest.raises(ValueError, match="w_qb"):
        mla_queries_cache(*bad)
    bad = list(args)
    bad[14] = torch.zeros(3, 2, C + R + 1)  # a pool row of another width
    with pytest.raises(ValueError, match="cache"):
        mla_queries_cache(*bad)
    with pytest.raises(ValueError, match="split 2"):
        mla_queries_cache(*args, d_split=2)  # a split without tickets
    with pytest.raises(ValueError, match="split 3"):
        mla_queries_cache(*args, tickets=torch.zeros(8, dtype=torch.int32), d_split=3)  # not a power of two


def test_split_form_compiles_for_sm90_and_gfx942(interpret):
    """The split form (bf16, q_nope over 4 programs: the scratch, the ticket and its atomics), the one-program form
    and an FP8 q_b (both e4m3 decodes), interleaved RoPE, and mla_decode_glue.py's launches for models without a query
    LoRA, compiled by Triton's own compiler for NVIDIA sm_90 and AMD gfx942 on this CPU in the
    16-bit dots a GPU runs (tokenfab/testing/target_compile.py); the tiny models' decode (the engine test) launches
    only the one-program form."""
    from tokenfab.kernels.gpu.mla_decode_glue import mla_latent_query, mla_norms_cache
    from tokenfab.kernels.gpu.mla_query_chain import mla_queries_cache
    from tokenfab.testing.target_compile import LaunchRecorder, compile_for_targets, gpu_variants
    bf = torch.bfloat16
    T, H, QL, nope, C, R = 2, 2, 64, 128, 128, 16
    rot = rotary(R, True)
    args = [torch.randn(T, QL).to(bf), torch.randn(T, C).to(bf), torch.randn(T, R).to(bf), torch.ones(QL, dtype=bf),
            torch.ones(C, dtype=bf), 1e-6, 1e-6, torch.randn(H * (nope + R), QL).to(bf),
            torch.randn(H, nope, C).to(bf), torch.arange(T), rot.cos, rot.sin, True, torch.arange(T),
            torch.zeros(2, 2, C + R, dtype=bf)]
    fp8 = list(args)
    fp8[7] = args[7].float().to(torch.float8_e4m3fn)
    with LaunchRecorder() as rec:
        for split in (1, 4):
            mla_queries_cache(*args, tickets=torch.zeros(8, dtype=torch.int32), d_split=split)
        mla_queries_cache(*fp8, tickets=torch.zeros(8, dtype=torch.int32), d_split=2,
                          qb_scale=torch.ones(3, 1))  # FP8 q_b: 288 rows, 3 row blocks
        # the three-launch glue it replaced, which the tiny models' decode (all with a query LoRA) no longer runs:
        # models without one still do (the latent rows a program each, through the same latent_rows helper)
        q_n = mla_norms_cache(args[0], args[1], args[2], args[3], args[4], 1e-6, 1e-6, args[9], rot.cos, rot.sin, True,
                              args[13], args[14])
        mla_latent_query((q_n @ args[7].t()).view(T, H, nope + R), args[8], args[9], rot.cos, rot.sin, True)
        mla_norms_cache(None, args[1], args[2], None, args[4], 0.0, 1e-6, args[9], rot.cos, rot.sin, True, args[13],
                        args[14])
    assert sorted(l["constexprs"]["D_SPLIT"] for l in rec.launches if "D_SPLIT" in l["constexprs"]) == [1, 2, 4]
    assert {l["name"] for l in rec.launches} == {"_mla_queries_cache_kernel", "_mla_norms_cache_kernel",
                                                 "_mla_latent_query_kernel"}
    launches = gpu_variants(rec.launches)
    # FP8 codes converted by the hardware (sm_90, ROCm) as well as by the integer decode the interpreter ran
    launches += [dict(l, constexprs={**l["constexprs"], "NATIVE_FP8": True}) for l in launches
                 if l["constexprs"].get("FP8")]
    # and the widest tuning config (kernels/gpu/mla_query_chain.py _configs: 128-input tiles, 8 warps)
    launches += [dict(l, constexprs={**l["constexprs"], "BLOCK_K": 128}, options={**l["options"], "num_warps": 8})
                 for l in launches if "D_SPLIT" in l["constexprs"] and not l["constexprs"]["IEEE"]]
    failures = compile_for_targets(launches)
    assert not failures, "\n".join(f"{f['kernel']} on {f['target']}: {f['error']}" for f in failures)
