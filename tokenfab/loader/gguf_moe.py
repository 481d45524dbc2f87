"""GGUF files of the Mixture-of-Experts architectures llama.cpp names ``qwen3moe`` (Qwen3-MoE) and ``deepseek2``
(DeepSeek-V3 / R1, Kimi-K2 and other DeepSeek-V3-shaped models: MLA attention, sigmoid routing with a correction
bias) read as Hugging Face checkpoints: their config and their tensors under transformers' names.

How llama.cpp's converter (convert_hf_to_gguf.py, ``Qwen3MoeModel`` / ``DeepseekV2Model``) lays them out, and what
this module undoes:

* Routed experts are stacked per layer: ``blk.N.ffn_{gate,up,down}_exps.weight`` [E, out, in] (Hugging Face: one
  ``mlp.experts.{e}.{gate,up,down}_proj.weight`` [out, in] per expert); :func:`moe_tensors` splits them.
* DeepSeek's MLA up-projection ``kv_b_proj`` [H * (nope + v), kv_lora] is written as two tensors for llama.cpp's
  absorbed attention: ``attn_k_b`` = its key rows per head, transposed ([H, kv_lora, nope]), and ``attn_v_b`` = its
  value rows ([H, v, kv_lora]); :func:`join_kv_b` puts them back. Files converted before that split (no
  ``attention.key_length_mla`` key) hold ``attn_kv_b`` itself and their ``key_length`` / ``value_length`` are the
  per-head query-key and value widths instead of the latent widths.
* MLA is written as multi-query attention (``head_count_kv`` 1); the Hugging Face config has as many KV heads as
  query heads. The routing correction bias is ``blk.N.exp_probs_b.bias``; shared experts are ``*_shexp``; the
  first ``leading_dense_block_count`` layers keep a dense MLP (``ffn_gate`` / ``ffn_up`` / ``ffn_down``).
* DeepSeek's RoPE pairs adjacent elements (``rope_interleave``), which is ggml's normal RoPE: no rows are permuted
  (llama.cpp permutes q/k rows for its ``llama`` architecture only).
* YaRN: ``rope.scaling.type`` yarn with ``factor``, ``original_context_length``, ``yarn_beta_fast`` /
  ``yarn_beta_slow`` (llama.cpp's defaults 32 / 1 when absent) and, for deepseek2, ``yarn_log_multiplier`` =
  0.1 * ``mscale_all_dim`` (the softmax scale's YaRN factor). GGUF keeps no separate ``mscale``; DeepSeek-V3's and
  Kimi-K2's configs set it equal to ``mscale_all_dim``, as the config written here does.

Routing that tokenfab's DeepSeek-V3 model does not compute is refused by name: deepseek2 files with softmax gating
(DeepSeek-V2 / V2-Lite: ``expert_gating_func`` 1 or absent), qwen3moe files with dense layers.
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from tokenfab.errors import UnsupportedError, WeightLoadError

MOE_ARCHITECTURES = ("qwen3moe", "deepseek2")
GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax)

# llama.cpp tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N."), one tensor each.
LAYER_NAMES = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}  # .weight
KV_B_HALVES = ("attn_k_b.weight", "attn_v_b.weight")


def yarn_parameters(arch: str, meta: dict, rope_theta: float, need: Callable[[str], object]) -> dict:
    """Hugging Face ``rope_parameters`` for a file whose ``{arch}.rope.scaling.type`` is yarn (see the module
    docstring for the keys read). Raises WeightLoadError when ``factor`` or ``original_context_length`` is
    missing."""
    out = {"rope_type": "yarn", "rope_theta": rope_theta, "factor": float(need("rope.scaling.factor")),
           "original_max_position_embeddings": int(need("rope.scaling.original_context_length")),
           "beta_fast": float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
           "beta_slow": float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0))}
    log_mul = meta.get(f"{arch}.rope.scaling.yarn_log_multiplier")
    if arch == "deepseek2" and log_mul is not None:
        mscale = round(float(log_mul) / 0.1, 6)  # the converter wrote 0.1 * mscale_all_dim (a float32)
        out.update(mscale=mscale, mscale_all_dim=mscale)
    return out


def moe_config(arch: str, meta: dict, tensor_names: set[str], need: Callable[[str], object]) -> dict:
    """The architecture-specific part of the Hugging Face config of a ``qwen3moe`` / ``deepseek2`` file:
    ``Qwen3MoeForCausalLM`` or ``DeepseekV3ForCausalLM`` with its expert counts, routing and (deepseek2) MLA
    widths. ``need(key)`` reads ``{arch}.{key}`` or raises WeightLoadError.

    Raises:
        UnsupportedError: softmax-gated deepseek2 (DeepSeek-V2), qwen3moe with dense layers.
        WeightLoadError: a required key is missing.
    """
    n_layers = int(need("block_count"))
    experts = int(need("expert_count"))
    common = {"num_experts_per_tok": int(need("expert_used_count")),
              "moe_intermediate_size": int(need("expert_feed_forward_length"))}
    if arch == "qwen3moe":
        dense = sorted(i for i in range(n_layers) if f"blk.{i}.ffn_gate.weight" in tensor_names)
        if dense:
            raise UnsupportedError(f"GGUF qwen3moe file with dense MLP layers {dense[:4]}: not supported "
                                   "(every layer must be a MoE layer, as llama.cpp's qwen3moe graph runs them).")
        return dict(common, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=experts,
                    norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)), decoder_sparse_step=1,
                    mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=False)
    gating = int(meta.get(f"{arch}.expert_gating_func", 1))
    if gating != GATING_SIGMOID:
        raise UnsupportedError(f"GGUF deepseek2 file with {arch}.expert_gating_func {gating} (softmax, DeepSeek-V2): "
                               "only sigmoid routing with a correction bias (DeepSeek-V3, Kimi-K2: 2) is supported.")
    rope = int(need("rope.dimension_count"))
    if f"{arch}.attention.key_length_mla" in meta:  # attn_k_b / attn_v_b files: key/value lengths are the latent's
        nope = int(need("attention.key_length_mla")) - rope
        v = int(need("attention.value_length_mla"))
    else:
        nope = int(need("attention.key_length")) - rope
        v = int(need("attention.value_length"))
    q_lora = meta.get(f"{arch}.attention.q_lora_rank")
    heads = int(need("attention.head_count"))
    return dict(common, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                num_key_value_heads=heads, n_routed_experts=experts,
                n_shared_experts=int(meta.get(f"{arch}.expert_shared_count", 0)),
                first_k_dense_replace=int(meta.get(f"{arch}.leading_dense_block_count", 0)),
                routed_scaling_factor=float(meta.get(f"{arch}.expert_weights_scale", 1.0)),
                norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", False)),
                n_group=int(meta.get(f"{arch}.expert_group_count", 1)),
                topk_group=int(meta.get(f"{arch}.expert_group_used_count", 1)),
                kv_lora_rank=int(need("attention.kv_lora_rank")),
                q_lora_rank=None if q_lora is None else int(q_lora), qk_rope_head_dim=rope,
                qk_nope_head_dim=nope, v_head_dim=v, rope_interleave=True, head_dim=rope,
                scoring_func="sigmoid", topk_method="noaux_tc")


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """Hugging Face's ``kv_b_proj.weight`` [H * (nope + v), kv_lora] from llama.cpp's ``attn_k_b`` [H, kv_lora,
    nope] (the key rows per head, transposed) and ``attn_v_b`` [H, v, kv_lora]: per head, the nope key rows then
    the v value rows (the inverse of convert_hf_to_gguf.py's split).

    Raises WeightLoadError when the two disagree on heads or latent width."""
    if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise WeightLoadError(f"GGUF attn_k_b {k_b.shape} and attn_v_b {v_b.shape} do not fit together "
                              "(expected [H, kv_lora, nope] and [H, v, kv_lora]).")
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])


def expert_matrix(tensor, e: int) -> np.ndarray:
    """Expert ``e`` of a stacked ``gguf.ReaderTensor`` [E, out, in] as a fresh float32 [out, in] array, dequantized
    alone (``gguf.quants.dequantize`` on that expert's rows of the memory map), so a layer's stack is never held
    in float32 at once (DeepSeek-V3's gate stack alone is 256 x 2048 x 7168: 15 GB).

    Raises UnsupportedError for a block type the installed gguf package cannot dequantize."""
    from gguf.quants import dequantize as gguf_dequantize

    out, inputs = int(tensor.shape[1]), int(tensor.shape[0])
    try:
        arr = gguf_dequantize(tensor.data[e], tensor.tensor_type)
    except NotImplementedError:
        raise UnsupportedError(f"GGUF tensor '{tensor.name}': quantization type {tensor.tensor_type.name} cannot "
                               "be dequantized by the installed gguf package.") from None
    return np.array(arr, dtype=np.float32).reshape(out, inputs)


def moe_tensors(reader, cfg: dict, dequantize: Callable, hf_name: Callable[[str], str]
                ) -> Iterator[tuple[str, np.ndarray]]:
    """``(hf_name, float32 array)`` for every tensor of a ``qwen3moe`` / ``deepseek2`` reader: expert stacks split per
    expert (:func:`expert_matrix`), ``attn_k_b`` + ``attn_v_b`` joined into ``kv_b_proj`` (:func:`join_kv_b`), the
    rest renamed by ``hf_name``; then a zero routing correction bias for deepseek2 MoE layers whose file has none
    (llama.cpp adds the bias only when present, so zeros compute the same routing). ``dequantize(t)``: one tensor
    as a float32 array in Hugging Face (row-major) shape. Arrays are fresh (not views of the memory map).

    Raises:
        WeightLoadError: an ``attn_k_b`` without its ``attn_v_b`` (or the reverse), or an unknown tensor name.
    """
    halves: dict[str, dict[str, np.ndarray]] = {}
    with_bias = set()
    for t in reader.tensors:
        layer, _, rest = t.name[len("blk."):].partition(".") if t.name.startswith("blk.") else ("", "", "")
        if rest.removesuffix(".weight") in EXPERT_STACKS:
            proj = EXPERT_STACKS[rest.removesuffix(".weight")]
            for e in range(int(t.shape[-1])):  # GGUF lists ne0 first: the expert count is last
                yield f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", expert_matrix(t, e)
            continue
        if rest in KV_B_HALVES:
            pair = halves.setdefault(layer, {})
            pair[rest] = dequantize(t)
            if len(pair) == 2:
                yield (f"model.layers.{layer}.self_attn.kv_b_proj.weight",
                       join_kv_b(pair[KV_B_HALVES[0]], pair[KV_B_HALVES[1]]))
                del halves[layer]
            continue
        if rest == "exp_probs_b.bias":
            with_bias.add(int(layer))
        yield hf_name(t.name), np.array(dequantize(t), dtype=np.float32, copy=True)
    if halves:
        layer, pair = next(iter(halves.items()))
        raise WeightLoadError(f"GGUF layer {layer} holds {next(iter(pair))} without its other half "
                              f"({' + '.join(KV_B_HALVES)} make kv_b_proj).")
    if cfg["model_type"] == "deepseek_v3":
        for i in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
            if i not in with_bias:
                yield f"model.layers.{i}.mlp.gate.e_score_correction_bias", np.zeros(cfg["n_routed_experts"],
                                                                                      dtype=np.float32)

