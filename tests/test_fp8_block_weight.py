"""FP8 block-scaled weights (DeepSeek-V3 / Kimi-K2 as published) kept packed: dequantization against the published
formula written here (partial edge blocks), the C++ GEMV / GEMM against the PyTorch reference, the tiny DeepSeek-V3
in FP8 layout against the same model on its dequantized weights, ``tokenfab plan``'s packed bytes and the refusals.
"""
from __future__ import annotations

import io
import json
import os
from contextlib import redirect_stdout

import pytest
import torch

from conftest import max_prompt_logprob_gap
from decode_stack_ab import generate_through
from tokenfab.kernels.cpu import build as cpu_build
from tokenfab.kernels.cpu.ops import fp8_linear as cpu_fp8
from tokenfab.model_config import ConfigError
from tokenfab.quant.fp8_block_weight import Fp8BlockWeight
from tokenfab.testing.fp8_checkpoint import quantize_fp8_block, write_fp8_checkpoint

# in / out dims not multiples of 128 (partial blocks): hidden 160, intermediate 224, o_proj in 96, kv_a out 48
TINY = dict(hidden_size=160, intermediate_size=224, q_lora_rank=64)
kernel = pytest.mark.skipif(not cpu_fp8.fp8_block_linear_applies(),
                            reason="fused CPU kernels with AVX512-BF16 not available")


def formula(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The published dequantization, element by element: W[r, c] = float(q[r, c]) * s[r // 128, c // 128]."""
    r = torch.arange(q.shape[0]) // 128
    c = torch.arange(q.shape[1]) // 128
    return q.to(torch.float32) * s[r[:, None], c[None, :]]


def random_fp8(n: int, k: int, seed: int = 0, nan: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Every e4m3fn byte code (subnormals, zeros of both signs; NaN codes 0x7F / 0xFF only when ``nan``) at random
    places, and random positive block scales."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.tensor([c for c in range(256) if nan or c & 0x7F != 0x7F], dtype=torch.uint8)
    q = codes[torch.randint(len(codes), (n, k), generator=g)].view(torch.float8_e4m3fn)
    s = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.01 + 1e-4
    return q, s


def test_dequantize_is_the_published_formula_on_partial_blocks():
    q, s = random_fp8(200, 328)  # 2 x 3 blocks, the last row block 72 rows and the last column block 72 wide
    w = Fp8BlockWeight(q, s)
    ref = formula(q, s)
    assert torch.equal(w.dequantize(), ref)
    assert torch.equal(w.dequantize_rows(120, 190), ref[120:190])  # across the row-block edge
    assert w.nbytes == 200 * 328 + 4 * 2 * 3
    # the e4m3fn decode itself (OCP: bias 7, exponent 0 subnormal m 2^-9): torch's cast agrees with the formula
    c = torch.arange(256, dtype=torch.int64)
    sign, e, m = 1 - 2 * (c >> 7).float(), (c >> 3) & 15, (c & 7).float()
    value = sign * torch.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e.float() - 7))
    dec = c.to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = (c & 0x7F) != 0x7F
    assert torch.equal(dec[finite], value[finite]) and dec[~finite].isnan().all()


def test_quantizer_round_trips_within_e4m3_precision():
    w = torch.randn(200, 160) * 0.05
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 2)
    assert torch.allclose(s[1, 1], w[128:, 128:].abs().max() / 448)
    back = formula(q, s)
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + s.max() * 2 ** -9).all()  # 3 mantissa bits, subnormals


