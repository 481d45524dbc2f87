"""ShardPlan: split_range properties, GQA head placement, tensor shards and per-rank byte accounting."""
from __future__ import annotations

import pytest

from tokenfab.config import parse_config
from tokenfab.parallel import ShardPlan, count_parameters, model_tensors, split_range, weight_bytes_per_rank


def _check_cover(ranges, n):
    """Contiguous, in order, sizes differ by <= 1 (larger first), union == [0, n) exactly once."""
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    for (s0, e0), (s1, e1) in zip(ranges, ranges[1:]):
        assert e0 == s1
    sizes = [e - s for s, e in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    covered = [i for s, e in ranges for i in range(s, e)]
    assert covered == list(range(n))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 8, 16, 64, 100, 163840, 163841, 32000, 18432])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
def test_split_range_properties(n, world):
    r = split_range(n, world)
    assert len(r) == world
    if n <= 4096:
        _check_cover(r, n)
    else:
        assert r[0][0] == 0 and r[-1][1] == n and all(a[1] == b[0] for a, b in zip(r, r[1:]))
        sizes = [e - s for s, e in r]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n


def test_split_range_named_cases():
    assert [e - s for s, e in split_range(16, 6)] == [3, 3, 3, 3, 2, 2]
    assert split_range(16, 6) == [(0, 3), (3, 6), (6, 9), (9, 12), (12, 14), (14, 16)]
    assert split_range(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert [e - s for s, e in split_range(100, 6)] == [17, 17, 17, 17, 16, 16]
    assert [e - s for s, e in split_range(163840, 6)] == [27307] * 4 + [27306] * 2
    # fewer items than ranks: the last ranks get empty ranges
    assert split_range(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_split_range_errors():
    with pytest.raises(ValueError, match="world_size"):
        split_range(4, 0)
    with pytest.raises(ValueError, match="negative"):
        split_range(-1, 2)


def _gqa(heads, kv, **kw):
    return parse_config(dict(architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=heads * 16,
                             intermediate_size=100, num_hidden_layers=2, num_attention_heads=heads,
                             num_key_value_heads=kv, head_dim=16, max_position_embeddings=128, **kw))


@pytest.mark.parametrize("heads,kv", [(8, 8), (8, 2), (64, 8), (32, 4), (4, 2), (12, 3), (8, 1)])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 8, 9])
def test_gqa_query_heads_stay_with_their_kv_head(heads, kv, world):
    mc = _gqa(heads, kv)
    p = ShardPlan.for_model(mc, world)
    g = heads // kv
    # every query head on exactly one rank, contiguous
    covered = sorted(h for s, e in p.heads for h in range(s, e))
    assert covered == list(range(heads))
    for r in range(world):
        hs, he = p.heads[r]
        ks, ke = p.kv_heads[r]
        if he == hs:
            assert ke == ks  # no heads -> no KV
            continue
        # the KV heads a rank stores are exactly the groups of its query heads
        assert ks == hs // g and ke == -(-he // g)
    # every KV head is stored somewhere
    assert sorted({k for s, e in p.kv_heads for k in range(s, e)}) == list(range(kv))


def test_gqa_examples():
    p = ShardPlan.for_model(_gqa(8, 2), 3)  # kv < world: KV head 0 replicated on ranks 0, 1
    assert p.heads == [(0, 2), (2, 4), (4, 8)]
    assert p.kv_heads == [(0, 1), (0, 1), (1, 2)]
    assert p.kv_head_ranks(0) == [0, 1]
    p = ShardPlan.for_model(_gqa(64, 8), 6)  # kv >= world: KV heads split 2,2,1,1,1,1 and query heads follow
    assert [p.num_kv_heads(r) for r in range(6)] == [2, 2, 1, 1, 1, 1]
    assert [p.num_heads(r) for r in range(6)] == [16, 16, 8, 8, 8, 8]


from test_planner import KIMI_K2  # noqa: E402  (the published Kimi-K2 shape, one copy)


def test_kimi_plan_ranges_on_6():
    p = ShardPlan.for_model(parse_config(KIMI_K2), 6)
    assert [e - s for s, e in p.heads] == [11, 11, 11, 11, 10, 10]
    assert p.experts == [(0, 64), (64, 128), (128, 192), (192, 256), (256, 320), (320, 384)]
    assert [e - s for s, e in p.vocab] == [27307] * 4 + [27306] * 2
    assert [e - s for s, e in p.shared_intermediate] == [342, 342, 341, 341, 341, 341]  # 2048 = 6 x 341 + 2
    assert p.intermediate == split_range(18432, 6)
    assert p.kv_heads == [(0, 1)] * 6  # MLA latent on every rank
    assert p.expert_owner(383) == 5 and p.vocab_owner(27307) == 1


