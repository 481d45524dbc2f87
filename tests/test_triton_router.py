"""The Triton router selection (kernels/gpu/router.py) in Triton's interpreter on CPU against SigmoidGroupRouter's
PyTorch path (layers/moe.py, the kernel seam switched off): the same expert set per token (random logits have no
ties), and the same weights per expert to float32 rounding (unbiased sigmoid scores, renormalized, scaled). Expert
counts that are not powers of two too (Kimi K3's top-16 of 896, Kimi-K2's top-8 of 384), padded in the kernel.
"""
from __future__ import annotations

import pytest
import torch

from tokenfab.kernels import dispatch
from tokenfab.kernels.gpu import support as triton_support
from tokenfab.layers.moe import SigmoidGroupRouter

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


@pytest.mark.parametrize("E,n_group,topk_group,top_k,shift", [(256, 8, 4, 8, 0), (64, 1, 1, 8, 0), (16, 4, 2, 4, 0),
                                                            (8, 4, 3, 2, 0), (896, 1, 1, 16, 0), (384, 1, 1, 8, -2),
                                                            (24, 1, 1, 4, -2)])
@pytest.mark.parametrize("norm", [True, False])
def test_selection_matches_the_router(monkeypatch, E, n_group, topk_group, top_k, shift, norm):
    """``shift`` moves every correction bias down: every expert's choice score then falls below what a padding
    column (logit 0, no bias) would score, so a padded count (384, 24) that let padding compete would fail."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret")
    from tokenfab.kernels.gpu import router
    assert router.applies(E, n_group, top_k)
    g = torch.Generator().manual_seed(E + top_k)
    r = SigmoidGroupRouter(32, E, top_k, n_group, topk_group, norm, 2.5)
    r.weight.data = torch.randn(E, 32, generator=g)
    r.e_score_correction_bias.data = torch.randn(E, generator=g) * 0.1 + shift
    x = torch.randn(9, 32, generator=g)
    w, ids = router.sigmoid_group_topk(torch.nn.functional.linear(x, r.weight), r.e_score_correction_bias,
                                       n_group, topk_group, top_k, norm, 2.5)
    monkeypatch.setattr(dispatch, "sigmoid_group_topk", lambda *a, **k: None)
    w_ref, ids_ref = r(x)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (9, top_k)
    order, order_ref = ids.argsort(dim=1), ids_ref.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), ids_ref.gather(1, order_ref))  # the same experts
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), rtol=1e-6, atol=1e-7)


def test_shapes_outside_the_kernel_stay_on_the_reference_path():
    """Kimi K3's 896 and Kimi-K2's 384 experts (ungrouped) take the selection launch and the fused one, padded to a
    power of two; grouped routing still needs power-of-two counts."""
    from tokenfab.kernels.gpu import router
    assert not router.applies(384, 1, 6)  # top_k not a power of two
    assert not router.applies(96, 8, 8)   # grouped, expert count not a power of two
    assert not router.applies(8, 8, 2)    # groups of one expert (no best two)
    assert router.applies(896, 1, 16) and router.applies(384, 1, 8) and router.applies(24, 1, 4)
    assert router.fused_applies(896, 1, 16) and router.fused_applies(256, 8, 8)
    assert not router.fused_applies(96, 8, 8) and not router.fused_applies(384, 1, 6)
