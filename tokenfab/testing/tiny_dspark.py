"""Tiny random DSpark drafters written in the two published layouts (tests and benchmarks; no network).

:func:`write_tiny_dspark` writes ``config.json`` + ``model.safetensors`` shaped like SpecForge's
``configs/kimi-k3-dspark-5mla.json`` / ``-4kda-1mla.json`` (``layout="specforge"``) or a speculators
``speculators_model_type: "dspark"`` folder (``layout="speculators"``), with random weights at a given size.
"""
from __future__ import annotations

import json
import os

import torch

MLA = dict(num_attention_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16)
KDA = {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
       "use_full_rank_gate": True}


def dspark_tensors(layer_types: list[str], hidden: int, target_hidden: int, n_taps: int, vocab: int,
                   intermediate: int, markov_rank: int, confidence: bool, layout: str, seed: int = 0,
                   mla: dict = MLA, kda: dict = KDA, output_gate: bool = True) -> dict[str, torch.Tensor]:
    """Random float32 tensors with the published names (speculators: ``markov_head.*`` / ``confidence_head.proj``;
    SpecForge: the same plus an ``embed_tokens`` copy and KDA conv kernels stored [channels, K])."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s, std=1.0: torch.randn(*s, generator=g) * std
    lin = lambda o, i: rn(o, i, std=i ** -0.5)
    d = hidden
    t = {"fc.weight": lin(d, n_taps * target_hidden), "hidden_norm.weight": 1 + rn(d, std=0.1),
         "norm.weight": 1 + rn(d, std=0.1)}
    H, nope, rope, vd, C, ql = (mla[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                                 "v_head_dim", "kv_lora_rank", "q_lora_rank"))
    Hk, Dk, K = kda["num_heads"], kda["head_dim"], kda["short_conv_kernel_size"]
    for i, kind in enumerate(layer_types):
        L = f"layers.{i}."
        t[L + "input_layernorm.weight"], t[L + "post_attention_layernorm.weight"] = 1 + rn(d, std=0.1), \
            1 + rn(d, std=0.1)
        t[L + "mlp.gate_proj.weight"], t[L + "mlp.up_proj.weight"] = lin(intermediate, d), lin(intermediate, d)
        t[L + "mlp.down_proj.weight"] = lin(d, intermediate)
        a = L + "self_attn."
        if kind == "mla":
            t[a + "q_a_proj.weight"], t[a + "q_a_layernorm.weight"] = lin(ql, d), 1 + rn(ql, std=0.1)
            t[a + "q_b_proj.weight"] = lin(H * (nope + rope), ql)
            t[a + "kv_a_proj_with_mqa.weight"], t[a + "kv_a_layernorm.weight"] = lin(C + rope, d), 1 + rn(C, std=0.1)
            t[a + "kv_b_proj.weight"] = lin(H * (nope + vd), C)
            if output_gate:
                t[a + "g_proj.weight"] = lin(H * vd, d)
            t[a + "o_proj.weight"] = lin(d, H * vd)
        else:
            hd = Hk * Dk
            for n in "qkvg":
                t[a + n + "_proj.weight"] = lin(hd, d)
            for n in "qkv":
                w = rn(hd, K, std=0.7)
                t[a + n + "_conv1d.weight"] = w if layout == "specforge" else w.unsqueeze(1)
            t[a + "f_a_proj.weight"], t[a + "f_b_proj.weight"] = lin(Dk, d), lin(hd, Dk)
            t[a + "b_proj.weight"], t[a + "dt_bias"] = lin(Hk, d), rn(hd, std=0.5)
            t[a + "A_log"] = torch.rand(Hk, generator=g).mul(3).add(0.5).log()
            t[a + "o_norm.weight"], t[a + "o_proj.weight"] = 1 + rn(Dk, std=0.1), lin(d, hd)
    if markov_rank:
        t["markov_head.markov_w1.weight"] = rn(vocab, markov_rank, std=0.5)
        t["markov_head.markov_w2.weight"] = lin(vocab, markov_rank)
    if confidence:
        t["confidence_head.proj.weight"] = lin(1, d + markov_rank)
        t["confidence_head.proj.bias"] = rn(1)
    if layout == "specforge":
        t["embed_tokens.weight"] = rn(vocab, d)  # the target's embedding copy SpecForge ships; ignored on load
    return t


def dspark_config(layout: str, layer_types: list[str], *, hidden: int, target_hidden: int, vocab: int,
                  target_layer_ids: list[int], target_num_layers: int, block_size: int, mask_token_id: int,
                  intermediate: int, markov_rank: int, confidence: bool, sample_from_anchor: bool | None = None,
                  aux_hidden_stream: str | None = None, mla: dict = MLA, kda: dict = KDA,
                  output_gate: bool = True, rope_theta: float = 10000.0) -> dict:
    """config.json in the published layout (field names and nesting as published)."""
    layer = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=len(layer_types),
                 vocab_size=vocab, rms_norm_eps=1e-5, hidden_act="silu", num_key_value_heads=1, head_dim=24,
                 max_position_embeddings=4096, rope_theta=rope_theta, rope_scaling=None, rope_interleave=True,
                 attention_bias=False, mla_use_nope=True, mla_use_output_gate=output_gate, **mla)
    if "kda" in layer_types:
        layer["linear_attn_config"] = dict(kda, backend="fla")
    heads = dict(markov_rank=markov_rank, markov_head_type="vanilla", enable_confidence_head=confidence,
                 confidence_head_with_markov=confidence)
    if aux_hidden_stream is not None:
        heads["aux_hidden_stream"] = aux_hidden_stream
    if sample_from_anchor is not None:
        heads["sample_from_anchor"] = sample_from_anchor
    if layout == "specforge":
        arch = "KimiK3DSpark5MLADraftModel" if layer_types == ["mla"] * 5 else "KimiK3DSpark4KDA1MLADraftModel"
        cfg = dict(layer, architectures=[arch], model_type="qwen3", block_size=block_size,
                   num_target_layers=target_num_layers, layer_types=["full_attention"] * len(layer_types),
                   dflash_config=dict(heads, mask_token_id=mask_token_id, target_layer_ids=target_layer_ids,
                                      projector_type="dspark", confidence_head_alpha=1.0), dtype="bfloat16")
        if "kda" in layer_types:
            cfg["draft_layer_types"] = list(layer_types)
        return cfg
    layer["model_type"] = "kimi_linear"
    if "kda" in layer_types:
        layer["draft_layer_types"] = list(layer_types)
    return dict(heads, speculators_model_type="dspark", architectures=["DSparkSpeculator"], block_size=block_size,
                aux_hidden_state_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
                target_hidden_size=target_hidden, draft_vocab_size=vocab, transformer_layer_config=layer,
                speculators_config={"algorithm": "dspark", "verifier": {"num_hidden_layers": target_num_layers}})


def write_tiny_dspark(out_dir: str, layout: str, layer_types: list[str], *, hidden: int = 64,
                      target_hidden: int = 64, vocab: int = 512, target_layer_ids=(0, 2), target_num_layers: int = 4,
                      block_size: int = 4, mask_token_id: int = 3, intermediate: int = 96, markov_rank: int = 8,
                      confidence: bool = True, seed: int = 0, **cfg_kw) -> tuple[str, dict, dict]:
    """Write a tiny random drafter; returns (folder, config dict, float32 tensors by published name)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    cfg = dspark_config(layout, layer_types, hidden=hidden, target_hidden=target_hidden, vocab=vocab,
                        target_layer_ids=list(target_layer_ids), target_num_layers=target_num_layers,
                        block_size=block_size, mask_token_id=mask_token_id, intermediate=intermediate,
                        markov_rank=markov_rank, confidence=confidence, **cfg_kw)
    t = dspark_tensors(layer_types, hidden, target_hidden, len(target_layer_ids), vocab, intermediate, markov_rank,
                       confidence, layout, seed, output_gate=cfg_kw.get("output_gate", True))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(out_dir, "model.safetensors"))
    return out_dir, cfg, t
