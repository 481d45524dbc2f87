"""Routed experts of FP8 block-scaled checkpoints (DeepSeek-V3 / Kimi-K2 as published) kept packed
(tokenfab/quant/fp8_block_experts.py): dequantization against the published formula written in
tests/test_fp8_block_weight.py (``formula``: W[r, c] = fp8[r, c] * scale_inv[r // 128, c // 128], partial blocks),
the grouped kernel against a float64 product on the dequantized weights, every e4m3 code through the kernel, the
module path with an expert range (expert parallel), the tiny FP8 DeepSeek-V3 against its dequantized twin, host
experts on the FP8 checkpoint, and the plan's bytes against the resident bytes.
"""
from __future__ import annotations

import pytest
import torch

from conftest import max_prompt_logprob_gap
from test_fp8_block_weight import formula, fp8_pair, random_fp8  # noqa: F401  (fp8_pair: a fixture)
from tokenfab import LLM, SamplingParams
from tokenfab.errors import WeightLoadError
from tokenfab.kernels.cpu.ops import fp8_linear as cpu_fp8
from tokenfab.quant.fp8_block_experts import Fp8BlockExperts
from tokenfab.quant.fp8_block_weight import Fp8BlockWeight

def any_kernel() -> bool:
    """An FP8 expert kernel runs here: the AVX512-BF16 one, or on CPUs without it the AVX2 one."""
    return cpu_fp8.fp8_experts_applies() or cpu_fp8.fp8_block_linear_avx2_applies()


kernel = pytest.mark.skipif(not any_kernel(), reason="no FP8 expert kernel here (C++ kernels not built)")


def gate_up_stack(E: int, I: int, H: int, seed: int = 0, nan: bool = False):
    """An [E, 2I, H] gate|up stack loaded from per-expert FP8 weights as the loader hands them over, and the
    float32 weights by the formula (gate rows then up rows, each with its own blocks)."""
    st = Fp8BlockExperts.for_parts(E, [I, I], H)
    ref = []
    for e in range(E):
        g, u = random_fp8(I, H, seed=seed + 2 * e, nan=nan), random_fp8(I, H, seed=seed + 2 * e + 1, nan=nan)
        st.load_part(e, 0, "weight", Fp8BlockWeight(*g), "gate")
        st.load_part(e, I, "weight", Fp8BlockWeight(*u), "up")
        ref.append(torch.cat([formula(*g), formula(*u)]))
    return st, torch.stack(ref)


def test_dequantize_is_the_published_formula_per_part():
    """I = 200: each of gate and up has a partial 72-row last block (a block never mixes gate and up rows);
    H = 160: a partial 32-column last block."""
    st, ref = gate_up_stack(3, 200, 160)
    assert st.packed.dtype == torch.uint8 and st.scale.shape == (3, 4, 2)
    for e in range(3):
        assert torch.equal(st.dequantize_expert(e), ref[e])
    assert torch.equal(st.dequantize_rows(1, 150, 260), ref[1, 150:260])  # across the gate / up boundary
    assert st.nbytes == 3 * (400 * 160 + 4 * 2 * 2 * 2)  # exactly the checkpoint's bytes: 1 per value, 4 per block
    with pytest.raises(WeightLoadError, match="gate: checkpoint"):
        st.load_part(0, 0, "weight", Fp8BlockWeight(*random_fp8(200, 128)), "gate")
    with pytest.raises(WeightLoadError, match="w.weight_packed"):
        st.load_part(0, 0, "weight_packed", torch.zeros(200, 20, dtype=torch.int32), "w.weight_packed")


