"""The Triton kernels (paged decode attention, fused MoE) in Triton's interpreter on CPU, against the PyTorch paths
and, through the engine, against transformers (tests/test_gpu_kernel_count.py). On a GPU the same kernels run compiled (benchmarks/gpu_check.sh).

The interpreter has no bfloat16 (numpy), so these run in float32; the kernels' bf16 path is the same code with
another load type.
"""
from __future__ import annotations

import pytest
import torch

# conftest.py chose the interpreter before triton was imported
from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


def reference_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """tests/test_triton_decode_attention.py's float64 gather-and-softmax reference, as float32."""
    from test_triton_decode_attention import gathered_reference
    return gathered_reference(q, k_cache, v_cache, block_tables, context_lens, scale).float()


@pytest.mark.parametrize("H,Hk,D,Dv,page", [(8, 2, 32, 32, 16), (4, 4, 16, 16, 8), (16, 1, 80, 64, 16),
                                             (40, 1, 160, 144, 16)],
                         ids=["gqa", "mha-page8", "mla-latent", "mla-3-head-blocks"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_matches_reference(interpret, H, Hk, D, Dv, page, num_splits):
    from tokenfab.kernels.gpu.decode_attention import paged_decode_attention
    g = torch.Generator().manual_seed(H * 100 + D + page)
    num_blocks, B = 40, 4
    k_cache = torch.randn(num_blocks, page, Hk, D, generator=g)
    mla = Dv != D
    v_cache = k_cache[..., :Dv] if mla else torch.randn(num_blocks, page, Hk, Dv, generator=g)
    context_lens = torch.tensor([1, page, 2 * page + 3, 100])  # one token, a full block, a partial block, long
    max_blocks = -(-100 // page)
    block_tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in range(B)])
    q = torch.randn(B, H, D, generator=g)
    got = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 0.3, num_splits=num_splits)
    want = reference_decode(q, k_cache, v_cache, block_tables, context_lens, 0.3)
    assert got.shape == (B, H, Dv)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_decode_attention_rejects_mismatched_dtypes(interpret):
    from tokenfab.kernels.gpu.decode_attention import paged_decode_attention
    k = torch.zeros(2, 8, 1, 16)
    with pytest.raises(ValueError, match="cast q to the cache dtype"):
        paged_decode_attention(torch.zeros(1, 2, 16, dtype=torch.float64), k, k, torch.zeros(1, 1, dtype=torch.int64),
                               torch.ones(1, dtype=torch.int64), 1.0)


def test_align_pairs_hand_worked(interpret):
    """ids [[2, 0], [2, 1], [5, 2]] over local experts [0, 3) with tiles of 2 rows. Pairs (token*k + slot):
    expert 0 <- pair 1; expert 1 <- pair 3; expert 2 <- pairs 0, 2, 5; pair 4 (expert 5) lives on another rank.
    Padded runs: 2 + 2 + 4 = 8 rows; the worst case is 6 + 3 * 1 = 9 -> 10 rows, 5 tiles."""
    from tokenfab.kernels.gpu.moe import align_pairs
    ids = torch.tensor([[2, 0], [2, 1], [5, 2]])
    sorted_pairs, expert_of_block, num_post = align_pairs(ids, start=0, num_local=3, block_m=2)
    pad = 6
    assert sorted_pairs.tolist() == [1, pad, 3, pad, 0, 2, 5, pad, pad, pad]
    assert expert_of_block.tolist() == [0, 1, 2, 2, -1]
    assert num_post.tolist() == [8]


def _experts(T, E, k, hidden, inter, start, num_local, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hidden, generator=g)
    w13 = torch.randn(num_local, 2 * inter, hidden, generator=g) / 4
    w2 = torch.randn(num_local, hidden, inter, generator=g) / 4
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("T,E,k,start,num_local", [(1, 8, 3, 0, 8), (7, 8, 2, 0, 8), (40, 16, 4, 4, 6),
                                                   (300, 8, 2, 0, 8)],
                         ids=["one-token", "decode", "expert-parallel-slice", "prefill-tiles-of-64"])
@pytest.mark.parametrize("glu", ["separate", "epilogue"])
def test_fused_moe_matches_routed_experts(interpret, T, E, k, start, num_local, glu):
    """Against RoutedExperts' PyTorch loop (each active expert once over its tokens, index_add back); SiLU-GLU as
    its own launch or in the gate|up GEMM's epilogue (act None; intermediate 24: a partial 32-row N tile, so the
    up rows' offset and mask are exercised)."""
    from tokenfab.kernels.gpu.moe import fused_moe
    from tokenfab.layers.activation import silu_and_mul
    from tokenfab.layers.moe import RoutedExperts
    x, w13, w2, weights, ids = _experts(T, E, k, 32, 24, start, num_local, seed=T + start)
    ref = RoutedExperts(E, 32, 24, expert_range=(start, start + num_local))
    ref.w13.data.copy_(w13)
    ref.w2.data.copy_(w2)
    ref.use_grouped_mm = False
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENFAB_TRITON", "0")
        want = ref(x, weights, ids)
    got = fused_moe(x, w13, w2, weights, ids, silu_and_mul if glu == "separate" else None, start)
    assert want.abs().max() > 0.1  # something was routed here
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_applies_only_on_gpu_or_when_interpreting(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.delenv("TOKENFAB_TRITON", raising=False)
    assert not triton_support.applies(x)  # CPU serving never takes the interpreter
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret")
    assert triton_support.applies(x)
    monkeypatch.setenv("TOKENFAB_TRITON", "0")
    assert not triton_support.applies(x)
    triton_support.check_env()
    monkeypatch.setenv("TOKENFAB_TRITON", "off")  # a typo must not silently mean "on"
    with pytest.raises(Exception, match="TOKENFAB_TRITON='off'.*use 1"):
        triton_support.check_env()


# The whole engine through these kernels against transformers: tests/test_gpu_kernel_count.py's
# test_gpu_path_engine_token_exact (the GPU code path, which runs the decode attention and the fused MoE here too).
