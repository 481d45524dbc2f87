"""Tensor parallel on FP8 block-scaled checkpoints (DeepSeek-V3 layout), with shard boundaries inside 128-blocks.

The tiny FP8 DeepSeek-V3 has hidden 160, dense intermediate 300, shared-expert intermediate 160, 4 MLA heads
(q_b_proj 4 x 32 rows, o_proj 4 x 24 columns, kv_b_proj 4 x 40 rows), so the shard plan cuts FP8 weights inside
blocks: at TP 3 the dense MLP at channels 100 and 200 (rank 2 starts 72 into block 1), q_b_proj at rows 64 and 96,
the shared expert at 54 and 107, o_proj at columns 48 and 72; at TP 2 the dense MLP at 150 (22 into block 1).

* slicing, exact: a shard (e4m3 rows / columns + the scales of the blocks it overlaps) dequantizes to the
  published formula's full weight sliced, bit for bit, and this rank's shards read through the sharded loader tile
  every FP8 weight of the checkpoint (kv_b_proj dequantized at load included);
* the shard's linear (C++ kernel on padded rows / columns, and the PyTorch reference) against F.linear on the
  sliced dequantized weight within the float32 accumulation bound;
* TP 2 and TP 3 over worker processes (gloo, float32) against TP 1: greedy tokens identical, prompt logprobs within
  1e-4, the bound the bf16 TP tests use (tests/test_tensor_parallel.py): the ranks compute the same exact products
  as one rank, summed in another order (row-parallel partial sums all-reduced, a cut block's two partial sums scaled
  separately), a float32 rounding difference of ~1e-7 relative per dot product, far below 1e-4 after two layers.
"""
from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import max_prompt_logprob_gap, tp_generate
from test_fp8_block_weight import formula, fp32_bound, kernel, random_fp8
from tokenfab.errors import WeightLoadError
from tokenfab.kernels.cpu.ops import fp8_linear as cpu_fp8
from tokenfab.loader.fp8_block_loader import Fp8CheckpointWeights
from tokenfab.quant.fp8_block_shard import Fp8BlockShard
from tokenfab.quant.fp8_block_weight import Fp8BlockWeight

os.environ.setdefault("TOKENFAB_TP_TIMEOUT", "120")  # a broken test fails instead of hanging

TP_DIMS = dict(hidden_size=160, intermediate_size=300, moe_intermediate_size=160, q_lora_rank=64)
ENGINE_KW = dict(dtype="float32", max_model_len=96, max_num_batched_tokens=16, block_size=8, progress=False)
N_NEW = 6