@kernel
def test_tile_layout_round_trip_and_dequantize():
    """The tile relayout against its definition (fp8_tiles.h: per 16 rows and 4 inputs, 64 bytes whose word 2j + e
    holds row j's code at 4q + e in its low byte, at 4q + 2 + e in its high byte), back exactly, and
    dequantize_rows of a tiled stack equal to the formula across tile, block and part boundaries."""
    st, W = gate_up_stack(2, 208, 160, seed=21)
    before = st.packed.clone()
    t = before.clone()
    cpu_fp8.fp8_tiles_relayout(t, True)
    w = before[1, 32:48].reshape(16, 40, 2, 2)  # tile 2 of expert 1: [row j, quad q, half h, e]
    assert torch.equal(t[1, 32:48].reshape(-1), w.permute(1, 0, 3, 2).reshape(-1))  # [q][j][e][h]
    cpu_fp8.fp8_tiles_relayout(t, False)
    assert torch.equal(t, before)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_fp8.fp8_tiles_relayout(before[:, :40].contiguous(), True)
    if not (cpu_fp8.fp8_experts_applies() and cpu_fp8.fp8_tiles_preferred()):
        pytest.skip("this CPU keeps FP8 expert stacks row-major")
    st.prepare()
    assert st.cpu_tiles and not torch.equal(st.packed, before)
    assert torch.equal(st.dequantize_expert(1), W[1])
    assert torch.equal(st.dequantize_rows(0, 7, 300), W[0, 7:300])  # partial tiles, across the gate / up boundary


