"""Config-only model folders at real shapes, for ``--load-format dummy`` runs (benchmarks/gpu_check.sh).

    python benchmarks/gpu_shapes.py --out DIR [--cases llama3b,qwen3moe,dsv3,k3] [--k3-experts 896|auto] [--tiny]
                                    [--unquantized]

Each case is a folder ``DIR/<case>`` holding config.json (the published field names, as each architecture's
parser in tokenfab/config.py / config_kimi.py reads them; architectures from tokenfab/models/architectures.py) and a
small byte-level BPE tokenizer (tokenfab.testing.tokenizer_builder, 512 tokens: ids beyond it decode to nothing, and
the benchmarks feed token ids). No weight file: load them with ``LLM(folder, load_format="dummy")`` or
``decode_floor.py --load-format dummy``, which fill every weight on the device with seeded random values.

Cases (real dimensions; fewer layers where the whole model would not fit one GPU):

* ``llama3b``: Llama-3.2-3B, all 28 layers: hidden 3072, intermediate 8192, GQA 24 / 8 heads of 128, vocab 128256,
  tied embeddings, llama3 RoPE scaling. 3.21e9 parameters (6.4 GB in bf16).
* ``qwen3moe``: Qwen3-30B-A3B's shapes, 6 of its 48 layers: hidden 2048, 128 experts top-8 of intermediate 768
  (renormalized), GQA 32 / 4 heads of 128 with q/k norms, vocab 151936, untied. 4.36e9 parameters (8.7 GB).
* ``dsv3``: DeepSeek-V3 as published (FP8 block-scaled: every decoder Linear but the router and ``kv_b_proj``, and
  the routed experts, e4m3 with 128 x 128 block scales), 3 of its 61 layers (the first dense, intermediate 18432; then two MoE layers of 256
  experts top-8 in 8 groups top-4, moe_intermediate 2048, one shared expert, sigmoid scores with a correction
  bias, routed scaling 2.5), MLA with q_lora 1536 / kv_lora 512 / rope 64 / nope 128 / v 128 over 128 heads, vocab
  129280, YaRN RoPE. 2.55e10 parameters (27 GB in FP8; 51 GB in bf16).
* ``k3``: Kimi K3's published text shape (tests/test_kimi_k3.py::test_plan_k3_shaped_config), 2 of its 93 layers:
  layer 1 KDA (96 heads of 128) with the dense MLP (intermediate 33792), layer 2 gated NoPE MLA (96 heads) with the
  latent MoE (``--k3-experts`` of the published 896 experts, top-16, latent 3584, intermediate 3072, 2 shared
  experts, SiTU), attention residuals, vocab 163840. The routed experts are MXFP4 as published (896 of them: 16 GB;
  ``load_format="dummy"`` fills them packed, tokenfab/loader/dummy_packed.py).

Beside ``k3``, ``DIR/k3-dspark`` holds a DSpark drafter's config.json at K3's width (:func:`k3_dspark`), for
``--speculative-config '{"method": "dspark", "model": "DIR/k3-dspark", ...}'`` with ``--load-format dummy``
(benchmarks/gpu_serve_check.sh).

``--unquantized``: ``dsv3`` and ``k3`` without their quantization_config (bf16 throughout, the same shapes): the
dense kernels' side of a packed-vs-bf16 comparison. 896 bf16 K3 experts are 59 GB, so ``--k3-experts auto`` then
means 896 on a GPU with at least 120 GiB (H200) and 384 (25 GB) on smaller ones; batch 1 reads the same bytes
either way (16 experts), larger batches hit fewer distinct experts with 384.

``--tiny``: the same four families and config fields at test sizes (hidden 64-128, 2-3 layers), for a dry run of
gpu_check.sh's Python on CPU. ``--count``: also build each model on the meta device and print its parameters
and bf16 bytes (no memory used). Exit status 2 for an unknown case.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CASES = ("llama3b", "qwen3moe", "dsv3", "k3")
TOKENIZER_VOCAB = 512


def llama3b(tiny: bool = False) -> dict:
    """Llama-3.2-3B's config.json (transformers LlamaConfig fields); ``tiny``: the same fields at test size."""
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 3072,
         "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
         "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 8192},
         "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000,
         "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"}
    if tiny:
        c.update(vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                 bos_token_id=0, eos_token_id=1,
                 rope_scaling=dict(c["rope_scaling"], original_max_position_embeddings=1024))
    return c


