"""Tensor parallel for Kimi Linear (hybrid KDA + NoPE MLA + sigmoid MoE) over N CPU processes (gloo), float32.

The tiny checkpoint has 5 KDA heads (split 3+2 on 2 ranks, 2+2+1 on 3, 1+1+1+1+1+0 on 6), 4 MLA heads (none on two
of 6 ranks), 8 routed experts, intermediate sizes 98 / 44 and a 512-row vocabulary, so no split is even. Variants
of the same weights:

* ``4d``: as transformers saves it (published names, legacy 4-D A_log [1, 1, H, 1]);
* ``padded``: A_log stored 1-D with 8 entries for the 5 heads (junk beyond num_heads: only the first 5 are real);
* ``fused_conv``: transformers-5 runtime names (one ``conv1d`` [3HD, 1, K] for q|k|v), padded A_log.

Four prompts of 3-30 tokens with ``max_num_batched_tokens=16``: prefill runs in chunks, so each sequence's KDA state
(conv + recurrent, only this rank's heads) must carry across steps, with decodes and prefills mixed in one step.
Greedy tokens must equal one rank's and prompt logprobs agree within 1e-4; every variant is compared with the
single-rank run of ``4d`` (which also checks that the A_log forms read to the same model).

Kimi K3 (K3 layout from tests/test_kimi_k3.py with 3 KDA and 3 MLA heads, 6 MXFP4 experts): N = 2 against N = 1.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from test_kimi_linear import make_kimi_linear
from conftest import max_prompt_logprob_gap, tp_generate

os.environ.setdefault("TOKENFAB_TP_TIMEOUT", "120")  # a broken test fails instead of hanging

KDA_HEADS, KDA_DIM, STORED_A_LOG = 5, 16, 8
N_NEW = 6
ENGINE_KW = dict(dtype="float32", device="cpu", max_model_len=96, max_num_batched_tokens=16, block_size=8,
                 max_num_seqs=4, progress=False)
MEASURED: dict[str, float] = {}
_REF: list = []


@pytest.fixture(scope="module")
def variants(tmp_path_factory, tokenizer_dir):
    """{variant: checkpoint folder}."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("tp_kimi")
    src = make_kimi_linear(str(root / "4d"), tokenizer_dir, seed=11, linear_num_heads=KDA_HEADS,
                           linear_head_dim=KDA_DIM, intermediate_size=98, moe_intermediate_size=44)
    out = {"4d": src}
    sd = load_file(os.path.join(src, "model.safetensors"))
    assert any(k.endswith("A_log") and v.dim() == 4 for k, v in sd.items())  # the legacy form as saved

    def write(name: str, tensors: dict) -> None:
        dst = root / name
        dst.mkdir()
        for f in os.listdir(src):
            if f != "model.safetensors":
                (dst / f).write_bytes((root / "4d" / f).read_bytes())
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        out[name] = str(dst)

    padded = {k: (torch.cat([v.reshape(-1), torch.full((STORED_A_LOG - KDA_HEADS,), 7.0)])
                  if k.endswith("A_log") else v) for k, v in sd.items()}
    write("padded", padded)
    fused = {}
    for k, v in padded.items():
        if k.endswith(".q_conv1d.weight"):
            base = k[: -len("q_conv1d.weight")]
            fused[base + "conv1d.weight"] = torch.cat(
                [padded[base + p + "_conv1d.weight"] for p in ("q", "k", "v")], dim=0).contiguous()
        elif not k.endswith(("k_conv1d.weight", "v_conv1d.weight")):
            fused[k] = v
    write("fused_conv", fused)
    return out


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in (3, 21, 11, 30)]


def run(path: str, n: int):
    return tp_generate(path, n, prompts(), N_NEW, **ENGINE_KW)


def reference(variants):
    if not _REF:
        _REF.extend(run(variants["4d"], 1))
    return _REF


@pytest.mark.parametrize("variant,n", [("4d", 2), ("4d", 3), ("padded", 2), ("padded", 3), ("fused_conv", 3),
                                       ("padded", 6)])
def test_tp_kimi_linear_matches_single_rank(variants, variant, n):
    ref, got = reference(variants), run(variants[variant], n)
    worst = max_prompt_logprob_gap(ref, got, f"{variant} N={n}")
    MEASURED[f"{variant} N={n}"] = worst
    assert worst < 1e-4, f"{variant} N={n}: max |d prompt logprob| = {worst}"


