"""Packed GGUF weights (tokenfab/quant, kernels/cpu/csrc/gguf_linear.cpp): exact unpacking against gguf-py and the
kernel's products against the float64 product with the dequantized weight.

Tolerance (float32 accumulation): the kernel forms, per output, sum over blocks of d * (sum_k x_k q_k) (+ m * sum_k
x_k): products of bf16 values are exact, each float32 addition rounds with relative error u = 2^-24, and no sum has
more than 3K + 64 terms (the GEMV: <= 48 per chain and block, K / 32 block scalings; the brgemm path: K products;
float32 x adds its own split error <= u |x|). So with
S = sum_k |x_k| (|d_k q_k| + |m_k|) (+ |bias|) the float32 result is within (3K + 64) u S of the exact one (the
classical gamma_n = n u / (1 - n u) bound), and a bf16 output adds one rounding to 8 significant bits, <= 2^-8 |y|. A wrong nibble, pair or
scale order moves outputs by O(S), far outside this.

bf16 x of more than 16 rows (prefill) multiplies the weight rounded once to bf16 (the dequantized bf16 twin's
weight, brgemm as bf16 GEMMs run): those outputs are checked under the same bound against the product with that
rounded weight (``bf16_weight``), and their float32 outputs (``linear_f32``) without the bf16 output rounding.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_helpers import assert_within_bound, check_kernel_product, int8_activations, with_bias  # noqa: E402
from tokenfab.kernels.cpu import build as cpu_build  # noqa: E402
from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf  # noqa: E402
from tokenfab.layers.linear import Linear  # noqa: E402
from tokenfab.quant import gguf_blocks  # noqa: E402
from tokenfab.quant.gguf_weight import GGUFWeight  # noqa: E402

TYPES = ("Q8_0", "Q4_0", "Q4_1")

needs_kernel = pytest.mark.skipif(not cpu_gguf.gguf_linear_applies(),
                                  reason="gguf_linear needs the CPU kernels with AVX512-BF16")


def quantized(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF rows [n, k / 32 * block bytes] from gguf-py's own quantizer on random weights."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[name])


def random_blocks(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF rows of random bytes with finite fp16 scales (every nibble / int8 pattern occurs)."""
    rng = np.random.default_rng(seed)
    bt = gguf_blocks.BLOCK_TYPES[name]
    raw = rng.integers(0, 256, size=(n, k // 32, bt.block_bytes), dtype=np.uint8)
    scales = 2 if not bt.has_min else 4
    raw[..., :scales] = (rng.standard_normal((n, k // 32, scales // 2)) * 0.05).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def exact(x: torch.Tensor, raw: np.ndarray, name: str, bias: torch.Tensor | None,
          bf16_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 x W^T + b, the bound's S) from the GGUF rows ``raw`` the weight was built from (not from the packed
    tiles): W = gguf's own dequantize, |d q| and |m| from the block fields; ``bf16_weight``: W rounded once to bf16
    (the dequantized bf16 twin) and S = |x| |W|."""
    bt = gguf_blocks.block_type(name)
    d, m, q = gguf_blocks._fields(torch.from_numpy(raw), bt)
    n = raw.shape[0]
    q = q.double() - (8 if bt is gguf_blocks.Q4_0 else 0)
    dq = (d.double().unsqueeze(-1) * q).reshape(n, -1)
    mm = (m.double().unsqueeze(-1).expand(*m.shape, 32).reshape(n, -1) if m is not None
          else torch.zeros_like(dq))
    w = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])))
    assert torch.equal(w.double(), dq + mm)  # the fields agree with gguf's values
    if bf16_weight:
        dq, mm = w.to(torch.bfloat16).double(), torch.zeros_like(dq)
        w = dq
    x64 = x.double().reshape(-1, dq.shape[1])
    return with_bias(x64 @ w.double().T, x64.abs() @ (dq.abs() + mm.abs()).T, bias)


def check_close(y: torch.Tensor, x: torch.Tensor, raw: np.ndarray, name: str, bias: torch.Tensor | None,
                bf16_weight: bool = False) -> None:
    assert_within_bound(y, x, *exact(x, raw, name, bias, bf16_weight))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("source", ["quantize", "random"])
def test_dequantize_bit_identical_to_gguf(name, source):
    raw = (quantized if source == "quantize" else random_blocks)(name, 24, 128)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    mine = gguf_blocks.dequantize_rows(torch.from_numpy(raw), gguf_blocks.block_type(name))
    assert mine.dtype == torch.float32 and mine.shape == ref.shape
    assert torch.equal(mine.view(torch.int32), torch.from_numpy(np.ascontiguousarray(ref)).view(torch.int32))


@pytest.mark.parametrize("name", TYPES)
def test_tiles_round_trip_and_keep_the_byte_count(name):
    raw = torch.from_numpy(random_blocks(name, 37, 96))  # 37 rows: a partial last tile
    w = GGUFWeight.from_rows(raw, name, 96)
    assert torch.equal(w.rows(), raw)
    assert w.nbytes == 48 * raw.shape[1]  # 37 rows padded to 48: the GGUF bytes per row, no float copy
    assert torch.equal(w.dequantize_rows(5, 30), gguf_blocks.dequantize_rows(raw[5:30], w.block))


def test_unsupported_type_and_bad_rows_are_refused():
    with pytest.raises(ValueError, match="Q2_K.*packed types: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K"):
        gguf_blocks.block_type("Q2_K")
    with pytest.raises(ValueError, match="multiple of 32"):
        GGUFWeight.from_rows(torch.zeros(4, 34, dtype=torch.uint8), "Q8_0", 48)


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 12, 16, 17, 33, 64])  # 5..16: GEMV passes or AMX; 17+: prefill
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_exact_product(name, rows, dtype):
    n, k = 40, 160  # n: not a multiple of the 16-row tile nor of the 32-column prefill block
    raw = quantized(name, n, k, seed=rows)
    x, _, bias = check_kernel_product(raw, name, k, rows, dtype, check_close)
    # the float32 reference F.linear(x, dequant(W)) is within the same bound of the exact product
    ref_w = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])))
    check_close(torch.nn.functional.linear(x.float(), ref_w, None if bias is None else bias.float()),
                x.float(), raw, name, bias)


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
def test_kernel_on_random_blocks_and_3d_input(name):
    raw = random_blocks(name, 50, 64, seed=3)
    w = GGUFWeight.from_rows(torch.from_numpy(raw), name, 64)
    w.prepare()
    for shape in ((2, 1, 64), (2, 9, 64)):
        x = torch.randn(shape).to(torch.bfloat16)
        y = w.linear(x, None)
        assert y.shape == (*shape[:-1], 50)
        check_close(y, x, raw, name, None, bf16_weight=x.numel() // 64 > 16)  # 18 rows: the prefill path


def test_reference_path_when_the_kernel_does_not_apply(monkeypatch):
    """A CPU without AVX512-BF16 (gguf_linear_applies False) or TOKENFAB_CPU_LINEAR=torch: the PyTorch path, never
    the kernel, with the same results."""
    raw_np = quantized("Q4_1", 20, 64)
    raw = torch.from_numpy(raw_np)
    x = torch.randn(3, 64).to(torch.bfloat16)

    def boom(*a, **k):
        raise AssertionError("the C++ kernel ran")

    for forced in ("no_bf16", "env"):
        with monkeypatch.context() as mp:
            if forced == "no_bf16":
                mp.setattr(cpu_gguf, "gguf_linear_applies", lambda: False)
            else:
                mp.setenv("TOKENFAB_CPU_LINEAR", "torch")
            mp.setattr(cpu_gguf, "gguf_linear", boom)
            w = GGUFWeight.from_rows(raw, "Q4_1", 64)
            w.prepare()
            assert not w._kernel
            check_close(w.linear(x, None), x, raw_np, "Q4_1", None)


@pytest.mark.parametrize("sizes", [(32, 16, 16), (24, 8, 8)])  # whole tiles joined as is; partial ones repacked
def test_linear_concat_of_packed_weights(sizes):
    k = 64
    raws = [random_blocks("Q4_0", n, k, seed=i) for i, n in enumerate(sizes)]
    parts = [GGUFWeight.from_rows(torch.from_numpy(r), "Q4_0", k) for r in raws]
    lins = []
    for p in parts:
        lin = Linear(k, p.out_features)
        lin.set_qweight(p)
        assert lin.weight is None
        lin.fuse()  # chooses the kernel once, as post_load does
        lins.append(lin)
    x = torch.randn(2, k).to(torch.bfloat16)
    separate = torch.cat([l(x) for l in lins], dim=-1)
    want = torch.cat([p.dequantize() for p in parts])
    fused = Linear.concat(lins)
    assert fused is not None and fused.qweight.out_features == sum(sizes)
    assert torch.equal(fused.qweight.dequantize(), want)
    if cpu_gguf.gguf_linear_applies():
        assert torch.equal(fused(x), separate)  # the same per-row dot products in the kernel's lanes
    else:
        check_close(fused(x), x, np.concatenate(raws), "Q4_0", None)
    with pytest.raises(ValueError, match="does not fit"):
        Linear(k, 3).set_qweight(parts[0])


def test_concat_refuses_mixed_block_types():
    a = GGUFWeight.from_rows(torch.from_numpy(random_blocks("Q4_0", 16, 32)), "Q4_0", 32)
    b = GGUFWeight.from_rows(torch.from_numpy(random_blocks("Q8_0", 16, 32)), "Q8_0", 32)
    assert GGUFWeight.concat([a, b]) is None


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
def test_gemv_prefetch_distance_changes_no_output_bit(name):
    """The GEMV's software prefetch (the extension's gguf_prefetch, TOKENFAB_GGUF_PREFETCH) only requests bytes early:
    off, short or past the weight's end, every output is the same bits, within the exact product's bound."""
    ext = cpu_build.load()
    n, k = 72, 256
    raw = quantized(name, n, k, seed=11)
    w = GGUFWeight.from_rows(torch.from_numpy(raw), name, k)
    w.prepare()
    x = torch.randn(3, k).to(torch.bfloat16)
    before = ext.gguf_prefetch()
    try:
        outs = {}
        for d in (0, 64, 2048, 1 << 20):  # 1 MiB: every prefetch lands past the weight's bytes
            assert ext.gguf_prefetch(d) >= 0 and ext.gguf_prefetch() == d
            outs[d] = [w.linear(x[:1], None), w.linear(x, None), w.linear(x.float(), None)]
    finally:
        ext.gguf_prefetch(before)
    for d, ys in outs.items():
        for y, y0 in zip(ys, outs[0]):
            assert torch.equal(y, y0), d
    check_close(outs[2048][1], x, raw, name, None)


@needs_kernel
def test_batched_gemv_rows_equal_single_row_bits():
    """Q8_0 decode batches of 5..16 rows share one unpacking of each weight tile (the operand buffer of the GEMV
    passes): every row's output is bit for bit that row's single-row GEMV. Float32 x always takes the GEMV; bf16 x
    does except on an AMX path (its 5..16 rows run AMX tiles) or with int8 activations (switched off here). (Q4_0 / Q4_1 passes of 5..8 rows sum in two chains per
    row instead of four: test_kernel_matches_exact_product bounds them.)"""
    name = "Q8_0"
    from tokenfab.kernels.cpu import isa
    n, k = 72, 320  # n: a partial last tile
    raw = quantized(name, n, k, seed=21)
    w = GGUFWeight.from_rows(torch.from_numpy(raw), name, k)
    w.prepare()
    dtypes = [torch.float32] + ([torch.bfloat16] if isa.selected_level() != "amx" else [])
    with int8_activations(False):  # bf16 rows: the exact GEMV, not int8 activations
        for dtype in dtypes:
            for rows in (5, 8, 13, 16):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
                y = w.linear(x, None)
                alone = torch.cat([w.linear(x[i:i + 1], None) for i in range(rows)])
                assert torch.equal(y, alone), (dtype, rows)
                check_close(y, x, raw, name, None)
