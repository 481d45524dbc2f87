"""Kimi K3 layout and K3-only blocks against independent naive references (loops, float64).

transformers has no K3, so the references here are written from the formulas (issue 7; Moonshot's published
modeling code as transcribed in public ports: ``SituAndMul``, ``_apply_attn_res``, ``KimiSparseMoeBlock``, the KDA
gate with ``gate_lower_bound``) and never call tokenfab code. The tiny checkpoint has the published layout: nested
``text_config``, ``language_model.`` prefix, 1-indexed layer lists, padded A_log (junk beyond num_heads), MXFP4
packed routed experts (compressed-tensors mxfp4-pack-quantized), a vision tower to skip.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from tokenfab import LLM, SamplingParams
from tokenfab.config import ConfigError, parse_config
from tokenfab.errors import WeightLoadError
from tokenfab.testing.tiny_k3 import k3_text_config

P = "language_model."
TEXT = k3_text_config()  # hidden 64, 4 layers: KDA 1, 3, 4 and MLA 2 (1-indexed), attention-residual blocks of 2
QUANT = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
         "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"]}},
         "ignore": ["re:.*shared_experts.*", "re:.*self_attn.*", "lm_head"]}


# ---- naive references (float64, loops) -----------------------------------------------------------------------
def naive_e2m1(code: int) -> float:
    """E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is subnormal (m * 0.5)."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    v = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -v if s else v


