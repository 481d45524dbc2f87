"""How many device kernels one decoder layer launches in a decode step on the GPU code path (issue #30: a dense
layer at most 10, an MoE layer at most 14, and no host sync).

The engine runs a tiny checkpoint (float32 and bfloat16) on CPU with the seam taking every GPU choice
(``TOKENFAB_TRITON=interpret-gpu-path``, Triton's interpreter running the kernels), the C++ CPU kernels absent and no
weight repacked for CPU GEMMs (``TOKENFAB_CPU_LINEAR=torch``), as on a GPU machine. tokenfab/testing/kernel_count.py
states the counting rule (every Triton launch; every ATen op but views, metadata-only ops and bare allocations; host
reads counted as syncs). Each decoder layer is a scope (forward hooks), counted in the first decode-only step; a
failure prints the per-kernel breakdown of every layer. Llama and Qwen3 (dense), Qwen3-MoE, DeepSeek-V3's dense
and MoE MLA layers (plain and packed experts) and Kimi Linear's layers hold the issue's targets, most below them
(held to their current counts). The same path also runs against transformers token for token (test_gpu_path_engine_token_exact; KDA:
tests/test_kda_gpu_path.py), so a launch saved by a wrong result cannot pass.
"""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.gpu import support as triton_support
from tokenfab.testing.kernel_count import KernelCounter, breakdown

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")

DENSE_MAX, MOE_MAX = 10, 14
# DeepSeek-V3 and Kimi's MLA layers (a shared expert beside the routed ones): the MoE layer within the issue's
# target 14, at 11 (input norm, the a-projection GEMM, one launch for q_a norm + q_b GEMM + absorbed queries + RoPE +
# latent write, attention, W_UV, o GEMM, post norm, router GEMM + selection + alignment, gate|up GEMM with SiLU-GLU,
# down GEMM, k-sum: the shared experts run as routed slots); the dense layer at the target 10 (the MLP's GEMM,
# SiLU-GLU and GEMM). Were 14 / 12, then 13 / 12 until the q_b GEMM joined the norms, absorbed queries and latent
# write in one launch (kernels/gpu/mla_query_chain.py)
MLA_DENSE_MAX, MLA_MOE_MAX = 10, 11
# Kimi Linear's KDA layers: the six projections of x in one GEMM, f_b and g_b in one bmm, the short conv (+ state
# update), the recurrence and the gated output norm in one launch, o_proj: 9 with a dense MLP, 10 with the MoE block
# (the MoE alignment in the router's launch; were 41 / 49, then 11 / 13 with the conv a launch of its own, then
# 10 / 12 with the norm one)
KDA_DENSE_MAX, KDA_MOE_MAX = 9, 10


@pytest.fixture
def gpu_path_on_cpu(monkeypatch):
    from tokenfab.kernels.cpu import build as cpu_build
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    monkeypatch.setenv("TOKENFAB_CPU_KERNELS", "0")
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", "torch")  # no CPU repacking of bf16 weights at load (GPU: never)
    monkeypatch.setattr(cpu_build, "load", lambda: None)  # a GPU machine has no C++ CPU kernels loaded


