"""GGUF K-quants Q4_K, Q5_K and Q6_K kept packed (tokenfab/quant/gguf_kquants.py, kernels/cpu/csrc/gguf_linear.cpp):
dequantization bit-identical to gguf-py's ``gguf.quants.dequantize``, the tile layout an exact inverse, and the
kernel's products against the float64 product with gguf's dequantized weight.

Kernel tolerance (float32 accumulation): per output the kernel sums, per 32-value sub-block (16 for Q6_K's scales),
the exact bf16 products x_k q_k in float32 chains, scales each sum once by the exact float32 d * sc (and subtracts
dmin * m times the float32 sum of that sub-block's x, Q4_K/Q5_K): every term of the exact sum passes through at
most 3K + 64 float32 roundings of relative size u = 2^-24 (as for Q4_1, tests/test_gguf_linear.py), so with
S = sum_k |x_k| (|d sc q_k| + |dmin m|) (+ |bias|) the float32 result is within (3K + 64) u S of the exact
product; a bf16 output adds one rounding, <= 2^-8 |y|. A wrong nibble, high-bit, scale or row order moves outputs
by O(S), far outside this. bf16 x of more than 16 rows (prefill) multiplies the weight rounded once to bf16 (the
dequantized bf16 twin's): checked under the same bound against the product with that weight (``bf16_weight``).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_helpers import assert_within_bound, check_kernel_product, with_bias  # noqa: E402
from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf  # noqa: E402
from tokenfab.quant import gguf_blocks, gguf_kquants  # noqa: E402
from tokenfab.quant.gguf_weight import GGUFWeight  # noqa: E402

KTYPES = ("Q4_K", "Q5_K", "Q6_K")

needs_kernel = pytest.mark.skipif(not cpu_gguf.gguf_linear_applies(),
                                  reason="gguf_linear needs the CPU kernels with AVX512-BF16")


def random_kblocks(name: str, n: int, k: int, seed: int = 0, scale: float = 0.05) -> np.ndarray:
    """K-quant rows [n, k / 256 * super bytes] of random bytes with finite fp16 d (and dmin): every quant, high-bit
    and 6-bit scale pattern occurs."""
    rng = np.random.default_rng(seed)
    sb = gguf_kquants.SUPER_BYTES[name]
    raw = rng.integers(0, 256, size=(n, k // 256, sb), dtype=np.uint8)
    f16 = lambda c: (rng.standard_normal((n, k // 256, c)) * scale).astype(np.float16).view(np.uint8)  # noqa: E731
    if name == "Q6_K":
        raw[..., 208:210] = f16(1)
    else:
        raw[..., 0:4] = f16(2)
    return raw.reshape(n, -1)


def gguf_values(raw: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])))


@pytest.mark.parametrize("name", KTYPES)
@pytest.mark.parametrize("rows", [1, 7, 37])  # not multiples of the 16-row tile
def test_dequantize_bit_identical_to_gguf(name, rows):
    raw = random_kblocks(name, rows, 512, seed=rows)
    ref = gguf_values(raw, name)
    mine = gguf_blocks.dequantize_rows(torch.from_numpy(raw), gguf_blocks.block_type(name))
    assert mine.dtype == torch.float32 and mine.shape == ref.shape == (rows, 512)
    assert torch.equal(mine.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("name", KTYPES)
def test_tiles_round_trip_and_keep_the_byte_count(name):
    raw = torch.from_numpy(random_kblocks(name, 37, 512, seed=2))  # 37 rows: a partial last tile
    w = GGUFWeight.from_rows(raw, name, 512)
    assert w.tiles.shape == (3, 2, 16 * gguf_kquants.SUPER_BYTES[name])
    assert torch.equal(w.rows(), raw)
    assert torch.equal(w.rows(1, 3), raw[16:])
    assert w.nbytes == 48 * raw.shape[1]  # 37 rows padded to 48: the GGUF bytes per row, no float copy
    assert torch.equal(w.dequantize_rows(5, 30).view(torch.int32), gguf_values(raw[5:30].numpy(), name).view(
        torch.int32))
    ids = torch.tensor([[0, 36], [17, 5]])
    emb = w.embedding(ids, torch.float32)
    assert torch.equal(emb, gguf_values(raw.numpy(), name)[ids])


def test_kquant_rows_must_be_whole_super_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        GGUFWeight.from_rows(torch.zeros(4, 144, dtype=torch.uint8), "Q4_K", 128)


def exact(x: torch.Tensor, raw: np.ndarray, name: str, bias: torch.Tensor | None,
          bf16_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 x W^T + b with W = gguf's dequantize of ``raw``, the bound's S): S from |W| + |dmin m| per element,
    the minimum unpacked by gguf's own ``Q4_K.get_scale_min``; ``bf16_weight``: W rounded once to bf16 (the
    dequantized bf16 twin) and S = |x| |W|."""
    w = gguf_values(raw, name)
    w = (w.to(torch.bfloat16) if bf16_weight else w).double()
    n, k = w.shape
    extra = torch.zeros_like(w)
    if name != "Q6_K" and not bf16_weight:
        blocks = raw.reshape(-1, gguf_kquants.SUPER_BYTES[name])
        _, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
        dm = torch.from_numpy(dmin * mn.astype(np.float64)).reshape(n, k // 32, 1).expand(n, k // 32, 32)
        extra = dm.reshape(n, k).abs()
    x64 = x.double().reshape(-1, k)
    return with_bias(x64 @ w.T, x64.abs() @ (w.abs() + 2 * extra).T, bias)  # |d sc q| <= |w| + |dmin m|


def check_close(y: torch.Tensor, x: torch.Tensor, raw: np.ndarray, name: str, bias: torch.Tensor | None,
                bf16_weight: bool = False) -> None:
    assert_within_bound(y, x, *exact(x, raw, name, bias, bf16_weight))


@needs_kernel
@pytest.mark.parametrize("name", KTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 16, 17, 33])  # 1..16: GEMV passes; 17+: the dequantizing GEMM
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_exact_product(name, rows, dtype):
    n, k = 40, 512  # n: not a multiple of the 16-row tile nor of the 32-column prefill block
    raw = random_kblocks(name, n, k, seed=rows)
    x, y, bias = check_kernel_product(raw, name, k, rows, dtype, check_close)
    # a wrong order would fail; so would a kernel left at zero: outputs are O(S), not O(tol)
    assert (y.double() - exact(x, raw, name, bias)[0]).abs().max() < 0.05 * y.double().abs().max()