def tiled_copy(q: torch.Tensor) -> torch.Tensor:
    """A copy of e4m3 weight q [n, K] with its whole 16-row tiles in the CPU tile layout (the rest row-major)."""
    qt = q.view(torch.uint8).clone()
    cpu_fp8.fp8_tiles_relayout(qt[:q.shape[0] // 16 * 16], True)
    return qt.view(torch.float8_e4m3fn)


def fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float32 accumulation in another order: each of the two float32 results is within K * 2^-24 * sum_k |x_k W_nk|
    of the exact sum (the products are exact), so they differ by at most twice that."""
    return 2 * x.shape[-1] * 2.0 ** -24 * (x.abs().float() @ w.abs().T) + 1e-30


@kernel
# (45, 2080): 17 scale blocks, the last 32 wide: from 8 rows of x (3 in float32) the GEMV tiles, over several K
# chunks, two weight rows at a time and one alone where a thread's share of rows is odd; (20, 4160): bf16 x of 9-12
# rows takes the GEMV there (K >= 4096), brgemm at the narrower shapes. "tiles": the weight's whole 16-row tiles in
# the CPU tile layout (fp8_tiles.h): the tile GEMV up to 16 rows of x, brgemm over converted tiles beyond; (45, .)
# and (20, .) end in 13 and 4 row-major rows (the row GEMV, and brgemm blocks holding a tile and row-major rows)
@pytest.mark.parametrize("n,k", [(200, 320), (256, 160), (96, 32), (45, 2080), (20, 4160)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 12, 13, 16, 17, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["rows", "tiles"])
def test_kernel_matches_reference(n, k, m, dtype, layout):
    q, s = random_fp8(n, k, seed=m + n)
    w = Fp8BlockWeight(q, s)
    W = formula(q, s)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    bias = torch.randn(n)
    tiled = layout == "tiles"
    if tiled:
        y = cpu_fp8.fp8_block_linear(x, tiled_copy(q), s, bias, tiled=True)
    else:
        y = cpu_fp8.fp8_block_linear(x, q, s, bias)
    ref = torch.nn.functional.linear(x.float(), W) + bias  # w.reference_linear before its one rounding
    assert torch.equal(w.reference_linear(x, bias), ref.to(dtype))
    from tokenfab.kernels.cpu import isa
    if (dtype == torch.bfloat16 and m > cpu_fp8.fp8_gemv_max_rows(dtype, k, tiled)
            and (isa.selected_level() != "amx" or tiled)):
        # the brgemm path without AMX multiplies the weight rounded once to bf16 (the dequantized bf16 twin's)
        W = W.bfloat16().float()
        ref = torch.nn.functional.linear(x.float(), W) + bias
    assert y.dtype == dtype and y.shape == (m, n)
    tol = fp32_bound(x, W) + bias.abs() * 2 ** -23
    if dtype == torch.bfloat16:  # plus the one rounding of each result to bf16 (half an ulp, 2^-8 relative)
        tol = tol + ref.abs() * 2 ** -8
    assert ((y.float() - ref).abs() <= tol).all(), (y.float() - ref).abs().max()


@kernel
@pytest.mark.parametrize("layout", ["rows", "tiles"])
@pytest.mark.parametrize("m", [4, 16, 160])  # GEMV (bf16 and float32), AMX / GEMV, AMX / brgemm
def test_kernel_decodes_every_e4m3_code_exactly(m, layout):
    """x = rows of the identity: y[i, n] = W[n, i] exactly (one exact product scaled once), so the kernel's e4m3
    table and block scaling are checked bit for bit against the formula (subnormals, signed zeros, partial blocks);
    "tiles": the weight's 12 whole 16-row tiles in the CPU tile layout, its last 8 rows row-major."""
    q, s = random_fp8(200, 160, seed=3)
    tiled = layout == "tiles"
    if tiled:
        q = tiled_copy(q)
    eye = torch.eye(160)
    y = torch.cat([cpu_fp8.fp8_block_linear(eye[i:i + m], q, s, tiled=tiled) for i in range(0, 160, m)])
    want = formula(*random_fp8(200, 160, seed=3))
    assert torch.equal(y, want.T)
    yb = torch.cat([cpu_fp8.fp8_block_linear(eye[i:i + m].bfloat16(), q, s, tiled=tiled) for i in range(0, 160, m)])
    assert torch.equal(yb, want.T.bfloat16())


def _named(name, fn):
    """``fn`` with ``__name__`` set (the parametrized linears below tell which kernel they are)."""
    fn.__name__ = name
    return fn


@pytest.mark.parametrize("linear", [
    pytest.param(_named("avx512", cpu_fp8.fp8_block_linear), id="avx512", marks=kernel),
    pytest.param(_named("avx2", lambda x, w, s, b: cpu_fp8.fp8_block_linear_avx2(x.float(), w, s, b)), id="avx2",
                 marks=pytest.mark.skipif(
        cpu_build.load() is None or not getattr(cpu_build.load(), "fp8_block_linear_avx2_built", False),
        reason="the fused CPU kernels are not built here, or without AVX2 / FMA / F16C"))])
def test_kernel_nan_codes_give_nan(linear):
    """e4m3's NaN codes (0x7F, 0xFF) give NaN in their output columns alone, on the GEMV and the prefill path of the
    AVX512-BF16 kernel (row-major and in the CPU tile layout) and of the AVX2 one."""
    q, s = random_fp8(128, 64, seed=5)
    qb = q.view(torch.uint8).clone()
    qb[7, 3], qb[100, 40] = 0x7F, 0xFF
    x = torch.randn(3, 64)
    weights = [(qb, {})]
    if linear.__name__ == "avx512":
        weights.append((tiled_copy(qb.view(torch.float8_e4m3fn)).view(torch.uint8), {"tiled": True}))
    for w, kw in weights:
        for xm in (x, x.repeat(8, 1)):  # GEMV and GEMM (float32 x: the tile GEMV up to 16 rows)
            for xd in (xm, xm.repeat(3, 1).bfloat16()):
                y = linear(xd, w.view(torch.float8_e4m3fn), s, None, **kw)
                nan_cols = y.isnan().all(0)
                assert nan_cols[7] and nan_cols[100] and nan_cols.sum() == 2, (kw, xd.shape, xd.dtype)


def test_forced_reference_path(monkeypatch):
    q, s = random_fp8(200, 160, seed=7)
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", "torch")
    w = Fp8BlockWeight(q, s)
    w.prepare()
    assert not w._kernel
    x = torch.randn(4, 160)
    assert torch.equal(w.linear(x, None), torch.nn.functional.linear(x, formula(q, s)))


@pytest.mark.parametrize("prepared", [False, True], ids=["as-loaded", "prepared"])
def test_concat_joins_whole_row_blocks_only(prepared):
    """Joined as loaded, and after prepare() (where this CPU takes the tile layout: the joined tiles stay whole, the
    last weight's 8 rows past its tiles stay at the end), against the parts' formula and through the kernel."""
    parts = [random_fp8(128, 160, 1), random_fp8(72, 160, 2), random_fp8(40, 160, 3)]
    want = torch.cat([formula(*parts[0]), formula(*parts[1])])  # before prepare() re-lays the bytes in place
    a, b, c = (Fp8BlockWeight(*p) for p in parts)
    if prepared:
        for w in (a, b, c):
            w.prepare()
    ab = Fp8BlockWeight.concat([a, b])
    assert ab.cpu_tiles == a.cpu_tiles == (prepared and a._kernel and cpu_fp8.fp8_tiles_preferred())
    assert torch.equal(ab.dequantize(), want)
    assert torch.equal(ab.dequantize_rows(100, 199), want[100:199])  # across tiles into the row-major rows
    if prepared and ab._kernel:
        x = torch.randn(3, 160)
        ref = torch.nn.functional.linear(x.double(), want.double())
        assert ((ab.linear(x, None).double() - ref).abs() <= fp32_bound(x, want)).all()
    assert Fp8BlockWeight.concat([b, c]) is None  # b's last block is partial: the scale rows would not line up


@pytest.fixture(scope="module")
def fp8_pair(tiny_model, tmp_path_factory):
    """(FP8 checkpoint, its dequantized twin) of a tiny DeepSeek-V3 with partial blocks."""
    root = tmp_path_factory.mktemp("fp8")
    src = tiny_model("deepseek_v3", **TINY)
    fp8, twin = str(root / "fp8"), str(root / "twin")
    write_fp8_checkpoint(src, fp8, twin)
    return fp8, twin


@pytest.mark.parametrize("backend", ["tokenfab", "torch"], ids=["kernels", "forced-reference"])
def test_tiny_fp8_model_matches_dequantized_twin(fp8_pair, monkeypatch, backend):
    """fp32 activations: the packed model (C++ kernels, or the PyTorch reference path a CPU without AVX512-BF16
    takes, forced by TOKENFAB_CPU_LINEAR=torch) against the same model on the dequantized weights as plain fp32
    weights: greedy tokens identical, prompt logprobs within 1e-4."""
    from tokenfab import LLM, SamplingParams
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", backend)
    fp8, twin = fp8_pair
    # the 96-token prompt: its first step's expert segments (8 experts, top-2: about 24 tokens each) and linears
    # (over 100 rows) take the prefill paths
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 33, 200, 7], [9, 4, 300], list(range(3, 43)),
                                                  [(7 * i + 3) % 500 for i in range(96)])]
    sp = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10, prompt_logprobs=0)
    outs = {}
    for key, path in (("packed", fp8), ("reference", twin)):
        llm = LLM(path, dtype="float32", max_model_len=128, progress=False)
        outs[key] = llm.generate(prompts, sp, use_tqdm=False)
        if key == "packed":
            model = llm.llm_engine.runner.model
            attn, moe = model.model.layers[0].self_attn, model.model.layers[1].mlp
            packed = [m for m in model.modules() if isinstance(m, Fp8BlockWeight)]
            # layer 0: q_a|kv_a (joined or not), q_b, o_proj, dense gate|up / down; layer 1: the same attention and
            # the shared expert; kv_b_proj is plain (dequantized at load); the routed experts stay FP8 in their
            # stacks (tests/test_fp8_block_experts.py)
            assert attn.kv_b_proj.qweight is None and attn.kv_b_proj.weight is not None
            assert moe.experts.w13 is None and moe.experts.q13.format_name == "fp8_block"
            assert moe.experts.q13._kernel == (cpu_fp8.fp8_experts_applies() and backend != "torch")
            assert attn.o_proj.qweight is not None and moe.shared_experts.down_proj.qweight is not None
            assert len(packed) >= 2 * 4 + 2 + 2
            assert attn.o_proj.qweight._kernel == (cpu_fp8.fp8_block_linear_applies() and backend != "torch")
            del llm
    gap = max_prompt_logprob_gap(outs["reference"], outs["packed"], "packed FP8")
    assert gap < 1e-4