def qwen3moe(tiny: bool = False) -> dict:
    """Qwen3-30B-A3B's config.json with 6 layers (transformers Qwen3MoeConfig fields)."""
    c = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
         "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 6,
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
         "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
         "rope_scaling": None, "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 151643,
         "eos_token_id": 151645, "router_aux_loss_coef": 0.001, "output_router_logits": False,
         "torch_dtype": "bfloat16"}
    if tiny:
        c.update(vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                 num_experts_per_tok=2, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)
    return c


def dsv3(tiny: bool = False, quantized: bool = True) -> dict:
    """DeepSeek-V3's config.json with 3 layers, the first dense (transformers DeepseekV3Config fields); ``quantized``:
    with the published FP8 block-scaled ``quantization_config``."""
    c = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
         "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 3,
         "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
         "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
         "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True, "first_k_dense_replace": 1,
         "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
         "qk_nope_head_dim": 128, "v_head_dim": 128, "num_nextn_predict_layers": 0, "hidden_act": "silu",
         "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
         "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
         "torch_dtype": "bfloat16"}
    if tiny:
        c.update(vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                 topk_group=2, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                 v_head_dim=16, max_position_embeddings=8192,
                 rope_scaling=dict(c["rope_scaling"], original_max_position_embeddings=512))
    if quantized:
        from tokenfab.testing.fp8_checkpoint import QUANTIZATION_CONFIG
        c["quantization_config"] = dict(QUANTIZATION_CONFIG)
    return c


def k3(tiny: bool = False, experts: int = 896, quantized: bool = True) -> dict:
    """Kimi K3's config.json (nested ``text_config``, 1-indexed layer lists) with 2 layers: KDA + dense MLP, then
    gated NoPE MLA + latent MoE of ``experts`` routed experts; ``quantized``: MXFP4 routed experts as published
    (compressed-tensors mxfp4-pack-quantized; everything else bf16), else all bf16."""
    from tokenfab.testing.tiny_k3 import k3_text_config
    if tiny:
        text = k3_text_config(num_hidden_layers=2, kda_layers=(1,), full_attn_layers=(2,), num_experts=8,
                              model_max_length=4096)
    else:
        text = k3_text_config(hidden_size=7168, intermediate_size=33792, moe_intermediate_size=3072,
                              num_hidden_layers=2, kv_lora_rank=512, q_lora_rank=1536, num_experts=experts,
                              routed_expert_hidden_size=3584, attn_res_block_size=12, model_max_length=1 << 20,
                              kda_layers=(1,), full_attn_layers=(2,), kda_head_dim=128)
        text.update(vocab_size=163840, num_attention_heads=96, qk_nope_head_dim=128, qk_rope_head_dim=64,
                    v_head_dim=128, num_experts_per_token=16, num_shared_experts=2)
        text["linear_attn_config"] = dict(text["linear_attn_config"], num_heads=96)
    cfg = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text}
    if quantized:
        from tokenfab.testing.packed_experts_checkpoint import quantization_config
        cfg["quantization_config"] = quantization_config("mxfp4")
    return cfg


K3_DSPARK = "k3-dspark"  # the drafter folder write_cases adds beside ``k3``


def k3_dspark(tiny: bool = False) -> dict:
    """A DSpark drafter's config.json (speculators layout) for the ``k3`` case: 5 MLA draft layers at K3's width
    (hidden 7168, 96 heads, q_lora 1536, kv_lora 512, nope / rope / v 128 / 64 / 128; MLP intermediate 18432 and
    Markov rank 256 assumed, as SpecForge's 5-MLA drafter's sizes are not published with it), blocks of 8 (7
    drafts), tapping both target layers, vocab 163840; ``tiny``: the tiny ``k3``'s sizes. Loaded with the target's
    ``load_format="dummy"`` (spec_decode/dspark_proposer.py fills it too), so no weight file is written."""
    from tokenfab.testing.tiny_dspark import MLA, dspark_config
    if tiny:
        text = k3(tiny=True)["text_config"]
        return dspark_config("speculators", ["mla"] * 2, hidden=text["hidden_size"],
                             target_hidden=text["hidden_size"], vocab=text["vocab_size"], target_layer_ids=[0, 1],
                             target_num_layers=2, block_size=4, mask_token_id=3, intermediate=96, markov_rank=8,
                             confidence=False, mla=MLA)
    mla = dict(num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128)
    return dspark_config("speculators", ["mla"] * 5, hidden=7168, target_hidden=7168, vocab=163840,
                         target_layer_ids=[0, 1], target_num_layers=2, block_size=8, mask_token_id=163839,
                         intermediate=18432, markov_rank=256, confidence=False, mla=mla)


