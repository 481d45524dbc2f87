"""Kimi Linear (``KimiLinearForCausalLM``) and Kimi K3 (``KimiK3ForConditionalGeneration``): hybrid stacks of
Kimi Delta Attention (tokenfab/layers/kda.py, per-request recurrent state) and NoPE MLA (paged latent cache), with
sigmoid-routed MoE.

Kimi Linear reference: transformers 5 ``modeling_kimi_linear.py`` (NoPE MLA: the qk_rope_head_dim slice of q and
the shared key is cached and attended but never rotated; softmax scale qk_head_dim^-0.5; MoE = DeepSeek-V3 router
with shared experts).

Kimi K3 additions (no transformers implementation; formulas from the issue and Moonshot's published modeling code
as transcribed in public ports, e.g. sglang/vLLM ``kimi_k3`` models: ``SituAndMul``, ``_apply_attn_res``,
``KimiSparseMoeBlock``):

* gated MLA (``mla_use_output_gate``): o_proj(attn * sigmoid(g_proj x));
* SiTU-GLU: act(gate, up) = beta * tanh(gate / beta) * sigmoid(gate) * (lb * tanh(up / lb) if lb else up), in
  float32 (beta = ``activation_situ_beta``, lb = ``activation_situ_linear_beta``); used by the dense MLP, the shared
  experts and the routed experts (the KDA short conv keeps SiLU);
* latent MoE: router on x (sigmoid + noaux_tc bias for choice, top-k, renormalise, routed_scaling_factor); routed
  experts on z = routed_expert_down_proj(x); y = routed_expert_up_proj(RMSNorm(sum_k w_k E_k(z))) (norm when
  ``latent_moe_use_norm``); plus shared_experts(x);
* block attention residuals (``attn_res_block_size`` = S), arXiv:2603.15031 "Attention Residuals", block variant, as
  in Moonshot's ``_apply_attn_res``: sources V = [completed block sums..., current partial sum];
  mix(V) = sum_n softmax_n(<RMSNorm_noweight(V_n) * norm.weight, proj.weight>) V_n (float32). Layer i:
  h = mix over (blocks, prefix) with the self_attention_res pair (h = prefix when no block exists yet);
  if i % S == 0 the prefix closes as a block and a new prefix starts; prefix += attn(input_layernorm(h));
  h = mix with the mlp_res pair; prefix += mlp(post_attention_layernorm(h)). The embedding is the first block
  (layer 0 closes it). After the last layer: norm(mix with output_attn_res pair).
* MXFP4 routed experts (tokenfab/layers/mxfp4.py) kept packed (tokenfab/quant/mxfp4_experts.py); dequantised at
  load time to the engine dtype only when host experts are requested (the host/device split moves bf16 stacks).

Checkpoint names: published (``block_sparse_moe``, ``experts.{e}.w1/w2/w3``, ``q/k/v_conv1d``) and transformers 5
runtime names (``mlp``, fused ``experts.gate_up_proj``/``down_proj``, ``conv1d``, ``forget_gate.*``) both load.

Tensor parallel (docs/parallel.md): KDA layers own ``plan.kda_heads[rank]`` (per-head tensors read as slices, A_log and
the fused runtime conv read whole and sliced here, state slots hold this rank's heads), MLA layers ``plan.heads[rank]``
(K3: g_proj by head), MoE whole experts + split shared experts; every attention / MLP returns a partial sum that the
decoder layer all-reduces once (the K3 latent MoE also all-reduces its routed latent sum before the latent norm).
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from tokenfab.errors import WeightLoadError
from tokenfab.kernels import dispatch
from tokenfab.layers.attention_metadata import AttentionMetadata
from tokenfab.layers.kda import KimiDeltaAttention
from tokenfab.layers.linear import Linear
from tokenfab.layers.mla import MLAttention
from tokenfab.layers.mlp import GatedMLP
from tokenfab.layers.moe import RoutedExperts, SigmoidGroupRouter, route
from tokenfab.layers.mxfp4 import dequantize_mxfp4
from tokenfab.layers.norm import RMSNorm
from tokenfab.layers.shared_expert_fold import fold_shared_experts
from tokenfab.models.base import CausalLM, layer_index
from tokenfab.models.llama import DecoderLayer
from tokenfab.parallel.distributed import current_tp

_W123 = re.compile(r"^(.*\.mlp\.experts\.\d+)\.(w1|w2|w3)\.(weight|weight_packed|weight_scale|weight_shape)$")
_W_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MX = re.compile(r"^(.*)\.(weight_packed|weight_scale|weight_shape)$")
_ROUTED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$")


class NoRotary(nn.Module):
    """Identity "rotary embedding" for NoPE MLA: returns q and k unchanged."""

    is_identity = True  # layers/mla.py's GPU decode path then stores and reads the rope slice unrotated

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return q, k


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
            self._sum_tickets = dispatch.moe_sum_tickets(x)  # created on the first (prefill / warm-up) call
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


class _GatedOutProj(Linear):
    """o_proj of gated MLA: multiplies its input by sigmoid of the gate logits the attention set just before (then
    clears them): ``x * torch.sigmoid(g)``, one launch on a GPU (``dispatch.sigmoid_mul``)."""

    gate: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, self.gate = self.gate, None
        if g is not None:
            fused = dispatch.sigmoid_mul(x, g)
            x = fused if fused is not None else x * torch.sigmoid(g)
        return super().forward(x)


class GatedMLAttention(MLAttention):
    """K3 gated NoPE MLA: o_proj(attention(x) * sigmoid(g_proj x)); g_proj [H * v_head_dim, hidden]. On the GPU
    code path g_proj's rows join the fused a-projection's GEMM (one launch fewer per layer)."""

    def __init__(self, cfg, rotary, head_range=None):
        super().__init__(cfg, rotary, head_range)
        self.g_proj = Linear(cfg.hidden_size, self.num_heads * self.v_dim)
        self.o_proj = _GatedOutProj(self.num_heads * self.v_dim, cfg.hidden_size, cfg.attention_bias)

    def _a_extra(self) -> Linear | None:
        """g_proj on the GPU code path (the layer's norms tell where it runs); elsewhere it keeps its own GEMM."""
        return self.g_proj if dispatch.gpu_path(self.kv_a_layernorm.weight) else None

    def _take_a_extra(self, out: torch.Tensor) -> None:
        self.o_proj.gate = out  # the logits: o_proj applies the sigmoid with the product

    def _decode_values(self, o_lat: torch.Tensor, w_uv_t: torch.Tensor) -> torch.Tensor:
        """GPU decode: the value heads with the output gate in one launch (dispatch.mla_value_gate; o_proj's gate
        then taken), else the plain value heads, o_proj applying the gate."""
        g = self.o_proj.gate
        fused = None if g is None else dispatch.mla_value_gate(o_lat, w_uv_t, g)
        if fused is None:
            return super()._decode_values(o_lat, w_uv_t)
        self.o_proj.gate = None
        return fused

    def forward(self, positions, x, cache, meta):
        if len(getattr(self, "_a_split", ())) < 4:  # g_proj not joined to the a-projection: its own GEMM
            self.o_proj.gate = self.g_proj(x)
        return super().forward(positions, x, cache, meta)


def attn_res_mix(prefix: torch.Tensor, blocks: list[torch.Tensor], proj: Linear, norm: RMSNorm,
                 delta: torch.Tensor | None = None, out_norm: RMSNorm | None = None):
    """Block attention-residual mix (Moonshot ``_apply_attn_res``).

    Args:
        prefix: [T, H] the current partial block sum; blocks: completed block sums, each [T, H].
        proj: Linear(H, 1) (the pseudo-query, weight [1, H]); norm: RMSNorm(H) (eps and weight used).
        delta: optional [T, H]: the partial sum is then ``prefix + delta`` (the layer's residual add, in prefix's
            dtype), added in the same launch on a GPU.
        out_norm: optional RMSNorm(H) applied to the mix (the layer's next norm), in the same launch on a GPU.

    Returns:
        [T, H] in prefix's dtype: sum_n p_n V_n, p = softmax_n(sum_d (V_n / rms(V_n))[d] * norm.w[d] * proj.w[d]),
        V = [blocks..., prefix], everything in float32 (then ``out_norm`` of it when given). On a GPU one Triton
        launch (``dispatch.attn_res_mix``; the folded weight cached on ``proj``). With ``delta``: (that,
        ``prefix + delta``).
    """
    if not hasattr(proj, "mix_cache"):
        proj.mix_cache = {}
    out = dispatch.attn_res_mix(prefix, blocks, norm.weight, proj.weight, norm.eps, proj.mix_cache, delta,
                                None if out_norm is None else (out_norm.weight, out_norm.eps))
    if out is not None:
        return out
    if delta is not None:
        prefix = prefix + delta
    v = torch.stack([*blocks, prefix], dim=1).float()  # [T, N, H]
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps)
    w = norm.weight.float() * proj.weight.reshape(-1).float()
    p = (k * w).sum(-1).softmax(-1)  # [T, N]
    y = torch.matmul(p.unsqueeze(1), v).squeeze(1).to(prefix.dtype)
    if out_norm is not None:
        y = out_norm(y)
    return y if delta is None else (y, prefix)


