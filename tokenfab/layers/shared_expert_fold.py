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
stack and shared MLP of one dtype, or FP8 block-scaled ones as DeepSeek-V3 / Kimi-K2 ship them (:func:`_fold_fp8`:
the packed stacks grow by the shared MLP's codes and block scales before they are laid out for the kernels), all
experts on this rank (expert parallel would alias other ranks' ids), no host experts and a router shape the Triton
selection takes; elsewhere the layer keeps its separate shared MLP (INT4 / MXFP4 routed stacks beside a bf16 shared
MLP: formats that one grouped GEMM cannot mix).
"""
from __future__ import annotations

import torch
from torch import nn

from tokenfab.kernels import dispatch


class FoldedSharedExperts:
    """The stacks [routed | shared] of one MoE layer; calling it runs the routed and shared experts' sum.

    Attributes:
        w13: [E + s, 2I, hidden] ([gate | up] rows per expert); w2: [E + s, hidden, I]; slots: s. Both None for
            packed stacks, which the routed experts hold with the shared rows appended (:func:`_fold_fp8`).
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, slots: int):
        self.w13, self.w2, self.slots = w13, w2, slots

    def __call__(self, x: torch.Tensor, gate, experts) -> torch.Tensor | None:
        """x [T, hidden] -> [T, hidden] = sum_k w_k E_k(x) + shared(x), routed by ``gate`` (a
        SigmoidGroupRouter) with the shared slots appended, or None where the fused MoE does not apply here (the
        caller then runs its unfolded path). ``experts``' route counter, if any, sees the routed ids only."""
        if experts.host is not None or not dispatch.gpu_path(x):
            return None
        rows = self.w13.shape[0] if self.w13 is not None else experts.q13.num_experts
        aligned = dispatch.moe_alignment(x, gate.top_k + self.slots, 0, rows)  # by the router's launch
        w, ids = gate(x, self.slots, aligned)
        if experts.route_counter is not None:
            experts.route_counter.record(ids[:, : gate.top_k])
        if self.w13 is None:  # packed stacks holding the shared rows (:func:`_fold_fp8`), read as prepared now
            return experts.packed_kernel(x, w, ids, None, aligned=aligned)
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
    if experts.q13 is not None:
        return _fold_fp8(experts, shared, gate)
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


def _fold_fp8(experts: nn.Module, shared: nn.Module, gate) -> FoldedSharedExperts | None:
    """:func:`fold_shared_experts` for FP8 block-scaled experts and shared MLP (DeepSeek-V3 / Kimi-K2 as published):
    the routed stacks (quant/fp8_block_experts.py, still in the checkpoint layout: this runs before their
    ``prepare``) are replaced by stacks of E + s experts whose last s rows are the shared MLP's e4m3 codes and block
    scales, chunk j of its intermediate (gate and up rows j I .. (j + 1) I, down columns likewise) as expert E + j,
    the scales' blocks lining up when s == 1 or I is a multiple of 128. The routed calls read the first E experts
    of the same stacks (their ids never reach the rest); ``prepare`` later lays out all E + s for the kernels. The
    fold returned holds no weights of its own (``w13`` None): it calls the experts' packed kernels. None where it
    does not apply (another format or layout, expert parallel, host experts, shapes, the router)."""
    from tokenfab.quant.fp8_block_experts import Fp8BlockExperts
    from tokenfab.quant.fp8_block_weight import BLOCK, Fp8BlockWeight
    q13, q2 = experts.q13, experts.q2
    E, two_i, hidden = q13.num_experts, q13.out_features, q13.in_features
    inter = two_i // 2
    parts = [getattr(m, "qweight", None) for m in (shared.gate_proj, shared.up_proj, shared.down_proj)]
    if (type(q13) is not Fp8BlockExperts or type(q2) is not Fp8BlockExperts or q13.part_rows != inter
            or q13.cpu_tiles or q2.cpu_tiles or q13.gpu_layout or q2.gpu_layout or experts.host is not None
            or experts.start != 0 or experts.end != experts.num_experts or E != experts.num_experts
            or not dispatch.gpu_path(q13.packed) or any(type(w) is not Fp8BlockWeight or w.cpu_tiles for w in parts)
            or any(getattr(m, "bias", None) is not None for m in (shared.gate_proj, shared.up_proj,
                                                                   shared.down_proj))):
        return None
    gw, uw, dw = parts
    if (not inter or gw.out_features % inter or gw.in_features != hidden or (uw.out_features, uw.in_features)
            != (gw.out_features, hidden) or (dw.out_features, dw.in_features) != (hidden, gw.out_features)
            or q2.out_features != hidden or q2.in_features != inter):
        return None
    s = gw.out_features // inter
    if s > 1 and inter % BLOCK:  # the chunks' scales would share blocks
        return None
    from tokenfab.kernels.gpu import router
    if not router.applies(gate.num_experts, gate.n_group, gate.top_k) or gate.num_experts != E:
        return None
    br, hb = q13.block_rows, -(-hidden // BLOCK)  # scale rows per part (gate|up), scale blocks along hidden
    ib = inter // BLOCK if s > 1 else -(-inter // BLOCK)  # scale blocks along one chunk's intermediate
    try:  # the layer's routed stacks are briefly held twice (one layer at a time)
        with torch.no_grad():
            new13, new2 = Fp8BlockExperts(0, two_i, hidden, inter), Fp8BlockExperts(0, hidden, inter)
            new13.packed = torch.cat([q13.packed, torch.cat([gw.weight.view(torch.uint8).view(s, inter, hidden),
                                                             uw.weight.view(torch.uint8).view(s, inter, hidden)],
                                                            dim=1)])
            new13.scale = torch.cat([q13.scale, torch.cat([gw.scale_inv[:s * br].view(s, br, hb),
                                                           uw.scale_inv[:s * br].view(s, br, hb)], dim=1)])
            new2.packed = torch.cat([q2.packed, dw.weight.view(torch.uint8).view(hidden, s, inter).transpose(0, 1)])
            new2.scale = torch.cat([q2.scale, dw.scale_inv[:, :s * ib].view(hb, s, ib).transpose(0, 1)])
    except torch.OutOfMemoryError:  # no room for the copy: keep the separate shared MLP
        return None
    for new in (new13, new2):
        new.num_experts = E + s
        new.packed, new.scale = new.packed.contiguous(), new.scale.contiguous()
    experts.q13, experts.q2 = new13, new2  # the old stacks are freed
    return FoldedSharedExperts(None, None, s)
