"""The tensors a checkpoint of a model holds, listed from its config alone (no weights read).

One record per Hugging Face tensor name, the layer index written ``{L}`` and the layers that share the name and
shape aggregated into ``count``. The shard plan (:mod:`tokenfab.parallel.shard_plan`: bytes per rank) and the memory
planner (:mod:`tokenfab.planner`: ``tokenfab plan``) both read these records; this module imports neither.

Families:

* Llama / Qwen3 / Qwen3-MoE / DeepSeek-V3 (Kimi-K2): :func:`model_tensors`.
* Kimi Linear / Kimi K3 (hybrid KDA + MLA): :func:`kimi_model_tensors`, which :func:`model_tensors` dispatches to.
  KDA layers are listed under ``model.layers.{L}.kda_attn.`` (``self_attn.`` in checkpoints) so the shard plan
  splits them by KDA head; NoPE MLA layers (with the K3 output gate ``g_proj``), latent MoE
  (``routed_expert_down_proj`` / ``_up_proj`` / ``_norm``, experts on the latent width) and block
  attention-residual projections.

Both share the embeddings and norms, the MLA attention block, the dense MLP and the experts
(:func:`embeddings_and_norms`, :func:`mla_attention`, :func:`dense_mlp`, :func:`expert_tensors`), written once
through a :class:`TensorListing` that knows the weight format.

Multi-token-prediction layers (``num_nextn_predict_layers``) are not listed (the engine does not load them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorRecord:
    """One checkpoint tensor (or ``count`` identical ones in different layers): name, stored shape, total bytes."""

    name: str
    shape: tuple[int, ...]
    nbytes: int
    count: int = 1
    dtype: str = ""


WEIGHT_FORMATS = ("bfloat16", "float16", "float32", "fp8", "int4")
KIMI_WEIGHT_FORMATS = ("bfloat16", "float16", "float32", "mxfp4")
_FLOAT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
LAYER = "model.layers.{L}."


class TensorListing:
    """Collects :class:`TensorRecord` s, writing Linear weights in one storage format.

    ``element_bytes``: bytes per element of every tensor not quantized. ``quant``:

    * ``"plain"``: Linear weights are plain ``[out, in]`` tensors of ``element_bytes``;
    * ``"fp8"``: DeepSeek-V3 block FP8, every Linear of the decoder layers: float8_e4m3fn ``weight`` (1 byte) plus a
      float32 ``weight_scale_inv`` ``[ceil(out/128), ceil(in/128)]``;
    * ``"int4"``: compressed-tensors pack-quantized, group 32, routed experts only: ``weight_packed`` int32
      ``[out, in/8]``, ``weight_scale`` bfloat16 ``[out, ceil(in/32)]``, ``weight_shape`` int32 ``[2]``;
    * ``"mxfp4"``: compressed-tensors mxfp4-pack-quantized, routed experts only: ``weight_packed`` uint8
      ``[out, in/2]`` and ``weight_scale`` uint8 E8M0 ``[out, ceil(in/32)]``.
    """

    def __init__(self, element_bytes: int, quant: str = "plain"):
        self.element_bytes, self.quant = element_bytes, quant
        self.records: list[TensorRecord] = []

    @classmethod
    def for_format(cls, weight_format: str | int, quantized: dict[str, str], supported: tuple[str, ...],
                   models: str = "") -> "TensorListing":
        """A listing for ``weight_format``: an int (bytes per parameter), a float dtype name, or a key of
        ``quantized`` (format name -> ``quant``; those keep bfloat16 for what they do not quantize).

        Raises:
            ValueError: an unknown format, naming ``supported`` (and ``models``, e.g. ``" for Kimi models"``).
        """
        if isinstance(weight_format, int):
            return cls(weight_format)
        if weight_format in _FLOAT_BYTES:
            return cls(_FLOAT_BYTES[weight_format])
        if weight_format in quantized:
            return cls(2, quantized[weight_format])
        raise ValueError(f"weight dtype '{weight_format}' is not supported{models}; supported: "
                         f"{', '.join(supported)}")

    def plain(self, name: str, shape: tuple[int, ...], count: int, element_bytes: int | None = None,
              dtype: str = "") -> None:
        """A tensor of ``shape`` in ``count`` layers (nothing when ``count`` or a dim is 0)."""
        nb = self.element_bytes if element_bytes is None else element_bytes
        if count > 0 and all(shape):
            self.records.append(TensorRecord(name, tuple(shape), math.prod(shape) * nb, count, dtype))

    def linear(self, name: str, out: int, inp: int, count: int, bias: bool = False, expert: bool = False) -> None:
        """A Linear weight ``[out, in]`` in the listing's format (plus its scale tensors and optional bias)."""
        if count <= 0 or out == 0 or inp == 0:
            return
        if self.quant == "fp8":
            self.plain(name + ".weight", (out, inp), count, 1, "F8_E4M3")
            self.plain(name + ".weight_scale_inv", (-(-out // 128), -(-inp // 128)), count, 4, "F32")
        elif self.quant == "int4" and expert:
            self.plain(name + ".weight_packed", (out, -(-inp // 8)), count, 4, "I32")
            self.plain(name + ".weight_scale", (out, -(-inp // 32)), count, 2, "BF16")
            self.plain(name + ".weight_shape", (2,), count, 4, "I32")
        elif self.quant == "mxfp4" and expert:
            self.plain(name + ".weight_packed", (out, inp // 2), count, 1, "U8")
            self.plain(name + ".weight_scale", (out, -(-inp // 32)), count, 1, "U8")
        else:
            self.plain(name + ".weight", (out, inp), count)
        if bias:
            self.plain(name + ".bias", (out,), count)


# ------------------------------------------------------------------------------------------ shared blocks
def embeddings_and_norms(t: TensorListing, mc) -> None:
    """``embed_tokens``, ``lm_head`` (unless tied), the final norm and every layer's two RMSNorms."""
    h, L = mc.hidden_size, mc.num_hidden_layers
    t.plain("model.embed_tokens.weight", (mc.vocab_size, h), 1)
    if not mc.tie_word_embeddings:
        t.plain("lm_head.weight", (mc.vocab_size, h), 1)
    t.plain("model.norm.weight", (h,), 1)
    t.plain(LAYER + "input_layernorm.weight", (h,), L)
    t.plain(LAYER + "post_attention_layernorm.weight", (h,), L)


def mla_attention(t: TensorListing, prefix: str, mc, count: int, kv_a_bias: bool, output_gate: bool = False) -> None:
    """MLA projections of ``count`` layers: q (LoRA ``q_a``/``q_b`` with its norm, or one ``q_proj``), the joint
    ``kv_a_proj_with_mqa`` [kv_lora_rank + qk_rope_head_dim, hidden] (bias when ``kv_a_bias``) and its norm,
    ``kv_b_proj`` [H x (qk_nope_head_dim + v_head_dim), kv_lora_rank], the K3 output gate ``g_proj`` when
    ``output_gate``, and ``o_proj`` [hidden, H x v_head_dim]."""
    h, H = mc.hidden_size, mc.num_attention_heads
    if mc.q_lora_rank:
        t.linear(prefix + "q_a_proj", mc.q_lora_rank, h, count)
        t.plain(prefix + "q_a_layernorm.weight", (mc.q_lora_rank,), count)
        t.linear(prefix + "q_b_proj", H * mc.qk_head_dim, mc.q_lora_rank, count)
    else:
        t.linear(prefix + "q_proj", H * mc.qk_head_dim, h, count)
    t.linear(prefix + "kv_a_proj_with_mqa", mc.kv_lora_rank + mc.qk_rope_head_dim, h, count, kv_a_bias)
    t.plain(prefix + "kv_a_layernorm.weight", (mc.kv_lora_rank,), count)
    t.linear(prefix + "kv_b_proj", H * (mc.qk_nope_head_dim + mc.v_head_dim), mc.kv_lora_rank, count)
    if output_gate:
        t.linear(prefix + "g_proj", H * mc.v_head_dim, h, count)
    t.linear(prefix + "o_proj", h, H * mc.v_head_dim, count)


def dense_mlp(t: TensorListing, prefix: str, mc, count: int) -> None:
    """The gated MLP of ``count`` dense layers: gate/up [intermediate, hidden], down [hidden, intermediate]."""
    h, i = mc.hidden_size, mc.intermediate_size
    t.linear(prefix + "gate_proj", i, h, count, mc.mlp_bias)
    t.linear(prefix + "up_proj", i, h, count, mc.mlp_bias)
    t.linear(prefix + "down_proj", h, i, count, mc.mlp_bias)


def expert_tensors(linear, prefix: str, mc, n_moe: int, expert_in: int) -> None:
    """List the MoE experts of ``n_moe`` layers through ``linear(name, out, in, count, expert=...)``: routed experts
    ``{prefix}experts.{j}.gate/up/down_proj`` reading and writing ``expert_in`` features (hidden_size, or K3's
    latent width) and the shared experts (hidden_size in and out, moe_intermediate_size x n_shared_experts)."""
    mi, h = mc.moe_intermediate_size, mc.hidden_size
    for j in range(mc.num_experts):
        e = f"{prefix}experts.{j}."
        linear(e + "gate_proj", mi, expert_in, n_moe, expert=True)
        linear(e + "up_proj", mi, expert_in, n_moe, expert=True)
        linear(e + "down_proj", expert_in, mi, n_moe, expert=True)
    if mc.n_shared_experts:
        si = mi * mc.n_shared_experts
        linear(prefix + "shared_experts.gate_proj", si, h, n_moe)
        linear(prefix + "shared_experts.up_proj", si, h, n_moe)
        linear(prefix + "shared_experts.down_proj", h, si, n_moe)


def _moe_layer_counts(mc) -> tuple[int, int]:
    """(MoE layers, dense layers)."""
    n_moe = len(set(mc.moe_layers)) if mc.is_moe else 0
    return n_moe, mc.num_hidden_layers - n_moe


# -------------------------------------------------------------------------------------------------- families
def model_tensors(model_config, weight_format: str | int = "bfloat16") -> list[TensorRecord]:
    """The tensors a checkpoint of this model holds (HF names, layer index ``{L}`` aggregated into ``count``).

    Formats:

    * an int ``n`` or ``"bfloat16"`` / ``"float16"`` / ``"float32"``: every parameter takes ``n`` (2, 2, 4) bytes.
    * ``"fp8"``: DeepSeek-V3 block FP8. Every Linear weight inside the decoder layers (attention projections, dense
      MLP, shared and routed experts) is float8_e4m3fn (1 byte) plus a float32 ``weight_scale_inv``
      ``[ceil(out/128), ceil(in/128)]``; embeddings, lm_head, norms and router weight stay bfloat16, the router
      ``e_score_correction_bias`` float32.
    * ``"int4"``: compressed-tensors pack-quantized, group 32, symmetric, routed experts only: ``weight_packed``
      int32 ``[out, in/8]``, ``weight_scale`` bfloat16 ``[out, ceil(in/32)]``, ``weight_shape`` int32 ``[2]``; every
      other tensor bfloat16.

    Kimi Linear / K3 models are listed by :func:`kimi_model_tensors` (its own formats).

    Raises:
        ValueError: an unknown format.
    """
    mc = model_config
    if mc.family in ("kimi_linear", "kimi_k3"):
        return kimi_model_tensors(mc, weight_format)
    t = TensorListing.for_format(weight_format, {"fp8": "fp8", "int4": "int4"}, WEIGHT_FORMATS)
    h, L = mc.hidden_size, mc.num_hidden_layers
    n_moe, n_dense = _moe_layer_counts(mc)
    embeddings_and_norms(t, mc)
    a = LAYER + "self_attn."
    if mc.is_mla:
        mla_attention(t, a, mc, L, kv_a_bias=mc.attention_bias)
    else:
        hd, H, K = mc.head_dim, mc.num_attention_heads, mc.num_key_value_heads
        t.linear(a + "q_proj", H * hd, h, L, mc.attention_bias)
        t.linear(a + "k_proj", K * hd, h, L, mc.attention_bias)
        t.linear(a + "v_proj", K * hd, h, L, mc.attention_bias)
        t.linear(a + "o_proj", h, H * hd, L, mc.attention_bias)
        if mc.family in ("qwen3", "qwen3_moe"):
            t.plain(a + "q_norm.weight", (hd,), L)
            t.plain(a + "k_norm.weight", (hd,), L)
    m = LAYER + "mlp."
    dense_mlp(t, m, mc, n_dense)
    if n_moe:
        t.plain(m + "gate.weight", (mc.num_experts, h), n_moe)
        if mc.family == "deepseek_v3":
            t.plain(m + "gate.e_score_correction_bias", (mc.num_experts,), n_moe,
                    4 if t.quant in ("fp8", "int4") else t.element_bytes)
        expert_tensors(t.linear, m, mc, n_moe, h)
    return t.records


def kimi_model_tensors(mc, weight_format: str | int = "bfloat16") -> list[TensorRecord]:
    """Tensor records of a :class:`tokenfab.config_kimi.KimiConfig` model in ``weight_format``.

    Formats: ``"bfloat16"`` / ``"float16"`` / ``"float32"`` / an int (bytes per parameter) for every tensor, or
    ``"mxfp4"`` (also ``"int4"``, what ``auto_weight_format`` names a 4-bit compressed-tensors config): routed
    experts compressed-tensors mxfp4-pack-quantized, everything else bfloat16 (the published K3 layout).

    Raises:
        ValueError: an unknown format.
    """
    t = TensorListing.for_format(weight_format, {"mxfp4": "mxfp4", "int4": "mxfp4"}, KIMI_WEIGHT_FORMATS,
                                 " for Kimi models")
    h, L = mc.hidden_size, mc.num_hidden_layers
    n_kda, n_mla = len(mc.kda_layers), len(mc.mla_layers)
    n_moe, n_dense = _moe_layer_counts(mc)
    embeddings_and_norms(t, mc)
    p = LAYER
    if mc.attn_res_block_size:
        for n in ("self_attention_res_norm", "mlp_res_norm"):
            t.plain(p + n + ".weight", (h,), L)
        for n in ("self_attention_res_proj", "mlp_res_proj"):
            t.plain(p + n + ".weight", (1, h), L)
        t.plain("model.output_attn_res_norm.weight", (h,), 1)
        t.plain("model.output_attn_res_proj.weight", (1, h), 1)
    a = p + "kda_attn."  # KDA tensors get their own path so the shard plan splits them by KDA head width
    H, D = mc.kda_num_heads, mc.kda_head_dim
    hd = H * D
    for n in ("q_proj", "k_proj", "v_proj"):
        t.linear(a + n, hd, h, n_kda)
    for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
        t.plain(a + n + ".weight", (hd, 1, mc.kda_conv_kernel), n_kda)
    t.linear(a + "f_a_proj", D, h, n_kda)
    t.linear(a + "f_b_proj", hd, D, n_kda)
    t.linear(a + "b_proj", H, h, n_kda)
    t.plain(a + "dt_bias", (hd,), n_kda, 4)
    t.plain(a + "A_log", (H,), n_kda, 4)
    if mc.use_full_rank_gate:
        t.linear(a + "g_proj", hd, h, n_kda)
    else:
        t.linear(a + "g_a_proj", D, h, n_kda)
        t.linear(a + "g_b_proj", hd, D, n_kda)
    t.plain(a + "o_norm.weight", (D,), n_kda)
    t.linear(a + "o_proj", h, hd, n_kda)
    # NoPE MLA layers (K3: output gate); this listing has never counted an attention bias for Kimi models
    mla_attention(t, p + "self_attn.", mc, n_mla, kv_a_bias=False, output_gate=mc.mla_use_output_gate)
    m = p + "mlp."
    dense_mlp(t, m, mc, n_dense)
    if n_moe:
        lat = mc.routed_expert_hidden_size or h
        t.plain(m + "gate.weight", (mc.num_experts, h), n_moe, 4)
        t.plain(m + "gate.e_score_correction_bias", (mc.num_experts,), n_moe, 4)
        if mc.routed_expert_hidden_size:
            t.linear(m + "routed_expert_down_proj", lat, h, n_moe)
            t.linear(m + "routed_expert_up_proj", h, lat, n_moe)
            if mc.latent_moe_use_norm:
                t.plain(m + "routed_expert_norm.weight", (lat,), n_moe)
        expert_tensors(t.linear, m, mc, n_moe, lat)
    return t.records


def count_parameters(model_config) -> int:
    """Logical parameter count (elements) of the tensors :func:`model_tensors` lists, MTP layers excluded."""
    return sum(r.nbytes * r.count for r in model_tensors(model_config, 1))