class AttnResDecoderLayer(nn.Module):
    """K3 decoder layer with block attention residuals; forward carries (prefix, blocks) instead of h."""

    def __init__(self, cfg, layer_idx: int, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx, self.block_size = layer_idx, cfg.attn_res_block_size
        self.tp = current_tp()  # tensor parallel: attention / MLP partial sums are all-reduced here, once each
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(H, eps=eps)
        self.post_attention_layernorm = RMSNorm(H, eps=eps)
        self.self_attention_res_norm, self.self_attention_res_proj = RMSNorm(H, eps=eps), Linear(H, 1)
        self.mlp_res_norm, self.mlp_res_proj = RMSNorm(H, eps=eps), Linear(H, 1)

    def forward(self, positions, prefix: torch.Tensor, blocks: list[torch.Tensor], cache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # each mix comes out through the norm that follows it (one launch on a GPU)
        x = attn_res_mix(prefix, blocks, self.self_attention_res_proj, self.self_attention_res_norm,
                         out_norm=self.input_layernorm) if blocks else self.input_layernorm(prefix)
        cur: torch.Tensor | None = prefix
        if self.layer_idx % self.block_size == 0:
            blocks, cur = [*blocks, prefix], None
        a = self.self_attn(positions, x, cache, meta)
        if self.tp is not None:
            a = self.tp.all_reduce(a)
        if cur is None:
            cur = a
            x = attn_res_mix(cur, blocks, self.mlp_res_proj, self.mlp_res_norm, out_norm=self.post_attention_layernorm)
        else:  # cur + a in the mix's launch on a GPU
            x, cur = attn_res_mix(cur, blocks, self.mlp_res_proj, self.mlp_res_norm, delta=a,
                                  out_norm=self.post_attention_layernorm)
        if self.tp is None:  # cur is this layer's own tensor: the MLP adds into it in its last GEMM where it can
            return self.mlp(x, residual=cur), blocks
        return cur + self.tp.all_reduce(self.mlp(x)), blocks


class KimiLinearForCausalLM(CausalLM):
    """Hybrid KDA + NoPE MLA causal LM. Cache entries: MLA layers a tensor [num_blocks, block_size,
    kv_lora_rank + qk_rope_head_dim]; KDA layers a :class:`tokenfab.engine.state_cache.KDAStateCache`."""

    def __init__(self, cfg, max_positions: int):
        super().__init__(cfg)
        self.rotary = NoRotary()
        for i in range(cfg.num_hidden_layers):
            self.model.layers.append(self.make_layer(i))

    def make_attention(self, i: int) -> nn.Module:
        # tensor parallel (self.tp, captured at build): KDA layers own plan.kda_heads[rank], MLA layers
        # plan.heads[rank]; both return partial sums (row-parallel o_proj) that DecoderLayer all-reduces.
        tp = self.tp
        if self.cfg.layer_types[i] == "kda":
            return KimiDeltaAttention(self.cfg, None if tp is None else tp.r("kda_heads"))
        heads = None if tp is None else tp.r("heads")
        return GatedMLAttention(self.cfg, self.rotary, heads) if self.cfg.mla_use_output_gate else \
            MLAttention(self.cfg, self.rotary, heads)

    def make_mlp(self, i: int) -> nn.Module:
        if i in self.cfg.moe_layers:
            return KimiMoE(self.cfg)
        return make_mlp(self.cfg, self.cfg.intermediate_size if self.tp is None else self.tp.size("intermediate"))

    def make_layer(self, i: int) -> nn.Module:
        return DecoderLayer(self.cfg, self.make_attention(i), self.make_mlp(i))

    # ---- caches --------------------------------------------------------------------------------------------
    def make_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> list:
        """Paged latent cache for MLA layers; None placeholders for KDA layers (see :meth:`make_state_cache`)."""
        width = self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim
        return [torch.zeros(num_blocks, block_size, width, dtype=dtype, device=device) if t == "mla" else None
                for t in self.cfg.layer_types]

    def make_state_cache(self, kv_caches: list, num_slots: int, dtype: torch.dtype, device) -> None:
        """Put a KDA state cache of ``num_slots`` slots (max_num_seqs, plus the padding rows' spare slot when decode
        graphs are on: engine/cuda_graph_runner.py) in each KDA layer's entry."""
        for i, layer in enumerate(self.model.layers):
            if self.cfg.layer_types[i] == "kda":
                kv_caches[i] = layer.self_attn.make_state_cache(num_slots, dtype, device)

    # ---- loading -------------------------------------------------------------------------------------------
    def is_skipped_weight(self, name: str) -> bool:
        idx = layer_index(name)
        if idx is not None and idx >= self.cfg.num_hidden_layers:  # MTP layers
            return True
        if not (name.startswith("model.") or name.startswith("lm_head.")):  # e.g. K3 vision tower / projector
            return True
        return super().is_skipped_weight(name)

    def _map_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names/tensors -> this model's names/tensors (prefix, MoE and conv renames, A_log by head,
        MXFP4 dequantisation of routed experts)."""
        prefix = self.cfg.weight_prefix
        kda = {f"model.layers.{i}.self_attn": l.self_attn for i, l in enumerate(self.model.layers)
               if isinstance(l.self_attn, KimiDeltaAttention)}
        pending: dict[str, dict[str, torch.Tensor]] = {}
        dtype = self.model.norm.weight.dtype
        experts_of = {n: m for n, m in self.named_modules() if isinstance(m, RoutedExperts)}
        for name, t in weights:
            if prefix:
                if not name.startswith(prefix):
                    yield name, t  # not the text model: reported as skipped
                    continue
                name = name[len(prefix):]
            name = name.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")
            m = _W123.match(name)
            if m:
                name = f"{m.group(1)}.{_W_NAMES[m.group(2)]}.{m.group(3)}"
            if name.endswith(".self_attn.conv1d.weight"):  # transformers 5 runtime: q|k|v convs concatenated
                base = name[: -len("conv1d.weight")]
                mod = kda.get(base[:-1])
                for part, x in zip(("q", "k", "v"), t.chunk(3, dim=0)):
                    if mod is not None and mod.num_heads != mod.total_heads:  # tensor parallel: read whole, sliced
                        x = x[mod.h0 * mod.head_dim: mod.h1 * mod.head_dim]
                    yield f"{base}{part}_conv1d.weight", x
                continue
            if name.endswith(".self_attn.A_log") and name[: -len(".A_log")] in kda:
                mod = kda[name[: -len(".A_log")]]
                yield name, self._a_log_slice(mod, t, name)
                continue
            mx = _MX.match(name)
            if mx:
                base, part = mx.group(1), mx.group(2)
                if not _ROUTED.match(base):
                    raise WeightLoadError(f"{prefix}{name}: an MXFP4 tensor outside the routed experts; MXFP4 "
                                          "(mxfp4-pack-quantized) is supported for routed experts "
                                          "(mlp.experts.{e}.w1/w2/w3) only.")
                if not self.cfg.mxfp4_experts:
                    raise WeightLoadError(f"{prefix}{name}: MXFP4 tensor but config.json has no compressed-tensors "
                                          "quantization_config (format mxfp4-pack-quantized).")
                mod = experts_of.get(base.rsplit(".", 2)[0])
                if mod is not None and mod.q13 is not None:  # kept packed (tokenfab/quant/mxfp4_experts.py)
                    yield name, t
                    continue
                if part == "weight_shape":
                    continue
                d = pending.setdefault(base, {})
                d[part] = t
                if len(d) == 2:
                    del pending[base]
                    yield f"{base}.weight", dequantize_mxfp4(d["weight_packed"], d["weight_scale"], dtype,
                                                             name=prefix + base)
                continue
            yield name, t
        if pending:
            raise WeightLoadError("MXFP4 tensors without their pair (weight_packed + weight_scale): "
                                  + ", ".join(sorted(pending)[:10]))

    @staticmethod
    def _a_log_slice(mod: KimiDeltaAttention, t: torch.Tensor, name: str) -> torch.Tensor:
        """A_log (1-D, padded 1-D or legacy 4-D) -> this module's heads' entries [h1 - h0] (explicit per-head
        slice of the first num_heads real entries; the padding is never split across ranks)."""
        flat = t.reshape(-1)
        if flat.numel() < mod.total_heads:
            raise WeightLoadError(f"{name}: {flat.numel()} A_log entries for {mod.total_heads} KDA heads (a padded "
                                  "A_log must hold at least num_heads entries; only the first num_heads are real).")
        return flat[: mod.total_heads][mod.h0:mod.h1].float()

    dequantizes_experts_at_load = True  # _map_weights dequantizes MXFP4 experts that are not kept packed

    def expert_quantization(self):
        """The checkpoint's MXFP4 scheme (config.json's quantization_config, top level or under text_config) when
        config_kimi found MXFP4 routed experts, else None: those experts are then kept packed."""
        if not self.cfg.mxfp4_experts:
            return None
        from tokenfab.quant.compressed_tensors import parse_compressed_tensors
        raw = self.cfg.raw or {}
        return parse_compressed_tensors(raw.get("quantization_config")
                                        or (raw.get("text_config") or {}).get("quantization_config"))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        self.use_packed_experts()  # before _map_weights runs: it passes packed experts' tensors through
        return super().load_weights(self._map_weights(weights))


class KimiK3ForConditionalGeneration(KimiLinearForCausalLM):
    """Kimi K3 text model (weights under ``language_model.``; vision weights are skipped and reported).

    With ``attn_res_block_size`` the stack uses block attention residuals (:class:`AttnResDecoderLayer`) and a
    final mix (``model.output_attn_res_proj`` / ``model.output_attn_res_norm``) before ``model.norm``.
    """

    def __init__(self, cfg, max_positions: int):
        super().__init__(cfg, max_positions)
        if cfg.attn_res_block_size:
            self.model.output_attn_res_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            self.model.output_attn_res_proj = Linear(cfg.hidden_size, 1)

    def make_layer(self, i: int) -> nn.Module:
        if self.cfg.attn_res_block_size:
            return AttnResDecoderLayer(self.cfg, i, self.make_attention(i), self.make_mlp(i))
        return super().make_layer(i)

    def tap_hidden(self, layer_idx: int, out, stream: str = "partial_sum") -> torch.Tensor:
        """The hidden state [T, H] a drafter taps after decoder layer ``layer_idx``, from that layer's forward
        output ``out`` (with attention residuals: the pair (partial block sum, completed blocks)).

        stream: ``"partial_sum"``, the raw partial-block sum after the layer (a vLLM port's tap; the Inferact K3
        DSpark drafter's ``aux_hidden_stream: prefix``), or ``"attn_res_mixture"``, the attention-residual mix the
        next layer computes as its input (its self_attention_res pair over the completed blocks and that sum; after
        the last layer the output mix; SGLang's tap, ``aux_hidden_stream: attn_res``). Without attention residuals
        both are the layer output.
        """
        if not isinstance(out, tuple):
            return out
        prefix, blocks = out
        if stream == "partial_sum" or not blocks:
            return prefix
        if layer_idx + 1 < len(self.model.layers):
            nxt = self.model.layers[layer_idx + 1]
            return attn_res_mix(prefix, blocks, nxt.self_attention_res_proj, nxt.self_attention_res_norm)
        return attn_res_mix(prefix, blocks, self.model.output_attn_res_proj, self.model.output_attn_res_norm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata) -> torch.Tensor:
        if not self.cfg.attn_res_block_size:
            return super().forward(input_ids, positions, kv_caches, meta)
        prefix, blocks = self.model.embed_tokens(input_ids), []
        for layer, cache in zip(self.model.layers, kv_caches):
            prefix, blocks = layer(positions, prefix, blocks, cache, meta)
        return attn_res_mix(prefix, blocks, self.model.output_attn_res_proj, self.model.output_attn_res_norm,
                            out_norm=self.model.norm)  # the output mix through the final norm: one launch on a GPU
