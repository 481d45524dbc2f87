"""Mixture-of-Experts: routers (DeepSeek-V3 sigmoid group-limited top-k, Qwen3-MoE softmax top-k) and the
routed experts run grouped by expert.

Routing formulas follow transformers' ``DeepseekV3TopkRouter`` and ``Qwen3MoeTopKRouter``.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from tokenfab.kernels import dispatch
from tokenfab.layers.activation import silu_and_mul
from tokenfab.layers.linear import can_pack, pack_weight, packed_linear


class SigmoidGroupRouter(nn.Module):
    """DeepSeek-V3 / Kimi-K2 router (noaux_tc).

    scores = sigmoid(x W^T) in float32; choice scores = scores + e_score_correction_bias (used only to choose);
    groups scored by the sum of their top-2 choice scores, the best ``topk_group`` of ``n_group`` groups kept (others
    masked with -inf), top-k experts chosen; weights are the *unbiased* scores of the chosen experts, renormalized
    when ``norm_topk_prob`` (+1e-20), times ``routed_scaling_factor``. The weight and bias stay float32.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                    requires_grad=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, routed_scaling_factor

    _tickets: torch.Tensor | None = None  # GPU path: the fused router launch's per-tile counters (kept zero)

    def forward(self, x: torch.Tensor, extra: int = 0, align=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k + extra] float32, expert ids [T, k + extra] int64); the ``extra`` slots
        after the k routed ones are experts num_experts + j with weight 1.0 (shared experts run as routed ones,
        layers/shared_expert_fold.py). ``align``: the experts' alignment buffers (RoutedExperts.alignment), filled
        by the GPU path's one launch when it runs."""
        if self._tickets is None or self._tickets.device != x.device:
            self._tickets = dispatch.gpu_tickets(x, "router")  # created on the first (prefill / warm-up) call
        out = dispatch.sigmoid_group_topk(x, self.weight, self.e_score_correction_bias, self.n_group,
                                          self.topk_group, self.top_k, self.norm_topk_prob, self.scaling, extra,
                                          self._tickets, align)
        if out is not None:  # CPU: the same selection in one pass per token after the router GEMM
            return out
        scores = torch.nn.functional.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            T = x.shape[0]
            grouped = choice.view(T, self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, -1)
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * self.scaling
        if extra:
            T = x.shape[0]
            shared = torch.arange(self.num_experts, self.num_experts + extra, device=x.device).expand(T, extra)
            return torch.cat([w, w.new_ones(T, extra)], 1), torch.cat([ids, shared], 1)
        return w, ids


class SoftmaxTopKRouter(nn.Module):
    """Qwen3-MoE router: softmax over experts (float32), top-k, optional renormalization; weights cast back to
    the activation dtype as transformers does."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    _tickets: torch.Tensor | None = None  # GPU path: the fused router launch's per-tile counters (kept zero)

    def forward(self, x: torch.Tensor, align=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k] int64). On the GPU path decode batches
        take one launch (GEMM and selection, dispatch.softmax_router; with ``align``, the experts' alignment
        buffers, the pairs aligned by expert in it too), larger ones the GEMM and one launch."""
        if self._tickets is None or self._tickets.device != x.device:
            self._tickets = dispatch.gpu_tickets(x, "router")  # created on the first (prefill / warm-up) call
        out = dispatch.softmax_router(x, self.weight, self.top_k, self.norm_topk_prob, self._tickets, align)
        if out is not None:
            return out
        logits = torch.nn.functional.linear(x, self.weight)
        out = dispatch.softmax_topk(logits, self.top_k, self.norm_topk_prob)
        if out is not None:  # GPU path: softmax, top-k, renormalization and cast in one kernel
            return out
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w.to(logits.dtype), ids


def route(gate: nn.Module, experts: "RoutedExperts", x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object]:
    """An MoE block's routing of x [T, hidden] by ``gate`` (a router module) for ``experts``: (weights [T, k], ids
    [T, k], aligned), where on the GPU path the router's launch also aligns the pairs by expert into ``aligned``
    (RoutedExperts.alignment; None elsewhere), to pass as ``aligned=`` to the experts."""
    aligned = experts.alignment(x, gate.top_k)
    w, ids = gate(x, align=aligned)
    return w, ids, aligned