def count_decode_layers(path: str, dtype: str = "float32") -> tuple[dict[str, int], KernelCounter]:
    """Per-layer kernel counts of the first decode-only step of a short greedy run on ``path``."""
    from tokenfab import LLM, SamplingParams
    llm = LLM(path, dtype=dtype, max_model_len=64, block_size=8, progress=False)
    model = llm.llm_engine.runner.model
    assert llm.llm_engine.runner.cpu_decode_stack is None
    kc = KernelCounter()
    state = {"on": False, "done": False}

    def model_pre(_mod, args):
        meta = args[3]
        state["on"] = not state["done"] and meta.prefill is None and meta.decode is not None

    def model_post(_mod, _args, _out):
        if state["on"]:
            state["on"], state["done"] = False, True

    hooks = [model.register_forward_pre_hook(model_pre), model.register_forward_hook(model_post)]
    scopes = []
    for i, layer in enumerate(model.model.layers):
        def pre(_mod, _args, i=i):
            if state["on"]:
                scopes.append(kc.scope(f"layer{i}"))
                scopes[-1].__enter__()

        def post(_mod, _args, _out, i=i):
            if state["on"]:
                scopes.pop().__exit__(None, None, None)
        hooks += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    try:
        with kc:
            outs = llm.generate([{"prompt_token_ids": [5, 9, 14, 3, 7]}],
                                SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    finally:
        for h in hooks:
            h.remove()
    assert outs[0].outputs[0].finish_reason == "length", outs[0].outputs[0]
    assert state["done"], "no decode-only step ran"
    return {name: kc.total(name) for name in kc.counts}, kc


def report(kc: KernelCounter) -> str:
    return "\n".join(f"{name}: {kc.total(name)} kernels\n{breakdown(c)}" for name, c in sorted(kc.counts.items()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family,limit", [("llama", DENSE_MAX), ("qwen3", DENSE_MAX), ("qwen3_moe", MOE_MAX),
                                          ("deepseek_v3", MLA_MOE_MAX)])
def test_decode_layer_kernel_count(gpu_path_on_cpu, tiny_model, family, limit, dtype):
    """bfloat16 too: a cast anywhere on the way (router weights, the k-sum, a cache write) would show up there."""
    totals, kc = count_decode_layers(tiny_model(family, num_hidden_layers=3), dtype)
    print(report(kc))
    assert len(totals) == 3
    if family == "deepseek_v3":  # layer 0 dense (first_k_dense_replace=1), then MoE layers
        assert totals["layer0"] <= MLA_DENSE_MAX, f"{totals}\n{report(kc)}"
        assert max(totals["layer1"], totals["layer2"]) <= limit, f"{totals}\n{report(kc)}"
        assert kc.counts["layer1"]["triton:_align_kernel"] == 0, report(kc)  # inside the router's launch
        for c in kc.counts.values():  # the MLA queries and latent write in one launch, no q_b GEMM beside it
            assert c["triton:_mla_queries_cache_kernel"] == 1 and c["triton:_mla_latent_query_kernel"] == 0, report(kc)
        assert not kc.syncs, f"host syncs in the decode step: {kc.syncs}\n{report(kc)}"
        return
    assert not kc.syncs, f"host syncs in the decode step: {kc.syncs}\n{report(kc)}"
    assert max(totals.values()) <= limit, f"{family}: per-layer kernels {totals} > {limit}\n{report(kc)}"
    if family == "qwen3_moe":  # the pairs aligned inside the router's launch (one launch fewer)
        assert all(c["triton:_router_kernel"] == 1 and c["triton:_align_kernel"] == 0 for c in kc.counts.values()), \
            report(kc)
    launched = {n for c in kc.counts.values() for n in c}
    assert any(n.startswith("triton:") for n in launched), "the GPU path did not run"


def test_kda_decode_layer_kernel_count(gpu_path_on_cpu, tmp_path, tokenizer_dir):
    """Kimi Linear (layers: KDA + dense, MLA + MoE, KDA + MoE, KDA + dense, MLA + MoE): the KDA layers' decode step
    runs the short conv, the recurrence and the gated output norm in one Triton launch (kernels/gpu/kda.py
    ``kda_decode_fused``), without a host sync, within today's counts."""
    from test_kimi_linear import make_kimi_linear
    totals, kc = count_decode_layers(make_kimi_linear(str(tmp_path / "kl"), tokenizer_dir, seed=3))
    print(report(kc))
    assert not kc.syncs, f"host syncs in the decode step: {kc.syncs}\n{report(kc)}"
    for name in ("layer0", "layer2", "layer3"):
        assert kc.counts[name]["triton:_kda_recurrent_kernel"] == 1, report(kc)
        assert kc.counts[name]["triton:_short_conv_kernel"] == 0, report(kc)
        assert kc.counts[name]["triton:_gated_rms_norm_kernel"] == 0, report(kc)  # the norm inside that launch
    assert max(totals["layer0"], totals["layer3"]) <= KDA_DENSE_MAX and totals["layer2"] <= KDA_MOE_MAX, totals


def test_kimi_mla_moe_decode_layer_kernel_count(gpu_path_on_cpu, tmp_path, tokenizer_dir):
    """Kimi Linear's NoPE MLA + MoE layers (layer1, layer4 of make_kimi_linear): MLA's queries and latent write in
    one chained launch (the rope slice stored unrotated) and the shared experts folded into the routed stacks, within
    the MoE target."""
    from test_kimi_linear import make_kimi_linear
    totals, kc = count_decode_layers(make_kimi_linear(str(tmp_path / "kl"), tokenizer_dir, seed=3))
    for name in ("layer1", "layer4"):
        c = kc.counts[name]
        assert c["triton:_mla_queries_cache_kernel"] == 1 and c["triton:_router_kernel"] == 1, report(kc)
        assert totals[name] <= MLA_MOE_MAX, f"{totals}\n{report(kc)}"


# DeepSeek-V3 with its routed experts kept packed (MXFP4, as published checkpoints keep INT4 / FP8 ones): the bf16
# shared experts cannot join the packed stacks and run beside them (gate|up GEMM, SiLU-GLU, down GEMM, their sum in
# the k-sum), the routed SiLU-GLU in the packed gate|up GEMM's epilogue, the alignment in the router's launch, the
# MLA queries in one launch: 14 (was 18 with that activation a launch, 17 with the alignment one, 16 with the MLA
# queries three)
MLA_PACKED_MOE_MAX = 14


def test_packed_experts_moe_layer_kernel_count(gpu_path_on_cpu, tiny_model, tmp_path):
    """DeepSeek-V3 with MXFP4-packed routed experts: the packed grouped GEMMs run the routed experts' activation in
    their epilogue (the one SiLU-GLU launch left is the shared experts'), within MLA_PACKED_MOE_MAX."""
    from tokenfab.testing.packed_experts_checkpoint import write_packed_experts_checkpoint
    path = write_packed_experts_checkpoint(tiny_model("deepseek_v3", num_hidden_layers=2), str(tmp_path / "mx"),
                                           "mxfp4")
    totals, kc = count_decode_layers(path, "bfloat16")
    c = kc.counts["layer1"]
    assert c["triton:_grouped_gemm"] == 2 and c["triton:_silu_and_mul_kernel"] == 1, report(kc)
    assert c["triton:_align_kernel"] == 0, report(kc)  # the packed kernels take the router's alignment
    assert totals["layer1"] <= MLA_PACKED_MOE_MAX and not kc.syncs, f"{totals}\n{report(kc)}"


@pytest.mark.parametrize("aligned,shared", [(True, 1), (False, 1), (True, 2)],
                         ids=["block-aligned", "partial-blocks", "two-shared-aligned"])
def test_fp8_layers_kernel_count_and_twin(gpu_path_on_cpu, tiny_model, tmp_path, aligned, shared):
    """DeepSeek-V3 as its FP8 checkpoints ship (block-scaled e4m3 linears and routed experts). At widths in whole
    128-row blocks as the real model's (q_lora 128, intermediates 256 / 128: q_a|kv_a and gate|up join) the dense
    and MoE layers hold MLA_DENSE_MAX and MLA_MOE_MAX: the MLA queries' launch decodes the FP8 q_b itself and the
    FP8 shared expert is folded into the FP8 routed stacks as an always-chosen slot (were 12 / 16, then 10 / 14).
    Both there and at the tiny model's partial blocks (the fold with blocks that end mid-chunk), and with two shared
    experts' width folded as two slots, float32 greedy tokens on this path equal its dequantized twin's (plain
    weights, plain fold), prompt logprobs within 1e-4."""
    from conftest import max_prompt_logprob_gap
    from tokenfab import LLM, SamplingParams
    from tokenfab.testing.fp8_checkpoint import write_fp8_checkpoint
    widths = dict(q_lora_rank=128, moe_intermediate_size=128, intermediate_size=256) if aligned else {}
    src = tiny_model("deepseek_v3", num_hidden_layers=2, n_shared_experts=shared, **widths)
    fp8, twin = str(tmp_path / "fp8"), str(tmp_path / "twin")
    write_fp8_checkpoint(src, fp8, twin)
    if aligned and shared == 1:
        totals, kc = count_decode_layers(fp8, "bfloat16")
        assert all(c["triton:_mla_queries_cache_kernel"] == 1 for c in kc.counts.values()), report(kc)
        assert kc.counts["layer1"]["triton:_silu_and_mul_kernel"] == 0, report(kc)  # no shared MLP of its own
        assert totals["layer0"] <= MLA_DENSE_MAX and totals["layer1"] <= MLA_MOE_MAX and not kc.syncs, \
            f"{totals}\n{report(kc)}"
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 33, 200, 7], [9, 4, 300], list(range(3, 30)))]
    sp = SamplingParams(temperature=0.0, max_tokens=GPU_PATH_NEW, min_tokens=GPU_PATH_NEW, prompt_logprobs=0)
    outs = []
    for path in (twin, fp8):
        llm = LLM(path, dtype="float32", max_model_len=64, block_size=8, progress=False)
        moe = llm.llm_engine.runner.model.model.layers[1].mlp
        assert moe.folded is not None and moe.folded.slots == shared  # folded, plain and FP8 alike
        if path == fp8:
            assert moe.experts.q13.num_experts == moe.experts.num_experts + shared
        outs.append(llm.generate(prompts, sp, use_tqdm=False))
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
    assert max_prompt_logprob_gap(outs[0], outs[1], "FP8 on the GPU path") < 1e-4


