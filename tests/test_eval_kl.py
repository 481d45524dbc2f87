"""tokenfab eval kl: the statistics, float32 fidelity on every family (prefill + decode), and fault detection."""
from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

from tokenfab import Logprob
from tokenfab.eval.kl import (dense_from_logprob_dicts, kl_divergence, load_rows, run_kl, summarize,
                              top1_agreement)
from tokenfab.testing.tiny_checkpoints import FAMILIES, make_tiny_checkpoint
from tokenfab.testing.tokenizer_builder import build_tokenizer


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eval_kl_models")
    tok = build_tokenizer(str(root / "tokenizer"), vocab_size=512)
    return {f: make_tiny_checkpoint(str(root / f), f, seed=7, tokenizer_dir=tok) for f in FAMILIES}


# ---- statistics ------------------------------------------------------------------------------------------------
def test_kl_hand_computed():
    p = torch.tensor([[0.5, 0.5], [0.1, 0.9]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.75], [0.1, 0.9]], dtype=torch.float64)
    kl = kl_divergence(p.log(), q.log())
    want0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl[0].item() == pytest.approx(want0, rel=1e-12)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-15)
    # direction: KL(p||q) != KL(q||p)
    assert kl_divergence(q.log(), p.log())[0].item() != pytest.approx(want0, rel=1e-3)


def test_kl_renormalises_and_is_nonnegative_under_rounding():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=g, dtype=torch.float64) * 3
    ref = torch.log_softmax(logits, -1)
    test = (ref + 0.7).to(torch.float32)  # unnormalised by a constant, plus float32 rounding
    kl = kl_divergence(ref, test)
    assert (kl >= 0).all() and kl.max().item() < 1e-10
    assert top1_agreement(ref, test).all()


def test_kl_infinite_when_test_gives_zero_mass():
    ref = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    test = torch.tensor([[0.0, float("-inf")]], dtype=torch.float64)
    assert math.isinf(kl_divergence(ref, test)[0].item())


def test_dense_from_dicts_and_partial_dict_error():
    d = [{2: Logprob(math.log(0.5)), 0: Logprob(math.log(0.25)), 1: Logprob(math.log(0.25))}]  # as the engine
    dense = dense_from_logprob_dicts(d, 3)
    assert torch.allclose(dense.exp(), torch.tensor([[0.25, 0.25, 0.5]], dtype=torch.float64))
    with pytest.raises(ValueError, match="full vocabulary"):
        dense_from_logprob_dicts([{0: Logprob(0.0)}], 3)


def test_summarize_counts():
    s = summarize([np.array([1e-3, 3e-3]), np.array([2e-3])], [np.array([True, False]), np.array([True])])
    assert s["rows"] == 2 and s["positions"] == 3 and s["top1_mismatches"] == 1
    assert s["mean_kl"] == pytest.approx(2e-3) and s["max_kl"] == pytest.approx(3e-3)
    assert s["top1_agreement"] == pytest.approx(2 / 3)


def test_load_rows(tmp_path):
    rows = load_rows(None, None, 100, random_rows=3, row_len=7, seed=1)
    assert len(rows) == 3 and all(len(r) == 7 and 0 <= min(r) and max(r) < 100 for r in rows)
    assert rows == load_rows(None, None, 100, random_rows=3, row_len=7, seed=1)
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt_token_ids": [1, 2, 3, 4]}) + "\n" + json.dumps({"prompt_token_ids": [5, 6]}))
    assert load_rows(str(f), None, 100, row_len=3) == [[1, 2, 3], [5, 6]]
    f.write_text(json.dumps({"foo": 1}))
    with pytest.raises(ValueError, match="--dataset"):
        load_rows(str(f), None, 100)


# ---- fidelity on every family ----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_float32_fidelity_prefill_and_decode(tiny_models, family, tmp_path):
    res = run_kl(tiny_models[family], random_rows=2, row_len=40, decode_steps=5, temperature=1.0,
                 dtype="float32", max_model_len=128, progress=False, out_dir=str(tmp_path))
    p = res["paths"]
    assert p["prefill"]["positions"] == 2 * 40
    assert p["decode_greedy"]["positions"] == 2 * 4 and p["decode_sampled"]["positions"] == 2 * 4
    for name, s in p.items():
        assert s["rows"] == 2, name
        assert s["max_kl"] < 1e-6, (name, s)
        assert s["top1_agreement"] == 1.0, (name, s)
    assert os.path.isfile(tmp_path / "kl.json") and "| prefill |" in (tmp_path / "kl.md").read_text()


def test_no_model_means_the_default_model(tiny_models, monkeypatch):
    """MODEL omitted: the default model of every command (default_model_path: SmolLM2 when installed), not the
    embedded random one."""
    import tokenfab.default_model as dm
    monkeypatch.setattr(dm, "default_model_path", lambda quiet=False: tiny_models["llama"])
    monkeypatch.setattr(dm, "ensure_default_model", lambda *a, **k: pytest.fail("the embedded model was used"))
    res = run_kl(None, random_rows=1, row_len=12, decode_steps=0, dtype="float32", max_model_len=64,
                 progress=False)
    assert res["model"] == os.path.abspath(tiny_models["llama"])


# ---- fault detection -------------------------------------------------------------------------------------------
def _corrupt_copy(src: str, dst: str, **rope_updates) -> str:
    shutil.copytree(src, dst)
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["rope_parameters"].update(rope_updates)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.mark.parametrize("fault", [{"mscale_all_dim": 2.0}, {"factor": 4.0}], ids=["mscale_all_dim", "factor"])
def test_misread_yarn_parameter_raises_kl(tiny_models, fault, tmp_path):
    """tokenfab runs a copy whose config.json misstates a YaRN parameter; the reference reads the original. With rows
    longer than original_max_position_embeddings (64) the KL must rise by orders of magnitude."""
    src = tiny_models["deepseek_v3"]
    with open(os.path.join(src, "config.json")) as f:
        rp = json.load(f)["rope_parameters"]
    assert rp["original_max_position_embeddings"] == 64 and rp["factor"] == 40.0
    kw = dict(random_rows=1, row_len=96, decode_steps=4, temperature=0.0, dtype="float32", max_model_len=128,
              progress=False, seed=3)
    good = run_kl(src, **kw)["paths"]
    bad = run_kl(_corrupt_copy(src, str(tmp_path / "bad"), **fault), reference_model=src, **kw)["paths"]
    for path in ("prefill", "decode_greedy"):
        assert good[path]["mean_kl"] < 1e-9
        assert bad[path]["mean_kl"] > 1e-4, (path, bad[path])
        assert bad[path]["mean_kl"] > 1e4 * good[path]["mean_kl"], (path, good[path], bad[path])
    assert bad["prefill"]["top1_agreement"] < 1.0


def test_cli_writes_outputs_and_names_bad_flags(tiny_models, tmp_path, capsys):
    from tokenfab.cli import main
    out = tmp_path / "o"
    rc = main(["eval", "kl", tiny_models["llama"], "--random-rows", "1", "--row-len", "12", "--decode-steps", "3",
               "--temperature", "0", "--max-model-len", "64", "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads((out / "kl.json").read_text())
    assert res["paths"]["prefill"]["positions"] == 12 and res["paths"]["decode_sampled"]["rows"] == 0
    assert "prefill" in capsys.readouterr().out
    rc = main(["eval", "kl", tiny_models["llama"], "--random-rows", "1", "--row-len", "60", "--decode-steps", "8",
               "--max-model-len", "64", "--out", str(out), "--no-progress"])
    assert rc == 2
    assert "--row-len" in capsys.readouterr().err