@pytest.mark.skipif(not cpu_fp8.fp8_experts_applies(), reason="no AVX512-BF16 FP8 expert kernel here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_kernel_called_directly_matches_float64(dtype):
    """The tile kernels through ``fp8_experts_linear(tiled=True)`` on a stack re-laid by hand, whether or not this CPU
    would take the layout (AMX machines do not, so prepare() would not reach them there): segments of 1, 5, 16 (the
    tile GEMV) and 17, 40 rows (brgemm over converted tiles) against a float64 product; K = 2048 takes x's padded row
    stride, parts of 48 rows a partial 128-row scale block; then one token alone (x read in place)."""
    st, W = gate_up_stack(3, 48, 2048, seed=41)
    packed = st.packed.clone()
    cpu_fp8.fp8_tiles_relayout(packed, True)
    counts, experts = [1, 5, 16, 17, 40], [2, 0, 1, 2, 0]
    offsets = torch.tensor([0, 1, 6, 22, 39, 79])
    x = torch.randn(79, 2048, generator=torch.Generator().manual_seed(4)).to(dtype)
    y = cpu_fp8.fp8_experts_linear(x, packed, st.scale, torch.tensor(experts), offsets, 48, tiled=True)
    b = 0
    for e, n in zip(experts, counts):
        xs, we = x[b:b + n], W[e]
        if dtype == torch.bfloat16 and n > cpu_fp8.fp8_gemv_max_rows(dtype, 2048, tiled=True):
            we = we.bfloat16().float()  # brgemm: the weight rounded once to bf16
        ref = xs.double() @ we.double().T
        tol = fp32_bound(xs, we) + (ref.abs() * 2 ** -8 if dtype == torch.bfloat16 else 0)
        assert ((y[b:b + n].double() - ref).abs() <= tol).all(), (e, n)
        b += n
    # one token in all (batch-1 decode): x read in place at its natural stride
    y1 = cpu_fp8.fp8_experts_linear(x[:1], packed, st.scale, torch.tensor([1]), torch.tensor([0, 1]), 48, tiled=True)
    ref = x[:1].double() @ W[1].double().T
    assert ((y1.double() - ref).abs() <= fp32_bound(x[:1], W[1]) + (ref.abs() * 2 ** -8 if dtype == torch.bfloat16
                                                                    else 0)).all()


def fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Two float32 sums of the same exact products in different orders differ by at most 2 K 2^-24 sum |x W|."""
    return 2 * x.shape[-1] * 2.0 ** -24 * (x.abs().double() @ w.abs().double().T) + 1e-30


@pytest.mark.parametrize("H", [160, 2080])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["kernel", "tiles", "torch"])
def test_grouped_linear_matches_float64(dtype, path, H, monkeypatch):
    """Segments of 1, 2, 3, 5, 8, 12, 16, 17 and 70 tokens (expert 3 twice): the GEMV, AMX (bf16, more than 4 rows)
    and brgemm paths (the AVX2 kernel on CPUs without AVX512-BF16: its GEMV and float32 panels). H = 2080 (17 scale
    blocks, the last 32 wide): the GEMV reads x in several L1-sized K chunks. "tiles": parts of 80 rows (5 tiles, a
    partial 128-row scale block) in the CPU tile layout where this CPU takes it (fp8_tiles.h: the tile GEMV up to 16
    rows, brgemm over converted tiles beyond); "kernel": parts of 72 rows stay row-major."""
    if path == "torch":
        monkeypatch.setenv("TOKENFAB_PACKED_EXPERTS", "torch")
    elif not any_kernel():
        pytest.skip("no FP8 expert kernel here (C++ kernels not built)")
    st, W = gate_up_stack(8, 80 if path == "tiles" else 72, H, seed=11)
    st.prepare()
    assert (st._kernel or st._avx2) == (path != "torch")
    assert st.cpu_tiles == (path == "tiles" and st._kernel and cpu_fp8.fp8_tiles_preferred())
    rows = 2 * (80 if path == "tiles" else 72)
    experts, counts = [3, 0, 5, 1, 7, 2, 6, 4, 3], [1, 2, 3, 5, 8, 12, 16, 17, 70]
    x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = st.grouped_linear(x, experts, counts)
    assert y.dtype == dtype and y.shape == (sum(counts), rows)
    from tokenfab.kernels.cpu import isa
    b = 0
    for e, n in zip(experts, counts):
        xs = x[b:b + n]
        we = W[e]
        if (st._kernel and dtype == torch.bfloat16 and n > cpu_fp8.fp8_gemv_max_rows(dtype, H, st.cpu_tiles)
                and (isa.selected_level() != "amx" or st.cpu_tiles)):
            we = we.bfloat16().float()  # brgemm without AMX: the weight rounded once to bf16 (the bf16 twin's)
        ref = xs.double() @ we.double().T
        tol = fp32_bound(xs, we) + (ref.abs() * 2 ** -8 if dtype == torch.bfloat16 else 0)
        assert ((y[b:b + n].double() - ref).abs() <= tol).all(), (e, n, (y[b:b + n].double() - ref).abs().max())
        b += n


@kernel
@pytest.mark.parametrize("I", [200, 208], ids=["rows", "tiles"])
@pytest.mark.parametrize("m", [1, 3, 8, 32])
def test_kernel_decodes_every_finite_e4m3_code_exactly(m, I):
    """x = rows of the identity: y[i, r] = W[r, i] (one exact product, scaled once), bit for bit against the formula
    for all 254 finite codes (signed zeros, subnormals), float32 and bf16 x, through each path by m; parts of 200
    rows stay row-major, of 208 (13 tiles) take the tile layout where this CPU prefers it."""
    st, W = gate_up_stack(2, I, 160, seed=5)
    codes = set(st.packed.unique().tolist())
    assert codes == {c for c in range(256) if c & 0x7F != 0x7F}
    st.prepare()
    eye = torch.eye(160)
    for e in range(2):
        for dtype in (torch.float32, torch.bfloat16):
            y = torch.cat([st.grouped_linear(eye[i:i + m].to(dtype), [e], [len(eye[i:i + m])])
                           for i in range(0, 160, m)])
            assert torch.equal(y, W[e].T.to(dtype)), (e, dtype)


@kernel
@pytest.mark.parametrize("layout", ["rows", "tiles"])
def test_kernel_nan_codes_give_nan(layout, monkeypatch):
    """The two NaN codes (0x7F, 0xFF) are reachable and give NaN in exactly their rows' outputs, in either layout
    (TOKENFAB_PACKED_EXPERTS=rows keeps the checkpoint's)."""
    if layout == "rows":
        monkeypatch.setenv("TOKENFAB_PACKED_EXPERTS", "rows")
    st, _ = gate_up_stack(1, 128, 64, seed=9)
    st.packed[0, 7, 3], st.packed[0, 200, 40] = 0x7F, 0xFF
    st.prepare()
    assert st.cpu_tiles == (layout == "tiles" and st._kernel and cpu_fp8.fp8_tiles_preferred())
    for n in (1, 6, 20):
        y = st.grouped_linear(torch.randn(n, 64), [0], [n])
        nan_cols = y.isnan().all(0)
        assert nan_cols[7] and nan_cols[200] and nan_cols.sum() == 2


@pytest.mark.parametrize("expert_range", [None, (2, 6)], ids=["all", "ep-rank-2-6"])
def test_module_path_matches_float_experts(expert_range):
    """RoutedExperts on packed FP8 stacks against the same module on float32 stacks of the dequantized weights;
    with an expert range (expert parallel: this rank holds experts 2..5) pairs routed elsewhere contribute zero."""
    from tokenfab.layers.moe import RoutedExperts
    E, H, I = 8, 160, 96
    packed, ref = RoutedExperts(E, H, I, expert_range), RoutedExperts(E, H, I, expert_range)
    packed.use_packed("fp8_block")
    s, e_ = packed.start, packed.end
    for e in range(s, e_):
        for proj, rows, cols, row0 in (("gate", I, H, 0), ("up", I, H, I), ("down", H, I, 0)):
            q, sc = random_fp8(rows, cols, seed=31 * e + row0 + rows)
            (packed.q2 if proj == "down" else packed.q13).load_part(e - s, row0, "weight", Fp8BlockWeight(q, sc), proj)
            dst = ref.w2[e - s] if proj == "down" else ref.w13[e - s, row0:row0 + rows]
            dst.copy_(formula(q, sc))
    packed.fuse()
    ref.use_grouped_mm = False
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(9)])
    w = torch.rand(9, 3, generator=g)
    got, want = packed(x, w, ids), ref(x, w, ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()  # fp32 sums reordered
    if expert_range is not None:  # a token routed only outside the range gets exactly zero
        outside = torch.tensor([[0, 1, 7]])
        assert not packed(x[:1], w[:1], outside).any()


def _generate(path, prompts, **kw):
    llm = LLM(path, dtype="float32", max_model_len=128, progress=False, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, prompt_logprobs=0)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


PROMPTS = [[5, 17, 33, 200, 7], [9, 4, 300], list(range(3, 43))]


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_tiny_fp8_model_experts_packed_match_dequantized_twin(fp8_pair, path, monkeypatch):
    """fp32 activations: routed experts kept FP8 (no bf16 / float stack anywhere) against the dequantized twin;
    greedy identical, prompt logprobs within 1e-4; the kernel path and the PyTorch path (forced)."""
    if path == "torch":
        monkeypatch.setenv("TOKENFAB_PACKED_EXPERTS", "torch")
    fp8, twin = fp8_pair
    llm, outs = _generate(fp8, PROMPTS)
    model = llm.llm_engine.runner.model
    mods = [l.mlp.experts for l in model.model.layers if hasattr(l.mlp, "experts")]
    assert mods and all(isinstance(m.q13, Fp8BlockExperts) and m.w13 is None and m._p13 is None for m in mods)
    assert mods[0].q13._kernel == (path == "kernel" and cpu_fp8.fp8_experts_applies())
    assert mods[0].q13._avx2 == (path == "kernel" and not cpu_fp8.fp8_experts_applies() and any_kernel())
    assert not any(".experts." in n for n, _ in model.named_parameters())
    del llm
    _, ref = _generate(twin, PROMPTS)
    assert max_prompt_logprob_gap(ref, outs, f"FP8 experts ({path})") < 1e-4


def test_plan_bytes_equal_resident_expert_bytes(fp8_pair):
    """``tokenfab plan``'s expert bytes (the checkpoint's FP8 bytes and block scales) are what the loaded model holds,
    and the KV sizing's weight count sees them."""
    from tokenfab.engine.engine_config import model_weight_bytes
    from tokenfab.planner.memory_planner import estimate_weight_bytes
    fp8, _ = fp8_pair
    est = estimate_weight_bytes(fp8, 1)
    llm = LLM(fp8, dtype="float32", max_model_len=128, progress=False)
    model = llm.llm_engine.runner.model
    mods = [l.mlp.experts for l in model.model.layers if hasattr(l.mlp, "experts")]
    resident = sum(m.q13.nbytes + m.q2.nbytes for m in mods)
    assert est.per_rank[0]["experts"] == resident
    m = torch.nn.Module()  # the KV pool is sized from the weights' bytes: packed expert buffers are weights
    m.experts = Fp8BlockExperts.for_parts(4, [72, 72], 160)
    m.register_buffer("cos", torch.zeros(1000))
    assert model_weight_bytes(m) == m.experts.nbytes == 4 * (144 * 160 + 4 * 2 * 2)


def test_host_experts_on_fp8_checkpoint_dequantize_at_load(fp8_pair):
    """Host experts (the host/device split moves bf16 / float stacks): the FP8 experts are dequantized by the
    formula as they load, and the model matches the dequantized twin."""
    fp8, twin = fp8_pair
    llm, outs = _generate(fp8, PROMPTS, host_experts="50%")
    model = llm.llm_engine.runner.model
    mods = [l.mlp.experts for l in model.model.layers if hasattr(l.mlp, "experts")]
    assert mods and all(m.q13 is None and m.host is not None for m in mods)
    del llm
    _, ref = _generate(twin, PROMPTS)
    assert max_prompt_logprob_gap(ref, outs, "FP8 host experts") < 1e-4


def test_bf16_experts_in_fp8_checkpoint_refused(fp8_pair, tmp_path):
    """A routed expert stored unquantized in an FP8 checkpoint is refused by name (not silently mixed)."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    fp8, _ = fp8_pair
    bad = tmp_path / "bad"
    shutil.copytree(fp8, bad)
    for f in os.listdir(bad):
        if f.endswith(".safetensors"):
            sd = load_file(str(bad / f))
            key = next((k for k in sd if k.endswith("mlp.experts.3.up_proj.weight")), None)
            if key is not None:
                sd[key] = sd[key].float() * 0.01
                del sd[key + "_scale_inv"]
                save_file(sd, str(bad / f), metadata={"format": "pt"})
    assert json.load(open(bad / "config.json"))["quantization_config"]["quant_method"] == "fp8"
    with pytest.raises(WeightLoadError, match=r"experts\.3\.up_proj\.weight.*unquantized expert weight.*fp8_block"):
        LLM(str(bad), dtype="float32", max_model_len=128, progress=False)


def test_fp8_mtp_layer_experts_packed_drafts_match_dequantized_twin(tmp_path, tokenizer_dir):
    """A tiny FP8 DeepSeek-V3 with an MTP layer (its block FP8 too, as published): the MTP layer (which borrows the
    CausalLM loader) keeps its routed experts packed, and every proposal's draft tokens and logits equal the
    dequantized twin's (logits within 1e-4, fp32)."""
    from spec_helpers import spec_prompts
    from test_spec_mtp import MTP, _record_proposals

    from tokenfab.testing.fp8_checkpoint import write_fp8_checkpoint
    from tokenfab.testing.tiny_checkpoints import add_mtp_layers, make_tiny_checkpoint
    from safetensors.torch import load_file, save_file
    src = str(tmp_path / "src")
    make_tiny_checkpoint(src, "deepseek_v3", vocab_size=512, tokenizer_dir=tokenizer_dir, hidden_size=160,
                         intermediate_size=224, q_lora_rank=64)
    add_mtp_layers(src, 1, seed=3)
    mtp_file = str(tmp_path / "src" / "model-mtp.safetensors")  # its experts as published: one Linear per expert
    sd, split = load_file(mtp_file), {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            for e in range(v.shape[0]):
                gate, up = v[e].chunk(2, dim=0)
                split[k[:-len("gate_up_proj")] + f"{e}.gate_proj.weight"] = gate.contiguous()
                split[k[:-len("gate_up_proj")] + f"{e}.up_proj.weight"] = up.contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                split[k[:-len("down_proj")] + f"{e}.down_proj.weight"] = v[e].contiguous()
        else:
            split[k] = v
    save_file(split, mtp_file, metadata={"format": "pt"})
    fp8, twin = write_fp8_checkpoint(src, str(tmp_path / "fp8"), str(tmp_path / "twin")), str(tmp_path / "twin")
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = {}
    for key, path in (("fp8", fp8), ("twin", twin)):
        llm = LLM(path, dtype="float32", progress=False, speculative_config=MTP, max_num_batched_tokens=32)
        events = _record_proposals(llm)
        outs = llm.generate(spec_prompts(3), sp, use_tqdm=False)
        if key == "fp8":
            experts = llm.llm_engine.spec.proposer.mtp.model.layers[0].mlp.experts
            assert isinstance(experts.q13, Fp8BlockExperts) and experts.w13 is None
        runs[key] = ([o.outputs[0].token_ids for o in outs], events)
        del llm
    assert runs["fp8"][0] == runs["twin"][0]
    ev_a, ev_b = runs["fp8"][1], runs["twin"][1]
    assert ev_a and len(ev_a) == len(ev_b)
    for a, b in zip(ev_a, ev_b):
        assert a[1:4:2] == b[1:4:2] and a[2].tolist() == b[2].tolist()
        assert (a[4] - b[4]).abs().max() < 1e-4