def test_counting_rule():
    """Views and no-ops are free, bare allocations too; copies, fills and casts count, also when an aliasing op
    (reshape, to, contiguous) had to make one, with or without inference mode; in-place ops always count."""
    from tokenfab.testing.kernel_count import launches_kernel, may_alias
    a = torch.ops.aten
    for aliasing in (a.view.default, a.transpose.int, a.slice.Tensor, a.select.int, a.unsqueeze.default,
                     a.as_strided.default, a.detach.default, a.alias.default, a.t.default, a.split.Tensor,
                     a.expand.default, a.reshape.default, a.to.dtype, a.contiguous.default):
        assert may_alias(aliasing), aliasing
    for op in (a.copy_.default, a._to_copy.default, a.index_copy_.default, a.cat.default, a.add_.Tensor):
        assert not may_alias(op) and launches_kernel(op), op
    assert not launches_kernel(a.empty.memory_format) and not launches_kernel(a._unsafe_view.default)
    x = torch.randn(4, 6)
    for ctx in (torch.no_grad, torch.inference_mode):
        kc = KernelCounter()
        with ctx(), kc, kc.scope("s"):
            y = x.t().contiguous()  # a copy
            y.view(-1)[1:3].unsqueeze(0)  # views
            x.reshape(24)  # a view
            x.t().reshape(24)  # a copy
            torch.empty(3)
            x.float()  # already float32: nothing
            x.to(torch.bfloat16)  # a cast
            y.add_(1)  # in place
            float(x[0, 0])  # a host sync
            x.tolist()  # host reads CPU tensors never dispatch, caught before
            x.to("cpu")
        c = kc.counts["s"]
        copies = c["aten:clone"] + c["aten:contiguous"] + c["aten:reshape"] + c["aten:_unsafe_view"]
        casts = c["aten:_to_copy"] + c["aten:to"]
        assert copies == 2 and casts == 1 and c["aten:add_"] == 1, (ctx, c)
        item = "aten:item" if ctx is torch.inference_mode else "aten:_local_scalar_dense"
        assert c[item] == 1 and c["host:tolist"] == 1 and c["host:to(cpu)"] == 1, (ctx, c)
        assert sum(c.values()) == 7, (ctx, c)
        assert [n for _, n in kc.syncs] == [item, "host:tolist", "host:to(cpu)"]


