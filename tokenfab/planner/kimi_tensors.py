"""Checkpoint tensor inventory of Kimi Linear / Kimi K3 text models for the memory planner (``tokenfab plan``).

Like :func:`tokenfab.parallel.shard_plan.model_tensors` (HF names, ``{L}`` aggregated into ``count``), but for the
hybrid stack: KDA layers (listed under ``model.layers.{L}.kda_attn.`` so ShardPlan splits them by KDA head;
``self_attn.`` in checkpoints) (q/k/v/g projections, short convs, f_a/f_b, b_proj, dt_bias, A_log, o_norm, o_proj), NoPE
MLA layers (with the K3 output gate ``g_proj``), latent MoE (``routed_expert_down_proj`` / ``_up_proj`` / ``_norm``,
experts on the latent width) and block attention-residual projections.

Formats: ``"bfloat16"`` / ``"float16"`` / ``"float32"`` / an int (bytes per parameter) for every tensor, or
``"mxfp4"``: routed experts compressed-tensors mxfp4-pack-quantized (``weight_packed`` uint8 [out, in/2] +
``weight_scale`` uint8 E8M0 [out, in/32]), everything else bfloat16 (the published K3 layout).
"""
from __future__ import annotations

import math

from tokenfab.parallel.shard_plan import TensorRecord, expert_tensors

