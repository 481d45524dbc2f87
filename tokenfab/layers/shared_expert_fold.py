"""Shared experts run as routed experts on the GPU code path (DeepSeek-V3 / Kimi MoE layers).

A shared SiLU-GLU MLP of intermediate s * I beside routed experts of intermediate I is, exactly, s more experts of
intermediate I that every token chooses with weight 1: down(silu(gate x) * up x) splits along the intermediate axis
into s chunks whose down-projections sum (SGLang's "shared experts fusion" and vLLM's fused shared experts do the
same). So after loading, :func:`fold_shared_experts` stacks them behind the routed ones (w13 [E + s, 2I, hidden], w2
[E + s, hidden, I]; the routed experts keep views of the first E rows, nothing duplicated but the shared weights;
while folding, one layer's routed stacks are held twice), the router appends s always-chosen slots (ids E .. E + s -
1, weight 1.0) in its own launch, and the fused MoE runs everything in its grouped GEMMs: a decode MoE layer saves
the shared MLP's three launches (gate|up GEMM, activation, down GEMM) and the weighted sum stays one float32 k-sum
with a single rounding.

Results differ from ``routed + shared(x)`` by float rounding only (the shared output is no longer rounded to the
activation dtype before the sum; the sum's order changes). Applies with a plain (unquantized, bias-free) routed
stack and shared MLP of one dtype, all experts on this rank (expert parallel would alias other ranks' ids), no host
experts and a router shape the Triton selection takes; elsewhere the layer keeps its separate shared MLP.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenfab.kernels import dispatch


class FoldedSharedExperts:
    """The stacks [routed | shared] of one MoE layer; calling it runs the routed and shared experts' sum.

    Attributes:
        w13: [E + s, 2I, hidden] ([gate | up] rows per expert); w2: [E + s, hidden, I]; slots: s.
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, slots: int):
        self.w13, self.w2, self.slots = w13, w2, slots

    def __call__(self, x: torch.Tensor, gate, experts) -> torch.Tensor | None:
        """x [T, hidden] -> [T, hidden] = sum_k w_k E_k(x) + shared(x), routed by ``gate`` (a
        SigmoidGroupRouter) with the shared slots appended, or None where the fused MoE does not apply here (the
        caller then runs its unfolded path). ``experts``' route counter, if any, sees the routed ids only."""
        if experts.host is not None or not dispatch.gpu_path(x):
            return None
        aligned = dispatch.moe_alignment(x, gate.top_k + self.slots, 0, self.w13.shape[0])  # by the router's launch
        w, ids = gate(x, self.slots, aligned)
        if experts.route_counter is not None:
            experts.route_counter.record(ids[:, : gate.top_k])
        return dispatch.routed_experts(x, w, ids, 0, None, self.w13, self.w2,  # None: SiLU-GLU in the GEMM
                                       aligned=aligned)


def _plain_weight(lin: nn.Module) -> torch.Tensor | None:
    """The dense weight of a bias-free layers.linear.Linear (None when packed, quantized or biased)."""
    w = getattr(lin, "weight", None)
    if (w is None or getattr(lin, "bias", None) is not None or not isinstance(w, torch.Tensor) or w.is_meta
            or not w.dtype.is_floating_point or w.element_size() < 2 or getattr(lin, "fmt", None) is not None):
        return None
    return w


def fold_shared_experts(experts: nn.Module, shared: nn.Module | None, gate) -> FoldedSharedExperts | None:
    """After loading, on the GPU code path: stack ``shared`` (a GatedMLP of intermediate s * I) behind the routed
    ``experts`` (a plain RoutedExperts with w13 [E, 2I, hidden], w2 [E, hidden, I]) and point the experts' w13 /
    w2 at views of the new stacks; returns the fold, or None where it does not apply (module docstring) and
    nothing changed. ``gate``: the layer's SigmoidGroupRouter (its shape must suit the Triton selection)."""
    from tokenfab.layers.mlp import GatedMLP
    from tokenfab.layers.moe import RoutedExperts
    if shared is None or type(shared) is not GatedMLP or type(experts) is not RoutedExperts:
        return None
    w13, w2 = experts.w13, experts.w2
    if (w13 is None or w13.is_meta or experts.host is not None or experts.q13 is not None or experts.start != 0
            or experts.end != experts.num_experts or not dispatch.gpu_path(w13)):
        return None
    gw, uw, dw = (_plain_weight(m) for m in (shared.gate_proj, shared.up_proj, shared.down_proj))
    E, two_i, hidden = w13.shape
    inter = two_i // 2
    if (gw is None or uw is None or dw is None or not inter or gw.shape[0] % inter
            or not (gw.dtype == uw.dtype == dw.dtype == w13.dtype == w2.dtype)
            or gw.shape[1] != hidden or uw.shape != gw.shape or dw.shape != (hidden, gw.shape[0])):
        return None
    from tokenfab.kernels.gpu import router
    if not router.applies(gate.num_experts, gate.n_group, gate.top_k) or gate.num_experts != E:
        return None
    s = gw.shape[0] // inter
    try:  # the layer's routed stacks are briefly held twice (one layer at a time)
        with torch.no_grad():
            all13 = w13.new_empty(E + s, two_i, hidden)
            all13[:E] = w13
            all13[E:, :inter] = gw.view(s, inter, hidden)
            all13[E:, inter:] = uw.view(s, inter, hidden)
            all2 = w2.new_empty(E + s, hidden, inter)
            all2[:E] = w2
            all2[E:] = dw.view(hidden, s, inter).transpose(0, 1)
    except torch.OutOfMemoryError:  # no room for the copy: keep the separate shared MLP
        return None
    experts.w13 = nn.Parameter(all13[:E], requires_grad=False)  # the old stacks are freed
    experts.w2 = nn.Parameter(all2[:E], requires_grad=False)
    return FoldedSharedExperts(all13, all2, s)
