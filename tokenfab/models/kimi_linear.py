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
* latent MoE (the MoE side, with SiTU-GLU, lives in models/kimi_moe.py): router on x (sigmoid + noaux_tc bias
  for choice, top-k, renormalise, routed_scaling_factor); routed experts on z = routed_expert_down_proj(x);
  y = routed_expert_up_proj(RMSNorm(sum_k w_k E_k(z))) (norm when ``latent_moe_use_norm``); plus shared_experts(x);
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
from tokenfab.layers.moe import RoutedExperts
from tokenfab.layers.mxfp4 import dequantize_mxfp4
from tokenfab.layers.norm import RMSNorm
from tokenfab.models.base import CausalLM, layer_index
from tokenfab.models.kimi_moe import KimiMoE, make_mlp
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