def config_for(case: str, tiny: bool = False, k3_experts: int = 896, unquantized: bool = False) -> dict:
    """config.json of ``case`` (one of :data:`CASES`; ``unquantized``: dsv3 / k3 in bf16, module docstring).

    Raises:
        ValueError: an unknown case, naming the known ones.
    """
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; use one or more of {', '.join(CASES)}.")
    if case == "k3":
        return k3(tiny, k3_experts, quantized=not unquantized)
    if case == "dsv3":
        return dsv3(tiny, quantized=not unquantized)
    return {"llama3b": llama3b, "qwen3moe": qwen3moe}[case](tiny)


def write_cases(out: str, cases=CASES, tiny: bool = False, k3_experts: int = 896,
                unquantized: bool = False) -> dict[str, str]:
    """Write ``out/<case>/config.json`` and the tokenizer for each case (a folder that exists is rewritten);
    returns {case: folder}, with "k3-dspark" (its drafter's folder) beside k3.

    Raises:
        ValueError: an unknown case (before anything is written).
    """
    configs = {c: config_for(c, tiny, k3_experts, unquantized) for c in cases}
    from tokenfab.testing.tokenizer_builder import build_tokenizer
    os.makedirs(out, exist_ok=True)
    tok = os.path.join(out, "_tokenizer")
    if not os.path.isfile(os.path.join(tok, "tokenizer.json")):
        build_tokenizer(tok, vocab_size=TOKENIZER_VOCAB)
    folders = {}
    for case, cfg in configs.items():
        d = os.path.join(out, case)
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(tok):
            shutil.copy(os.path.join(tok, f), os.path.join(d, f))
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        folders[case] = d
    if "k3" in configs:  # the k3 case's DSpark drafter (config only; dummy weights)
        d = os.path.join(out, K3_DSPARK)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(k3_dspark(tiny), f, indent=2)
        folders[K3_DSPARK] = d
    return folders


def count_parameters(folder: str) -> tuple[int, int]:
    """(parameters, bytes in bf16) of the model config.json in ``folder`` describes, built on the meta device."""
    import torch

    from tokenfab.config import load_config
    from tokenfab.models.registry import get_model_class
    mc = load_config(folder)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = get_model_class(mc)(mc, max_positions=4097)
    finally:
        torch.set_default_dtype(prev)
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    if mc.tie_word_embeddings:  # built untied; a loaded model shares the embedding
        n -= mc.vocab_size * mc.hidden_size
    return n, 2 * n


def auto_k3_experts(big_gib: float = 120.0, unquantized: bool = False) -> int:
    """896, the published count, for MXFP4 experts (16 GB) and, unquantized (59 GB of bf16 experts in the k3 case's
    one MoE layer), when there is no CUDA device or device 0 has at least ``big_gib`` GiB (an H200's 141 GB); else
    384 (25 GB: fits an 80 GB H100 beside the rest of the case, ~8 GB)."""
    import torch
    if not unquantized or not torch.cuda.is_available():
        return 896
    return 896 if torch.cuda.get_device_properties(0).total_memory >= big_gib * 2**30 else 384


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the case folders")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)} (default: all)")
    ap.add_argument("--k3-experts", default="896",
                    help="routed experts of the k3 case (published: 896), or auto: 896 (unquantized: 896 on a GPU "
                         "with at least 120 GiB, else 384) (default: 896)")
    ap.add_argument("--tiny", action="store_true", help="test sizes (a CPU dry run)")
    ap.add_argument("--unquantized", action="store_true",
                    help="dsv3 and k3 in bf16 (default: FP8 and MXFP4 experts, as published)")
    ap.add_argument("--count", action="store_true", help="print each model's parameters (built on meta)")
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    k3_experts = (auto_k3_experts(unquantized=args.unquantized) if args.k3_experts == "auto"
                  else int(args.k3_experts))
    try:
        folders = write_cases(args.out, cases, args.tiny, k3_experts, args.unquantized)
    except ValueError as e:
        print(f"gpu_shapes.py: {e}", file=sys.stderr)
        return 2
    for case, d in folders.items():
        line = f"{case}: {d}"
        if args.count and case != K3_DSPARK:
            n, b = count_parameters(d)
            line += f" ({n:,} parameters, {b / 2**30:.2f} GiB in bf16)"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
