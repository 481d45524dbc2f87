"""The planner's long-context numbers for Kimi K3's shape (benchmarks/configs/kimi-k3-shape.json, the published
text shape also used by tests/test_kimi_k3.py): per-token KV of the MLA layers and per-request KDA state, computed
here by hand from the config's own fields, and the 1,052,672-token pool on 6 and on 4..8 devices.

Results table: benchmarks/results/2026-12-01-k3-long-context-plan.md.
"""
from __future__ import annotations

import json
import os

import pytest

from tokenfab.cli import main
from tokenfab.planner.memory_planner import plan_device_sweep, plan_memory
from tokenfab.planner.plan_inputs import PlanError, parse_device_counts
from tokenfab.planner.plan_report import sweep_rows

CONFIG = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "configs", "kimi-k3-shape.json")
POOL = 1_052_672
GB = 10**9


@pytest.fixture(scope="module")
def k3():
    with open(CONFIG) as f:
        return json.load(f)


def hand_kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    """(kv_lora_rank + qk_rope_head_dim) x MLA layers x bytes; MLA layers = the 1-indexed full_attn_layers."""
    t = cfg["text_config"]
    return (t["kv_lora_rank"] + t["qk_rope_head_dim"]) * len(t["linear_attn_config"]["full_attn_layers"]) * dtype_bytes


def hand_kda_state_bytes(cfg: dict, dtype_bytes: int = 2, heads: int | None = None) -> int:
    """Per request over all KDA layers: conv state of q, k, v (3 x heads x head_dim channels x (kernel - 1) taps,
    activation dtype) + the fp32 recurrent state heads x head_dim x head_dim."""
    lac = cfg["text_config"]["linear_attn_config"]
    h = lac["num_heads"] if heads is None else heads
    d, taps = lac["head_dim"], lac["short_conv_kernel_size"] - 1
    return len(lac["kda_layers"]) * (3 * h * d * taps * dtype_bytes + h * d * d * 4)


def test_k3_kv_bytes_per_token_and_kda_state_by_hand(k3):
    mp = plan_memory(CONFIG, 6, 288 * GB, kv_tokens=POOL, max_num_seqs=16)
    assert hand_kv_bytes_per_token(k3) == 27_648  # (512 + 64) x 24 x 2
    assert all(r.kv_bytes_per_token == hand_kv_bytes_per_token(k3) for r in mp.ranks)
    assert mp.model["kda_state_bytes_per_request"] == hand_kda_state_bytes(k3) == 449_372_160
    # 96 KDA heads over 6 ranks: 16 each; 16 requests' state reserved on every rank
    assert all(r.state_bytes == 16 * hand_kda_state_bytes(k3, heads=16) for r in mp.ranks)


def test_k3_pool_is_free_memory_over_kv_bytes(k3):
    """max KV tokens = (device memory - reserve - weights - KDA state) // KV bytes per token, fullest rank."""
    mem, seqs = 288 * GB, 4
    for reserve in ("10%", "4GiB"):
        mp = plan_memory(CONFIG, 6, mem, kv_tokens=POOL, max_num_seqs=seqs, activation_reserve=reserve)
        state = seqs * hand_kda_state_bytes(k3, heads=16)
        free = min(mem - mp.reserve_bytes - r.weight_bytes - state for r in mp.ranks)
        assert mp.max_kv_tokens == max(free, 0) // hand_kv_bytes_per_token(k3)
        assert mp.fits == (free >= POOL * hand_kv_bytes_per_token(k3))


def test_k3_device_sweep_rows_agree_with_single_plans(k3):
    plans = plan_device_sweep(CONFIG, [4, 6, 8], 141 * GB, kv_tokens=POOL, max_num_seqs=16)
    for mp, row in zip(plans, sweep_rows(plans)):
        single = plan_memory(CONFIG, row["devices"], 141 * GB, kv_tokens=POOL, max_num_seqs=16)
        assert row["max_kv_tokens"] == single.max_kv_tokens and row["fits"] == single.fits
        assert row["kv_bytes_per_rank"] == POOL * hand_kv_bytes_per_token(k3)
        assert row["fits"] == (row["headroom_bytes"] >= 0)


def test_parse_device_counts():
    assert parse_device_counts("4-8") == [4, 5, 6, 7, 8]
    assert parse_device_counts("4-6,8,12") == [4, 5, 6, 8, 12]
    for bad in ("8-4", "0", "four", "4-"):
        with pytest.raises(PlanError, match="--sweep-devices"):
            parse_device_counts(bad)
    with pytest.raises(PlanError, match="--max-num-seqs"):
        plan_memory(CONFIG, 6, 288 * GB, max_num_seqs=0)


def test_cli_sweep_prints_a_row_per_device_count(capsys):
    rc = main(["plan", CONFIG, "--device-memory", "141GB", "--kv-tokens", str(POOL), "--sweep-devices", "4-8",
               "--max-num-seqs", "16", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert [r["devices"] for r in out["rows"]] == [4, 5, 6, 7, 8]
    assert rc == (0 if any(r["fits"] for r in out["rows"]) else 1)
    rc = main(["plan", CONFIG, "--device-memory", "141GB", "--sweep-devices", "4-x"])
    assert rc != 0 and "--sweep-devices" in capsys.readouterr().err


def test_cli_weight_format_the_family_cannot_take_names_the_flag(capsys):
    rc = main(["plan", CONFIG, "--device-memory", "141GB", "--weight-dtype", "fp8"])
    err = capsys.readouterr().err
    assert rc != 0 and "--weight-dtype" in err and "Traceback" not in err
