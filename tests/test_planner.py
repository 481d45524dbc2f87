"""Memory planner: KV bytes, weight bytes from config and from safetensors headers, fit verdicts, CLI."""
from __future__ import annotations

import json
import os

import pytest

from tokenfab.cli import main
from tokenfab.config import parse_config
from tokenfab.parallel import ShardPlan, count_parameters
from tokenfab.planner import (
    PlanError,
    checkpoint_tensors,
    estimate_weight_bytes,
    kv_bytes_per_token_per_rank,
    kv_pool_tokens,
    parse_count,
    parse_reserve,
    parse_size,
    plan_memory,
)

# Published Kimi-K2 config.json shape (transformers 4.x dialect), no weights.
KIMI_K2 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", vocab_size=163840, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
    num_key_value_heads=64, n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8,
    first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=131072, n_group=1, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=2.827, scoring_func="sigmoid", topk_method="noaux_tc",
    rms_norm_eps=1e-6, hidden_act="silu", num_nextn_predict_layers=0, tie_word_embeddings=False,
    torch_dtype="bfloat16", rope_theta=50000.0,
    rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
)

GiB = 2**30
# The published Kimi-K2-Instruct checkpoint is block-FP8; its config.json says so.
KIMI_K2_FP8 = dict(KIMI_K2, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3",
                                                  "quant_method": "fp8", "weight_block_size": [128, 128]})


def test_kimi_kv_bytes_per_token():
    mc = parse_config(KIMI_K2)
    plan = ShardPlan.for_model(mc, 6)
    assert kv_bytes_per_token_per_rank(mc, plan, 2) == [(512 + 64) * 61 * 2] * 6 == [70_272] * 6
    assert kv_bytes_per_token_per_rank(mc, plan, 1) == [35_136] * 6  # fp8 KV


def test_kimi_parameter_count_by_hand():
    """Parameters, from the formulas (h hidden, L layers, H heads, E experts, V vocab):
    attention per layer = q_a (1536 h) + q_a_norm 1536 + q_b (H x 192 x 1536) + kv_a ((512 + 64) h) + kv_a_norm 512
                          + kv_b (H x (128 + 128) x 512) + o (h x H x 128) + 2 norms (2 h)
    dense MLP (layer 0) = 3 h x 18432;  MoE layer = router E h + bias E + 3 h x 2048 x (E + 1 shared)
    plus embed V h, lm_head V h, final norm h.
    """
    h, L, H, V, E = 7168, 61, 64, 163840, 384
    attn = 1536 * h + 1536 + H * 192 * 1536 + 576 * h + 512 + H * 256 * 512 + h * H * 128 + 2 * h
    total = L * attn + 3 * h * 18432 + 60 * (E * h + E + 3 * h * 2048 * (E + 1)) + 2 * V * h + h
    assert total == 1_026_408_232_448
    assert count_parameters(parse_config(KIMI_K2)) == total
    est = estimate_weight_bytes(KIMI_K2, 6, "bfloat16")
    assert est.total_bytes == 2 * total and est.num_params == total
    # per-rank sum = one copy + 5 further copies of the replicated tensors (norms, router, q_a, kv_a)
    assert sum(sum(d.values()) for d in est.per_rank) == est.total_bytes + 5 * est.replicated_bytes
    assert est.replicated_bytes == 2 * (61 * (1536 * h + 576 * h + 1536 + 512 + 2 * h) + 60 * (E * h + E) + h)


def test_kimi_1m_tokens_on_6_x_288gib_fits_with_fp8_checkpoint():
    mp = plan_memory(KIMI_K2_FP8, 6, 288 * GiB, kv_tokens=1_000_000)
    assert mp.weights.weight_format == "fp8" and mp.kv_dtype_bytes == 2
    reserve = int(288 * GiB * 0.10)
    assert mp.reserve_bytes == reserve
    heaviest = max(r.weight_bytes for r in mp.ranks)
    assert 155 * GiB < heaviest < 165 * GiB  # ~1.03 TB of FP8 weights + scales over 6 ranks
    assert mp.max_kv_tokens == (288 * GiB - reserve - heaviest) // 70_272
    assert mp.max_kv_tokens > 1_000_000
    assert mp.fits and mp.weights_fit and not mp.suggestions
    # one copy of the FP8 checkpoint is ~1.03 TB; per-rank sums add the replicated tensors and straddling scales
    assert 1.02e12 < mp.weights.total_bytes < 1.04e12
    assert sum(sum(r.weight_bytes_by_class.values()) for r in mp.ranks) >= mp.weights.total_bytes


def test_kimi_1m_tokens_bf16_weights_on_288gib_does_not_fit():
    mp = plan_memory(KIMI_K2, 6, 288 * GiB, kv_tokens=1_000_000, weight_dtype="bfloat16")
    assert not mp.weights_fit and not mp.fits  # ~320 GiB of bf16 weights per rank
    assert mp.min_devices is not None and mp.min_devices > 6
    assert any(s.startswith(f"use {mp.min_devices} devices") for s in mp.suggestions)


