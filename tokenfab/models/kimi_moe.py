"""The MoE side of Kimi Linear and Kimi K3 (models/kimi_linear.py builds their layers from these): K3's SiTU-GLU
activation, the dense SiTU MLP, routed experts with SiTU-GLU and the float32 latent sum, and the sigmoid-routed MoE
block with shared experts, optionally latent (K3).

* SiTU-GLU: act(gate, up) = beta * tanh(gate / beta) * sigmoid(gate) * (lb * tanh(up / lb) if lb else up), in
  float32 (beta = ``activation_situ_beta``, lb = ``activation_situ_linear_beta``), Moonshot's ``SituAndMul`` as
  transcribed in public ports (sglang / vLLM ``kimi_k3``).
* latent MoE: router on x (sigmoid + noaux_tc bias for choice, top-k, renormalise, routed_scaling_factor); routed
  experts on z = routed_expert_down_proj(x); y = routed_expert_up_proj(RMSNorm(sum_k w_k E_k(z))) (norm when
  ``latent_moe_use_norm``); plus shared_experts(x).

Tensor parallel: whole experts per rank, shared experts split by intermediate; the latent MoE all-reduces its
routed latent sum before the latent norm.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenfab.kernels import dispatch
from tokenfab.layers.linear import Linear
from tokenfab.layers.mlp import GatedMLP
from tokenfab.layers.moe import RoutedExperts, SigmoidGroupRouter, route
from tokenfab.layers.norm import RMSNorm
from tokenfab.layers.shared_expert_fold import fold_shared_experts
from tokenfab.parallel.distributed import current_tp


def situ_glu(gate_up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU on [..., 2I] laid out [gate | up] -> [..., I], computed in float32, cast back.

    beta * tanh(gate / beta) * sigmoid(gate) * (linear_beta * tanh(up / linear_beta) if linear_beta else up).
    Source: Moonshot's ``SituAndMul`` (Kimi K3 modeling), as transcribed in sglang / vLLM / ATOM ports. On a GPU one
    Triton launch (``dispatch.situ_and_mul``) instead of about ten.
    """
    out = dispatch.situ_and_mul(gate_up, beta, linear_beta)
    if out is not None:
        return out
    dtype = gate_up.dtype
    gate, up = gate_up.float().chunk(2, dim=-1)
    a = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return (a * up).to(dtype)