def test_kda_slices_tile_heads(variants):
    """In-process, no group: on 3 ranks the KDA tensors, A_log entries (from the padded 1-D form) and state slots
    hold exactly that rank's heads, and together tile all 5 heads; MLA heads and experts split as for DeepSeek-V3."""
    from safetensors.torch import load_file

    from tokenfab.engine.engine_config import EngineConfig
    from tokenfab.parallel.worker import build_rank

    path = variants["padded"]
    full = load_file(os.path.join(path, "model.safetensors"))
    cfg = EngineConfig(model=path, dtype="float32", max_model_len=96)
    a_logs, q_rows, o_cols, b_rows, state_heads, mla_rows, experts = [], 0, 0, 0, 0, 0, 0
    for r in range(3):
        _, loaded = build_rank(cfg, r, 3)
        kda = loaded.model.model.layers[0].self_attn
        assert kda.num_heads == (2, 2, 1)[r]
        sd = dict(loaded.model.named_parameters())
        # q|k|v|f_a|g_a|b joined after loading (KimiDeltaAttention.fuse): this rank's q and b rows are the
        # checkpoint's rows of its heads
        joined, hd = kda.in_proj.weight, kda.num_heads * KDA_DIM
        pre = "model.layers.0.self_attn."
        assert torch.equal(joined[:hd], full[pre + "q_proj.weight"][kda.h0 * KDA_DIM:kda.h1 * KDA_DIM].float())
        assert torch.equal(joined[-kda.num_heads:], full[pre + "b_proj.weight"][kda.h0:kda.h1].float())
        q_rows += hd
        o_cols += sd["model.layers.0.self_attn.o_proj.weight"].shape[1]
        b_rows += kda.num_heads
        assert sd["model.layers.0.self_attn.q_conv1d.weight"].shape[0] == kda.num_heads * KDA_DIM
        assert sd["model.layers.0.self_attn.dt_bias"].shape[0] == kda.num_heads * KDA_DIM
        a_logs.append(sd["model.layers.0.self_attn.A_log"])
        state_heads += kda.make_state_cache(2, torch.float32, "cpu").recurrent.shape[1]
        mla_rows += sd["model.layers.1.self_attn.kv_b_proj.weight"].shape[0]
        experts += sd["model.layers.1.mlp.experts.w2"].shape[0]
    assert (q_rows, o_cols, b_rows, state_heads) == (KDA_HEADS * KDA_DIM, KDA_HEADS * KDA_DIM, KDA_HEADS, KDA_HEADS)
    assert torch.equal(torch.cat(a_logs), full["model.layers.0.self_attn.A_log"][:KDA_HEADS].float())
    assert mla_rows == 4 * (16 + 24) and experts == 8


def test_tp_kimi_k3_matches_single_rank(tmp_path, tokenizer_dir):
    """K3 layout on 2 ranks: 3 KDA heads (2+1) with A_log padded to 16 entries, 3 gated-MLA heads (g_proj by head),
    latent MoE with 6 MXFP4 experts (3+3, dequantised per owned expert) and SiTU, block attention residuals."""
    from test_kimi_k3 import TEXT, k3_tensors, write_k3

    text = dict(TEXT, num_attention_heads=3, num_experts=6, intermediate_size=97,
                linear_attn_config=dict(TEXT["linear_attn_config"], num_heads=3))
    stored, _ = k3_tensors(text, seed=2)
    path = write_k3(str(tmp_path / "k3"), tokenizer_dir, text=text, tensors=stored)
    ref, got = run(path, 1), run(path, 2)
    worst = 0.0
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids, "K3 N=2: greedy tokens differ"
        for a, b in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            worst = max(worst, max(abs(a[k].logprob - b[k].logprob) for k in a))
    MEASURED["k3 N=2"] = worst
    assert worst < 1e-4, f"K3 N=2: max |d prompt logprob| = {worst}"


def test_report_measured(capsys):
    """Print the measured max |Δ prompt logprob| per variant and N (run with -s to see it)."""
    with capsys.disabled():
        print("\nKimi Linear TP vs 1 rank, max |Δ prompt logprob|:", {k: f"{v:.1e}" for k, v in MEASURED.items()})
