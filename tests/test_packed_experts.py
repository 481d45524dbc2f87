"""Routed experts kept packed: INT4 group-32 (compressed-tensors pack-quantized, Kimi K2-Thinking) and MXFP4
(compressed-tensors mxfp4-pack-quantized, Kimi K3).

References: compressed-tensors' own packers / unpackers and name matcher (independent of tokenfab's decoding), a
float64 matmul for the kernels, and the same tiny models saved with the experts dequantized (float32) for the
whole-model checks.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from decode_stack_ab import generate_through

from tokenfab import LLM, SamplingParams
from tokenfab.errors import UnsupportedError, WeightLoadError
from tokenfab.kernels.cpu.ops import packed_experts as cpu_packed_experts
from tokenfab.model_config import ConfigError
from tokenfab.quant.compressed_tensors import parse_compressed_tensors
from tokenfab.quant.int4_group import Int4GroupExperts, dequantize_int4_group
from tokenfab.quant.mxfp4_experts import Mxfp4Experts

ct_pack = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
ct_fp4 = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
ct_mx = pytest.importorskip("compressed_tensors.compressors.mx_utils")
ct_match = pytest.importorskip("compressed_tensors.utils.match")

INT4_QC = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
           "kv_cache_scheme": None,
           "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                         "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                     "strategy": "group", "group_size": 32, "dynamic": False,
                                                     "actorder": None, "observer": "minmax",
                                                     "observer_kwargs": {}}}},
           "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj$",
                      "re:model\\.layers\\.2\\.mlp\\.experts\\..*"]}


def _rand_int4(g, *shape):
    return torch.randint(-8, 8, shape, generator=g, dtype=torch.int64).to(torch.int8)


def _ct_int4_dequant(packed, scale, shape):
    """compressed-tensors' unpacker, then the symmetric group dequantization x_q * scale (float32)."""
    q = ct_pack.unpack_from_int32(packed, 4, torch.Size(shape)).to(torch.float32)
    return (q.view(shape[0], -1, 32) * scale.float().unsqueeze(-1)).reshape(shape)


def _ct_mxfp4_dequant(packed, scale):
    m, n = packed.shape[0], packed.shape[1] * 2
    v = ct_fp4.unpack_fp4_from_uint8(packed, m, n, dtype=torch.float32)
    return (v.view(m, -1, 32) * ct_mx.decompress_mx_scale(scale).float().unsqueeze(-1)).reshape(m, n)


# ---- bit layouts against compressed-tensors ---------------------------------------------------------------------
def test_int4_unpack_bit_identical_to_compressed_tensors():
    g = torch.Generator().manual_seed(0)
    q = _rand_int4(g, 6, 96)
    packed = ct_pack.pack_to_int32(q, 4)
    assert packed.dtype == torch.int32 and packed.shape == (6, 12)
    scale = (torch.rand(6, 3, generator=g) * 0.1 + 1e-3).to(torch.bfloat16)
    want = _ct_int4_dequant(packed, scale, (6, 96))
    assert torch.equal(dequantize_int4_group(packed, scale), want)
    st = Int4GroupExperts(2, 8, 96)  # into rows [2, 8) of expert 1, as up_proj lands after gate_proj's rows
    st.load_part(1, 2, "weight_packed", packed, "w")
    st.load_part(1, 2, "weight_scale", scale, "w")
    st.load_part(1, 2, "weight_shape", torch.tensor([6, 96]), "w")
    assert torch.equal(st.dequantize_rows(1, 2, 8), want)
    assert not st.dequantize_expert(0).any()
    with pytest.raises(WeightLoadError, match="weight_shape"):
        st.load_part(1, 0, "weight_shape", torch.tensor([6, 64]), "w")
    with pytest.raises(WeightLoadError, match="weight_packed .* int32"):
        st.load_part(1, 0, "weight_packed", packed.to(torch.int64), "w")


def test_int4_fp16_scales():
    g = torch.Generator().manual_seed(1)
    packed = ct_pack.pack_to_int32(_rand_int4(g, 4, 64), 4)
    scale = (torch.rand(4, 2, generator=g) + 0.5).to(torch.float16)
    st = Int4GroupExperts(1, 4, 64)
    st.load_part(0, 0, "weight_scale", scale, "w")
    st.load_part(0, 0, "weight_packed", packed, "w")
    assert st.scale.dtype == torch.float16
    assert torch.equal(st.dequantize_expert(0), _ct_int4_dequant(packed, scale, (4, 64)))


