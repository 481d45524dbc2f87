"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2) over a paged latent cache.

The cache stores, per token and layer, only the normalized compressed latent c_kv (kv_lora_rank) and the rotated
shared rope key (qk_rope_head_dim): one row of kv_lora_rank + qk_rope_head_dim values.

* Decode (one query per sequence) runs in absorbed form: the key up-projection W_UK is folded into the query
  (q_lat = q_nope W_UK) and the value up-projection W_UV applied after attention, so attention reads the latent
  cache directly (DeepSeek-V2 paper, arXiv:2405.04434, section 2.1.3).
* Prefill runs in expanded form (the context latents go through kv_b_proj to per-head keys and values), except
  short chunks over long contexts, which attend in absorbed form too when that needs fewer FLOPs (measured:
  benchmarks/mla_prefill_forms.py).

Reference: transformers ``DeepseekV3Attention`` (q_lora_rank may be null -> plain q_proj; q_a_layernorm and
kv_a_layernorm use eps 1e-6 whatever rms_norm_eps says).
"""
from __future__ import annotations

import torch
from torch import nn

from tokenfab.config import ModelConfig
from tokenfab.kernels import dispatch
from tokenfab.kernels.cpu.ops import decode_blocks as cpu_decode_blocks
from tokenfab.kernels.cpu.ops import head_gemm as cpu_head_gemm
from tokenfab.layers.attention_metadata import AttentionGroup, AttentionMetadata
from tokenfab.layers.linear import Linear
from tokenfab.layers.norm import RMSNorm
from tokenfab.layers import long_context_attention
from tokenfab.layers.paged_attention import (attention, fused_decode, gather_cache, gather_cache_range, run_groups,
                                             write_cache)
from tokenfab.layers.rotary import RotaryEmbedding


class MLAttention(nn.Module):
    """MLA layer. Input x [T, hidden] -> [T, hidden]; cache [num_blocks, block_size, kv_lora_rank + rope_dim]."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, head_range: tuple[int, int] | None = None):
        super().__init__()
        self.h0, self.h1 = head_range or (0, cfg.num_attention_heads)
        H = self.h1 - self.h0
        self.num_heads = H
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.qk_dim = self.nope + self.rope_dim
        self.q_lora_rank = cfg.q_lora_rank
        bias = cfg.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, H * self.qk_dim)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=1e-6)
            self.q_b_proj = Linear(self.q_lora_rank, H * self.qk_dim)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.kv_lora + self.rope_dim, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, eps=1e-6)
        self.kv_b_proj = Linear(self.kv_lora, H * (self.nope + self.v_dim))
        self.o_proj = Linear(H * self.v_dim, cfg.hidden_size, bias)
        self.rotary = rotary
        self.scale = cfg.softmax_scale()
        self.prefill_form = "auto"  # or "expanded" / "absorbed" (see _absorb_prefill)
        self.decode_block = True  # decode-only CPU batches: the whole block in one kernel call (_decode_block_weights)
        self._block_weights: list[torch.Tensor] | None = None
        self._chain_tickets: torch.Tensor | None = None  # GPU path: the chained decode launch's (first call)

    def fuse(self) -> None:
        """After loading: W_UK [H, nope, C] and W_UV^T [H, C, v] from kv_b_proj.weight [H*(nope+v), C] for the
        absorbed decode; packed for :func:`~tokenfab.kernels.cpu.ops.head_gemm.head_gemm_` when it applies (CPU bf16
        with AVX512-BF16, 2.5-8x faster than ``torch.bmm`` at decode shapes, benchmarks/NOTES.md), else contiguous
        copies for two plain batched GEMMs over heads."""
        self._fuse_a_projections()
        for lin in (getattr(self, "q_b_proj", None), self.o_proj):  # packed before the decode block reads them
            if lin is not None:
                lin.fuse()
        self._absorb()
        self._block_weights = self._decode_block_weights()

    def _absorb(self) -> None:
        """W_UK [H, nope, C] and W_UV^T [H, C, v] from kv_b_proj.weight (see :meth:`fuse`), nothing else fused."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora)
        w_uk, w_uv_t = w[:, : self.nope, :], w[:, self.nope:, :].transpose(1, 2)
        self._head_gemm = cpu_head_gemm.head_gemm_applies(w, w_uk) and cpu_head_gemm.head_gemm_applies(w, w_uv_t)
        if self._head_gemm:
            self._w_uk, self._w_uv_t = cpu_head_gemm.pack_head_weights(w_uk), cpu_head_gemm.pack_head_weights(w_uv_t)
        else:
            self._w_uk, self._w_uv_t = w_uk.contiguous(), w_uv_t.contiguous()

    def _decode_block_weights(self) -> list[torch.Tensor] | None:
        """The weights of :func:`~tokenfab.kernels.cpu.ops.decode_blocks.mla_decode` (the absorbed decode as one C++
        call, bit-identical to :meth:`forward`'s Python path), or None where it does not apply: it needs the fused
        q_a|kv_a projection, every linear in tokenfab's VNNI blocks (CPU bf16 with AVX512-BF16), no biases, the
        per-head GEMM kernel and float32 RoPE tables (not a NoPE MLA such as Kimi Linear's)."""
        fused = getattr(self, "qkv_a_proj", None)
        lins = (fused, getattr(self, "q_b_proj", None), self.o_proj)
        if (fused is None or not self._head_gemm
                or any(l is None or l.vnni_packed is None or l.bias is not None for l in lins)
                or getattr(self.rotary, "cos", None) is None or self.rotary.cos.dtype != torch.float32):
            return None
        return [fused.vnni_packed, self.q_a_layernorm.weight, self.kv_a_layernorm.weight, self.q_b_proj.vnni_packed,
                self._w_uk, self._w_uv_t, self.o_proj.vnni_packed]

    def decode_block_args(self) -> tuple[list[torch.Tensor], list[int], float, float] | None:
        """(weights, dims, eps_q, eps_kv) of :func:`~tokenfab.kernels.cpu.ops.decode_blocks.mla_decode` for this layer
        (with the rotary tables and ``scale``, all it needs besides the step's tensors), or None where the block does not
        apply (:meth:`_decode_block_weights`)."""
        if self._block_weights is None:
            return None
        dims = [self.q_lora_rank, self.kv_lora, self.rope_dim, self.num_heads, self.nope, self.v_dim,
                self.o_proj.out_features]
        return self._block_weights, dims, self.q_a_layernorm.eps, self.kv_a_layernorm.eps

    def _fuse_a_projections(self) -> None:
        """q_a_proj [q_lora, hidden] and kv_a_proj_with_mqa [kv_lora + rope, hidden] read the same x: one GEMM over
        their concatenated rows (``qkv_a_proj``, as vLLM's fused_qkv_a_proj) instead of two, with the rows of
        :meth:`_a_extra` (a subclass's own projection of x) appended when it gives one. Each output column is the
        same dot product as before."""
        if self.q_lora_rank is None or getattr(self, "qkv_a_proj", None) is not None:
            return
        parts, extra = [self.q_a_proj, self.kv_a_proj_with_mqa], self._a_extra()
        fused = None if extra is None else Linear.concat([*parts, extra])
        if fused is None:
            fused, extra = Linear.concat(parts), None
        if fused is not None:
            self.qkv_a_proj = fused
            self._a_split = [self.q_lora_rank, self.kv_lora, self.rope_dim] + ([] if extra is None
                                                                               else [extra.out_features])

    def _a_extra(self) -> Linear | None:
        """A projection of x to join the fused a-projection's GEMM (its output slice goes to :meth:`_take_a_extra`);
        None here."""
        return None

    def _take_a_extra(self, out: torch.Tensor) -> None:
        """Receives the :meth:`_a_extra` columns [T, out] (a strided view) of each fused a-projection."""

    def _fused_a(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_a, c_kv, k_rope) from the fused a-projection's one GEMM (views of its output); the extra columns, when
        joined, handed to :meth:`_take_a_extra`."""
        parts = self.qkv_a_proj(x).split(self._a_split, dim=-1)
        if len(parts) > 3:
            self._take_a_extra(parts[3])
        return parts[0], parts[1], parts[2]

    def _absorb_prefill(self, group: AttentionGroup) -> bool:
        """Prefill in absorbed form? ``prefill_form`` "expanded", "absorbed" or "auto" (default): absorbed when it
        needs fewer FLOPs in the parts where the forms differ, for chunks of Q = q_len queries over L = max_context
        gathered rows with S = L - (Q - 1) / 2 keys seen per query (per head):

            absorbed  2QC(nope + v) + 2QS(2C + rope)      expanded  2LC(nope + v) + 2QS(nope + rope + v)

        i.e. short chunks over long contexts. benchmarks/mla_prefill_forms.py measured both on this CPU: the
        measured time ratio falls on the same side of 1 as the FLOP ratio at every shape (e.g. Q 16 of L 2048:
        0.26 predicted, 0.42 measured; Q 1024 of 1024: 3.8 and 2.2). On GPUs (not measured) "auto" keeps the
        expanded form."""
        if self.prefill_form != "auto":
            return self.prefill_form == "absorbed"
        if group.block_tables.device.type != "cpu":  # measured on CPU only; GPU prefill stays expanded (as vLLM)
            return False
        Q, L, C = group.q_len, group.max_context, self.kv_lora
        seen = L - (Q - 1) / 2
        absorbed = Q * C * (self.nope + self.v_dim) + Q * seen * (2 * C + self.rope_dim)
        expanded = L * C * (self.nope + self.v_dim) + Q * seen * (self.qk_dim + self.v_dim)
        return absorbed < expanded

    def _absorbed_prefill(self, qg: torch.Tensor, ctx: torch.Tensor, group: AttentionGroup, w_uk: torch.Tensor,
                          w_uv_t: torch.Tensor) -> torch.Tensor:
        """Prefill attention over the latent rows themselves, as decode does (cost: :meth:`_absorb_prefill`):
        queries through W_UK, keys [c_kv | k_rope] and values c_kv shared by all heads (one latent "head"), then
        W_UV. qg [B, H, Q, nope + rope]; ctx [B, L, C + R] -> [B, H, Q, v]."""
        B, H, Q, _ = qg.shape
        rows = qg.transpose(1, 2).reshape(B * Q, H, self.qk_dim)  # [B*Q, H, D]
        q_lat = self._latent_queries(rows[..., : self.nope], rows[..., self.nope:], w_uk)
        lat = ctx.unsqueeze(1)  # [B, 1, L, C + R]
        o_lat = attention(q_lat.view(B, Q, H, -1).transpose(1, 2), lat, lat[..., : self.kv_lora], group, self.scale)
        o = self._value_heads(o_lat.transpose(1, 2).reshape(B * Q, H, self.kv_lora), w_uv_t)
        return o.view(B, Q, H, self.v_dim).transpose(1, 2)

    def _long_prefill(self, qg: torch.Tensor, cache: torch.Tensor, group: AttentionGroup, w_uk: torch.Tensor,
                      w_uv_t: torch.Tensor) -> torch.Tensor:
        """Prefill attention over a long context (:mod:`tokenfab.layers.long_context_attention`): the latent rows
        are read, and in expanded form expanded through kv_b_proj, one key block at a time, so no per-head copy of
        the context exists. The form follows :meth:`_absorb_prefill`. Expanded: keys [k_nope | k_rope] and values
        zero-padded to one width (the flash kernel wants equal widths). qg [B, H, Q, nope + rope] -> [B, H, Q, v]."""
        B, H, Q, _ = qg.shape
        C = self.kv_lora
        if self._absorb_prefill(group):
            rows = qg.transpose(1, 2).reshape(B * Q, H, self.qk_dim)
            q_lat = self._latent_queries(rows[..., : self.nope], rows[..., self.nope:], w_uk)  # [B*Q, H, C + R]

            def latent_block(k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
                lat = gather_cache_range(cache, group, k0, k1).to(qg.dtype).unsqueeze(1)  # [B, 1, n, C + R]
                return lat, lat  # values: the first C columns of the latent row (cut after attention)

            o_lat = long_context_attention.blocked_prefill_attention(
                q_lat.view(B, Q, H, -1).transpose(1, 2), group, latent_block, self.scale, C)  # [B, H, Q, C]
            o = self._value_heads(o_lat.transpose(1, 2).reshape(B * Q, H, C), w_uv_t)
            return o.view(B, Q, H, self.v_dim).transpose(1, 2)
        width = max(self.qk_dim, self.v_dim)
        if width > self.qk_dim:
            qg = torch.nn.functional.pad(qg, (0, width - self.qk_dim))

        def expanded_block(k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
            ctx = gather_cache_range(cache, group, k0, k1).to(qg.dtype)  # [B, n, C + R]
            n = ctx.shape[1]
            kv = self.kv_b_proj(ctx[..., :C]).view(B, n, H, self.nope + self.v_dim)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            k = torch.cat([k_nope, ctx[..., C:].unsqueeze(2).expand(B, n, H, self.rope_dim)], dim=-1)
            k = torch.nn.functional.pad(k, (0, width - self.qk_dim)) if width > self.qk_dim else k
            v = torch.nn.functional.pad(v, (0, width - self.v_dim)) if width > self.v_dim else v
            return k.transpose(1, 2), v.transpose(1, 2)

        return long_context_attention.blocked_prefill_attention(qg, group, expanded_block, self.scale, self.v_dim)

    def _latent_queries(self, q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor,
                        head_major: bool = False) -> torch.Tensor:
        """[q_nope W_UK | q_rope] per head in one buffer: q_nope [N, H, nope], q_rope [N, H, R] -> [N, H, C + R]
        (the per-head GEMM kernel when it applies, else one ``torch.bmm`` over heads). ``head_major`` (GPU decode):
        the buffer is [H, N, C + R] with the bmm writing its first C columns in place (one launch, no copy) and the
        result its [N, H, C + R] transposed view (last dim contiguous, as the decode kernel reads it)."""
        C = self.kv_lora
        if head_major and not self._head_gemm:
            q_hm = q_nope.new_empty(self.num_heads, q_nope.shape[0], C + self.rope_dim)
            torch.bmm(q_nope.transpose(0, 1), w_uk, out=q_hm[:, :, :C])
            q_hm[:, :, C:] = q_rope.transpose(0, 1)
            return q_hm.transpose(0, 1)
        q_lat = q_nope.new_empty(q_nope.shape[0], self.num_heads, C + self.rope_dim)
        if self._head_gemm:
            cpu_head_gemm.head_gemm_(q_nope, w_uk, q_lat[..., :C])
        else:
            q_lat[..., :C] = dispatch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        q_lat[..., C:] = q_rope
        return q_lat

    def _value_heads(self, o_lat: torch.Tensor, w_uv_t: torch.Tensor) -> torch.Tensor:
        """o_lat W_UV per head: [N, H, C] -> [N, H, v]."""
        if self._head_gemm:
            return cpu_head_gemm.head_gemm_(o_lat, w_uv_t, o_lat.new_empty(o_lat.shape[0], self.num_heads, self.v_dim))
        return dispatch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)

    def latent_decode(self, q_lat: torch.Tensor, cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        """Absorbed decode attention of one query row per sequence over the latent pool: q_lat [B, H, C + R] (q's
        dtype), cache [num_blocks, block_size, C + R] -> o_lat [B, H, C]. The paged decode kernel where it applies
        (:func:`tokenfab.layers.paged_attention.fused_decode`; the latent rows are one KV "head", values their
        first C columns), else the group's context gathered and :func:`~tokenfab.layers.paged_attention.attention`
        (values = the whole latent row, read in place: a sliced view would be copied; cut after)."""
        lat = cache.unsqueeze(2)  # [num_blocks, block_size, 1, C + R]
        o_lat = fused_decode(q_lat, lat, lat[..., : self.kv_lora], group, self.scale)
        if o_lat is None:
            ctx = gather_cache(cache, group).to(q_lat.dtype).unsqueeze(1)  # [B, 1, L, C + R]
            o_lat = attention(q_lat.unsqueeze(2), ctx, ctx, group, self.scale)[:, :, 0, : self.kv_lora]
        return o_lat

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(self, "_w_uk", None) is None:
            self.fuse()
        return self._w_uk, self._w_uv_t

    def _gpu_decode(self, positions: torch.Tensor, x: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor | None:
        """A decode-only batch on the GPU code path: the a-projection GEMM(s); with a query LoRA and a plain or FP8
        q_b weight (:meth:`_chain_weight`) one launch for q_a_layernorm, the q_b GEMM, the absorbed queries
        [q_nope W_UK | RoPE(q_rope)] written head-major and the latent row write
        (:mod:`tokenfab.kernels.gpu.mla_query_chain`), else (:mod:`tokenfab.kernels.gpu.mla_decode_glue`) the norms
        with the latent write, the q_b GEMM (or q_proj's) and the absorbed queries as three; then decode attention
        over the latent pool, W_UV into a token-major buffer and the o GEMM: the same math and roundings as
        :meth:`forward`'s general path.
        x [T, hidden] -> [T, hidden], or None where it does not apply (a prefill group, rows not the flat batch in
        order, CPU tensors, a rotary other than a float32 table or NoPE, dtypes the kernels do not take)."""
        dec, T = meta.decode, x.shape[0]
        rot = self.rotary
        cos = getattr(rot, "cos", None)
        nope_layer = getattr(rot, "is_identity", False)
        if (meta.prefill is not None or dec is None or dec.q_len != 1 or dec.flat_range != (0, T)
                or not (nope_layer or (cos is not None and cos.dtype == torch.float32))
                or not dispatch.mla_decode_glue_applies(x, cache)):
            return None
        w_uk, w_uv_t = self._absorbed_weights()
        if self._head_gemm or w_uk.dtype != x.dtype:
            return None
        fused_a = getattr(self, "qkv_a_proj", None)
        q_full = None
        if fused_a is not None:
            q_a, c_kv, k_rope = self._fused_a(x)
        else:
            if self.q_lora_rank is None:
                q_a, q_full = None, self.q_proj(x)
            else:
                q_a = self.q_a_proj(x)
            c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        if c_kv.dtype != x.dtype or (q_a is not None and q_a.dtype != x.dtype):
            return None  # the CUDA-graph capture never sees this: dtypes are fixed per engine
        q_norm = None if q_a is None else self.q_a_layernorm
        tables = (None, None) if nope_layer else (cos, rot.sin)
        from tokenfab.kernels.gpu import mla_decode_glue as glue
        qb = self._chain_weight(q_a, x)
        if qb is not None:  # the norms, the q_b GEMM, the absorbed queries and the latent write in one launch
            from tokenfab.kernels.gpu import mla_query_chain as chain
            q_lat = chain.mla_queries_cache(q_a, c_kv, k_rope, q_norm.weight, self.kv_a_layernorm.weight,
                                            q_norm.eps, self.kv_a_layernorm.eps, qb[0], w_uk, positions, *tables,
                                            getattr(rot, "interleave", False), meta.slot_mapping, cache,
                                            tickets=self._chain_tickets, qb_scale=qb[1])
            return self._attend_decode(q_lat, cache, dec, w_uv_t, T)
        q_n = glue.mla_norms_cache(q_a, c_kv, k_rope, None if q_norm is None else q_norm.weight,
                                   self.kv_a_layernorm.weight, 0.0 if q_norm is None else q_norm.eps,
                                   self.kv_a_layernorm.eps, positions, *tables, getattr(rot, "interleave", False),
                                   meta.slot_mapping, cache)
        q = (q_full if q_n is None else self.q_b_proj(q_n)).view(T, self.num_heads, self.qk_dim)
        q_lat = glue.mla_latent_query(q, w_uk, positions, *tables, getattr(rot, "interleave", False))
        return self._attend_decode(q_lat, cache, dec, w_uv_t, T)

    def _chain_weight(self, q_a: torch.Tensor | None, x: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, FP8 block scales or None) of q_b_proj when :meth:`_gpu_decode` may chain the q_b GEMM into one
        launch with the norms, absorbed queries and latent write (kernels/gpu/mla_query_chain.py): a query LoRA whose
        q_b weight is plain (unpacked, of x's dtype) or FP8 block-scaled as DeepSeek-V3 ships it (its e4m3 codes
        decoded in the launch; the activations stay exact, as kernels/gpu/fp8_linear.py's Triton kernel keeps
        them), bias-free, up to CHAIN_MAX_TOKENS tokens; else None (other compressed forms keep their GEMM)."""
        from tokenfab.kernels.gpu.mla_query_chain import CHAIN_MAX_TOKENS
        from tokenfab.quant.fp8_block_weight import Fp8BlockWeight
        lin = getattr(self, "q_b_proj", None)
        if (q_a is None or lin is None or lin._packed is not None or lin.bias is not None
                or x.shape[0] > CHAIN_MAX_TOKENS):
            return None
        q = lin.qweight
        if q is not None:
            if type(q) is not Fp8BlockWeight or q.cpu_tiles or q.weight.device != x.device:
                return None
            return q.weight, q.scale_inv
        w = lin.weight
        return (w, None) if w is not None and w.dtype == x.dtype and w.stride(-1) == 1 else None

    def _attend_decode(self, q_lat: torch.Tensor, cache: torch.Tensor, dec: AttentionGroup, w_uv_t: torch.Tensor,
                       T: int) -> torch.Tensor:
        """:meth:`_gpu_decode` from the latent queries [T, H, C + R] on: attention over the latent pool, the value
        heads and the o GEMM -> [T, hidden]."""
        o_lat = self.latent_decode(q_lat, cache, dec)  # [T, H, C]
        o = self._decode_values(o_lat, w_uv_t)
        return self.o_proj(o.view(T, self.num_heads * self.v_dim))

    def _decode_values(self, o_lat: torch.Tensor, w_uv_t: torch.Tensor) -> torch.Tensor:
        """:meth:`_gpu_decode`'s value heads: o_lat [T, H, C] -> o_lat W_UV [T, H, v] token-major (o_proj reads
        its [T, H * v] view), one batched GEMM writing that layout (a subclass may fuse its output gate here)."""
        o = o_lat.new_empty(o_lat.shape[0], self.num_heads, self.v_dim)
        torch.bmm(o_lat.transpose(0, 1), w_uv_t, out=o.transpose(0, 1))
        return o

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        if self.num_heads == 0:  # tensor parallel with more ranks than heads: contributes nothing to the sum
            return x.new_zeros(T, self.o_proj.out_features)
        if self._block_weights is not None and self.decode_block and meta.cpu_decode_block(x, cache):
            dec = meta.decode
            w, dims, eps_q, eps_kv = self.decode_block_args()
            return cpu_decode_blocks.mla_decode(x, positions, meta.slot_mapping, cache, dec.block_tables,
                                                dec.context_lens, w, dims, self.rotary.cos, self.rotary.sin,
                                                self.rotary.interleave, eps_q, eps_kv, self.scale)
        if self._chain_tickets is None:  # on the first (prefill / warm-up) call, before any graph capture
            self._chain_tickets = dispatch.gpu_tickets(x, "mla_chain", self.num_heads)
        out = self._gpu_decode(positions, x, cache, meta)
        if out is not None:
            return out
        fused_a = getattr(self, "qkv_a_proj", None)
        if fused_a is not None:  # after fuse(): [q_a | c_kv | k_rope] from one GEMM
            q_a, c_kv, k_rope = self._fused_a(x)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        q = q.view(T, self.num_heads, self.qk_dim)
        rot = self.rotary
        qr = None
        if getattr(rot, "cos", None) is not None:  # GPU path: kv norm, RoPE of q and k, latent write in one kernel
            qr = dispatch.mla_rope_cache(q, c_kv, k_rope, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps,
                                         positions, rot.cos, rot.sin, rot.interleave, meta.slot_mapping, cache)
        if qr is not None:
            q = qr
        else:
            q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
            c_kv = self.kv_a_layernorm(c_kv)
            q_rope, k_rope = self.rotary(positions, q_rope, k_rope.unsqueeze(1))
            write_cache(cache, meta.slot_mapping, torch.cat([c_kv, k_rope.squeeze(1)], dim=-1))
            q = torch.cat([q_nope, q_rope], dim=-1)
        w_uk, w_uv_t = self._absorbed_weights()

        def attend(group: AttentionGroup, qg: torch.Tensor) -> torch.Tensor:
            if group.q_len == 1:  # absorbed decode over the latent cache
                q_lat = self._latent_queries(qg[:, :, 0, : self.nope], qg[:, :, 0, self.nope:], w_uk,
                                             head_major=dispatch.gpu_path(qg))  # [B, H, C + R]
                o_lat = self.latent_decode(q_lat, cache, group)  # [B, H, C]
                return self._value_heads(o_lat, w_uv_t).unsqueeze(2)  # [B, H, 1, v]
            if long_context_attention.applies(group):  # key block by key block, memory bounded at any length
                return self._long_prefill(qg, cache, group, w_uk, w_uv_t)
            ctx = gather_cache(cache, group).to(qg.dtype)  # [B, L, C + R]
            if self._absorb_prefill(group):
                return self._absorbed_prefill(qg, ctx, group, w_uk, w_uv_t)
            B, L = ctx.shape[0], ctx.shape[1]
            kv = self.kv_b_proj(ctx[..., : self.kv_lora]).view(B, L, self.num_heads, self.nope + self.v_dim)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            k_r = ctx[..., self.kv_lora:].unsqueeze(2).expand(B, L, self.num_heads, self.rope_dim)
            k = torch.cat([k_nope, k_r], dim=-1).transpose(1, 2)
            return attention(qg, k, v.transpose(1, 2), group, self.scale)

        out = run_groups(meta, q, self.v_dim, attend)
        return self.o_proj(out.reshape(T, self.num_heads * self.v_dim))