def packed_bytes_of(folder: str) -> int:
    """Bytes of every tensor the tiny FP8 checkpoint stores, from the config: FP8 linears 1 byte per parameter plus
    4 bytes per 128 x 128 block scale, the rest (float32 embeddings, norms, router, lm_head) 4 bytes."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    h, L, V, H = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["num_attention_heads"]
    qk, v = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ql, kvl, rope, E, I, mi = (cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"],
                               cfg["n_routed_experts"], cfg["intermediate_size"], cfg["moe_intermediate_size"])

    def fp8(o, i):
        return o * i + 4 * (-(-o // 128)) * (-(-i // 128))

    attn = fp8(ql, h) + fp8(H * qk, ql) + fp8(kvl + rope, h) + fp8(H * (cfg["qk_nope_head_dim"] + v), kvl) \
        + fp8(h, H * v) + 4 * (ql + kvl)  # + the two latent norms
    mlp = lambda i: 2 * fp8(i, h) + fp8(h, i)  # noqa: E731
    dense = cfg["first_k_dense_replace"]
    moe = E * mlp(mi) + mlp(mi * cfg["n_shared_experts"]) + 4 * (E * h + E)  # router weight + correction bias
    layers = L * (attn + 4 * 2 * h) + dense * mlp(I) + (L - dense) * moe
    return layers + 4 * (2 * V * h + h)


def test_plan_counts_fp8_packed_bytes(fp8_pair):
    from tokenfab.cli import main
    fp8, _ = fp8_pair
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["plan", fp8, "--device-memory", "1GiB", "--json"]) == 0
    plan = json.loads(buf.getvalue())
    text = json.dumps(plan)
    want = packed_bytes_of(fp8)
    assert str(want) in text, f"plan does not report {want} weight bytes"
    assert "F8_E4M3" in text


@pytest.mark.parametrize("field,value", [("quant_method", "awq"), ("fmt", "e5m2"), ("activation_scheme", "static"),
                                         ("weight_block_size", [64, 64]), ("weight_block_size", None)])
def test_bad_quantization_config_is_refused_naming_the_field(field, value):
    from tokenfab.config import parse_config
    from tokenfab.testing.fp8_checkpoint import QUANTIZATION_CONFIG
    from tokenfab.testing.tiny_checkpoints import make_hf_config, tiny_config_kwargs
    cfg = dict(make_hf_config("deepseek_v3", **tiny_config_kwargs("deepseek_v3", **TINY)).to_dict(),
               architectures=["DeepseekV3ForCausalLM"])
    assert parse_config(dict(cfg, quantization_config=QUANTIZATION_CONFIG)).fp8_block_size == (128, 128)
    qc = dict(QUANTIZATION_CONFIG, **{field: value})
    if value is None:
        del qc[field]
    with pytest.raises(ConfigError) as e:
        parse_config(dict(cfg, quantization_config=qc))
    msg = str(e.value)
    assert f"quantization_config.{field}" in msg and "\n" not in msg


def test_unpaired_fp8_weight_is_refused():
    """(Tensor parallel is no longer refused: tests/test_tp_fp8.py runs TP 2 / 3 and refuses a misfit shard scale.)"""
    from tokenfab.errors import WeightLoadError
    from tokenfab.loader.fp8_block_loader import Fp8CheckpointWeights
    q, s = random_fp8(200, 160)
    items = [("model.layers.0.mlp.down_proj.weight", q), ("model.layers.0.self_attn.o_proj.weight_scale_inv", s)]
    with pytest.raises(WeightLoadError, match="o_proj.weight_scale_inv .no float8.*|down_proj.weight .no"):
        list(Fp8CheckpointWeights(items))
    with pytest.raises(WeightLoadError, match="b.weight is float8_e5m2"):
        list(Fp8CheckpointWeights([("b.weight", q.float().to(torch.float8_e5m2))]))
    got = dict(Fp8CheckpointWeights([("a.weight_scale_inv", s), ("a.weight", q)]))
    assert isinstance(got["a.weight"], Fp8BlockWeight)


@kernel
@pytest.mark.parametrize("q_lora", [64, 128], ids=["q_a-kv_a-separate", "q_a-kv_a-joined"])
def test_fp8_decode_stack_is_bit_identical_to_the_module_path(tiny_model, tmp_path, monkeypatch, q_lora):
    """bf16 decode of the FP8 model through the fused C++ stack (MLA and MLP projections as FP8 Lins) against the
    module path on the same packed weights: same tokens and logprobs over steps that read the cache rows the stack
    wrote. q_lora 128 lets q_a|kv_a join (whole 128-row blocks), 64 keeps them apart."""
    from tokenfab import LLM
    fp8 = write_fp8_checkpoint(tiny_model("deepseek_v3", **dict(TINY, q_lora_rank=q_lora)), str(tmp_path / "fp8"))
    llm = LLM(fp8, dtype="bfloat16", max_model_len=256, block_size=8, max_num_batched_tokens=40, progress=False)
    runner = llm.llm_engine.runner
    attn = runner.model.model.layers[0].self_attn
    assert (getattr(attn, "qkv_a_proj", None) is not None) == (q_lora == 128)
    assert isinstance(attn.o_proj.qweight, Fp8BlockWeight)
    experts = runner.model.model.layers[1].mlp.experts
    assert experts.w13 is None and experts.q13.format_name == "fp8_block" and experts.q13._kernel
    stack = runner.cpu_decode_stack
    assert stack is not None  # the FP8 model's decode stays fused, its routed experts packed
    prompts = [[5, 17, 33, 200, 7, 9, 11, 300, 41], [9, 4, 300] * 10, list(range(3, 20))]
    want, sizes = generate_through(llm, prompts, False, monkeypatch, max_tokens=10)
    assert not sizes
    got, sizes = generate_through(llm, prompts, True, monkeypatch, max_tokens=10)
    assert sizes and max(sizes) == 3  # the 3-sequence decode steps ran through the stack
    assert got == want


def test_model_weight_bytes_counts_the_packed_bytes():
    """The KV pool is sized from the weights' bytes (gpu_memory_utilization): the FP8 bytes and scales a
    PackedWeight holds as buffers are weights, the RoPE-table kind of buffer is not."""
    from tokenfab.engine.engine_config import model_weight_bytes
    from tokenfab.layers.linear import Linear
    m = torch.nn.Module()
    m.lin = Linear(160, 200)
    m.lin.set_qweight(Fp8BlockWeight(*random_fp8(200, 160)))
    m.norm = torch.nn.Parameter(torch.ones(160))
    m.register_buffer("cos", torch.zeros(1000))
    assert model_weight_bytes(m) == 200 * 160 + 4 * 2 * 2 + 160 * 4