def test_kimi_1m_tokens_on_6_x_141gb_does_not_fit_and_suggests():
    mp = plan_memory(KIMI_K2_FP8, 6, parse_size("141GB"), kv_tokens=1_000_000)
    assert not mp.fits and not mp.weights_fit
    m = mp.min_devices
    assert m is not None and m > 6
    assert plan_memory(KIMI_K2_FP8, m, 141 * 10**9, kv_tokens=1_000_000).fits
    assert not plan_memory(KIMI_K2_FP8, m - 1, 141 * 10**9, kv_tokens=1_000_000).fits
    assert any(f"use {m} devices" in s for s in mp.suggestions)
    off = [s for s in mp.suggestions if s.startswith("--offload-experts")]
    assert off and " fits " in off[0] and "host memory" in off[0]
    mo = plan_memory(KIMI_K2_FP8, 6, 141 * 10**9, kv_tokens=1_000_000, offload_experts=True)
    assert mo.fits
    # the devices are filled with experts first (tests/test_host_experts.py): only the rest go to host memory
    assert all(0 < r.offloaded_bytes < r.weight_bytes_by_class["experts"] for r in mo.ranks)
    assert all(r.weight_bytes == sum(r.weight_bytes_by_class.values()) - r.offloaded_bytes for r in mo.ranks)


def test_kv_pool_tokens_formula():
    mc = parse_config(KIMI_K2)
    t = kv_pool_tokens(mc, 6, 100 * GiB, [60 * GiB, 61 * GiB, 60 * GiB, 60 * GiB, 60 * GiB, 60 * GiB], 2, 10 * GiB)
    assert t == (100 * GiB - 10 * GiB - 61 * GiB) // 70_272
    assert kv_pool_tokens(mc, 6, 100 * GiB, 60 * GiB, 2, 10 * GiB, block_size=256) % 256 == 0
    assert kv_pool_tokens(mc, 6, 100 * GiB, 95 * GiB, 2, 10 * GiB) == 0


def test_gqa_kv_bytes_follow_kv_heads():
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=128, intermediate_size=100,
               num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=128)
    mc = parse_config(cfg)
    # 3 ranks > 2 KV heads: each rank stores one KV head (head 0 replicated on ranks 0 and 1)
    assert kv_bytes_per_token_per_rank(mc, ShardPlan.for_model(mc, 3), 2) == [2 * 1 * 16 * 3 * 2] * 3
    assert kv_bytes_per_token_per_rank(mc, ShardPlan.for_model(mc, 1), 2) == [2 * 2 * 16 * 3 * 2]
    est = estimate_weight_bytes(cfg, 3, "float32")
    # k_proj/v_proj rows of KV head 0 are held twice: sum = one copy + 2 extra norms copies + one extra KV head
    extra_kv_head = 2 * 3 * 16 * 128 * 4  # k and v, 3 layers, 16 rows of 128 inputs, fp32
    assert sum(sum(d.values()) for d in est.per_rank) == est.total_bytes + 2 * est.replicated_bytes + extra_kv_head


def test_sizes_counts_and_reserve():
    assert parse_size("288GiB") == 288 * 2**30
    assert parse_size("141GB") == 141 * 10**9
    assert parse_size("80G") == 80 * 10**9
    assert parse_size("80Gi") == 80 * 2**30
    assert parse_size("1.5TB") == 1_500_000_000_000
    assert parse_size("1024") == 1024
    assert parse_count("1M", "--kv-tokens") == 1_000_000
    assert parse_count("128Ki", "--max-model-len") == 131072
    assert parse_reserve("10%", 1000) == 100
    assert parse_reserve("8GiB", 1000) == 8 * 2**30
    for bad in ("288XB", "GiB", "", "12 parsecs", "-5G"):
        with pytest.raises(PlanError, match="--device-memory"):
            parse_size(bad, "--device-memory")
    with pytest.raises(PlanError, match="--activation-reserve"):
        parse_reserve("150%", 1000)
    with pytest.raises(PlanError, match="--kv-tokens"):
        parse_count("lots", "--kv-tokens")


def _write_cfg(tmp_path, cfg) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_cli_bad_device_memory_names_the_flag(tmp_path, capsys):
    cfg = _write_cfg(tmp_path, KIMI_K2)
    rc = main(["plan", cfg, "--devices", "6", "--device-memory", "288XB"])
    err = capsys.readouterr().err
    assert rc == 2 and "--device-memory" in err and "288XB" in err


