"""The ``text_config`` of a tiny Kimi K3 layout (tests/test_kimi_k3.py and benchmarks/spec_dspark.py; no network).

:func:`k3_text_config` returns the published field names and nesting (hybrid KDA + gated NoPE MLA with attention
residuals, latent MoE with a shared expert, SiTU activations) at the test's size unless sizes are given.
"""
from __future__ import annotations


def k3_text_config(*, hidden_size: int = 64, intermediate_size: int = 96, moe_intermediate_size: int = 32,
                   num_hidden_layers: int = 4, kv_lora_rank: int = 16, q_lora_rank: int = 24, num_experts: int = 4,
                   routed_expert_hidden_size: int = 32, attn_res_block_size: int = 2, model_max_length: int = 512,
                   kda_layers=(1, 3, 4), full_attn_layers=(2,), kda_head_dim: int = 16) -> dict:
    """A K3 ``text_config`` (vocab 512, 2 attention heads, 2 KDA heads); layer lists are 1-indexed as published."""
    return dict(
        vocab_size=512, hidden_size=hidden_size, intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_hidden_layers, num_attention_heads=2,
        kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_experts=num_experts, num_experts_per_token=2, num_shared_experts=1, routed_scaling_factor=2.0,
        moe_renormalize=True, num_expert_group=1, topk_group=1, first_k_dense_replace=1,
        routed_expert_hidden_size=routed_expert_hidden_size, latent_moe_use_norm=True, hidden_act="situ",
        activation_situ_beta=1.5, activation_situ_linear_beta=2.0, attn_res_block_size=attn_res_block_size,
        mla_use_nope=True, mla_use_output_gate=True, model_max_length=model_max_length, rms_norm_eps=1e-5,
        model_type="kimi_linear", moe_router_activation_func="sigmoid", bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False,
        linear_attn_config={"kda_layers": list(kda_layers), "full_attn_layers": list(full_attn_layers),
                            "num_heads": 2, "head_dim": kda_head_dim, "short_conv_kernel_size": 4,
                            "gate_lower_bound": -5.0, "use_full_rank_gate": True},
    )