_FLOAT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def kimi_model_tensors(mc, weight_format: str | int = "bfloat16") -> list[TensorRecord]:
    """Tensor records of a :class:`tokenfab.config_kimi.KimiConfig` model in ``weight_format``.

    Raises:
        ValueError: an unknown format.
    """
    if isinstance(weight_format, int):
        fb, mx = weight_format, False
    elif weight_format in _FLOAT_BYTES:
        fb, mx = _FLOAT_BYTES[weight_format], False
    elif weight_format in ("mxfp4", "int4"):  # int4: what auto_weight_format names a 4-bit compressed-tensors config
        fb, mx = 2, True
    else:
        raise ValueError(f"weight dtype '{weight_format}' is not supported for Kimi models; supported: bfloat16, "
                         "float16, float32, mxfp4")
    recs: list[TensorRecord] = []
    h = mc.hidden_size

    def plain(name, shape, count, nb=fb, dtype=""):
        if count > 0 and all(shape):
            recs.append(TensorRecord(name, tuple(shape), math.prod(shape) * nb, count, dtype))

    def linear(name, out, inp, count, expert=False):
        if mx and expert:
            plain(name + ".weight_packed", (out, inp // 2), count, 1, "U8")
            plain(name + ".weight_scale", (out, -(-inp // 32)), count, 1, "U8")
        else:
            plain(name + ".weight", (out, inp), count)

    L = mc.num_hidden_layers
    n_kda, n_mla = len(mc.kda_layers), len(mc.mla_layers)
    moe = set(mc.moe_layers) if mc.is_moe else set()
    n_moe, n_dense = len(moe), L - len(moe)
    plain("model.embed_tokens.weight", (mc.vocab_size, h), 1)
    if not mc.tie_word_embeddings:
        plain("lm_head.weight", (mc.vocab_size, h), 1)
    plain("model.norm.weight", (h,), 1)
    p = "model.layers.{L}."
    plain(p + "input_layernorm.weight", (h,), L)
    plain(p + "post_attention_layernorm.weight", (h,), L)
    if mc.attn_res_block_size:
        for n in ("self_attention_res_norm", "mlp_res_norm"):
            plain(p + n + ".weight", (h,), L)
        for n in ("self_attention_res_proj", "mlp_res_proj"):
            plain(p + n + ".weight", (1, h), L)
        plain("model.output_attn_res_norm.weight", (h,), 1)
        plain("model.output_attn_res_proj.weight", (1, h), 1)
    a = p + "kda_attn."  # KDA tensors get their own path so the shard plan splits them by KDA head width
    # KDA layers
    H, D = mc.kda_num_heads, mc.kda_head_dim
    hd = H * D
    for n in ("q_proj", "k_proj", "v_proj"):
        linear(a + n, hd, h, n_kda)
    for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
        plain(a + n + ".weight", (hd, 1, mc.kda_conv_kernel), n_kda)
    linear(a + "f_a_proj", D, h, n_kda)
    linear(a + "f_b_proj", hd, D, n_kda)
    linear(a + "b_proj", H, h, n_kda)
    plain(a + "dt_bias", (hd,), n_kda, 4)
    plain(a + "A_log", (H,), n_kda, 4)
    if mc.use_full_rank_gate:
        linear(a + "g_proj", hd, h, n_kda)
    else:
        linear(a + "g_a_proj", D, h, n_kda)
        linear(a + "g_b_proj", hd, D, n_kda)
    plain(a + "o_norm.weight", (D,), n_kda)
    linear(a + "o_proj", h, hd, n_kda)
    # MLA layers (NoPE; K3: output gate)
    a = p + "self_attn."
    Hm = mc.num_attention_heads
    if mc.q_lora_rank:
        linear(a + "q_a_proj", mc.q_lora_rank, h, n_mla)
        plain(a + "q_a_layernorm.weight", (mc.q_lora_rank,), n_mla)
        linear(a + "q_b_proj", Hm * mc.qk_head_dim, mc.q_lora_rank, n_mla)
    else:
        linear(a + "q_proj", Hm * mc.qk_head_dim, h, n_mla)
    linear(a + "kv_a_proj_with_mqa", mc.kv_lora_rank + mc.qk_rope_head_dim, h, n_mla)
    plain(a + "kv_a_layernorm.weight", (mc.kv_lora_rank,), n_mla)
    linear(a + "kv_b_proj", Hm * (mc.qk_nope_head_dim + mc.v_head_dim), mc.kv_lora_rank, n_mla)
    if mc.mla_use_output_gate:
        linear(a + "g_proj", Hm * mc.v_head_dim, h, n_mla)
    linear(a + "o_proj", h, Hm * mc.v_head_dim, n_mla)
    # MLPs
    m = p + "mlp."
    for n, (o, i) in (("gate_proj", (mc.intermediate_size, h)), ("up_proj", (mc.intermediate_size, h)),
                      ("down_proj", (h, mc.intermediate_size))):
        linear(m + n, o, i, n_dense)
    if n_moe:
        lat = mc.routed_expert_hidden_size or h
        plain(m + "gate.weight", (mc.num_experts, h), n_moe, 4)
        plain(m + "gate.e_score_correction_bias", (mc.num_experts,), n_moe, 4)
        if mc.routed_expert_hidden_size:
            linear(m + "routed_expert_down_proj", lat, h, n_moe)
            linear(m + "routed_expert_up_proj", h, lat, n_moe)
            if mc.latent_moe_use_norm:
                plain(m + "routed_expert_norm.weight", (lat,), n_moe)
        expert_tensors(linear, m, mc, n_moe, lat)
    return recs


def kda_state_note(mc, plan, kv_dtype_bytes: int) -> str:
    """One line for the plan: per-request KDA state bytes (all KDA layers; per rank when heads are split)."""
    total = mc.kda_state_bytes_per_request(kv_dtype_bytes)
    H = max(mc.kda_num_heads, 1)
    kda = getattr(plan, "kda_heads", None) or [(0, H)] * plan.world_size  # KDA heads per rank (own split)
    per_rank = [total * (e - s) // H for s, e in kda]
    return (f"KDA state (not per token): {total:,} bytes per request over {len(mc.kda_layers)} KDA layers "
            f"(conv {3 * mc.kda_num_heads * mc.kda_head_dim} ch x {mc.kda_conv_kernel - 1} taps + fp32 "
            f"{mc.kda_num_heads} x {mc.kda_head_dim} x {mc.kda_head_dim} per layer); up to {max(per_rank):,} bytes "
            f"per request on one rank; the per-token KV counts the {len(mc.mla_layers)} MLA layers only")