def test_mxfp4_unpack_bit_identical_to_compressed_tensors():
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (5, 48), generator=g, dtype=torch.int64).to(torch.uint8)
    scale = torch.randint(100, 150, (5, 3), generator=g, dtype=torch.int64).to(torch.uint8)
    st = Mxfp4Experts(3, 5, 96)
    st.load_part(2, 0, "weight_packed", packed, "w")
    st.load_part(2, 0, "weight_scale", scale, "w")
    assert torch.equal(st.dequantize_expert(2), _ct_mxfp4_dequant(packed, scale))
    # compressed-tensors' packer on E2M1 values gives bytes that decode back to those values
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = vals[torch.randint(0, 8, (4, 64), generator=g)] * torch.where(torch.rand(4, 64, generator=g) < 0.5, -1.0, 1.0)
    x[x == 0] = 0.0  # packer maps -0 to code 8, which decodes as -0 (equal to 0)
    p = ct_fp4.pack_fp4_to_uint8(x)
    assert torch.equal(st.dequantize_packed(p, torch.full((4, 2), 127, dtype=torch.uint8)), x)


def test_ignore_list_matches_compressed_tensors():
    s = parse_compressed_tensors(INT4_QC)
    assert s.format == "int4_group"
    names = ["model.layers.1.mlp.experts.3.gate_proj", "model.layers.1.mlp.experts.3.down_proj",
             "model.layers.2.mlp.experts.0.up_proj", "model.layers.1.self_attn.q_a_proj",
             "model.layers.0.mlp.gate_proj", "model.layers.1.mlp.shared_experts.down_proj", "lm_head"]
    got = [s.quantizes(n) for n in names]
    want = [not any(ct_match.match_name(n, ig) for ig in INT4_QC["ignore"]) for n in names]
    assert got == want == [True, True, False, False, False, False, False]


@pytest.mark.parametrize("path,value,field", [
    (("config_groups", "group_0", "weights", "num_bits"), 8, "weights.num_bits"),
    (("config_groups", "group_0", "weights", "symmetric"), False, "weights.symmetric"),
    (("config_groups", "group_0", "weights", "group_size"), 128, "weights.group_size"),
    (("config_groups", "group_0", "weights", "strategy"), "channel", "weights.strategy"),
    (("config_groups", "group_0", "input_activations"), {"num_bits": 8}, "group_0.input_activations"),
    (("format",), "int-quantized", "format"),
    (("kv_cache_scheme",), {"num_bits": 8}, "kv_cache_scheme"),
    (("surprise",), 1, "surprise"),
])
def test_quantization_config_parsed_strictly(path, value, field):
    qc = json.loads(json.dumps(INT4_QC))
    d = qc
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    with pytest.raises(ConfigError, match=f"quantization_config.*{field}") as e:
        parse_compressed_tensors(qc)
    assert "\n" not in str(e.value)


