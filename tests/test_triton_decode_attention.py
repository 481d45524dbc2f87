"""The split-context paged decode attention (kernels/gpu/decode_attention.py) in Triton's interpreter: against a
float64 gather-and-softmax over contexts split unevenly (lengths off the page and tile grid, one sequence far
longer than the others, contexts shorter than the split count), for GQA and MLA's latent cache, under several
tile configs (head blocks, value slices, tile lengths); float32 to 2e-5 and bf16 within its rounding bound; the
split-count cost model by hand; launch shapes independent of the context lengths (CUDA-graph safety)."""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def gathered_reference(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Per sequence: its context gathered token by token through the block table, softmax(scale q k^T) v in
    float64 over the cached values as stored (bf16 caches widened exactly). Returns [B, H, Dv] float64."""
    B, H, _ = q.shape
    page, Hk = k_cache.shape[1], k_cache.shape[2]
    out = []
    for b in range(B):
        t = torch.arange(int(context_lens[b]))
        blk = block_tables[b][t // page]
        k = k_cache[blk, t % page].double().repeat_interleave(H // Hk, 1)  # [L, H, D]
        v = v_cache[blk, t % page].double().repeat_interleave(H // Hk, 1)
        p = (torch.einsum("hd,lhd->hl", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(out)


# (name, H, Hk, D, Dv): GQA with 4 heads per KV head of 24 dims; MLA's latent cache with 20 query heads over one
# 40 + 8 wide latent row (values = the first 40 dims, not a power of two), and 40 heads (3 blocks of 16)
SHAPES = [("gqa", 12, 3, 24, 24), ("mla", 20, 1, 48, 40), ("mla-40-heads", 40, 1, 40, 32)]
# one token; shorter than 7 splits of 16-token tiles; off the page grid; much longer than the rest
LENS = [1, 5, 37, 300]
CONFIGS = [{"BLOCK_H": 16, "DV_SPLIT": 1, "BLOCK_N": 16, "KEYS_AS_ROWS": False},
           {"BLOCK_H": 64, "DV_SPLIT": 2, "BLOCK_N": 32, "KEYS_AS_ROWS": False},
           {"BLOCK_H": 64, "DV_SPLIT": 1, "BLOCK_N": 32, "KEYS_AS_ROWS": True}]


def make_case(name, H, Hk, D, Dv, page, dtype, seed, lens=LENS):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    max_blocks = -(-max(lens) // page)
    num_blocks = B * max_blocks + 3
    k_cache = torch.randn(num_blocks, page, Hk, D, generator=g).to(dtype)
    v_cache = k_cache[..., :Dv] if name.startswith("mla") else torch.randn(num_blocks, page, Hk, Dv,
                                                                            generator=g).to(dtype)
    # every sequence its own blocks, scattered over the pool; columns past a context hold other ids
    block_tables = torch.randperm(num_blocks, generator=g)[:B * max_blocks].view(B, max_blocks)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(lens)


@pytest.mark.parametrize("num_splits,config", [(1, CONFIGS[0]), (3, CONFIGS[0]), (7, CONFIGS[0]), (7, CONFIGS[1]),
                                               (1, CONFIGS[2]), (7, CONFIGS[2])],
                         ids=["1-split", "3-splits", "7-splits", "7-splits-2-value-slices", "1-split-keys-as-rows",
                              "7-splits-keys-as-rows"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_float32_matches_gathered_reference(interpret, monkeypatch, shape, num_splits, config):
    from tokenfab.kernels.gpu import decode_attention
    monkeypatch.setattr(decode_attention, "INTERPRETER_CONFIG", config)
    name, H, Hk, D, Dv = shape
    q, k_cache, v_cache, bt, cl = make_case(name, H, Hk, D, Dv, page=16, dtype=torch.float32, seed=H + num_splits)
    got = decode_attention.paged_decode_attention(q, k_cache, v_cache, bt, cl, D ** -0.5, num_splits=num_splits)
    want = gathered_reference(q, k_cache, v_cache, bt, cl, D ** -0.5)
    assert got.shape == (len(LENS), H, Dv) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=[s[0] for s in SHAPES[:2]])
def test_bfloat16_within_rounding_bound(interpret, shape, num_splits):
    """bf16 cache and queries, page 8 (scores exact: bf16 products summed in float32, the reference in float64
    over the same bf16 values). Three roundings to bf16, each at most half an ulp, 2^-9 relative: the
    probabilities before the value product (error <= 2^-9 * sum p |v| <= 2^-9 max|v|), the split partials before
    the merge and the output (each <= 2^-9 max|v|, outputs being convex combinations of values): 3 * 2^-9 * max|v|."""
    from tokenfab.kernels.gpu.decode_attention import paged_decode_attention
    name, H, Hk, D, Dv = shape
    q, k_cache, v_cache, bt, cl = make_case(name, H, Hk, D, Dv, page=8, dtype=torch.bfloat16, seed=7 + num_splits)
    got = paged_decode_attention(q, k_cache, v_cache, bt, cl, D ** -0.5, num_splits=num_splits)
    want = gathered_reference(q, k_cache, v_cache, bt, cl, D ** -0.5)
    assert got.dtype == torch.bfloat16
    bound = 3 * 2 ** -9 * v_cache.double().abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= bound, (err, bound)


@pytest.mark.parametrize("shape", [SHAPES[0], ("mla-wide", 20, 1, 304, 288)], ids=["gqa-narrow", "mla-wide"])
def test_every_tuner_config_through_the_autotuner(interpret, monkeypatch, shape):
    """The GPU launch path (triton.autotune: key names, config prune, grid from the config) in the interpreter,
    each config of the shape's list (narrow for GQA, wide for value dims over 256) made the winner in turn by a
    stand-in timer; its output against the reference."""
    from tokenfab.kernels.gpu import decode_attention
    name, H, Hk, D, Dv = shape
    tuner = decode_attention._wide if Dv > 256 else decode_attention._narrow
    monkeypatch.setattr(decode_attention, "_fixed_config", lambda dtype: None)  # as bf16 on a GPU
    q, k_cache, v_cache, bt, cl = make_case(name, H, Hk, D, Dv, page=16, dtype=torch.float32, seed=11, lens=[1, 45])
    want = gathered_reference(q, k_cache, v_cache, bt, cl, 0.3)
    winners = []
    for target in range(len(tuner.configs)):
        calls = []

        def stand_in(kernel_call, quantiles, target=target, calls=calls):  # no timing: config `target` wins
            calls.append(None)
            return [0.0 if len(calls) - 1 == target else 1.0] * 3

        monkeypatch.setattr(tuner, "do_bench", stand_in, raising=False)
        monkeypatch.setattr(tuner, "cache", {})
        got = decode_attention.paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.3, num_splits=3)
        if target < len(calls):  # the prune may merge configs: fewer candidates than the list holds
            best = next(iter(tuner.cache.values()))
            winners.append((tuple(sorted(best.kwargs.items())), best.num_warps, best.num_stages))
            torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    assert len(winners) == len(set(winners)) >= 4  # each candidate won once


def test_launch_shapes_do_not_depend_on_context_lengths(interpret, monkeypatch):
    """CUDA-graph safety: the same (batch, heads, max_context) launch the same grids whatever the lengths on the
    device; the outputs still follow the lengths."""
    from tokenfab.kernels.gpu import decode_attention
    grids = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            grids.append(tuple(grid))
            return self.fn[grid]

    monkeypatch.setattr(decode_attention, "_split_attention", Recorder(decode_attention._split_attention))
    monkeypatch.setattr(decode_attention, "_combine", Recorder(decode_attention._combine))
    q, k_cache, v_cache, bt, cl = make_case("mla", 20, 1, 48, 40, page=16, dtype=torch.float32, seed=3)
    outs = []
    for lens in (cl, torch.tensor([300, 2, 64, 17])):
        outs.append(decode_attention.paged_decode_attention(q, k_cache, v_cache, bt, lens, 0.2, max_context=304,
                                                            num_splits=None))
        torch.testing.assert_close(outs[-1].double(), gathered_reference(q, k_cache, v_cache, bt, lens, 0.2),
                                   atol=2e-5, rtol=2e-5)
    half = len(grids) // 2
    assert len(grids) in (2, 4) and grids[:half] == grids[half:]


@pytest.mark.parametrize("case,want", [
    # MLA, 128 heads, batch 1 x 32K, 132 SMs: c = 1 * 132 / 2 = 66 splits fill the GPU; the partial-cost optimum
    # sqrt(32768 * 1152 * 66 / (2 * 128 * 512 * 2)) = 97.5 is past that, so 66
    ((1, 1, 128, 512, 1152, 2, 32768, 132), 66),
    # same at 4K: sqrt(4096 * 1152 * 66 / 262144) = 34.5 -> 34 (partials cost more than a fuller GPU saves)
    ((1, 1, 128, 512, 1152, 2, 4096, 132), 34),
    # MLA batch 64 x 4K: 128 programs already fill 132 SMs, c = 1.03 -> one split, no combine pass
    ((64, 1, 128, 512, 1152, 2, 4096, 132), 1),
    # GQA 32 / 8 heads of 128 at batch 1 x 32K: 4 programs per SM (8 KB accumulators), c = 4 * 132 / 8 = 66;
    # partials are tiny (sqrt(8 * 32768 * 512 * 66 / (2 * 8 * 4 * 128 * 2)) = 735)
    ((1, 8, 4, 128, 512, 2, 32768, 132), 66),
    # GQA batch 16 x 4K on MI300X's 304 CUs: c = 4 * 304 / 128 = 9.5 -> 10 (round half to even)
    ((16, 8, 4, 128, 512, 2, 4096, 304), 10),
    # a 100-token context: at most 100 // 64 = 1 split
    ((1, 1, 128, 512, 1152, 2, 100, 132), 1),
])
def test_num_splits_cost_model(case, want):
    from tokenfab.kernels.gpu.decode_attention import default_num_splits
    batch, kv_heads, group, dv, row_bytes, elem, ctx, sms = case
    assert default_num_splits(batch, kv_heads, group, dv, row_bytes, elem, ctx, sms) == want


def test_configs_fitted_to_the_group_and_value_width():
    """The tuner's prune: head blocks cut to the group rounded up to a power of two (>= 16 rows), value slices to
    >= 16 dims each, duplicates dropped."""
    from tokenfab.kernels.gpu.decode_attention import _NARROW_CONFIGS, _WIDE_CONFIGS, _fit_configs
    mla_tp8 = _fit_configs(_WIDE_CONFIGS, {"G": 16}, BLOCK_DK=512)  # 128 heads over 8 ranks
    assert {c.kwargs["BLOCK_H"] for c in mla_tp8} == {16}
    assert len(mla_tp8) == len(_WIDE_CONFIGS)  # 16-token tiles of 16 heads over 8 warps and over 4 stay apart
    mla = _fit_configs(_WIDE_CONFIGS, {"G": 128}, BLOCK_DK=512)
    assert [c.kwargs for c in mla] == [c.kwargs for c in _WIDE_CONFIGS]
    gqa = _fit_configs(_NARROW_CONFIGS, {"G": 4}, BLOCK_DK=128)
    assert {c.kwargs["BLOCK_H"] for c in gqa} == {16} and len(gqa) == len(_NARROW_CONFIGS)
    narrow_values = _fit_configs(_WIDE_CONFIGS, {"G": 40}, BLOCK_DK=16)
    assert {c.kwargs["DV_SPLIT"] for c in narrow_values} == {1}
    assert len(narrow_values) == len(_WIDE_CONFIGS) - 1  # (64 heads, 2 slices, 32 tokens) became the second
    assert {c.kwargs["BLOCK_H"] for c in narrow_values} == {64, 16}


def test_float32_caches_run_one_untuned_config(monkeypatch):
    """On a GPU (not interpreting) float32 fidelity runs take FLOAT32_CONFIG; bf16 goes to the tuner with
    TOKENFAB_TRITON_AUTOTUNE=1, else takes the tuner's first config ("first")."""
    from tokenfab.kernels.gpu import decode_attention
    monkeypatch.setattr(decode_attention.support, "interpreting", lambda: False)
    for tune, want in ((True, None), (False, "first")):
        monkeypatch.setattr(decode_attention.support, "autotune_enabled", lambda tune=tune: tune)
        assert decode_attention._fixed_config(torch.float32) is decode_attention.FLOAT32_CONFIG
        assert decode_attention._fixed_config(torch.bfloat16) == want