def test_cli_json_and_table(tmp_path, capsys):
    cfg = _write_cfg(tmp_path, KIMI_K2_FP8)
    rc = main(["plan", cfg, "--devices", "6", "--device-memory", "288GiB", "--kv-tokens", "1M", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] is True and out["max_kv_tokens"] > 1_000_000
    assert [r["kv_bytes_per_token"] for r in out["ranks"]] == [70_272] * 6
    assert out["ranks"][0]["experts"] == [0, 64] and out["weights"]["format"] == "fp8"
    rc = main(["plan", str(tmp_path), "--devices", "6", "--device-memory", "141GB", "--kv-tokens", "1M"])
    text = capsys.readouterr().out
    assert rc == 1 and "DOES NOT FIT" in text and "--offload-experts" in text


# ------------------------------------------------------------------------------------- safetensors headers
TINY_DSV3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=100, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
    max_position_embeddings=256, n_group=1, topk_group=1, num_nextn_predict_layers=1,
)


def _write_tiny_checkpoint(folder):
    import torch
    from safetensors.torch import save_file

    a = {
        "model.embed_tokens.weight": torch.zeros(100, 64, dtype=torch.bfloat16),                       # 12,800 B
        "model.layers.0.self_attn.q_b_proj.weight": torch.zeros(4 * 32, 48, dtype=torch.float8_e4m3fn),  # 6,144 B
        "model.layers.0.self_attn.q_b_proj.weight_scale_inv": torch.ones(1, 1, dtype=torch.float32),     # 4 B
    }
    b = {
        "model.layers.1.mlp.experts.3.down_proj.weight_packed": torch.zeros(64, 32 // 8, dtype=torch.int32),  # 1,024
        "model.layers.1.mlp.experts.3.down_proj.weight_shape": torch.tensor([64, 32], dtype=torch.int32),    # 8 B
        "model.layers.2.eh_proj.weight": torch.zeros(64, 128, dtype=torch.bfloat16),  # MTP layer: not loaded
    }
    save_file(a, os.path.join(folder, "model-00001-of-00002.safetensors"))
    save_file(b, os.path.join(folder, "model-00002-of-00002.safetensors"))
    wm = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in b}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(TINY_DSV3, f)


def test_safetensors_header_dtypes_and_bytes(tmp_path):
    _write_tiny_checkpoint(str(tmp_path))
    # Only headers are read: truncating the tensor data away must not matter.
    for fn in os.listdir(tmp_path):
        if fn.endswith(".safetensors"):
            p = tmp_path / fn
            with open(p, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
            os.truncate(p, 8 + n)
    recs = {r.name: r for r in checkpoint_tensors(str(tmp_path))}
    assert recs["model.embed_tokens.weight"].dtype == "BF16"
    assert recs["model.embed_tokens.weight"].nbytes == 100 * 64 * 2
    assert recs["model.layers.0.self_attn.q_b_proj.weight"].dtype == "F8_E4M3"
    assert recs["model.layers.0.self_attn.q_b_proj.weight"].nbytes == 128 * 48
    assert recs["model.layers.0.self_attn.q_b_proj.weight_scale_inv"].nbytes == 4
    assert recs["model.layers.1.mlp.experts.3.down_proj.weight_packed"].dtype == "I32"
    assert recs["model.layers.1.mlp.experts.3.down_proj.weight_packed"].nbytes == 64 * 4 * 4

    est = estimate_weight_bytes(str(tmp_path), 2)  # auto: real dtypes from the headers
    assert est.source == "safetensors" and "F8_E4M3" in est.weight_format
    assert est.skipped_bytes == 64 * 128 * 2  # MTP layer 2 (num_hidden_layers = 2)
    assert est.total_bytes == 12_800 + 6_144 + 4 + 1_024 + 8
    r0, r1 = est.per_rank
    assert r0["embed"] == r1["embed"] == 6_400                 # 50 vocab rows each
    assert r0["attn_q"] == r1["attn_q"] == 3_072 + 4           # 2 heads each; the one 128-row scale block on both
    assert r0["experts"] == 1_024 + 8 and r1["experts"] == 0   # expert 3 of 8 lives on rank 0


def test_single_safetensors_file_and_config_json_path(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(100, 64, dtype=torch.float32)},
              str(tmp_path / "model.safetensors"))
    cfg = _write_cfg(tmp_path, TINY_DSV3)
    est = estimate_weight_bytes(cfg, 3)
    assert est.source == "safetensors" and est.total_bytes == 100 * 64 * 4
    assert [d["embed"] for d in est.per_rank] == [34 * 256, 33 * 256, 33 * 256]
    # an explicit --weight-dtype computes from the config instead
    assert estimate_weight_bytes(cfg, 3, "bfloat16").source == "config"


def test_auto_weight_format_reads_quantization_config():
    from tokenfab.planner.memory_planner import auto_weight_format

    assert auto_weight_format(parse_config(KIMI_K2_FP8)) == "fp8"
    assert auto_weight_format(parse_config(KIMI_K2)) == "bfloat16"
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32,
                                                                             "symmetric": True}}}}
    mc = parse_config(dict(KIMI_K2, quantization_config=ct))
    assert auto_weight_format(mc) == "int4"
    est = estimate_weight_bytes(dict(KIMI_K2, quantization_config=ct), 6)
    assert est.weight_format == "int4" and 0.55e12 < est.total_bytes < 0.62e12  # K2-Thinking is ~594 GB