# ---- kernel vs reference ----------------------------------------------------------------------------------------
def _stack(fmt, E, n, K, g):
    if fmt == "int4":
        st = Int4GroupExperts(E, n, K)
        for e in range(E):
            st.load_part(e, 0, "weight_packed", ct_pack.pack_to_int32(_rand_int4(g, n, K), 4), "w")
            st.load_part(e, 0, "weight_scale", (torch.rand(n, K // 32, generator=g) * 0.02 + 1e-3).bfloat16(), "w")
    else:
        st = Mxfp4Experts(E, n, K)
        st.packed.copy_(torch.randint(0, 256, st.packed.shape, generator=g, dtype=torch.int64).to(torch.uint8))
        st.scale.copy_(torch.randint(118, 124, st.scale.shape, generator=g, dtype=torch.int64).to(torch.uint8))
    return st


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [96, 128])
def test_grouped_kernel_matches_float64(fmt, dtype, K, monkeypatch):
    g = torch.Generator().manual_seed(3)
    st = _stack(fmt, 5, 42, K, g)  # 42 rows: a 32-row block and a 10-row one (row groups of 4 / 2, single rows)
    # token tiles of 1, 4 + 2, 4 + 3 and 4 x 3 (register GEMV, up to 12 tokens); 300 tokens: the prefill path
    # (brgemm, tiles of 4 x 64 + 44; bf16 x on the tile layout takes it past 256 tokens)
    experts, counts = [0, 2, 3, 4, 1], [1, 6, 7, 12, 300]
    x = torch.randn(sum(counts), K, generator=g).to(dtype)
    segs = list(zip(experts, counts, (0, 1, 7, 14, 26)))
    want = torch.cat([x[b:b + n].double() @ st.dequantize_expert(e).double().t() for e, n, b in segs])
    # float32: every path sums exact float32 products of x (or of its three bf16 parts) and the dequantized weight in
    # float32; held to 2 K u S (u = 2^-24, S = |x| |W|^T), the FP8 tests' bound, which the paths meet with a wide
    # margin (worst seen 0.035 of it); bf16 rounds weights or outputs to bf16 (2^-8 relative)
    S = torch.cat([x[b:b + n].double().abs() @ st.dequantize_expert(e).double().abs().t() for e, n, b in segs])

    def close(y):
        if dtype == torch.float32:
            return ((y.double() - want).abs() <= 2 * K * 2.0 ** -24 * S).all()
        return ((y.double() - want).abs() <= 1e-2 * (want.abs() + 1)).all()
    monkeypatch.setenv("TOKENFAB_PACKED_EXPERTS", "torch")  # the path CPUs without AVX512-BF16 take
    st.prepare()
    assert not st._kernel
    ref = st.grouped_linear(x, experts, counts)
    assert ref.dtype == dtype and close(ref)
    monkeypatch.delenv("TOKENFAB_PACKED_EXPERTS")
    st.prepare()
    if not cpu_packed_experts.packed_experts_applies():  # the AVX2 kernel (test_packed_experts_avx2.py) where built
        assert st._avx2 == cpu_packed_experts.packed_experts_avx2_applies() and not st._kernel
        got = st.grouped_linear(x, experts, counts)
        assert got.dtype == dtype and close(got)
        return
    assert st._kernel
    got = st.grouped_linear(x, experts, counts)
    assert got.dtype == dtype and close(got)
    if dtype == torch.float32:
        assert (got - ref).abs().max() < 1e-4
    else:  # the 300-token segment (prefill, brgemm) multiplies the weight rounded once to bf16: the bf16 twin's
        xs, wt = x[26:].double(), st.dequantize_expert(1).bfloat16().double()
        twin = xs @ wt.t()
        bound = 2 * K * 2.0 ** -24 * (xs.abs() @ wt.abs().t()) + 2.0 ** -8 * twin.abs()
        assert ((got[26:].double() - twin).abs() <= bound).all()


@pytest.mark.parametrize("layout", ["tiles", "rows"])
@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_prefill_dequantization_exact_at_scale_edges(fmt, layout, monkeypatch):
    """The prefill path's bf16 weights, read back one at a time: x one-hot at k gives y[:, r] = W[r, k] exactly
    (one product 1 * w, the rest 0 * w), so y must equal the dequantized weight rounded once to bf16, bit for bit.
    MXFP4 scales 2 and 252 are the ends of the exponent-add path; a scale of 1 in one 16-row group (subnormal values
    in its last scale group) sends that group through the float32 path, whose values outside that scale group are
    read back too."""
    if not cpu_packed_experts.packed_experts_applies():
        pytest.skip("kernels without AVX512-BF16: no prefill kernel here")
    if layout == "rows":
        monkeypatch.setenv("TOKENFAB_PACKED_EXPERTS", "rows")
    g = torch.Generator().manual_seed(5)
    n, K = 42, 160  # rows 0-15 / 16-31 (one 32-row block), 32-41 (a partial block); 128 + 32 values per row
    st = _stack(fmt, 2, n, K, g)
    read = K
    if fmt == "mxfp4":
        st.scale[:, :, :].copy_(torch.randint(100, 150, st.scale.shape, generator=g).to(torch.uint8))
        st.scale[0, 3, 0], st.scale[0, 4, 1], st.scale[1, 40, 2] = 2, 252, 252
        st.scale[0, 20, 4] = st.scale[1, 37, 4] = 1  # float32 path for rows 16-31 of expert 0 and 32-41 of expert 1
        read = 128  # values past 128 in those rows are subnormal: not read back (dot products may flush them)
    st.prepare()
    assert st.cpu_tiles == (layout == "tiles")
    counts = [3 * read, 300]  # both segments take the prefill path (more than 256 tokens)
    cols = torch.cat([torch.arange(read).repeat(3), torch.randint(0, read, (300,), generator=g)])
    x = torch.nn.functional.one_hot(cols, K).to(torch.bfloat16)
    y = st.grouped_linear(x, [0, 1], counts)
    for e, rows in ((0, slice(0, 3 * read)), (1, slice(3 * read, 3 * read + 300))):
        twin = st.dequantize_expert(e).bfloat16()  # [n, K]: W rounded once to bf16
        want = twin[:, cols[rows]].t()
        assert torch.equal(y[rows], want), f"expert {e}: {(y[rows].float() - want.float()).abs().max()}"


def test_mxfp4_scale_bytes_0_and_255():
    """E8M0 0 is 2^-127 (a float32 subnormal) and 255 is NaN: on the decode path (1 and 5 tokens) a row with scale 0
    gives the exact tiny sums, and a row with one NaN scale gives NaN on every path (decode, 20 float32 tokens
    through the float32 prefill conversion, 300 bf16 tokens through the bf16 one)."""
    if not cpu_packed_experts.packed_experts_applies():
        pytest.skip("kernels without AVX512-BF16: no kernel here")
    g = torch.Generator().manual_seed(9)
    n, K = 20, 96
    st = _stack("mxfp4", 1, n, K, g)
    st.scale[0, 3, :] = 0
    st.scale[0, 7, 1] = 255
    st.prepare()
    w = st.dequantize_expert(0).double()  # row 3: codes * 2^-127, exactly; row 7: NaN in its second group
    for T, dtype in ((1, torch.float32), (5, torch.float32), (20, torch.float32), (300, torch.bfloat16)):
        x = torch.randn(T, K, generator=g).to(dtype)
        y = st.grouped_linear(x, [0], [T])
        assert torch.isnan(y[:, 7]).all() and not torch.isnan(y[:, :7]).any()
        if T < 20:  # the register path multiplies exact values: float32 sums of ~K terms, then one rounding
            want = x.double() @ w[3]
            assert ((y[:, 3].double() - want).abs() <= 2 * K * 2.0 ** -24 * (x.double().abs() @ w[3].abs())
                    + 2.0 ** -149).all()
            assert (y[:, 3] != 0).all()


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_cpu_tile_layout(fmt, monkeypatch):
    """prepare() re-lays whole 16-row tiles in place (rows past them stay): the documented layout (word 2j + e of
    block L of group g holds, in nibble s, row j's code at k = 32 g + 2 (4L + s) + e; scales group-major), read back
    exactly by dequantize_rows over ranges across tile edges; and the tiled kernel agrees with the checkpoint-layout
    kernel (TOKENFAB_PACKED_EXPERTS=rows) within float32 rounding, 1 to 20 tokens per expert."""
    if not cpu_packed_experts.packed_experts_applies():
        pytest.skip("kernels without AVX512-BF16: no CPU tile layout")
    g = torch.Generator().manual_seed(11)
    n, K = 40, 96  # two tiles and 8 rows past them
    st, rows = _stack(fmt, 2, n, K, g), _stack(fmt, 2, n, K, torch.Generator().manual_seed(11))
    before = [st.dequantize_expert(e) for e in range(2)]
    codes = st.packed.view(torch.uint8).clone()  # checkpoint layout: byte b = codes 2b (low) and 2b + 1 (high)
    scale_before = st.scale.clone()
    st.prepare()
    assert st.cpu_tiles and st.kernel_id == st.kernel_format + 16
    tiled = st.packed.view(torch.uint8)
    for e, t, gi, L, j, half, s in [(0, 0, 0, 0, 0, 0, 0), (1, 1, 2, 3, 15, 1, 3), (0, 1, 1, 2, 7, 0, 1)]:
        k = 32 * gi + 2 * (4 * L + s) + half
        r = 16 * t + j
        want = (int(codes[e, r, k // 2]) >> (4 * (k % 2))) & 15
        off = 16 * t * (K // 2) + gi * 256 + 64 * L + 2 * (2 * j + half)
        word = int(tiled[e].reshape(-1)[off]) | (int(tiled[e].reshape(-1)[off + 1]) << 8)
        assert (word >> (4 * s)) & 15 == want
        assert torch.equal(st.scale[e].reshape(-1)[16 * t * (K // 32) + 16 * gi + j], scale_before[e, r, gi])
    assert torch.equal(st.packed.view(torch.uint8)[:, 32:], codes[:, 32:])  # rows past the tiles: untouched
    for e in range(2):
        for a, b in [(0, 40), (3, 17), (16, 32), (30, 40), (33, 38), (5, 6)]:
            assert torch.equal(st.dequantize_rows(e, a, b), before[e][a:b]), (e, a, b)
    monkeypatch.setenv("TOKENFAB_PACKED_EXPERTS", "rows")
    rows.prepare()
    assert rows._kernel and not rows.cpu_tiles
    for counts in ([1, 3], [5, 12], [20, 9], [70, 2]):
        x = torch.randn(sum(counts), K, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            a, b = st.grouped_linear(x.to(dtype), [1, 0], counts), rows.grouped_linear(x.to(dtype), [1, 0], counts)
            w = torch.cat([before[1].double()] * counts[0] + [before[0].double()] * counts[1]).view(-1, n, K)
            bound = 2 * K * 2.0 ** -24 * torch.einsum("tk,tnk->tn", x.double().abs(), w.abs())
            if dtype == torch.bfloat16:  # one rounding of each output, and brgemm's weights rounded to bf16
                bound = bound + 2.0 ** -8 * (a.double().abs() + b.double().abs()) \
                    + 2.0 ** -8 * torch.einsum("tk,tnk->tn", x.double().abs(), w.abs())
            assert ((a.double() - b.double()).abs() <= 2 * bound + 1e-30).all(), (counts, dtype)


# ---- tiny DeepSeek-V3 with INT4 routed experts in the published layout ------------------------------------------
def _quantize_int4(w: torch.Tensor):
    """Symmetric group-32 INT4 of a float weight: (packed int32, bf16 scale, dequantized float32)."""
    out, inp = w.shape
    scale = (w.view(out, -1, 32).abs().amax(-1) / 7).clamp_min(1e-4).bfloat16()
    q = (w.view(out, -1, 32) / scale.float().unsqueeze(-1)).round().clamp(-8, 7).to(torch.int8).view(out, inp)
    packed = ct_pack.pack_to_int32(q, 4)
    return packed, scale, _ct_int4_dequant(packed, scale, (out, inp))


def _split_experts(sd: dict, n_experts: int) -> dict:
    """transformers 5's fused mlp.experts.gate_up_proj / down_proj -> per-expert Linear weights (as published)."""
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            for e in range(n_experts):
                gate, up = v[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(n_experts):
                out[f"{base}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


@pytest.fixture(scope="module")
def deepseek_int4(tiny_model, tmp_path_factory):
    """(INT4 checkpoint folder, reference folder with the same experts dequantized to float32). Layers 1 and 2 are
    MoE; layer 2's experts are in the ignore list and stay float (unquantized) in both."""
    from safetensors.torch import load_file, save_file
    src = tiny_model("deepseek_v3", num_hidden_layers=3)
    cfg = json.load(open(os.path.join(src, "config.json")))
    sd = {}
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(src, f)))
    sd = _split_experts(sd, cfg["n_routed_experts"])
    q_sd, ref_sd = {}, {}
    for k, v in sd.items():
        if ".mlp.experts." in k and k.startswith("model.layers.1."):
            packed, scale, deq = _quantize_int4(v.float())
            base = k[: -len(".weight")]
            q_sd[base + ".weight_packed"], q_sd[base + ".weight_scale"] = packed, scale
            q_sd[base + ".weight_shape"] = torch.tensor(list(v.shape), dtype=torch.int64)
            ref_sd[k] = deq
        else:
            q_sd[k] = ref_sd[k] = v
    root = tmp_path_factory.mktemp("ds_int4")
    dirs = []
    for name, tensors, qc in (("int4", q_sd, INT4_QC), ("ref", ref_sd, None)):
        d = root / name
        d.mkdir()
        for f in os.listdir(src):
            if not f.endswith(".safetensors") and f != "model.safetensors.index.json":
                shutil.copy(os.path.join(src, f), d / f)
        c = dict(cfg)
        if qc:
            c["quantization_config"] = qc
        json.dump(c, open(d / "config.json", "w"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
        dirs.append(str(d))
    return dirs[0], dirs[1]


def _run(path, prompts, **kw):
    llm = LLM(path, dtype="float32", device="cpu", progress=False, max_num_batched_tokens=16, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False)
    return llm, outs


def _compare(a_outs, b_outs, prompts):
    worst = 0.0
    for p, a, b in zip(prompts, a_outs, b_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        worst = max(worst, max(abs(a.prompt_logprobs[i][p[i]].logprob - b.prompt_logprobs[i][p[i]].logprob)
                               for i in range(1, len(p))))
    return worst


PROMPTS = [[5, 77, 301, 12, 9, 250, 41, 8, 199, 33, 400, 17, 64], [300, 2, 91, 7]]


@pytest.mark.parametrize("path_kind", ["kernel", "torch"])
def test_deepseek_int4_matches_dequantized(deepseek_int4, path_kind, monkeypatch):
    if path_kind == "torch":
        monkeypatch.setenv("TOKENFAB_PACKED_EXPERTS", "torch")
    q_dir, ref_dir = deepseek_int4
    llm, q_outs = _run(q_dir, PROMPTS)
    model = llm.llm_engine.runner.model
    packed = model.model.layers[1].mlp.experts
    assert packed.w13 is None and packed.q13.packed.dtype == torch.int32 and packed.q2.scale.dtype == torch.bfloat16
    assert packed.q13._kernel == (path_kind == "kernel" and cpu_packed_experts.packed_experts_applies())
    assert packed.q13._avx2 == (path_kind == "kernel" and cpu_packed_experts.packed_experts_avx2_applies())
    assert model.model.layers[2].mlp.experts.q13 is None  # ignored by quantization_config: unquantized
    _, ref_outs = _run(ref_dir, PROMPTS)
    worst = _compare(q_outs, ref_outs, PROMPTS)
    print(f"\nINT4 experts ({path_kind}) vs dequantized float32: max |Δ prompt logprob| = {worst:.2e}")
    assert worst < 1e-4


def test_packed_experts_setting_is_checked_at_engine_start(deepseek_int4, monkeypatch):
    """A TOKENFAB_PACKED_EXPERTS typo is refused by name when the engine starts, before any weight is read."""
    from tokenfab.errors import EngineConfigError
    monkeypatch.setenv("TOKENFAB_PACKED_EXPERTS", "tiles")
    with pytest.raises(EngineConfigError, match="TOKENFAB_PACKED_EXPERTS='tiles' is not a setting.*torch.*rows"):
        LLM(deepseek_int4[0], dtype="float32", device="cpu", progress=False)


def test_planner_counts_packed_bytes_as_resident(deepseek_int4):
    from tokenfab.planner.memory_planner import estimate_weight_bytes
    q_dir, _ = deepseek_int4
    est = estimate_weight_bytes(q_dir, 1)
    llm = LLM(q_dir, dtype="float32", device="cpu", progress=False)
    model = llm.llm_engine.runner.model
    layer1, layer2 = model.model.layers[1].mlp.experts, model.model.layers[2].mlp.experts
    resident = layer1.q13.nbytes + layer1.q2.nbytes
    resident += sum(t.numel() * t.element_size() for t in (layer2._p13 or []) + (layer2._p2 or [])
                    + [w for w in (layer2.w13, layer2.w2) if w is not None])
    shapes = 8 * 3 * 2 * 8  # weight_shape int64 [2] per expert Linear of layer 1: read, checked, not kept
    assert est.per_rank[0]["experts"] == resident + shapes


def test_packed_experts_refuse_host_experts(deepseek_int4):
    """INT4 experts and host experts: refused by name (Kimi's MXFP4 experts are dequantized at load instead, as
    before, tests/test_host_experts.py::test_kimi_k3_situ_latent_experts)."""
    q_dir, _ = deepseek_int4
    with pytest.raises(UnsupportedError, match="host experts .* int4_group"):
        LLM(q_dir, dtype="float32", device="cpu", progress=False, host_experts="50%")


def test_bf16_experts_under_int4_config_refused(deepseek_int4, tmp_path):
    q_dir, ref_dir = deepseek_int4
    bad = tmp_path / "bad"
    shutil.copytree(ref_dir, bad)
    c = json.load(open(bad / "config.json"))
    c["quantization_config"] = INT4_QC
    json.dump(c, open(bad / "config.json", "w"))
    with pytest.raises(WeightLoadError, match="unquantized expert weight"):
        LLM(str(bad), dtype="float32", device="cpu", progress=False)


# ---- tiny Kimi K3 with MXFP4 routed experts -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def k3_pair(tmp_path_factory, tokenizer_dir):
    from test_kimi_k3 import P, TEXT, k3_tensors, write_k3
    stored, _ = k3_tensors(TEXT)
    deq = {}
    for k, v in stored.items():
        if k.endswith("_packed"):
            base = k[: -len("_packed")]
            deq[base] = _ct_mxfp4_dequant(v, stored[base + "_scale"])
        elif not k.endswith(("_scale", "_shape")) or not k.startswith(P + "model.") or ".experts." not in k:
            deq[k] = v
    root = tmp_path_factory.mktemp("k3mx")
    return (write_k3(str(root / "mxfp4"), tokenizer_dir, tensors=stored),
            write_k3(str(root / "ref"), tokenizer_dir, tensors=deq, quant=None))


def test_k3_mxfp4_kept_packed_matches_dequantized(k3_pair):
    q_dir, ref_dir = k3_pair
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 512, (n,), generator=g).tolist() for n in (19, 6)]
    llm, q_outs = _run(q_dir, prompts)
    model = llm.llm_engine.runner.model
    mods = [l.mlp.experts for l in model.model.layers if hasattr(l.mlp, "experts")]
    assert mods and all(m.w13 is None and m.q13.packed.dtype == torch.uint8 and m.q2.scale.dtype == torch.uint8
                        for m in mods)
    assert not any(p.dtype == torch.bfloat16 and ".experts." in n for n, p in model.named_parameters())
    _, ref_outs = _run(ref_dir, prompts)
    worst = _compare(q_outs, ref_outs, prompts)
    print(f"\nK3 MXFP4 packed vs dequantized float32: max |Δ prompt logprob| = {worst:.2e}")
    assert worst < 1e-4


def test_other_quant_methods_left_to_their_loaders():
    """quantization_config of another method (DeepSeek-V3's fp8) is not parsed here: no packed experts, no error."""
    from types import SimpleNamespace

    from tokenfab.models.base import CausalLM
    fake = SimpleNamespace(cfg=SimpleNamespace(raw={"quantization_config": {"quant_method": "fp8",
                                                                            "weight_block_size": [128, 128]}}))
    assert CausalLM.expert_quantization(fake) is None
    fake.cfg.raw["quantization_config"] = INT4_QC
    assert CausalLM.expert_quantization(fake).format == "int4_group"


def test_deferred_expert_storage_reserves_nothing_until_packed_or_allocated():
    """The loader builds experts on the meta device; packing replaces them, materialize() allocates the rest."""
    from tokenfab.layers.moe import RoutedExperts, deferred_expert_storage
    with deferred_expert_storage():
        a, b = RoutedExperts(4, 64, 32), RoutedExperts(4, 64, 32)
    assert a.w13.is_meta and b.w2.is_meta
    a.use_packed("mxfp4")
    b.materialize()
    assert a.w13 is None and a.q13.packed.shape == (4, 64, 32) and a.q2.scale.shape == (4, 64, 1)
    assert not b.w13.is_meta and b.w13.shape == (4, 64, 64)
    assert not RoutedExperts(2, 64, 32).w13.is_meta  # outside the context: allocated as before


@pytest.mark.skipif(not cpu_packed_experts.packed_experts_applies(), reason="kernels without AVX512-BF16")
def test_decode_stack_runs_packed_experts_bit_identical(deepseek_int4, monkeypatch):
    """bf16 decode of the INT4 model through the fused C++ stack (layer 1's experts packed: set_moe_packed, the same
    ops as RoutedExperts.packed_forward; layer 2's bf16) against the module path: same tokens and logprobs."""
    q_dir, _ = deepseek_int4
    llm = LLM(q_dir, dtype="bfloat16", device="cpu", progress=False, max_model_len=128)
    runner = llm.llm_engine.runner
    assert runner.model.model.layers[1].mlp.experts.q13._kernel
    stack = runner.cpu_decode_stack
    assert stack is not None
    want, sizes = generate_through(llm, PROMPTS, False, monkeypatch, max_tokens=8)
    assert not sizes
    got, sizes = generate_through(llm, PROMPTS, True, monkeypatch, max_tokens=8)
    assert sizes and got == want