def block_slice(q: torch.Tensor, s: torch.Tensor, dim: int, start: int, end: int):
    """The rank's part of (weight, weight_scale_inv) for elements [start, end) of ``dim``: the e4m3 rows / columns
    and every scale block they overlap, [start // 128, ceil(end / 128)) (written out here, not the shard plan's)."""
    b0, b1 = (start // 128, -(-end // 128)) if end > start else (start // 128, start // 128)
    return q.narrow(dim, start, end - start), s.narrow(dim, b0, b1 - b0)


@pytest.mark.parametrize("dim,start,end", [
    (0, 200, 300),   # starts 72 into block 1, ends in the partial edge block 2
    (0, 100, 200),   # straddles blocks 0 / 1
    (0, 54, 107),    # inside block 0, neither end on a block edge
    (0, 128, 300),   # block-aligned start (offset 0) with a partial last block
    (1, 150, 300),   # a column range 22 into block 1
    (1, 7, 290),     # columns across all three blocks
])
def test_shard_dequantizes_to_the_full_weight_sliced(dim, start, end):
    q, s = random_fp8(300, 300, seed=start + end)
    full = formula(q, s)
    qs, ss = block_slice(q, s, dim, start, end)
    off = start % 128
    shard = Fp8BlockShard(qs, ss, off if dim == 0 else 0, off if dim == 1 else 0)
    want = full.narrow(dim, start, end - start)
    assert (shard.out_features, shard.in_features) == tuple(want.shape)
    assert torch.equal(shard.dequantize(), want)
    assert torch.equal(shard.dequantize_rows(3, 41), want[3:41])
    # stored padded to the block grid: the offset's zero rows / columns, K rounded up to 32
    rows = off * (dim == 0) + shard.out_features
    cols = off * (dim == 1) + shard.in_features
    assert shard.weight.shape == (rows, -(-cols // 32) * 32)


def test_shard_without_its_offset_is_wrong():
    """The offset matters: rows [50, 250) overlap blocks 0 and 1, the scale grid of an aligned 200-row weight too, but
    read as one (the kernels' row // 128 from the shard's start) its rows 78-127 (W's rows 128-177) get block 0's
    scales instead of block 1's."""
    q, s = random_fp8(300, 160, seed=1)
    qs, ss = block_slice(q, s, 0, 50, 250)
    assert torch.equal(Fp8BlockShard(qs, ss, 50, 0).dequantize(), formula(q, s)[50:250])
    naive = Fp8BlockWeight(qs, ss).dequantize()
    assert torch.equal(naive[:78], formula(q, s)[50:128]) and not torch.equal(naive, formula(q, s)[50:250])


def test_empty_shard_gives_zeros_plus_bias():
    q, s = random_fp8(300, 160, seed=2)
    rows = Fp8BlockShard(*block_slice(q, s, 0, 128, 128))
    cols = Fp8BlockShard(*block_slice(q, s, 1, 64, 64))
    rows.prepare(), cols.prepare()
    x = torch.randn(3, 160)
    assert rows.linear(x, None).shape == (3, 0)
    bias = torch.randn(300)
    assert torch.equal(cols.linear(x[:, :0], bias), bias.expand(3, 300))


@pytest.mark.parametrize("backend", [pytest.param("tokenfab", marks=kernel, id="kernel"),
                                     pytest.param("torch", id="reference")])
@pytest.mark.parametrize("m,dtype", [(1, torch.float32), (5, torch.float32), (20, torch.float32),
                                     (2, torch.bfloat16), (8, torch.bfloat16), (40, torch.bfloat16)])
def test_shard_linear_matches_the_sliced_weight(monkeypatch, backend, m, dtype):
    """Column-parallel shards (rows) with a bias, and row-parallel shards (columns) whose partial products sum to
    the full product: each within the float32 accumulation bound of F.linear on the sliced dequantized weight
    (plus one bf16 rounding for bf16 x). bf16 x past fp8_gemv_max_rows on the kernel's brgemm path (no AMX)
    multiplies the weight rounded once to bf16, the dequantized bf16 twin's: the sliced weight is that one there."""
    from tokenfab.kernels.cpu import isa
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", backend)
    twin = (backend == "tokenfab" and dtype == torch.bfloat16 and m > cpu_fp8.fp8_gemv_max_rows(dtype, 320)
            and isa.selected_level() != "amx")

    def weight(q, s):
        w = formula(q, s)
        return w.bfloat16().float() if twin else w
    q, s = random_fp8(300, 320, seed=m)  # rows cut (in_features 320: the aligned first shard runs the kernel too)
    full = weight(q, s)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 320, generator=g).to(dtype)
    bias = torch.randn(300, generator=g)
    cuts = [0, 100, 200, 300]  # TP 3's dense-MLP cuts: offsets 0, 100 and 72 (block 1)
    for a, b in zip(cuts, cuts[1:]):
        shard = Fp8BlockShard(*block_slice(q, s, 0, a, b), a % 128, 0) if a % 128 else \
            Fp8BlockWeight(*block_slice(q, s, 0, a, b))
        shard.prepare()
        assert shard._kernel == (backend == "tokenfab")
        y = shard.linear(x, bias[a:b])
        ref = F.linear(x.float(), full[a:b]) + bias[a:b]
        tol = fp32_bound(x, full[a:b]) + bias[a:b].abs() * 2 ** -23
        if dtype == torch.bfloat16:
            tol = tol + ref.abs() * 2 ** -8
        assert y.dtype == dtype and y.shape == (m, b - a)
        assert ((y.float() - ref).abs() <= tol).all(), (a, b, (y.float() - ref).abs().max())
    q, s = random_fp8(160, 300, seed=m + 1)  # columns cut
    full = weight(q, s)
    x = torch.randn(m, 300, generator=g).to(dtype)
    parts, tol = [], 2 * fp32_bound(x, full)
    for a, b in zip(cuts, cuts[1:]):
        shard = Fp8BlockShard(*block_slice(q, s, 1, a, b), 0, a % 128)
        shard.prepare()
        assert shard._kernel == (backend == "tokenfab")
        y = shard.linear(x[:, a:b], None)
        assert y.dtype == dtype and y.shape == (m, 160)
        parts.append(y.float())
        if dtype == torch.bfloat16:  # each partial sum rounded once to bf16
            tol = tol + F.linear(x[:, a:b].float(), full[:, a:b]).abs() * 2 ** -8
    ref = F.linear(x.float(), full)
    assert ((sum(parts) - ref).abs() <= tol).all(), (sum(parts) - ref).abs().max()


@pytest.fixture(scope="module")
def fp8_tp(tiny_model, tmp_path_factory):
    """The tiny FP8 DeepSeek-V3 whose TP 2 / 3 cuts fall inside 128-blocks."""
    from tokenfab.testing.fp8_checkpoint import write_fp8_checkpoint
    return write_fp8_checkpoint(tiny_model("deepseek_v3", **TP_DIMS), str(tmp_path_factory.mktemp("fp8tp") / "fp8"))


@pytest.mark.parametrize("n", [2, 3])
def test_rank_shards_tile_every_fp8_weight(fp8_tp, n):
    """Through the sharded loader (each rank reads its slices of the file) and Fp8CheckpointWeights: every FP8
    weight's rank shards, dequantized, concatenate along the split dim to the full weight by the formula, bit for bit
    (replicated ones are whole on every rank); kv_b_proj comes dequantized, the rest packed; some shards start inside
    a block after the first."""
    from safetensors.torch import load_file

    from tokenfab.config import load_config
    from tokenfab.parallel.shard_plan import ShardPlan
    from tokenfab.parallel.sharded_loading import iterate_rank_weights

    ckpt = load_file(os.path.join(fp8_tp, "model.safetensors"))
    plan = ShardPlan.for_model(load_config(fp8_tp), n)
    per_rank = [dict(Fp8CheckpointWeights(iterate_rank_weights(fp8_tp, plan, r), plan=plan, rank=r))
                for r in range(n)]
    offsets = set()
    checked = 0
    for name, q in ckpt.items():
        if q.dtype != torch.float8_e4m3fn or ".mlp.experts." in name:
            continue
        full = formula(q, ckpt[name + "_scale_inv"])
        got = [per_rank[r][name] for r in range(n)]
        deq = [g if isinstance(g, torch.Tensor) else g.dequantize() for g in got]
        if name.endswith("kv_b_proj.weight"):
            assert all(isinstance(g, torch.Tensor) for g in got)
        else:
            assert all(isinstance(g, Fp8BlockWeight) for g in got)
        offsets |= {(g.row_offset, g.col_offset) for g in got if isinstance(g, Fp8BlockShard)}
        rng = plan.element_range(name, 0)
        if rng is None:
            assert all(torch.equal(d, full) for d in deq), name
        else:
            assert torch.equal(torch.cat(deq, dim=rng[0]), full), name
        checked += 1
    assert checked == 2 * 5 + 3 + 3  # per layer q_a, q_b, kv_a, kv_b, o_proj; dense MLP 3, shared expert 3
    want = {2: {(64, 0), (80, 0), (0, 48), (22, 0), (0, 22), (0, 80)},
            3: {(64, 0), (96, 0), (0, 48), (0, 72), (100, 0), (72, 0), (0, 100), (54, 0), (107, 0), (0, 54),
                (0, 107)}}[n]
    assert want <= offsets, sorted(offsets)


def test_built_ranks_hold_padded_shards(fp8_tp):
    """In-process, no group: at TP 3 the packed Linears hold shards with the offsets the plan implies."""
    from tokenfab.engine.engine_config import EngineConfig
    from tokenfab.parallel.worker import build_rank

    cfg = EngineConfig(model=fp8_tp, dtype="float32", max_model_len=96)
    _, loaded = build_rank(cfg, 2, 3)
    layer0, layer1 = loaded.model.model.layers[0], loaded.model.model.layers[1]
    down, qb = layer0.mlp.down_proj.qweight, layer0.self_attn.q_b_proj.qweight
    assert isinstance(down, Fp8BlockShard) and (down.col_offset, down.in_features) == (72, 100)
    assert isinstance(qb, Fp8BlockShard) and (qb.row_offset, qb.out_features) == (96, 32)
    assert isinstance(layer1.mlp.shared_experts.gate_proj.qweight, Fp8BlockShard)
    assert down._kernel == qb._kernel == cpu_fp8.fp8_block_linear_applies()  # the kernel runs on the padding


def test_misfit_scale_is_refused_naming_the_tensor(fp8_tp):
    """A weight_scale_inv slice that does not cover the blocks of the rank's rows is a WeightLoadError naming it."""
    from tokenfab.config import load_config
    from tokenfab.parallel.shard_plan import ShardPlan
    plan = ShardPlan.for_model(load_config(fp8_tp), 3)
    q, s = random_fp8(160, 300, seed=4)
    name = "model.layers.0.mlp.down_proj.weight"
    qs, ss = block_slice(q, s, 1, 200, 300)
    assert isinstance(dict(Fp8CheckpointWeights([(name, qs), (name + "_scale_inv", ss)], plan=plan, rank=2))[name],
                      Fp8BlockShard)
    with pytest.raises(WeightLoadError, match=r"down_proj.weight_scale_inv: expected a float32 \[2, 2\]"):
        list(Fp8CheckpointWeights([(name, qs), (name + "_scale_inv", ss[:, :1])], plan=plan, rank=2))


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in (3, 21, 11, 30)]


_REF: list = []


@pytest.mark.parametrize("n", [2, 3])
def test_tp_fp8_matches_single_rank(fp8_tp, n):
    if not _REF:
        _REF.extend(tp_generate(fp8_tp, 1, prompts(), N_NEW, **ENGINE_KW))
    got = tp_generate(fp8_tp, n, prompts(), N_NEW, **ENGINE_KW)
    worst = max_prompt_logprob_gap(_REF, got, f"FP8 TP {n}")
    assert worst < 1e-4, f"FP8 TP {n}: max |d prompt logprob| = {worst}"