def naive_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(packed.shape[0], packed.shape[1] * 2, dtype=torch.float64)
    for r in range(packed.shape[0]):
        for c in range(packed.shape[1]):
            b = int(packed[r, c])
            for j, code in enumerate((b & 15, b >> 4)):  # low nibble = even column
                col = 2 * c + j
                out[r, col] = naive_e2m1(code) * 2.0 ** (int(scale[r, col // 32]) - 127)
    return out


def naive_situ(gate: torch.Tensor, up: torch.Tensor, beta: float, lb: float | None) -> torch.Tensor:
    out = torch.empty_like(gate, dtype=torch.float64)
    for i, (g, u) in enumerate(zip(gate.reshape(-1).tolist(), up.reshape(-1).tolist())):
        a = beta * math.tanh(g / beta) / (1 + math.exp(-g))
        out.view(-1)[i] = a * (lb * math.tanh(u / lb) if lb is not None else u)
    return out


def naive_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def naive_mix(prefix, blocks, proj_w, norm_w, eps):
    """Attention-residual mix for each token: softmax over sources of <rms-normalised source * norm_w, proj_w>."""
    srcs = [*blocks, prefix]
    out = torch.zeros_like(prefix)
    for t in range(prefix.shape[0]):
        scores = []
        for v in srcs:
            vt = v[t]
            r = math.sqrt(float((vt * vt).mean()) + eps)
            scores.append(sum(float(vt[d]) / r * float(norm_w[d]) * float(proj_w.reshape(-1)[d])
                              for d in range(vt.shape[0])))
        m = max(scores)
        e = [math.exp(s - m) for s in scores]
        for v, ei in zip(srcs, e):
            out[t] += ei / sum(e) * v[t]
    return out


def naive_latent_moe(x, W, pre, tc):
    """Router on x (sigmoid, bias for choice only, top-k, renormalise, scale); experts in the latent space."""
    E, k = tc["num_experts"], tc["num_experts_per_token"]
    b, lb = tc["activation_situ_beta"], tc["activation_situ_linear_beta"]
    z = x @ W[pre + "routed_expert_down_proj.weight"].T
    y = torch.zeros_like(z)
    for t in range(x.shape[0]):
        s = [1 / (1 + math.exp(-float(x[t] @ W[pre + "gate.weight"][e]))) for e in range(E)]
        choice = [s[e] + float(W[pre + "gate.e_score_correction_bias"][e]) for e in range(E)]
        top = sorted(range(E), key=lambda e: -choice[e])[:k]
        tot = sum(s[e] for e in top) + 1e-20
        for e in top:
            w1, w3, w2 = (W[f"{pre}experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2"))
            h = naive_situ(z[t] @ w1.T, z[t] @ w3.T, b, lb) @ w2.T
            y[t] += s[e] / tot * tc["routed_scaling_factor"] * h
    y = naive_rms(y, W[pre + "routed_expert_norm.weight"], tc["rms_norm_eps"])
    y = y @ W[pre + "routed_expert_up_proj.weight"].T
    sh = pre + "shared_experts."
    return y + naive_situ(x @ W[sh + "gate_proj.weight"].T, x @ W[sh + "up_proj.weight"].T, b, lb) @ \
        W[sh + "down_proj.weight"].T


def naive_kda(x, W, pre, tc):
    lac = tc["linear_attn_config"]
    H, D, K, lbd = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"], lac["gate_lower_bound"]
    n = x.shape[0]
    proj = {c: x @ W[f"{pre}{c}_proj.weight"].T for c in "qkv"}
    conv = {}
    for c in "qkv":
        w = W[f"{pre}{c}_conv1d.weight"][:, 0, :]
        y = torch.zeros_like(proj[c])
        for t in range(n):
            for j in range(K):
                src = t - (K - 1) + j
                if src >= 0:
                    y[t] += w[:, j] * proj[c][src]
        conv[c] = y * torch.sigmoid(y)
    gpre = (x @ W[pre + "f_a_proj.weight"].T) @ W[pre + "f_b_proj.weight"].T + W[pre + "dt_bias"]
    a_log = W[pre + "A_log"].reshape(-1)[:H]
    beta = torch.sigmoid(x @ W[pre + "b_proj.weight"].T)
    gate = x @ W[pre + "g_proj.weight"].T
    out = torch.zeros(n, H * D, dtype=torch.float64)
    for h in range(H):
        S = torch.zeros(D, D, dtype=torch.float64)
        sl = slice(h * D, (h + 1) * D)
        for t in range(n):
            q, k, v = conv["q"][t, sl], conv["k"][t, sl], conv["v"][t, sl]
            q = q / math.sqrt(float(q @ q) + 1e-6) * D ** -0.5
            k = k / math.sqrt(float(k @ k) + 1e-6)
            g = lbd * torch.sigmoid(math.exp(float(a_log[h])) * gpre[t, sl])
            S = torch.exp(g)[:, None] * S
            S = S + torch.outer(k, float(beta[t, h]) * (v - S.T @ k))
            o = S.T @ q
            o = o / math.sqrt(float((o * o).mean()) + tc["rms_norm_eps"]) * W[pre + "o_norm.weight"]
            out[t, sl] = o * torch.sigmoid(gate[t, sl])
    return out @ W[pre + "o_proj.weight"].T


def naive_gated_mla(x, W, pre, tc):
    H, nope, rope, vd, C = (tc[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                            "v_head_dim", "kv_lora_rank"))
    n = x.shape[0]
    q = naive_rms(x @ W[pre + "q_a_proj.weight"].T, W[pre + "q_a_layernorm.weight"], 1e-6) @ W[pre + "q_b_proj.weight"].T
    q = q.view(n, H, nope + rope)
    ckv = x @ W[pre + "kv_a_proj_with_mqa.weight"].T
    lat, krope = ckv[:, :C], ckv[:, C:]  # NoPE: the rope slice is used as is
    kv = (naive_rms(lat, W[pre + "kv_a_layernorm.weight"], 1e-6) @ W[pre + "kv_b_proj.weight"].T).view(n, H, nope + vd)
    o = torch.zeros(n, H, vd, dtype=torch.float64)
    for h in range(H):
        for t in range(n):
            sc = [float(q[t, h] @ torch.cat([kv[j, h, :nope], krope[j]])) * (nope + rope) ** -0.5 for j in range(t + 1)]
            m = max(sc)
            e = [math.exp(s - m) for s in sc]
            for j in range(t + 1):
                o[t, h] += e[j] / sum(e) * kv[j, h, nope:]
    o = o.reshape(n, H * vd) * torch.sigmoid(x @ W[pre + "g_proj.weight"].T)
    return o @ W[pre + "o_proj.weight"].T


def naive_k3_trace(W, tc, tokens):
    """Full K3 text model, float64, no cache: (per layer i, the input mix h layer i computes from the blocks; per
    layer i, the partial-block sum after it; the output attention-residual mix before the final norm)."""
    eps, S = tc["rms_norm_eps"], tc["attn_res_block_size"]
    kda = {i - 1 for i in tc["linear_attn_config"]["kda_layers"]}
    m = "model."
    prefix, blocks, mixes, sums = W[m + "embed_tokens.weight"][tokens], [], [], []
    for i in range(tc["num_hidden_layers"]):
        L = f"{m}layers.{i}."
        h = naive_mix(prefix, blocks, W[L + "self_attention_res_proj.weight"], W[L + "self_attention_res_norm.weight"],
                      eps) if blocks else prefix
        mixes.append(h)
        cur = prefix
        if i % S == 0:
            blocks, cur = blocks + [prefix], None
        hn = naive_rms(h, W[L + "input_layernorm.weight"], eps)
        a = naive_kda(hn, W, L + "self_attn.", tc) if i in kda else naive_gated_mla(hn, W, L + "self_attn.", tc)
        cur = a if cur is None else cur + a
        h = naive_rms(naive_mix(cur, blocks, W[L + "mlp_res_proj.weight"], W[L + "mlp_res_norm.weight"], eps),
                      W[L + "post_attention_layernorm.weight"], eps)
        if i < tc["first_k_dense_replace"]:
            b, lb = tc["activation_situ_beta"], tc["activation_situ_linear_beta"]
            mo = naive_situ(h @ W[L + "mlp.gate_proj.weight"].T, h @ W[L + "mlp.up_proj.weight"].T, b, lb) @ \
                W[L + "mlp.down_proj.weight"].T
        else:
            mo = naive_latent_moe(h, W, L + "block_sparse_moe.", tc)
        prefix = cur + mo
        sums.append(prefix)
    h = naive_mix(prefix, blocks, W[m + "output_attn_res_proj.weight"], W[m + "output_attn_res_norm.weight"], eps)
    return mixes, sums, h


def naive_k3_logits(W, tc, tokens):
    """Full K3 text model, float64, no cache: logits [n, vocab]."""
    h = naive_k3_trace(W, tc, tokens)[2]
    return naive_rms(h, W["model.norm.weight"], tc["rms_norm_eps"]) @ W["lm_head.weight"].T


# ---- the tiny K3-layout checkpoint ----------------------------------------------------------------------------
def k3_tensors(tc: dict, seed: int = 0) -> tuple[dict, dict]:
    """(stored tensors with the published names/dtypes, float64 dequantised view for the naive reference)."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s, std=1.0: torch.randn(*s, generator=g) * std
    lin = lambda o, i: rn(o, i, std=i ** -0.5)
    d, V = tc["hidden_size"], tc["vocab_size"]
    lac = tc["linear_attn_config"]
    H, D = lac["num_heads"], lac["head_dim"]
    hd = H * D
    t = {"model.embed_tokens.weight": rn(V, d), "lm_head.weight": rn(V, d, std=0.2),
         "model.norm.weight": 1 + rn(d, std=0.1), "model.output_attn_res_norm.weight": 1 + rn(d, std=0.1),
         "model.output_attn_res_proj.weight": rn(1, d, std=0.5)}
    packed_pairs = {}
    for i in range(tc["num_hidden_layers"]):
        L = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            t[L + n + ".weight"] = 1 + rn(d, std=0.1)
        for n in ("self_attention_res_proj", "mlp_res_proj"):
            t[L + n + ".weight"] = rn(1, d, std=0.5)
        a = L + "self_attn."
        if i + 1 in lac["kda_layers"]:
            for n in "qkvg":
                t[a + n + "_proj.weight"] = lin(hd, d)
            for n in "qkv":
                t[a + n + "_conv1d.weight"] = rn(hd, 1, lac["short_conv_kernel_size"], std=0.7)
            t[a + "f_a_proj.weight"], t[a + "f_b_proj.weight"] = lin(D, d), lin(hd, D)
            t[a + "b_proj.weight"], t[a + "dt_bias"] = lin(H, d), rn(hd, std=0.5)
            a_log = torch.full((D,), 9.0)  # padded to head_dim: entries past num_heads are junk, never used
            a_log[:H] = torch.rand(H, generator=g).mul(3).add(0.5).log()
            t[a + "A_log"] = a_log
            t[a + "o_norm.weight"], t[a + "o_proj.weight"] = 1 + rn(D, std=0.1), lin(d, hd)
        else:
            Hm, nope, rope, vd, C, ql = (tc[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                                         "v_head_dim", "kv_lora_rank", "q_lora_rank"))
            t[a + "q_a_proj.weight"], t[a + "q_a_layernorm.weight"] = lin(ql, d), 1 + rn(ql, std=0.1)
            t[a + "q_b_proj.weight"] = lin(Hm * (nope + rope), ql)
            t[a + "kv_a_proj_with_mqa.weight"], t[a + "kv_a_layernorm.weight"] = lin(C + rope, d), 1 + rn(C, std=0.1)
            t[a + "kv_b_proj.weight"] = lin(Hm * (nope + vd), C)
            t[a + "g_proj.weight"], t[a + "o_proj.weight"] = lin(Hm * vd, d), lin(d, Hm * vd)
        if i < tc["first_k_dense_replace"]:
            I = tc["intermediate_size"]
            t[L + "mlp.gate_proj.weight"], t[L + "mlp.up_proj.weight"] = lin(I, d), lin(I, d)
            t[L + "mlp.down_proj.weight"] = lin(d, I)
        else:
            b = L + "block_sparse_moe."
            E, lat, m = tc["num_experts"], tc["routed_expert_hidden_size"], tc["moe_intermediate_size"]
            sh = m * tc["num_shared_experts"]
            t[b + "gate.weight"], t[b + "gate.e_score_correction_bias"] = lin(E, d), rn(E, std=0.05)
            t[b + "routed_expert_down_proj.weight"], t[b + "routed_expert_up_proj.weight"] = lin(lat, d), lin(d, lat)
            t[b + "routed_expert_norm.weight"] = 1 + rn(lat, std=0.1)
            for n, (o, i_) in (("gate_proj", (sh, d)), ("up_proj", (sh, d)), ("down_proj", (d, sh))):
                t[b + f"shared_experts.{n}.weight"] = lin(o, i_)
            for e in range(E):
                for n, (o, i_) in (("w1", (m, lat)), ("w3", (m, lat)), ("w2", (lat, m))):
                    pk = torch.randint(0, 256, (o, i_ // 2), generator=g, dtype=torch.int64).to(torch.uint8)
                    sc = torch.randint(123, 127, (o, i_ // 32), generator=g, dtype=torch.int64).to(torch.uint8)
                    packed_pairs[b + f"experts.{e}.{n}.weight"] = (pk, sc)
    ref = {k: v.double() for k, v in t.items()}
    stored = {P + k: v.to(torch.bfloat16).float() if v.dim() == 2 else v for k, v in t.items()}
    ref = {k: stored[P + k].double() for k in t}  # the reference sees exactly the stored values
    for k, (pk, sc) in packed_pairs.items():
        stored[P + k + "_packed"], stored[P + k + "_scale"] = pk, sc
        stored[P + k + "_shape"] = torch.tensor(list(naive_mxfp4(pk[:1], sc[:1]).shape), dtype=torch.int64)
        ref[k] = naive_mxfp4(pk, sc)
    stored["vision_tower.patch_embed.weight"] = rn(4, 4)
    stored["mm_projector.weight"] = rn(4, d)
    return stored, ref


def write_k3(out_dir: str, tokenizer_dir: str, text: dict = TEXT, tensors: dict | None = None,
             quant: dict | None = QUANT) -> str:
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    cfg = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
           "eos_token_id": 1}
    if quant:
        cfg["quantization_config"] = quant
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"))
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), out_dir)
    return out_dir


@pytest.fixture(scope="module")
def k3(tmp_path_factory, tokenizer_dir):
    stored, ref = k3_tensors(TEXT)
    return write_k3(str(tmp_path_factory.mktemp("k3")), tokenizer_dir, tensors=stored), ref


# ---- block tests ----------------------------------------------------------------------------------------------
def test_mxfp4_dequant_matches_naive():
    from tokenfab.layers.mxfp4 import dequantize_mxfp4
    g = torch.Generator().manual_seed(0)
    pk = torch.randint(0, 256, (3, 32), generator=g, dtype=torch.int64).to(torch.uint8)
    sc = torch.randint(110, 140, (3, 2), generator=g, dtype=torch.int64).to(torch.uint8)
    assert torch.equal(dequantize_mxfp4(pk, sc, torch.float64), naive_mxfp4(pk, sc))
    with pytest.raises(ValueError, match="weight_scale"):
        dequantize_mxfp4(pk, sc[:, :1])


def test_situ_matches_naive():
    from tokenfab.models.kimi_moe import situ_glu
    x = torch.randn(5, 2 * 7, dtype=torch.float64) * 4
    for beta, lb in ((1.5, 2.0), (4.0, 25.0), (1.0, None)):
        got = situ_glu(x, beta, lb).double()  # computed in float32 inside (as the reference implementations do)
        assert (got - naive_situ(x[:, :7], x[:, 7:], beta, lb)).abs().max() < 1e-5


def test_attn_res_mix_matches_naive():
    from tokenfab.layers.linear import Linear
    from tokenfab.layers.norm import RMSNorm
    from tokenfab.models.kimi_linear import attn_res_mix
    torch.manual_seed(0)
    d = 16
    proj, norm = Linear(d, 1), RMSNorm(d, eps=1e-5)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(1, d))
        norm.weight.copy_(1 + 0.3 * torch.randn(d))
    prefix = torch.randn(3, d, dtype=torch.float64) * 2
    blocks = [torch.randn(3, d, dtype=torch.float64) * s for s in (1.0, 3.0)]
    got = attn_res_mix(prefix, blocks, proj, norm)
    want = naive_mix(prefix, blocks, proj.weight.detach().double(), norm.weight.detach().double(), 1e-5)
    assert (got - want).abs().max() < 1e-5


def test_latent_moe_matches_naive(k3):
    """The K3 latent MoE block (SiTU experts on MXFP4-dequantised weights) of the loaded model vs the naive one."""
    path, ref = k3
    llm = LLM(path, dtype="float32", device="cpu", progress=False)
    model = llm.llm_engine.runner.model
    x = torch.randn(6, TEXT["hidden_size"])
    with torch.no_grad():
        got = model.model.layers[1].mlp(x).double()  # float32 engine block
    want = naive_latent_moe(x.double(), ref, "model.layers.1.block_sparse_moe.", TEXT)
    assert (got - want).abs().max() < 1e-5


# ---- whole model ------------------------------------------------------------------------------------------------
def test_k3_layout_loads_and_generates_like_naive_reference(k3):
    """Greedy generation (chunked prefill, two sequences batched) equals the naive float64 K3; prompt logprobs
    within 1e-4. Vision weights are skipped and reported; eos comes from config.json."""
    path, ref = k3
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=16, progress=False)
    eng = llm.llm_engine
    assert eng.eos_token_ids == [1]
    assert set(eng.skipped_weights) == {"vision_tower.patch_embed.weight", "mm_projector.weight"}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 512, (n,), generator=g).tolist() for n in (21, 6)]
    n_gen = 4
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n_gen, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False)
    worst = 0.0
    for p, o in zip(prompts, outs):
        toks = list(p)
        for _ in range(n_gen):
            toks.append(int(naive_k3_logits(ref, TEXT, toks)[-1].argmax()))
        assert o.outputs[0].token_ids == toks[len(p):]
        lp = torch.log_softmax(naive_k3_logits(ref, TEXT, p), -1)
        worst = max(worst, max(abs(o.prompt_logprobs[i][p[i]].logprob - float(lp[i - 1, p[i]])) for i in range(1, len(p))))
    print(f"\nK3 fp32 engine vs naive float64 reference: max |Δ prompt logprob| = {worst:.2e}")
    assert worst < 1e-4


# ---- bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("drop", ["hidden_size", "kv_lora_rank", "num_hidden_layers"])
def test_k3_config_missing_field(drop):
    text = {k: v for k, v in TEXT.items() if k != drop}
    with pytest.raises(ConfigError, match=f"text_config.{drop}"):
        parse_config({"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
                      "text_config": text})


def test_k3_config_missing_text_config():
    with pytest.raises(ConfigError, match="text_config"):
        parse_config({"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3"})


def test_k3_layer_index_out_of_range():
    text = dict(TEXT, linear_attn_config=dict(TEXT["linear_attn_config"], kda_layers=[1, 3, 5]))
    with pytest.raises(ConfigError, match="out of range"):
        parse_config({"architectures": ["KimiK3ForConditionalGeneration"], "text_config": text})


def test_mxfp4_outside_routed_experts_is_refused(tmp_path, tokenizer_dir):
    stored, _ = k3_tensors(TEXT)
    w = stored.pop(P + "model.layers.0.mlp.gate_proj.weight")
    stored[P + "model.layers.0.mlp.gate_proj.weight_packed"] = torch.zeros(w.shape[0], w.shape[1] // 2,
                                                                           dtype=torch.uint8)
    stored[P + "model.layers.0.mlp.gate_proj.weight_scale"] = torch.full((w.shape[0], w.shape[1] // 32), 127,
                                                                         dtype=torch.uint8)
    path = write_k3(str(tmp_path / "bad"), tokenizer_dir, tensors=stored)
    with pytest.raises(WeightLoadError, match="outside the routed experts"):
        LLM(path, dtype="float32", device="cpu", progress=False)


def test_planner_counts_hybrid_state():
    mc = parse_config({"architectures": ["KimiK3ForConditionalGeneration"], "text_config": TEXT})
    assert mc.kv_cache_bytes_per_token(2) == (16 + 8) * 1 * 2  # one MLA layer
    assert mc.kda_state_bytes_per_request(2) == 3 * (3 * 32 * 3 * 2 + 2 * 16 * 16 * 4)


def test_plan_k3_shaped_config():
    """``tokenfab plan`` on the published K3 text shape: 93 layers (69 KDA + 24 MLA), hidden 7168, 896 experts
    top-16, latent 3584, MXFP4 experts, on 6 devices: weights (~2.8T parameters), per-token MLA KV (MLA layers
    only) and per-request KDA state."""
    from tokenfab.planner.memory_planner import plan_memory
    full = [i for i in range(1, 94) if i % 4 == 0][:23] + [93]
    text = dict(TEXT, vocab_size=163840, hidden_size=7168, intermediate_size=33792, moe_intermediate_size=3072,
                num_hidden_layers=93, num_attention_heads=96, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, num_experts=896, num_experts_per_token=16, num_shared_experts=2,
                routed_expert_hidden_size=3584, attn_res_block_size=12, model_max_length=1 << 20,
                linear_attn_config=dict(TEXT["linear_attn_config"], num_heads=96, head_dim=128,
                                        kda_layers=[i for i in range(1, 94) if i not in full], full_attn_layers=full))
    cfg = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
           "quantization_config": QUANT}
    mp = plan_memory(cfg, 6, 288 * 10**9, max_model_len=1 << 20)
    assert mp.model["num_kda_layers"] == 69 and mp.model["num_mla_layers"] == 24
    assert all(r.kv_bytes_per_token == (512 + 64) * 24 * 2 for r in mp.ranks)
    assert mp.model["kda_state_bytes_per_request"] == 69 * (3 * 96 * 128 * 3 * 2 + 96 * 128 * 128 * 4)
    assert 2.7e12 < mp.weights.num_params < 2.9e12 and mp.weights.weight_format == "mxfp4"
    assert any("KDA state" in a for a in mp.assumptions)
    assert all(200 * 2**30 < r.weight_bytes < 300 * 2**30 for r in mp.ranks)  # ~1.45 TiB / 6 with MXFP4 experts
