"""Config parsing: both dialects read to the same values; unsupported things are refused naming the field."""
from __future__ import annotations

import math

import pytest
import torch

from tokenfab.config import ConfigError, parse_config

# The published DeepSeek-V3 config.json shape (transformers 4.x dialect), trimmed to the fields we read.
DSV3_4X = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "eos_token_id": 1, "bos_token_id": 0, "num_nextn_predict_layers": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


def to_5x(cfg: dict) -> dict:
    c = dict(cfg)
    rs = dict(c.pop("rope_scaling"))
    rs["rope_type"] = rs.pop("type")
    rs["rope_theta"] = c.pop("rope_theta")
    c["rope_parameters"] = rs
    c["rope_interleave"] = True
    return c


def test_dialects_read_the_same():
    a, b = parse_config(DSV3_4X), parse_config(to_5x(DSV3_4X))
    assert a.rope == b.rope
    assert a.rope.rope_type == "yarn" and a.rope.factor == 40 and a.rope.original_max_position_embeddings == 4096
    assert a.rope.interleave and a.rope.dim == 64 and a.rope.theta == 10000
    assert a.softmax_scale() == b.softmax_scale()
    # qk_head_dim^-0.5 x mscale^2, mscale = 0.1 x 1.0 x ln(40) + 1 (worked by hand: 1.368888...)
    m = 0.1 * math.log(40) + 1
    assert abs(a.softmax_scale() - (192 ** -0.5) * m * m) < 1e-12
    assert a.moe_layers == list(range(3, 61)) and a.kv_cache_bytes_per_token(2) == (512 + 64) * 61 * 2


def test_kimi_k2_model_type_and_rope_type_key():
    c = dict(DSV3_4X, model_type="kimi_k2", rope_theta=50000, rms_norm_eps=1e-5)
    c["rope_scaling"] = dict(DSV3_4X["rope_scaling"], factor=32, beta_fast=1, beta_slow=1)
    c["rope_scaling"]["rope_type"] = c["rope_scaling"].pop("type")
    mc = parse_config(c)
    assert mc.model_type == "kimi_k2" and mc.rope.theta == 50000 and mc.rope.beta_fast == 1 and mc.rope.factor == 32
    assert mc.rms_norm_eps == 1e-5


def test_yarn_frequencies_match_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tokenfab.layers.rotary import compute_inv_freq
    hf = DeepseekV3Config(**{k: v for k, v in to_5x(DSV3_4X).items() if k not in ("architectures",)})
    inv_ref, att_ref = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    mc = parse_config(DSV3_4X)
    inv, att = compute_inv_freq(mc.rope, mc.max_position_embeddings)
    assert torch.allclose(inv, inv_ref, rtol=1e-6, atol=0) and abs(att - att_ref) < 1e-12


@pytest.mark.parametrize("change, field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"model_type": "llama"}, "model_type"),
])
def test_refusals_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        parse_config(dict(DSV3_4X, **change))


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tokenfab.layers.rotary import compute_inv_freq
    rp = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=dict(rp), max_position_embeddings=131072)
    inv_ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    mc = parse_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 10,
                       "hidden_size": 256, "intermediate_size": 10, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "max_position_embeddings": 131072, "rope_parameters": rp})
    inv, _ = compute_inv_freq(mc.rope, mc.max_position_embeddings)
    assert torch.allclose(inv, inv_ref, rtol=1e-6)