def test_tensor_shards_for_engine():
    p = ShardPlan.for_model(parse_config(KIMI_K2), 6)
    q = p.shard_tensor("model.layers.0.self_attn.q_b_proj.weight", (64 * 192, 1536), 1)
    assert (q.dim, q.start, q.end) == (0, 11 * 192, 22 * 192)
    # FP8 scale rows: elements [2112, 4224) touch 128-row blocks 16..32 -> [16, 33)
    qs = p.shard_tensor("model.layers.0.self_attn.q_b_proj.weight_scale_inv", (96, 12), 1)
    assert (qs.dim, qs.start, qs.end) == (0, 16, 33)
    o = p.shard_tensor("model.layers.0.self_attn.o_proj.weight", (7168, 64 * 128), 5)
    assert (o.dim, o.start, o.end) == (1, 54 * 128, 64 * 128)
    kvb = p.shard_tensor("model.layers.0.self_attn.kv_b_proj.weight", (64 * 256, 512), 0)
    assert (kvb.dim, kvb.start, kvb.end) == (0, 0, 11 * 256)
    assert p.shard_tensor("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (576, 7168), 3).dim is None
    assert p.shard_tensor("model.layers.5.mlp.experts.70.up_proj.weight", (2048, 7168), 1).owned
    assert not p.shard_tensor("model.layers.5.mlp.experts.70.up_proj.weight", (2048, 7168), 0).owned
    fused = p.shard_tensor("model.layers.5.mlp.experts.gate_up_proj", (384, 4096, 7168), 2)
    assert (fused.dim, fused.start, fused.end) == (0, 128, 192)
    d = p.shard_tensor("model.layers.0.mlp.down_proj.weight", (7168, 18432), 0)
    assert (d.dim, d.start, d.end) == (1, 0, 3072)
    sh = p.shard_tensor("model.layers.1.mlp.shared_experts.down_proj.weight", (7168, 2048), 4)
    assert (sh.dim, sh.start, sh.end) == (1, 1366, 1707)
    # packed INT4 experts are whole; a packed TP tensor maps columns by the pack factor
    pk = p.shard_tensor("model.layers.1.mlp.shared_experts.down_proj.weight_packed", (7168, 256), 1)
    assert (pk.dim, pk.start, pk.end) == (1, 342 // 8, -(-684 // 8))
    assert p.shard_tensor("model.embed_tokens.weight", (163840, 7168), 5).start == 136534
    assert p.shard_tensor("model.layers.3.mlp.gate.e_score_correction_bias", (384,), 2).dim is None
    with pytest.raises(ValueError, match="disagree"):
        p.shard_tensor("model.layers.0.self_attn.q_b_proj.weight", (99999, 1536), 0)


def test_mtp_layers_are_skipped():
    mc = parse_config(dict(KIMI_K2, num_nextn_predict_layers=1))
    p = ShardPlan.for_model(mc, 2)
    assert not p.shard_tensor("model.layers.61.eh_proj.weight", (7168, 14336), 0).owned


def test_kimi_bf16_bytes_by_hand():
    """Per-rank bf16 bytes match the formulas; their sum = total + 5 extra copies of the replicated tensors."""
    mc = parse_config(KIMI_K2)
    h, L, H, V, I, mI, E = 7168, 61, 64, 163840, 18432, 2048, 384
    ql, kvl, nope, rope, v = 1536, 512, 128, 64, 128
    n_moe, n_dense = 60, 1
    replicated_params = (L * (ql * h + (kvl + rope) * h + ql + kvl + 2 * h)  # q_a, kv_a, 4 norms per layer
                         + n_moe * (E * h + E) + h)                           # router + bias, final norm
    total_params = count_parameters(mc)
    per = weight_bytes_per_rank(mc, 6, "bfloat16")
    assert sum(sum(d.values()) for d in per) == 2 * total_params + 5 * 2 * replicated_params
    # rank 0: 11 heads, 64 experts, 27307 vocab rows, 3072 dense channels, 342 shared channels
    rank0 = 2 * (replicated_params + 2 * 27307 * h
                 + L * (11 * (nope + rope) * ql + 11 * (nope + v) * kvl + h * 11 * v)
                 + n_dense * 3 * h * 3072 + n_moe * (64 * 3 * h * mI + 3 * h * 342))
    assert sum(per[0].values()) == rank0
    assert per[0]["experts"] == 2 * n_moe * 64 * 3 * h * mI
    assert per[5]["router"] == per[0]["router"] == 2 * n_moe * (E * h + E)


def test_fp8_and_int4_formats():
    mc = parse_config(KIMI_K2)
    names = {r.name: r for r in model_tensors(mc, "fp8")}
    r = names["model.layers.{L}.self_attn.q_b_proj.weight_scale_inv"]
    assert r.shape == (96, 12) and r.nbytes == 96 * 12 * 4 and r.count == 61
    assert names["model.embed_tokens.weight"].nbytes == 163840 * 7168 * 2
    assert names["model.layers.{L}.mlp.experts.7.down_proj.weight"].nbytes == 7168 * 2048
    names = {r.name: r for r in model_tensors(mc, "int4")}
    assert names["model.layers.{L}.mlp.experts.0.gate_proj.weight_packed"].shape == (2048, 7168 // 8)
    assert names["model.layers.{L}.mlp.experts.0.gate_proj.weight_scale"].shape == (2048, 7168 // 32)
    assert names["model.layers.{L}.self_attn.q_b_proj.weight"].nbytes == 64 * 192 * 1536 * 2
    with pytest.raises(ValueError, match="not supported"):
        model_tensors(mc, "int3")


def test_more_ranks_than_heads_and_experts():
    mc = parse_config(dict(KIMI_K2, num_attention_heads=4, n_routed_experts=8, n_group=1))
    p = ShardPlan.for_model(mc, 10)
    assert [p.num_heads(r) for r in range(10)] == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert p.kv_heads[3] == (0, 1) and p.kv_heads[4] == (0, 0)
    assert [e - s for s, e in p.experts] == [1] * 8 + [0, 0]
    per = weight_bytes_per_rank(mc, 10, "bfloat16")
    assert per[9]["experts"] == 0 and per[9]["attn_q"] == 0 and per[9]["norms"] == per[0]["norms"]
