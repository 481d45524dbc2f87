"""Split-K's choice of slices and its ordered reduction (kernels/gpu/split_k.py), in Triton's interpreter: the choice
against the rule written out (enough programs per SM, no empty slice, the partial-traffic bound) over many sizes,
the reduction against the float32 sum of the slices in order plus the bias, rounded once to the output dtype."""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


@pytest.mark.parametrize("sms", [4, 132, 304])
def test_choice_fills_the_device_and_leaves_no_slice_empty(monkeypatch, sms):
    from tokenfab.kernels.gpu import split_k
    monkeypatch.setattr(split_k, "sm_count", lambda device: sms)
    dev = torch.device("cpu")
    for tiles in (1, 3, 64, 128, 224, 2 * sms - 1, 2 * sms, 5000):
        for k_steps in (1, 7, 8, 32, 144, 576):
            for max_split in (None, 1, 3):
                s = split_k.choose_split(tiles, k_steps, dev, min_steps=4, max_split=max_split)
                per = -(-k_steps // s)
                assert 1 <= s <= k_steps and (s - 1) * per < k_steps  # every slice has work
                if tiles >= 2 * sms or k_steps < 8:
                    assert s == 1
                    continue
                assert max_split is None or s <= max_split
                assert per >= min(4, k_steps)
                want = min(-(-8 * sms // tiles), k_steps // 4, max_split or k_steps)  # before the no-empty rounding
                assert s <= want and -(-k_steps // -(-k_steps // want)) == s


def test_traffic_bound():
    from tokenfab.kernels.gpu.split_k import max_split_for
    assert max_split_for(7168 * 18432, 1, 7168) == 18432 // 16
    assert max_split_for(4096 * 4096, 64, 4096) == 4
    assert max_split_for(100, 64, 4096) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split,M,N", [(1, 1, 5), (3, 2, 1100), (7, 5, 33)])
def test_reduction_sums_slices_in_order(interpret, dtype, split, M, N):
    from tokenfab.kernels.gpu.split_k import partial_buffer, reduce_partials
    g = torch.Generator().manual_seed(split)
    p = partial_buffer(split, M, N, torch.device("cpu"))
    p.copy_(torch.randn(split, M, N, generator=g) * torch.logspace(-3, 3, split)[:, None, None])
    bias = torch.randn(N, generator=g) if split % 2 else None
    y = torch.empty(M, N, dtype=dtype)
    reduce_partials(p, y, bias)
    want = p[0].clone()
    for s in range(1, split):
        want += p[s]  # float32, slice order
    if bias is not None:
        want += bias
    if dtype == torch.float32:
        assert torch.equal(y, want)
    else:  # one rounding to bf16 (the interpreter truncates: within one bf16 step)
        assert ((y.float() - want).abs() <= 2.0 ** -7 * want.abs()).all()