_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
_DEFERRED = threading.local()


@contextlib.contextmanager
def deferred_expert_storage():
    """Inside this context, RoutedExperts are built with their w13 / w2 on the meta device (no memory): the loader
    then keeps them packed (:meth:`RoutedExperts.use_packed`) or allocates them (:meth:`RoutedExperts.materialize`)
    before any weight is read, so a packed checkpoint never reserves its experts' bf16 size."""
    prev = getattr(_DEFERRED, "on", False)
    _DEFERRED.on = True
    try:
        yield
    finally:
        _DEFERRED.on = prev


class RoutedExperts(nn.Module):
    """E routed SiLU-GLU experts with stacked weights: w13 [E, 2I, hidden] ([gate | up]) and w2 [E, hidden, I].

    Token-expert pairs are sorted by expert (one argsort) so that each expert's tokens are contiguous; then either
    one grouped GEMM per projection runs all experts (``torch._grouped_mm``, when this torch has it) or a loop runs
    each active expert once over its tokens (the fallback and the reference in tests). Results are weighted and
    summed back with index_add. ``expert_range`` [start, end) lets a rank own a subset (expert parallel): pairs
    routed elsewhere contribute zero here and are summed by the all-reduce.

    Packed experts (a compressed-tensors or FP8 block-scaled checkpoint, :meth:`use_packed`): ``q13`` / ``q2`` are
    :class:`~tokenfab.quant.packed_experts.PackedExperts` stacks with the same rows and ``w13`` / ``w2`` are None;
    :meth:`packed_forward` then runs each projection as one grouped linear over the sorted pairs.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, expert_range: tuple[int, int] | None = None):
        super().__init__()
        self.start, self.end = expert_range or (0, num_experts)
        n = self.end - self.start
        self.num_experts, self.intermediate = num_experts, intermediate
        dev = "meta" if getattr(_DEFERRED, "on", False) else None  # see deferred_expert_storage()
        self.w13 = nn.Parameter(torch.empty(n, 2 * intermediate, hidden, device=dev), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, hidden, intermediate, device=dev), requires_grad=False)
        self.use_grouped_mm = _HAS_GROUPED_MM
        self.fused_dispatch = True  # packed CPU experts: the dispatch in one kernel call (False: the Python loop)
        self._p13: list[torch.Tensor] | None = None  # per-expert packed weights (CPU bf16), see fuse()
        self._p2: list[torch.Tensor] | None = None
        # host-offloaded experts (layers/host_experts.py): None, or the split that computes this layer instead
        self.host = None
        self.q13 = self.q2 = None  # packed expert stacks (tokenfab/quant/packed_experts.py), see use_packed()
        self.route_counter = None  # engine/expert_popularity.py: counts routed pairs per expert when recording

    def use_packed(self, fmt: str) -> None:
        """Keep this layer's experts packed in format ``fmt`` (a key of
        :data:`tokenfab.quant.packed_experts.FORMATS`): ``q13`` [E, 2I, hidden] and ``q2`` [E, hidden, I] replace
        ``w13`` / ``w2`` (freed before any weight is loaded), filled by the loader from the checkpoint's per-expert
        tensors (``weight_packed`` / ``weight_scale``; FP8: ``weight`` + ``weight_scale_inv`` paired)."""
        from tokenfab.quant.packed_experts import expert_format
        cls = expert_format(fmt)
        n, I, H = self.end - self.start, self.intermediate, self.w13.shape[2]
        self.w13 = self.w2 = None
        self.q13, self.q2 = cls.for_parts(n, [I, I], H), cls.for_parts(n, [H], I)

    def materialize(self) -> None:
        """Allocate w13 / w2 (uninitialized, CPU, their dtype) when they were built on the meta device."""
        if self.w13 is not None and self.w13.is_meta:
            self.w13 = nn.Parameter(torch.empty(self.w13.shape, dtype=self.w13.dtype), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(self.w2.shape, dtype=self.w2.dtype), requires_grad=False)

    def fuse(self) -> None:
        """After loading, on CPU in bf16: pack each expert's weights (:func:`~tokenfab.layers.linear.pack_weight`)
        and run a loop over the active experts (measured 1.2-3x faster than torch._grouped_mm's CPU path at decode
        sizes with oneDNN packing, benchmarks/NOTES.md). Packed experts choose their kernel instead."""
        if self.q13 is not None:
            self.q13.prepare()
            self.q2.prepare()
            return
        if type(self).forward is not RoutedExperts.forward:  # a subclass with its own math reads w13/w2 itself
            return
        if self.w13 is not None and self.w13.shape[0] and can_pack(self.w13[0]):
            self._p13 = [pack_weight(w) for w in self.w13]
            self._p2 = [pack_weight(w) for w in self.w2]
            self.w13 = self.w2 = None

    accumulate_fp32 = False  # the weighted sum in x's dtype (subclasses may sum in float32)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The experts' gated activation on gate_up [N, 2I] ([gate | up]) -> [N, I]: SiLU-GLU (subclasses with
        another activation override it; layers/host_experts.py computes host experts with it)."""
        return silu_and_mul(gate_up)

    def kernel_act(self):
        """The activation as the GPU grouped GEMMs take it (kernels/gpu/moe.py ``fused_moe``'s ``act``): None,
        SiLU-GLU in the gate|up GEMM's epilogue (subclasses with another activation return theirs)."""
        return None

    def _grouped_ok(self, xs: torch.Tensor) -> bool:
        """torch._grouped_mm needs 16-byte-aligned row strides (e.g. float32 with intermediate 34 is refused)."""
        e = xs.element_size()
        return all((d * e) % 16 == 0 for d in (xs.shape[1], self.intermediate))

    def _pairs_by_expert(self, ids: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor, int]:
        """(k, order, counts, lo) for ids [T, k]: the flat (token, slot) pairs sorted by expert id (stable), the pair
        count of each of this rank's experts, and where this rank's first pair stands in ``order``."""
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts)[self.start:self.end]
        lo = int((flat_ids < self.start).sum()) if self.start else 0
        return ids.shape[1], order, counts, lo

    def alignment(self, x: torch.Tensor, k: int):
        """On the GPU path with device experts: unfilled buffers for the router's launch to align this call's pairs
        (x's T tokens, ``k`` slots each, over this rank's stack rows) by expert, for ``aligned=`` of
        :meth:`forward` (dispatch.moe_alignment); None elsewhere (the experts align their pairs themselves)."""
        if self.host is not None or not dispatch.gpu_path(x):
            return None
        stack = self.w13 if self.q13 is None else self.q13.packed  # the rows the kernels' alignment counts
        return None if stack is None else dispatch.moe_alignment(x, k, self.start, stack.shape[0])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                plus: torch.Tensor | None = None, aligned=None) -> torch.Tensor:
        """x [T, hidden]; weights, ids [T, k] -> [T, hidden] = sum over this rank's experts of weight * expert(x),
        plus ``plus`` [T, hidden] when given (the shared experts' output: on the GPU path added inside the Triton
        k-sum, one launch fewer; elsewhere after the sum, as ``out + plus``). ``aligned``: :meth:`alignment`'s
        buffers as the router filled them (the GPU kernels then skip their alignment launch)."""
        if plus is not None:
            if self.host is None and dispatch.gpu_path(x):  # the Triton k-sum adds it (float32, one rounding)
                if self.route_counter is not None:
                    self.route_counter.record(ids)
                out = (self.packed_forward(x, weights, ids, plus, aligned) if self.q13 is not None else
                       dispatch.routed_experts(x, weights, ids, self.start, self.kernel_act(), self.w13, self.w2,
                                               plus=plus, aligned=aligned))
                if out is not None:
                    return out
                return self.forward_unfused(x, weights, ids) + plus
            return self.forward(x, weights, ids) + plus
        if self.route_counter is not None:
            self.route_counter.record(ids)
        if self.host is not None:  # part of the experts in host memory: the split runs both sides, same sum order
            return self.host.forward(self, x, weights, ids)
        if self.q13 is not None:
            return self.packed_forward(x, weights, ids, aligned=aligned)
        out = dispatch.routed_experts(x, weights, ids, self.start, self.kernel_act(), self.w13, self.w2,
                                      self._p13 if self.fused_dispatch else None, self._p2, aligned=aligned)
        if out is not None:  # CPU: the same math in C++; CUDA/ROCm: grouped GEMMs in Triton, graph-safe
            return out
        return self.forward_unfused(x, weights, ids)

    def forward_unfused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` where no kernel applies: pairs sorted by expert, per-expert (or grouped) GEMMs in
        PyTorch, the weighted rows summed with index_add. x [T, hidden]; weights, ids [T, k] -> [T, hidden]."""
        k, order, counts, lo = self._pairs_by_expert(ids)
        hi = lo + int(counts.sum())
        out = torch.zeros_like(x)
        if hi == lo:
            return out
        order = order[lo:hi]
        token_of = order // k  # token index of each sorted (token, slot) pair
        w_sorted = weights.reshape(-1)[order]
        xs = x[token_of]
        if self._p13 is not None:
            h = torch.empty(hi - lo, x.shape[1], dtype=x.dtype, device=x.device)
            b = 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    gate_up = packed_linear(xs[b:b + n], self._p13[e], None, 2 * self.intermediate)
                    h[b:b + n] = packed_linear(silu_and_mul(gate_up), self._p2[e], None, x.shape[1])
                    b += n
        elif self.use_grouped_mm and self._grouped_ok(xs):
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            h = torch._grouped_mm(silu_and_mul(torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offs)),
                                  self.w2.transpose(1, 2), offs=offs)
        else:
            h = torch.empty(hi - lo, x.shape[1], dtype=x.dtype, device=x.device)
            b = 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    h[b:b + n] = silu_and_mul(xs[b:b + n] @ self.w13[e].t()) @ self.w2[e].t()
                    b += n
        out.index_add_(0, token_of, (h * w_sorted[:, None]).to(out.dtype))
        return out

    def packed_kernel(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      out_dtype: torch.dtype | None, plus: torch.Tensor | None = None,
                      norm: tuple | None = None, aligned=None) -> torch.Tensor | None:
        """The packed stacks' routed sum by the GPU kernels (``dispatch.routed_experts_packed``: ``out_dtype``,
        ``plus``, ``norm``, ``aligned`` as there), or None where they do not run (CPU; stacks in the CPU tile
        layout, which their own C++ kernel takes)."""
        if self.q13.cpu_tiles or self.q2.cpu_tiles:
            return None
        return dispatch.routed_experts_packed(
            x, weights, ids, self.q13.format_name, self.q13.packed, self.q13.scale, self.q2.packed, self.q2.scale,
            self.kernel_act(), self.start, out_dtype, plus, (self.q13.gpu_layout, self.q2.gpu_layout), norm,
            aligned)

    def packed_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       plus: torch.Tensor | None = None, aligned=None) -> torch.Tensor:
        """The routed sum over packed experts (``q13`` / ``q2``): pairs sorted by expert (stable), one grouped
        linear per projection over all active experts, :meth:`act` in between, each row times its float32 routing
        weight rounded to the output dtype and summed with index_add (float32 output when ``accumulate_fp32``,
        else x's dtype). x [T, hidden]; weights, ids [T, k] -> [T, hidden]. On CUDA/ROCm the whole sum is one
        Triton launch per projection with the weights decoded in registers (kernels/gpu/packed_moe.py), ``plus``
        [T, hidden] added in its k-sum (elsewhere after the sum); stacks in the CPU tile layout
        (PackedExperts.cpu_tiles) always take their grouped linears."""
        out = self.packed_kernel(x, weights, ids, torch.float32 if self.accumulate_fp32 else None, plus,
                                 aligned=aligned)
        if out is not None:
            return out
        if plus is not None:
            return self.packed_forward(x, weights, ids) + plus
        k, order, counts, lo = self._pairs_by_expert(ids)
        out = torch.zeros_like(x, dtype=torch.float32 if self.accumulate_fp32 else x.dtype)
        active = [(e, n) for e, n in enumerate(counts.tolist()) if n]
        if not active:
            return out
        experts, cnts = [e for e, _ in active], [n for _, n in active]
        order = order[lo:lo + sum(cnts)]
        token_of = order // k
        w_sorted = weights.reshape(-1)[order]
        h = self.q2.grouped_linear(self.act(self.q13.grouped_linear(x[token_of], experts, cnts)), experts, cnts)
        out.index_add_(0, token_of, (h.to(w_sorted.dtype) * w_sorted[:, None]).to(out.dtype))
        return out