# new tokens per prompt in the interpreted engine runs (every kernel interpreted; the CPU path's test_engine_exact.py
# takes 12): with prompts of 21 / 30 tokens the contexts still cross KV blocks of 8 while decoding
GPU_PATH_NEW = 6


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_gpu_path_engine_token_exact(gpu_path_on_cpu, tiny_model, family):
    """The whole engine on the GPU code path (fused add + norm across layers, q/k norm + RoPE + cache write or MLA's
    kv norm + RoPE + latent write, the Triton decode attention, routers, alignment, the fused MoE and k-sum kernels,
    all interpreted) against transformers: greedy tokens identical, prompt and decode logprobs within 1e-4
    (tests/test_engine_exact.py's check), prefill chunks and decode steps mixed."""
    from test_engine_exact import check_family, make_prompts
    from tokenfab.kernels.gpu import decode_attention, moe, rope_cache
    calls = {"rope_cache": 0, "attention": 0, "moe": 0}
    name = "mla_rope_cache" if family == "deepseek_v3" else "qk_rope_cache"

    def spy(mod, attr, key):
        orig = getattr(mod, attr)

        def f(*a, **kw):
            calls[key] += 1
            return orig(*a, **kw)
        return f

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rope_cache, name, spy(rope_cache, name, "rope_cache"))
        mp.setattr(decode_attention, "paged_decode_attention",
                   spy(decode_attention, "paged_decode_attention", "attention"))
        mp.setattr(moe, "fused_moe", spy(moe, "fused_moe", "moe"))
        _, worst = check_family(tiny_model(family), make_prompts(3, [21, 4, 9]), n_new=GPU_PATH_NEW)
    assert calls["rope_cache"], "the fused RoPE + cache write did not run"
    assert calls["attention"] > 0 and (calls["moe"] > 0) == family.endswith(("moe", "v3")), calls
    assert worst < 1e-4


