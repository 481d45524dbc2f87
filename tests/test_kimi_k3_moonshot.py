"""Kimi K3 points where tokenfab follows Moonshot's own modeling code rather than a generic MoE: router
renormalization only when top_k > 1, MoE layer placement ``i >= first_k_dense_replace and i % moe_layer_freq == 0``,
and float32 where Moonshot computes in float32 (the latent routed sum, the KDA short-conv weights, beta's sigmoid).
Each is checked against a reference written here (formulas, float32/float64 accumulation), never tokenfab code.
"""
from __future__ import annotations

import math

import torch

from tokenfab import LLM
from tokenfab.config import parse_config
from test_kimi_k3 import TEXT, k3_tensors, naive_situ, naive_rms, write_k3

K3 = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3"}


def test_top1_router_is_not_renormalized(tmp_path, tokenizer_dir):
    """At top_k = 1 the routed weight is the raw sigmoid score times routed_scaling_factor (Moonshot renormalizes
    only when top_k > 1): the loaded model's latent MoE block equals the naive block without renormalization."""
    text = dict(TEXT, num_experts_per_token=1)
    assert parse_config(dict(K3, text_config=text)).norm_topk_prob is False
    assert parse_config(dict(K3, text_config=TEXT)).norm_topk_prob is True  # top_k = 2: renormalized
    stored, ref = k3_tensors(text)
    path = write_k3(str(tmp_path / "k3"), tokenizer_dir, text=text, tensors=stored)
    model = LLM(path, dtype="float32", device="cpu", progress=False).llm_engine.runner.model
    x = torch.randn(5, text["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model.model.layers[1].mlp(x).double()
    pre, b, lb = "model.layers.1.block_sparse_moe.", text["activation_situ_beta"], text["activation_situ_linear_beta"]
    xd = x.double()
    z = xd @ ref[pre + "routed_expert_down_proj.weight"].T
    y = torch.zeros_like(z)
    for t in range(x.shape[0]):
        s = [1 / (1 + math.exp(-float(xd[t] @ ref[pre + "gate.weight"][e]))) for e in range(text["num_experts"])]
        e = max(range(text["num_experts"]), key=lambda j: s[j] + float(ref[pre + "gate.e_score_correction_bias"][j]))
        w1, w3, w2 = (ref[f"{pre}experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2"))
        y[t] = s[e] * text["routed_scaling_factor"] * (naive_situ(z[t] @ w1.T, z[t] @ w3.T, b, lb) @ w2.T)
    y = naive_rms(y, ref[pre + "routed_expert_norm.weight"], text["rms_norm_eps"]) @ \
        ref[pre + "routed_expert_up_proj.weight"].T
    sh = pre + "shared_experts."
    want = y + naive_situ(xd @ ref[sh + "gate_proj.weight"].T, xd @ ref[sh + "up_proj.weight"].T, b, lb) @ \
        ref[sh + "down_proj.weight"].T
    assert (got - want).abs().max() < 1e-5


def test_moe_layer_placement_follows_moonshot():
    """first_k_dense_replace = 1, moe_layer_freq = 2 over 7 layers: MoE at i >= 1 with i % 2 == 0 -> [2, 4, 6]
    (the old (i - 1) % 2 rule gave [1, 3, 5])."""
    text = dict(TEXT, num_hidden_layers=7, moe_layer_freq=2,
                linear_attn_config=dict(TEXT["linear_attn_config"], kda_layers=[1, 3, 4, 5, 6, 7],
                                        full_attn_layers=[2]))
    assert parse_config(dict(K3, text_config=text)).moe_layers == [2, 4, 6]
    text3 = dict(text, first_k_dense_replace=3, moe_layer_freq=3)
    assert parse_config(dict(K3, text_config=text3)).moe_layers == [3, 6]


def test_latent_routed_sum_is_float32():
    """bf16 experts, the weighted sum over 16 chosen experts accumulated in float32 (Moonshot), not rounded to
    bf16 after every add: equals a float64 sum of the same bf16 expert outputs within float32 rounding, while a
    bf16 running sum misses by far more."""
    from tokenfab.models.kimi_moe import SituRoutedExperts, situ_glu
    g = torch.Generator().manual_seed(0)
    E, k, hid, inter, T = 32, 16, 64, 48, 7
    ex = SituRoutedExperts(E, hid, inter, 1.5, 2.0, accumulate_fp32=True).to(torch.bfloat16)
    with torch.no_grad():
        ex.w13.copy_(torch.randn(E, 2 * inter, hid, generator=g) * hid ** -0.5)
        ex.w2.copy_(torch.randn(E, hid, inter, generator=g) * inter ** -0.5)
    x = torch.randn(T, hid, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g) * 0.3
    with torch.no_grad():
        got = ex(x, w, ids)
        # per-expert outputs exactly as the grouped GEMMs compute them (same rows per expert, same order)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        want = torch.zeros(T, hid, dtype=torch.float64)
        bf16_sum = torch.zeros(T, hid, dtype=torch.bfloat16)
        for e in range(E):
            sel = order[flat[order] == e]
            if len(sel) == 0:
                continue
            tok = sel // k
            h = situ_glu(x[tok] @ ex.w13[e].t(), 1.5, 2.0) @ ex.w2[e].t()
            contrib = h.float() * w.reshape(-1)[sel, None]
            want.index_add_(0, tok, contrib.double())
            bf16_sum.index_add_(0, tok, contrib.to(torch.bfloat16))
    assert got.dtype == torch.float32
    scale = want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err < 1e-6 * scale * k
    assert (bf16_sum.double() - want).abs().max().item() > 20 * max(err, 1e-7 * scale)


def test_kda_short_conv_weights_and_beta_stay_float32(tmp_path, tokenizer_dir):
    """In a bf16 engine the KDA short-conv weights keep the checkpoint's float32 values exactly, and beta is
    sigmoid taken in float32 of b_proj's output (the GPU kernel takes the same float32 sigmoid:
    tests/test_triton_kda.py)."""
    from tokenfab.layers.kda import _Gates
    stored, _ = k3_tensors(TEXT)
    name = "language_model.model.layers.0.self_attn.q_conv1d.weight"
    stored[name] = stored[name] + 1e-3 * torch.rand_like(stored[name])  # values bf16 cannot hold
    path = write_k3(str(tmp_path / "k3"), tokenizer_dir, tensors=stored)
    model = LLM(path, dtype="bfloat16", device="cpu", progress=False).llm_engine.runner.model
    attn = model.model.layers[0].self_attn
    assert attn.q_conv1d.weight.dtype == torch.float32
    assert torch.equal(attn.q_conv1d.weight.data, stored[name].float())
    x = torch.randn(9, TEXT["hidden_size"], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        _qkv, g_raw, logits, _gate = attn._project(x)  # logits: b_proj's columns of the joined projection
        beta = _Gates(attn, g_raw, logits).padded()[1][:9]
    assert logits.dtype == torch.bfloat16 and logits.shape == (9, attn.num_heads)
    assert beta.dtype == torch.float32
    want = 1 / (1 + torch.exp(-logits.double()))
    assert (beta.double() - want).abs().max() < 1e-7
    assert (torch.sigmoid(logits).double() - want).abs().max() > 1e-4  # what a bf16 sigmoid would lose
