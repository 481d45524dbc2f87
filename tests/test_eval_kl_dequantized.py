"""``tokenfab eval kl --reference dequantized``: a GGUF file served packed against transformers on the same weights
dequantized to float32 (tokenfab/eval/kl.py, loader/gguf_to_hf.py's float32 folder), on a tiny qwen3 K-quant file.

float32 activations: the packed kernels differ from the float32 reference only by float32 accumulation order, so
KL is at rounding level (< 1e-8 nats) with every top-1 the same; bfloat16 activations: KL is reported, positive and
small. A reference on other weights (the bf16-rounded cache folder's siblings, a wrong dequantization) would give
KL many orders of magnitude larger.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

gguf = pytest.importorskip("gguf")

from test_gguf_qwen import tiny_qwen, write_qwen_gguf  # noqa: E402
from tokenfab.eval.kl import run_kl  # noqa: E402


@pytest.fixture
def tiny_gguf(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFAB_CACHE", str(tmp_path / "cache"))
    path = str(tmp_path / "tiny-qwen3.gguf")
    write_qwen_gguf(tiny_qwen(tiny_model, "qwen3"), path, "qwen3")
    return path


def test_kl_against_dequantized_weights(tiny_gguf, tokenizer_dir, tmp_path):
    kw = dict(reference="dequantized", tokenizer=tokenizer_dir, random_rows=2, row_len=12, decode_steps=4,
              temperature=1.0, max_model_len=64, progress=False)
    res = run_kl(tiny_gguf, dtype="float32", out_dir=str(tmp_path / "out"), **kw)
    assert res["reference"] == "dequantized"
    ref_dir = res["reference_model"]
    assert ref_dir.endswith("-float32")
    src = json.load(open(os.path.join(ref_dir, "gguf_source.json")))
    assert src["stored_dtype"] == "float32"
    from safetensors.torch import load_file
    sd = load_file(os.path.join(ref_dir, "model.safetensors"))
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    for p in ("prefill", "decode_greedy", "decode_sampled"):
        s = res["paths"][p]
        assert s["positions"] > 0 and s["top1_agreement"] == 1.0, p
        assert s["max_kl"] < 1e-8, (p, s["max_kl"])
    bf = run_kl(tiny_gguf, dtype="bfloat16", **kw)
    s = bf["paths"]["prefill"]
    assert s["positions"] == 24 and 0 < s["mean_kl"] < 0.05


def test_dequantized_reference_refuses_other_inputs(tiny_gguf, tiny_model):
    from tokenfab.eval import usage_error
    err = type(usage_error("x"))
    with pytest.raises(err, match="MODEL must be a packed checkpoint"):
        run_kl(tiny_model("llama"), reference="dequantized", progress=False)
    with pytest.raises(err, match="drop --reference-model"):
        run_kl(tiny_gguf, reference="dequantized", reference_model=tiny_model("llama"), progress=False)
    with pytest.raises(err, match="use --reference dequantized"):
        run_kl(tiny_gguf, reference="transformers", progress=False)