@pytest.mark.parametrize("variant", [dict(q_lora_rank=None, rope_interleave=False),
                                     dict(n_group=4, topk_group=1, first_k_dense_replace=2, num_hidden_layers=3,
                                          norm_topk_prob=False, n_shared_experts=2),
                                     dict(n_routed_experts=12, num_experts_per_tok=4, n_group=1, topk_group=1)],
                         ids=["q-lora-null-half-rope", "grouped-routing-two-shared", "ungrouped-12-experts"])
def test_gpu_path_deepseek_variants_token_exact(gpu_path_on_cpu, tiny_model, variant):
    """DeepSeek-V3 variants on the GPU code path against transformers (tests/test_engine_exact.py's check): MLA's
    decode glue from q_proj (no q LoRA) with half-split RoPE; grouped routing with a bias, no renormalization and
    two experts' width of shared MLP folded into the routed stacks as two always-chosen slots; ungrouped routing over
    an expert count that is not a power of two (as Kimi K3's 896 and Kimi-K2's 384: the selection padded, the shared
    expert still folded)."""
    from test_engine_exact import check_family, make_prompts
    from tokenfab.kernels.gpu import mla_decode_glue, mla_query_chain
    from tokenfab.layers import shared_expert_fold
    calls = {"glue": 0, "chain": 0, "fold": 0}
    orig_glue, orig_chain = mla_decode_glue.mla_latent_query, mla_query_chain.mla_queries_cache
    orig_fold = shared_expert_fold.FoldedSharedExperts.__call__

    def glue(*a, **kw):
        calls["glue"] += 1
        return orig_glue(*a, **kw)

    def chain(*a, **kw):
        calls["chain"] += 1
        return orig_chain(*a, **kw)

    def fold(self, *a, **kw):
        calls["fold"] += 1
        assert self.slots == variant.get("n_shared_experts", 1)
        return orig_fold(self, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mla_decode_glue, "mla_latent_query", glue)
        mp.setattr(mla_query_chain, "mla_queries_cache", chain)
        mp.setattr(shared_expert_fold.FoldedSharedExperts, "__call__", fold)
        _, worst = check_family(tiny_model("deepseek_v3", **variant), make_prompts(4, [30, 7]), n_new=GPU_PATH_NEW)
    # without a query LoRA the three-launch glue, with one the chained launch
    assert calls["glue" if variant.get("q_lora_rank", 1) is None else "chain"] and calls["fold"], calls
    assert worst < 1e-4


def test_gpu_path_seam(monkeypatch):
    """Only ``interpret-gpu-path`` (with TRITON_INTERPRET=1) sends CPU tensors down the GPU path; plain
    ``interpret`` keeps them on the CPU kernels, and the engine accepts both values."""
    from tokenfab.kernels import dispatch
    x = torch.zeros(2, 8)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    triton_support.check_env()
    assert dispatch.gpu_path(x) and triton_support.interpreting() and triton_support.applies(x)
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret")
    assert not dispatch.gpu_path(x) and triton_support.applies(x)
    monkeypatch.setenv("TOKENFAB_TRITON", "0")
    assert not dispatch.gpu_path(x)
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not dispatch.gpu_path(x)
