"""Host-offloaded experts (tokenfab/layers/host_experts.py, tokenfab/planner/expert_placement.py): outputs with 0%,
50% and 100% of the routed experts on the host equal the outputs without offload (float32: same greedy tokens,
logprobs within 1e-5; the split keeps the no-offload per-token sum order, so they are in fact equal), on one rank and
on three, for DeepSeek-V3, Qwen3-MoE and Kimi Linear; the accounting counts every routed pair on the side that ran it;
placement choices against hand-worked cases; the planner's memory-fill split on a Kimi-K2-shaped config on 4
devices against a split computed by hand from the parameter formulas.
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from conftest import tp_generate
from test_kimi_linear import make_kimi_linear
from tokenfab import LLM, SamplingParams

os.environ.setdefault("TOKENFAB_TP_TIMEOUT", "300")  # a broken test fails instead of hanging

VOCAB = 512
N_NEW = 5
ENGINE_KW = dict(dtype="float32", max_model_len=96, max_num_batched_tokens=16, block_size=8, progress=False)
OVERRIDES = {  # 16 experts (uneven over 3 ranks: 6 + 5 + 5), several MoE layers
    "deepseek_v3": dict(num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, n_group=4, topk_group=2,
                        num_hidden_layers=3),
    "qwen3_moe": dict(num_attention_heads=8, num_key_value_heads=2, num_experts=16, num_hidden_layers=2),
}
_REF: dict[str, list] = {}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tokenizer_dir):
    from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("host_experts")
    made: dict[str, str] = {}

    def make(family: str) -> str:
        if family not in made:
            if family == "kimi_linear":
                made[family] = make_kimi_linear(str(root / family), tokenizer_dir, seed=3, num_local_experts=16)
            else:
                made[family] = make_tiny_checkpoint(str(root / family), family, vocab_size=VOCAB,
                                                    tokenizer_dir=tokenizer_dir, **OVERRIDES[family])
        return made[family]
    return make


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(5, VOCAB) for _ in range(n)] for n in (3, 19, 9)]


def run(path: str, n: int, **kw):
    return tp_generate(path, n, prompts(), N_NEW, **ENGINE_KW, **kw)


def reference(family: str, path: str):
    if family not in _REF:
        _REF[family] = run(path, 1)
    return _REF[family]


def assert_same(ref, got, label: str, tol: float = 1e-5) -> float:
    """Same greedy tokens and prompt logprobs within ``tol``; returns the largest |Δ logprob|."""
    worst = 0.0
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids, f"{label}: greedy tokens differ"
        for a, b in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            worst = max(worst, max(abs(a[k].logprob - b[k].logprob) for k in a))
    assert worst <= tol, f"{label}: max |d prompt logprob| = {worst}"
    return worst


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "kimi_linear"])
@pytest.mark.parametrize("share", ["0%", "50%", "100%"])
def test_one_rank_identical_to_no_offload(ckpt, family, share):
    """The split sums the same pairs in the same order, so with the host worker on as many threads as the device
    side (this machine's CPU on both: the same GEMM calls) it is bit-identical in float32 on every CPU family. At
    the default worker size (half the threads) a float32 GEMM may split its sums differently (seen on AMD EPYC:
    up to ~5e-7 in a prompt logprob), so there only the tolerance holds."""
    path = ckpt(family)
    same_threads = run(path, 1, host_experts=share, host_expert_threads=torch.get_num_threads())
    worst = assert_same(reference(family, path), same_threads, f"{family} {share}")
    assert worst == 0.0
    assert_same(reference(family, path), run(path, 1, host_experts=share), f"{family} {share} default threads")


@pytest.mark.slow
@pytest.mark.parametrize("family,share", [("deepseek_v3", "0%"), ("deepseek_v3", "50%"), ("deepseek_v3", "100%"),
                                          ("qwen3_moe", "50%"), ("kimi_linear", "50%")])
def test_three_ranks_match(ckpt, family, share):
    """3 ranks (experts 6 + 5 + 5, each rank offloading its share of its own range) against one rank without
    offload: tensor parallel alone moves prompt logprobs by ~1e-7 (all-reduce order); the split adds nothing."""
    path = ckpt(family)
    assert_same(reference(family, path), run(path, 3, host_experts=share), f"{family} {share} N=3")


def test_kimi_k3_situ_latent_experts(tmp_path_factory, tokenizer_dir, monkeypatch):
    """Kimi K3's SiTU experts in the latent space, summed in float32 (its own expert math through ``act``). Without
    host experts the MXFP4 experts stay packed; their PyTorch path (float32 matmuls on the dequantized rows) is the
    bit-exact reference for the split, which loads them dequantized."""
    from test_kimi_k3 import TEXT, k3_tensors, write_k3
    monkeypatch.setenv("TOKENFAB_PACKED_EXPERTS", "torch")
    stored, _ = k3_tensors(TEXT)
    path = write_k3(str(tmp_path_factory.mktemp("k3_host")), tokenizer_dir, tensors=stored)
    ref = run(path, 1)
    for share in ("50%", "100%"):
        same_threads = run(path, 1, host_experts=share, host_expert_threads=torch.get_num_threads())
        assert assert_same(ref, same_threads, f"kimi_k3 {share}") == 0.0


def test_accounting_counts_each_pair_on_its_side(ckpt, tmp_path):
    """With the popularity recorder on: host pairs = the recorded routed pairs of the host experts, device pairs =
    the rest, and all pairs = tokens forwarded x top-k x MoE layers (prompt + generated - 1 per sequence)."""
    path = ckpt("deepseek_v3")
    out_file = tmp_path / "pop.json"
    llm = LLM(path, host_experts="50%", record_expert_popularity=str(out_file), **ENGINE_KW)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=N_NEW, min_tokens=N_NEW)
        llm.generate([{"prompt_token_ids": p} for p in prompts()], sp, use_tqdm=False)
        hs = llm.llm_engine.get_stats()["host_experts"]
        from tokenfab.layers.host_experts import moe_expert_modules
        host_ids = {i: [m.start + j for j in m.host.host_local]
                    for i, m in moe_expert_modules(llm.llm_engine.runner.model).items()}
    finally:
        llm.llm_engine.shutdown()
    pop = json.loads(out_file.read_text())
    moe_layers = [1, 2]  # first_k_dense_replace = 1 of 3 layers
    assert sorted(int(k) for k in pop["layers"]) == moe_layers
    assert all(host_ids[i] == list(range(8, 16)) for i in moe_layers)  # 8 of 16, the highest ids (no popularity)
    tokens = sum(len(p) + N_NEW - 1 for p in prompts())
    assert pop["tokens"] == tokens
    assert sum(sum(pop["layers"][str(i)]) for i in moe_layers) == tokens * 2 * len(moe_layers)  # top-2
    host_pairs = sum(pop["layers"][str(i)][j] for i in moe_layers for j in host_ids[i])
    assert hs["host_pairs"] == host_pairs > 0
    assert hs["device_pairs"] == tokens * 2 * len(moe_layers) - host_pairs > 0
    assert hs["bytes_to_host"] == hs["bytes_to_device"] == host_pairs * 64 * 4  # hidden 64, float32 rows
    assert hs["layer_calls"] == hs["passes"] * len(moe_layers) and hs["passes"] > 0
    assert hs["resident_bytes"] == len(moe_layers) * 8 * 3 * 64 * 32 * 4  # 8 experts x (gate, up, down) 64 x 32


def test_popularity_keeps_the_most_used_on_the_device(ckpt, tmp_path):
    path = ckpt("deepseek_v3")
    counts = {"1": [5 * j for j in range(16)], "2": [100 - j for j in range(16)]}
    f = tmp_path / "pop.json"
    f.write_text(json.dumps({"layers": counts}))
    llm = LLM(path, num_device_experts=12, expert_popularity=str(f), **ENGINE_KW)
    from tokenfab.layers.host_experts import moe_expert_modules
    mods = moe_expert_modules(llm.llm_engine.runner.model)
    assert mods[1].host.host_local == [0, 1, 2, 3]  # layer 1: counts grow with the id, so the 4 lowest go
    assert mods[2].host.host_local == [12, 13, 14, 15]  # layer 2: counts fall with the id
    ref = reference("deepseek_v3", path)
    sp = SamplingParams(temperature=0.0, max_tokens=N_NEW, min_tokens=N_NEW, prompt_logprobs=0)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts()], sp, use_tqdm=False)
    assert_same(ref, got, "popularity")


# ------------------------------------------------------------------------------------------------ placement
def test_split_across_ranks_by_hand():
    from tokenfab.planner.expert_placement import split_across_ranks
    # 16 experts as 6 + 5 + 5; 8 to the host: exact shares 3, 2.5, 2.5 -> floors 3, 2, 2, one left to rank 1
    assert split_across_ranks(8, [(0, 6), (6, 11), (11, 16)]) == [3, 3, 2]
    assert split_across_ranks(16, [(0, 6), (6, 11), (11, 16)]) == [6, 5, 5]
    assert split_across_ranks(0, [(0, 6), (6, 11), (11, 16)]) == [0, 0, 0]


def test_placement_from_counts_by_hand():
    from tokenfab.planner.expert_placement import placement_from_counts
    p = placement_from_counts([1, 2], 16, [(0, 6), (6, 11), (11, 16)], host_experts="50%")
    assert p.host == {1: (3, 4, 5, 8, 9, 10, 14, 15), 2: (3, 4, 5, 8, 9, 10, 14, 15)}
    pop = {1: [0] * 16, 2: list(range(16))}
    pop[1][0] = pop[1][1] = 9  # ties otherwise: the higher id goes first
    q = placement_from_counts([1, 2], 16, [(0, 16)], host_experts=3, popularity=pop)
    assert q.host == {1: (13, 14, 15), 2: (0, 1, 2)}
    assert placement_from_counts([1], 16, [(0, 16)], num_device_experts=16).host == {1: ()}


def test_placement_from_memory_by_hand():
    from tokenfab.planner.expert_placement import placement_from_memory
    # 2 ranks x 4 experts, 3 layers, 10-byte experts. Rank 0 has 75 bytes: 7 slots -> 2 per layer + 1 more in the
    # first layer; rank 1 has 200 bytes: 20 slots, more than its 12 expert-layers -> all on the device.
    p = placement_from_memory([0, 1, 2], 8, [(0, 4), (4, 8)], 10, [75, 200])
    assert p.host == {0: (3,), 1: (2, 3), 2: (2, 3)}
    assert p.host_bytes() == 50 and p.host_bytes((4, 8)) == 0


@pytest.mark.parametrize("kw,field", [
    (dict(host_experts="150%"), "host_experts"), (dict(host_experts="half"), "host_experts"),
    (dict(host_experts=-1), "host_experts"), (dict(host_experts=0.5), "host_experts"),
    (dict(num_device_experts=-2), "num_device_experts"),
    (dict(host_experts="50%", num_device_experts=4), "num_device_experts"),
    (dict(expert_popularity="/nonexistent.json"), "expert_popularity"),
    (dict(host_experts="50%", expert_popularity="/nonexistent.json"), "expert_popularity"),
    (dict(host_experts="50%", host_expert_threads=0), "host_expert_threads"),
    (dict(record_expert_popularity="/no/such/folder/pop.json"), "record_expert_popularity"),
])
def test_bad_settings_refused_by_name(ckpt, kw, field):
    with pytest.raises(ValueError, match=field):
        LLM(ckpt("deepseek_v3"), **ENGINE_KW, **kw)


def test_count_above_experts_refused(ckpt):
    with pytest.raises(ValueError, match="host-experts.*16 routed experts"):
        LLM(ckpt("deepseek_v3"), host_experts=17, **ENGINE_KW)


def test_dense_model_refused(tiny_model):
    with pytest.raises(ValueError, match="no routed experts"):
        LLM(tiny_model("llama"), host_experts="50%", **ENGINE_KW)


def test_serve_flags_reach_the_engine():
    import argparse

    from tokenfab.commands.serve import add_engine_args
    from tokenfab.server.launch import engine_config_from_args
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--model", dest="model_flag", default=None)
    add_engine_args(p)
    with pytest.raises(ValueError, match="host_experts"):
        engine_config_from_args(p.parse_args(["/tmp", "--host-experts", "120%"]))


def test_metrics_and_bench_section():
    from tokenfab.bench.host_expert_metrics import format_host_experts, host_experts_result
    from tokenfab.server.metrics import ServerMetrics
    m = ServerMetrics("m")
    hs = dict(device_s=0.5, host_s=0.75, copy_s=0.125, wait_s=0.25, device_pairs=30, host_pairs=10,
              bytes_to_host=4096, bytes_to_device=4096, passes=10, layer_calls=20, resident_bytes=2**20)
    text = m.render({"host_experts": hs}).decode()
    assert 'tokenfab:host_experts_wait_seconds_total{model_name="m"} 0.25' in text
    assert 'tokenfab:host_experts_routed_pairs_total{model_name="m",side="host"} 10.0' in text
    before = {"device_seconds": 0.0, "host_seconds": 0.0, "copy_seconds": 0.0, "wait_seconds": 0.0,
              "forward_passes": 0.0, "pairs_device": 0.0, "pairs_host": 0.0}
    after = {"device_seconds": 0.5, "host_seconds": 0.75, "copy_seconds": 0.125, "wait_seconds": 0.25,
             "forward_passes": 10.0, "pairs_device": 30.0, "pairs_host": 10.0, "resident_bytes": 2.0**20}
    r = host_experts_result(before, after)
    assert r["host_experts_device_ms_per_pass"] == 50.0 and r["host_experts_wait_ms_per_pass"] == 25.0
    assert r["host_experts_exposed_ms_per_pass"] == 37.5 and r["host_experts_host_pair_share"] == 0.25
    assert any("Wait for host" in line for line in format_host_experts(r, lambda a, b, f="": f"{a} {b}"))
    assert host_experts_result(before, dict(before)) is None  # no forward pass: no section


# ------------------------------------------------------------------------------------------------ planner
def _k2_by_hand():
    """Kimi-K2 in bf16 on 4 ranks, by hand (h hidden, every split even: 16 heads, 40,960 vocab rows, 4,608 dense
    and 512 shared-expert intermediate channels, 96 experts per rank): bytes per rank without routed experts, one
    routed expert of one layer, and KV bytes per token."""
    h, E = 7168, 384
    attn = 1536 * h + 1536 + 16 * 192 * 1536 + 576 * h + 512 + 16 * 256 * 512 + h * 16 * 128 + 2 * h
    params = 61 * attn + 3 * h * 4608 + 60 * (E * h + E + 3 * h * 512) + 2 * 40960 * h + h
    return 2 * params, 2 * 3 * h * 2048, (512 + 64) * 61 * 2


def test_planner_splits_kimi_k2_by_hand():
    from test_planner import KIMI_K2
    from tokenfab.planner import plan_memory
    GiB, T = 2**30, 131072
    dense, expert, kv = _k2_by_hand()
    kw = dict(max_model_len=T, weight_dtype="bfloat16", activation_reserve="8GiB", offload_experts=True)
    mp = plan_memory(KIMI_K2, 4, 400 * GiB, **kw)
    assert all(r.weight_bytes_by_class["experts"] == 96 * 60 * expert for r in mp.ranks)
    assert all(sum(r.weight_bytes_by_class.values()) - r.weight_bytes_by_class["experts"] == dense for r in mp.ranks)
    slots = (400 * GiB - 8 * GiB - dense - T * kv) // expert  # expert-layers each device holds
    base, extra = divmod(slots, 60)  # every MoE layer gets `base`, the first `extra` layers one more
    assert (dense, expert, kv) == (7_495_576_576, 88_080_384, 70_272)
    assert (slots, base, extra) == (4588, 76, 28)  # 404,200,526,848 bytes free per device
    ep = mp.expert_placement
    for i, layer in enumerate(range(1, 61)):
        dev = base + (i < extra)
        assert ep.host[layer] == tuple(j for r in range(4) for j in range(96 * r + dev, 96 * r + 96))
    host = 60 * 96 - slots
    assert all(r.offloaded_bytes == host * expert for r in mp.ranks)
    assert all(r.weight_bytes == dense + slots * expert for r in mp.ranks)
    assert mp.fits and mp.max_kv_tokens >= T

    # host experts exactly when the weights exceed device memory: all of them fit -> none on the host; one byte
    # less -> one expert per rank, in the last MoE layer (the highest id of each range)
    fit_all = dense + 96 * 60 * expert + T * kv + 8 * GiB
    full = plan_memory(KIMI_K2, 4, fit_all, **kw)
    assert full.expert_placement.num_host() == 0 and full.fits and all(r.offloaded_bytes == 0 for r in full.ranks)
    tight = plan_memory(KIMI_K2, 4, fit_all - 1, **kw)
    assert {k: v for k, v in tight.expert_placement.host.items() if v} == {60: (95, 191, 287, 383)}
    assert tight.fits
    assert plan_memory(KIMI_K2, 4, fit_all, weight_dtype="bfloat16", activation_reserve="8GiB",
                       max_model_len=T).fits  # without offload the same memory fits too
    assert not plan_memory(KIMI_K2, 4, fit_all - 1, weight_dtype="bfloat16", activation_reserve="8GiB",
                           max_model_len=T).fits


def test_plan_cli_prints_the_split(tmp_path, capsys):
    from test_planner import KIMI_K2
    from tokenfab.cli import main
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K2))
    rc = main(["plan", str(tmp_path), "--devices", "4", "--device-memory", "400GiB", "--weight-dtype", "bfloat16",
               "--max-model-len", "128Ki", "--activation-reserve", "8GiB", "--host-experts", "25%", "--json"])
    out = json.loads(capsys.readouterr().out)
    _, expert, _ = _k2_by_hand()
    assert rc == 0 and out["expert_placement"]["host"]["1"] == [j for r in range(4) for j in range(96 * r + 72,
                                                                                                96 * r + 96)]
    assert out["expert_placement"]["host_bytes"] == 60 * 96 * expert and out["offload_experts"]