class SituMLP(nn.Module):
    """down(situ_glu([gate(x) | up(x)])); checkpoint names gate_proj / up_proj / down_proj. x [T, H] -> [T, H]."""

    def __init__(self, hidden: int, intermediate: int, beta: float, linear_beta: float | None):
        super().__init__()
        self.gate_proj, self.up_proj = Linear(hidden, intermediate), Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.beta, self.linear_beta = beta, linear_beta
        self.gate_up: Linear | None = None

    def fuse(self) -> None:
        """After loading: one [2I, hidden] gate|up projection (one GEMM instead of two and the concatenation), as
        GatedMLP."""
        if self.gate_up is None:
            self.gate_up = Linear.concat([self.gate_proj, self.up_proj])
        self.down_proj.fuse()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; with ``residual`` (a [T, H] tensor the caller owns): ``residual`` + the MLP, the add
        in the down projection's GEMM where it can (Linear.forward_add_)."""
        if self.gate_up is not None:
            gu = self.gate_up(x)
        else:
            gu = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        return self.from_gate_up(gu, residual)

    def from_gate_up(self, gu: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP after its gate|up projection: gu [T, 2I] ([gate | up], unit stride along the last dim; rows may
        be strided, e.g. a slice of a wider GEMM's output) -> [T, H], ``residual`` as in :meth:`forward`."""
        h = situ_glu(gu, self.beta, self.linear_beta)
        return self.down_proj(h) if residual is None else self.down_proj.forward_add_(h, residual)


class SituRoutedExperts(RoutedExperts):
    """Routed experts with SiTU-GLU instead of SiLU-GLU (same stacked weights w13 / w2 and grouping).

    ``accumulate_fp32``: the weighted sum over the chosen experts is taken in float32 and returned in float32
    (K3's latent MoE: Moonshot sums the routed experts' latent outputs in float32 before the latent norm); otherwise
    each weighted expert output is rounded to x's dtype before it is added.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, beta: float, linear_beta: float | None,
                 expert_range: tuple[int, int] | None = None, accumulate_fp32: bool = False):
        super().__init__(num_experts, hidden, intermediate, expert_range)
        self.beta, self.linear_beta = beta, linear_beta
        self.accumulate_fp32 = accumulate_fp32

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiTU-GLU on gate_up [N, 2I] -> [N, I] (the host-expert split computes these experts with it)."""
        return situ_glu(gate_up, self.beta, self.linear_beta)

    def kernel_act(self):
        """SiTU-GLU for the GPU grouped GEMMs: computed in the gate|up GEMM's epilogue (kernels/gpu/moe.py)."""
        return ("situ", self.beta, self.linear_beta)

    _sum_tickets: torch.Tensor | None = None  # GPU path: the k-sum-with-norm launch's per-token counters (zero)

    def forward_normed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, norm: RMSNorm,
                       out_dtype: torch.dtype, aligned=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``norm`` of the float32 expert sum (K3's latent norm), rounded once to ``out_dtype``: x [T, hidden];
        weights, ids [T, k] -> [T, hidden]. On the GPU path (device experts, decode batches up to the k-sum's
        token limit) the norm is made in the k-sum's launch (kernels/gpu/moe.py ``moe_sum``); elsewhere
        :meth:`forward` then the norm (one launch on a GPU, ``dispatch.rms_norm``). ``aligned``: as
        RoutedExperts.forward; ``out``: a [T, hidden] view of ``out_dtype`` (unit column stride) the k-sum's launch
        writes the result into when it runs (the result is then ``out``; elsewhere a new tensor)."""
        if self._sum_tickets is None or self._sum_tickets.device != x.device:
            self._sum_tickets = dispatch.gpu_tickets(x, "moe_sum")  # created on the first (prefill / warm-up) call
        t = self._sum_tickets
        if self.host is None and t is not None and x.shape[0] <= t.numel() and self.accumulate_fp32:
            spec = (norm.weight, norm.eps, t) if out is None else (norm.weight, norm.eps, t, out)
            if self.q13 is not None:
                out = self.packed_kernel(x, weights, ids, out_dtype, norm=spec, aligned=aligned)
            else:
                out = dispatch.routed_experts(x, weights, ids, self.start, self.kernel_act(), self.w13, self.w2,
                                              out_dtype=out_dtype, norm=spec, aligned=aligned)
            if out is not None:
                if self.route_counter is not None:
                    self.route_counter.record(ids)
                return out
        y = self(x, weights, ids, aligned=aligned)
        fused = dispatch.rms_norm(y, norm.weight, norm.eps, out_dtype=out_dtype)
        return fused if fused is not None else norm(y).to(out_dtype)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, aligned=None) -> torch.Tensor:
        """x [T, hidden]; weights, ids [T, k] -> [T, hidden] = sum_k weights * expert_ids(x) (float32 when
        ``accumulate_fp32``, else x's dtype); ``aligned`` as RoutedExperts.forward."""
        if self.route_counter is not None:
            self.route_counter.record(ids)
        if self.host is not None:  # host-offloaded experts (layers/host_experts.py): same pairs, same sum order
            return self.host.forward(self, x, weights, ids)
        if self.q13 is not None:  # packed experts (MXFP4): the same pairs and sums, grouped linears
            return self.packed_forward(x, weights, ids, aligned=aligned)
        out = dispatch.routed_experts(x, weights, ids, self.start, self.kernel_act(), self.w13, self.w2,
                                      out_dtype=torch.float32 if self.accumulate_fp32 else None, aligned=aligned)
        if out is not None:  # CUDA/ROCm: the grouped GEMMs with SiTU-GLU in the first one's epilogue
            return out
        T, k = ids.shape
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // k
        w_sorted = weights.reshape(-1)[order]
        out = torch.zeros_like(x, dtype=torch.float32 if self.accumulate_fp32 else x.dtype)
        begin = sum(counts[: self.start])
        for e in range(self.start, self.end):
            n = counts[e]
            if n == 0:
                continue
            idx = token_of[begin:begin + n]
            h = situ_glu(x[idx] @ self.w13[e - self.start].t(), self.beta, self.linear_beta)
            h = h @ self.w2[e - self.start].t()
            out.index_add_(0, idx, (h.to(w_sorted.dtype) * w_sorted[begin:begin + n, None]).to(out.dtype))
            begin += n
        return out


def make_mlp(cfg, intermediate: int) -> nn.Module:
    """Dense gated MLP with the config's activation (SiLU or SiTU)."""
    if cfg.hidden_act == "situ":
        return SituMLP(cfg.hidden_size, intermediate, cfg.situ_beta, cfg.situ_linear_beta)
    return GatedMLP(cfg.hidden_size, intermediate)


class KimiMoE(nn.Module):
    """Sigmoid-routed MoE with shared experts; optionally latent (K3's stable latent MoE). x [T, H] -> [T, H].

    Router: transformers ``KimiLinearTopkRouter`` (= DeepSeek-V3 noaux_tc): float32 sigmoid scores, bias for choice
    only, top-k, renormalised (+1e-20) when moe_renormalize, times routed_scaling_factor.
    """

    def __init__(self, cfg):
        super().__init__()
        self.gate = SigmoidGroupRouter(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group,
                                       cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        self.latent = cfg.routed_expert_hidden_size
        inner = self.latent or cfg.hidden_size
        self.tp = tp = current_tp()  # tensor parallel: whole experts per rank, shared experts split (as DeepSeek-V3)
        rng = None if tp is None else tp.r("experts")
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts if tp is None else tp.size("shared_intermediate")
        if self.latent:
            self.routed_expert_down_proj = Linear(cfg.hidden_size, self.latent)
            self.routed_expert_up_proj = Linear(self.latent, cfg.hidden_size)
            self.routed_expert_norm = RMSNorm(self.latent, eps=cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
        if cfg.hidden_act == "situ":
            self.experts = SituRoutedExperts(cfg.num_experts, inner, cfg.moe_intermediate_size, cfg.situ_beta,
                                             cfg.situ_linear_beta, rng, accumulate_fp32=bool(self.latent))
        else:
            self.experts = RoutedExperts(cfg.num_experts, inner, cfg.moe_intermediate_size, rng)
        self.shared_experts = make_mlp(cfg, shared) if cfg.n_shared_experts else None
        self.folded = None  # GPU path, SiLU experts without the latent MoE: shared experts stacked behind routed
        self.x_proj: Linear | None = None  # GPU path, latent MoE: [latent down | shared gate | up] rows, one GEMM
        self.out_proj: Linear | None = None  # GPU path, latent MoE: [latent up | shared down] columns, one GEMM

    def fuse(self) -> None:
        """After loading, on the GPU code path. SiLU experts, no latent MoE: the shared experts become always-chosen
        routed experts (layers/shared_expert_fold.py), three launches and the add fewer per step. Latent MoE with
        SiTU shared experts (one process, device experts): the latent down-projection and the shared experts'
        gate and up projections, which all read x, become one GEMM (``x_proj``; each output column the same dot
        product), one launch fewer; with the latent norm, the latent up-projection and the shared experts' down
        projection, whose outputs are summed, become one GEMM over their joined inputs (``out_proj``: [normed
        latent | shared SiTU-GLU] written side by side), one launch fewer. Runs before the shared experts' own fuse
        (modules in pre-order)."""
        if self.folded is None and not self.latent:
            self.folded = fold_shared_experts(self.experts, self.shared_experts, self.gate)
        sh = self.shared_experts
        if (self.latent and self.x_proj is None and self.tp is None and isinstance(sh, SituMLP)
                and sh.gate_up is None and self.experts.host is None and dispatch.gpu_path(self.gate.weight)):
            self.x_proj = Linear.concat([self.routed_expert_down_proj, sh.gate_proj, sh.up_proj])
            if (self.x_proj is not None and self.routed_expert_norm is not None
                    and isinstance(self.experts, SituRoutedExperts) and self.experts.accumulate_fp32):
                self.out_proj = Linear.concat_inputs([self.routed_expert_up_proj, sh.down_proj])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> the MoE's output [T, H]; with ``residual`` (a [T, H] tensor the caller owns, no tensor
        parallel): ``residual`` + that output, on the GPU code path the adds made in the latent up-projection's
        and the shared experts' down GEMMs (Linear.forward_add_), elsewhere after the block, in the reference's
        order (residual + (routed + shared))."""
        if self.folded is not None:
            out = self.folded(x, self.gate, self.experts)
            if out is not None:
                return out if residual is None else residual + out
        w, ids, aligned = route(self.gate, self.experts, x)
        if self.out_proj is not None:
            return self._joined_forward(x, w, ids, aligned, residual)
        gu = None
        if self.x_proj is not None:  # the latent input and the shared experts' gate|up from one GEMM (views)
            z, gu = self.x_proj(x).split([self.latent, self.x_proj.out_features - self.latent], dim=-1)
        else:
            z = self.routed_expert_down_proj(x) if self.latent else x
        normed = (self.latent and self.tp is None and self.routed_expert_norm is not None
                  and isinstance(self.experts, SituRoutedExperts))
        if normed:  # the latent norm of the float32 routed sum (in the k-sum's launch on a GPU), in x's dtype
            y = self.experts.forward_normed(z, w, ids, self.routed_expert_norm, x.dtype, aligned)
        else:
            y = self.experts(z, w, ids, aligned=aligned)
        if self.latent:
            if self.tp is not None:
                # tensor parallel: the latent norm needs the full routed sum, so it is all-reduced here; the
                # (replicated) norm and up-projection then run on rank 0 only and the other ranks add zeros.
                y = self.tp.all_reduce(y)
                if self.tp.rank != 0:
                    y = x.new_zeros(x.shape)
            if self.tp is None or self.tp.rank == 0:
                if self.routed_expert_norm is not None and not normed:  # on the float32 latent sum, then x's dtype
                    n = self.routed_expert_norm
                    fused = dispatch.rms_norm(y, n.weight, n.eps, out_dtype=x.dtype)
                    y = fused if fused is not None else n(y)
                if residual is not None and self.tp is None and dispatch.gpu_path(x):  # residual + up(y) in its GEMM
                    y, residual = self.routed_expert_up_proj.forward_add_(y.to(x.dtype), residual), None
                else:
                    y = self.routed_expert_up_proj(y.to(x.dtype))
        if self.shared_experts is not None:  # y is this forward's own tensor: added to in the shared down GEMM
            y = self.shared_experts(x, residual=y) if gu is None else self.shared_experts.from_gate_up(gu, residual=y)
        return y if residual is None else residual + y

    def _joined_forward(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, aligned,
                        residual: torch.Tensor | None) -> torch.Tensor:
        """:meth:`forward` with ``x_proj`` and ``out_proj`` (GPU path, one process): x_proj's GEMM gives the latent
        input and the shared gate|up; the normed latent sum (in the k-sum's launch) and the shared SiTU-GLU are
        written side by side into one [T, latent + I_shared] buffer, which out_proj's GEMM multiplies by [W_up |
        W_shared_down] (adding into ``residual`` when given, cuBLAS's beta = 1): routed and shared outputs summed
        in the GEMM's float32 accumulator and rounded once (the reference rounds each, then adds)."""
        sh = self.shared_experts
        z, gu = self.x_proj(x).split([self.latent, self.x_proj.out_features - self.latent], dim=-1)
        joined = x.new_empty(x.shape[0], self.out_proj.in_features)
        y, h = joined[:, :self.latent], joined[:, self.latent:]
        got = self.experts.forward_normed(z, w, ids, self.routed_expert_norm, x.dtype, aligned, out=y)
        if got.data_ptr() != y.data_ptr():
            y.copy_(got)
        if dispatch.situ_and_mul(gu, sh.beta, sh.linear_beta, out=h) is None:
            h.copy_(situ_glu(gu, sh.beta, sh.linear_beta))
        return self.out_proj(joined) if residual is None else self.out_proj.forward_add_(joined, residual)