@needs_kernel
@pytest.mark.parametrize("name", KTYPES)
def test_kernel_float32_agrees_with_reference_path_closely(name):
    """float32 activations: the kernel (x split into three bf16 parts) and the float32 reference path agree to
    float32 accumulation error, far below what one wrong quant would move."""
    raw = random_kblocks(name, 33, 768, seed=9)
    w = GGUFWeight.from_rows(torch.from_numpy(raw), name, 768)
    w.prepare()
    x = torch.randn(2, 768)
    check_close(w.linear(x, None), x, raw, name, None)
    check_close(w.reference_linear(x, None), x, raw, name, None)


@needs_kernel
@pytest.mark.parametrize("name", [t for t in KTYPES if t != "Q4_K"])
def test_batched_gemv_rows_equal_single_row_bits(name):
    """5..16 rows (K-quants take no AMX path): Q5_K / Q6_K passes (K <= 2048) share one unpacking of each weight
    tile (the operand buffer): every row's output is bit for bit that row's single-row GEMV, within the exact
    product's bound. (Q4_K passes of 5..8 rows sum in two chains per row instead of four: bounded by
    test_kernel_matches_exact_product and below.)"""
    n, k = 40, 512
    raw = random_kblocks(name, n, k, seed=23)
    w = GGUFWeight.from_rows(torch.from_numpy(raw), name, k)
    w.prepare()
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (5, 9, 16):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
            y = w.linear(x, None)
            assert torch.equal(y, torch.cat([w.linear(x[i:i + 1], None) for i in range(rows)])), (dtype, rows)
            check_close(y, x, raw, name, None)


@needs_kernel
@pytest.mark.parametrize("name,k", [("Q4_K", 512), ("Q5_K", 2304)])  # Q5_K past the operand buffer's K
def test_eight_row_passes_within_the_bound(name, k):
    """Q4_K (any K) and Q5_K past K = 2048 run 5..16 rows in passes of up to 8 rows with two chains per row: each
    row within the exact product's bound (bf16 and float32 x), whatever its pass (5, 8, 9, 13, 16 rows)."""
    n = 24
    raw = random_kblocks(name, n, k, seed=29)
    w = GGUFWeight.from_rows(torch.from_numpy(raw), name, k)
    w.prepare()
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (5, 8, 9, 13, 16):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
            check_close(w.linear(x, None), x, raw, name, None)
            check_close(w.linear_f32(x, None), x, raw, name, None)


@pytest.mark.parametrize("name", KTYPES)
def test_tile_and_value_functions_stay_on_the_bytes_device(name):
    """pack_tiles, unpack_tiles and dequantize_rows build their shift tables on the device of the bytes they are
    given, so a GGUF weight on a GPU (embedding rows, the reference path) never mixes in CPU tensors. The meta
    device stands in for the GPU here: a CPU tensor mixed into its ops raises, as it would on CUDA."""
    raw = torch.zeros(20, 2 * gguf_kquants.SUPER_BYTES[name], dtype=torch.uint8, device="meta")
    tiles = gguf_kquants.pack_tiles(raw, name)
    assert tiles.device.type == "meta" and tiles.shape == (2, 2, 16 * gguf_kquants.SUPER_BYTES[name])
    assert gguf_kquants.unpack_tiles(tiles, name, 20).shape == raw.shape
    assert gguf_kquants.dequantize_rows(raw, name).shape == (20, 512)
