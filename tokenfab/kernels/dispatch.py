"""The one seam between the layers and the kernels: per op family, the kernel that runs these tensors here.

A layer asks for an op ("rms_norm", "rope", "paged_decode_attention", ...) with its tensors; the function here picks
the CPU kernel (:mod:`tokenfab.kernels.cpu.ops`, C++), the GPU kernel (:mod:`tokenfab.kernels.gpu`, Triton) or none,
by device, dtype, layout and the settings (``TOKENFAB_CPU_KERNELS``, ``TOKENFAB_CPU_ISA``, ``TOKENFAB_TRITON``), and
returns the kernel's result, or None when no kernel applies: the layer then runs its PyTorch reference (the math
the kernels are tested against, kept in the layer). The GPU modules import ``triton``, so they are imported only
when a GPU kernel applies.

========================== ================================= ====================================================
op family                  CPU kernel (C++)                  GPU kernel (Triton)
========================== ================================= ====================================================
rms_norm                   rms_norm (+ residual add)         gpu/norm_activation.py (+ residual add)
silu_and_mul               silu_and_mul                      gpu/norm_activation.py
situ_and_mul               -                                 gpu/norm_activation.py (Kimi K3's SiTU-GLU)
sigmoid_mul                -                                 gpu/norm_activation.py (K3's gated MLA output)
attn_res_mix               -                                 gpu/attn_res.py (Kimi K3's attention-residual mix)
rope                       rope                              gpu/norm_activation.py
qk_rope_cache              - (the decode block fuses it)     gpu/rope_cache.py (q/k norm + RoPE + KV write)
mla_rope_cache             - (the decode block fuses it)     gpu/rope_cache.py (kv norm + RoPE + latent write)
mla_decode_glue            - (the decode block fuses it)     gpu/mla_decode_glue.py (norms + latent write;
                                                             absorbed queries), gpu/mla_query_chain.py (those
                                                             and the q_b GEMM in one launch)
paged_decode_attention     paged_decode_attention            gpu/decode_attention.py
causal_softmax_ (prefill)  causal_softmax_                   -
flash_prefill_attention    flash_prefill_attention (bf16)    -
sigmoid_group_topk         sigmoid_group_topk                gpu/router.py (any ungrouped shape; with the GEMM
                                                             for power-of-two expert counts)
softmax_topk               -                                 gpu/router.py (Qwen3-MoE's softmax top-k)
routed_experts             moe_experts_packed                gpu/moe.py (dense stacks)
routed_experts_packed      -                                 gpu/packed_moe.py (INT4 / MXFP4 / FP8 stacks)
sample_plain               sample_plain                      -
kda_short_conv             -                                 gpu/short_conv.py (conv + SiLU + state update)
kda_recurrent              -                                 gpu/kda.py (fused recurrent gated delta rule)
gated_rms_norm             -                                 gpu/norm_activation.py (KDA's output norm)
kda_chunk (prefill)        -                                 gpu/kda_chunk.py (fla-core's chunk_kda, optional)
========================== ================================= ====================================================

The CPU-only fused paths (the decode blocks and decode stack, the VNNI / GGUF / FP8 / packed-expert linears chosen
once per weight at load) call :mod:`tokenfab.kernels.cpu.ops` directly.
"""
from __future__ import annotations

import torch

from tokenfab.kernels.cpu import build as cpu_build
from tokenfab.kernels.cpu import isa as cpu_isa
from tokenfab.kernels.cpu.ops import attention as cpu_attention
from tokenfab.kernels.cpu.ops import fp8_linear as cpu_fp8
from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf
from tokenfab.kernels.cpu.ops import moe as cpu_moe
from tokenfab.kernels.cpu.ops import norms_activations as cpu_norms
from tokenfab.kernels.cpu.ops import rotary as cpu_rotary
from tokenfab.kernels.cpu.ops import sampling as cpu_sampling
from tokenfab.kernels.cpu.ops import support as cpu_support
from tokenfab.kernels.gpu import support as gpu_support

# Without AVX512-BF16 in the kernels, MLA decode (one latent pool as keys and values) takes the fused CPU kernel only
# up to this many context tokens summed over the batch: beyond it the gathered path's bf16 GEMMs beat the kernel's
# float32 FMAs (measured on the benchmark shapes, benchmarks/NOTES.md). With AVX512-BF16, and for grouped-query
# attention, the kernel is faster at every measured shape.
FUSED_LATENT_MAX_TOKENS = 1024

PACKED_MOE_FORMATS = ("int4_group", "mxfp4", "fp8_block")  # the stacks gpu/packed_moe.py reads


def _gpu(x: torch.Tensor) -> bool:
    """A CUDA / ROCm tensor the Triton kernels take (``TOKENFAB_TRITON``); CPU tensors keep the C++ kernels, except
    in tests under ``TOKENFAB_TRITON=interpret-gpu-path`` (:func:`tokenfab.kernels.gpu.support.gpu_path`)."""
    return gpu_support.gpu_path(x)


def gpu_path(x: torch.Tensor) -> bool:
    """True when the layers run ``x`` on the GPU code path (the fused Triton glue between GEMMs): a CUDA / ROCm
    tensor with Triton on, or a CPU tensor under ``TOKENFAB_TRITON=interpret-gpu-path`` (tests)."""
    return gpu_support.gpu_path(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """RMSNorm of x [..., hidden] (with ``residual``: (norm(x + residual), x + residual), x 2-D) by the CPU kernel
    or, on a GPU, the Triton kernel; or None (another dtype, a strided last dim, kernels not built or off).
    ``out_dtype`` (GPU only, no residual; weight of any float dtype): ``RMSNorm(x).to(out_dtype)`` in one pass, the
    normed row computed as layers/norm.py does for x's dtype and rounded once (K3's latent norm)."""
    if out_dtype is not None:
        if _gpu(x) and residual is None and x.shape[-1] == weight.shape[0] and x.stride(-1) == 1:
            from tokenfab.kernels.gpu import norm_activation
            return norm_activation.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps,
                                            out_dtype=out_dtype).view(x.shape)
        return None
    if _gpu(x) and x.dtype == weight.dtype and x.shape[-1] == weight.shape[0] and x.stride(-1) == 1:
        from tokenfab.kernels.gpu import norm_activation
        if residual is None:
            return norm_activation.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
        if x.dim() == 2 and residual.dtype == x.dtype and residual.stride(-1) == 1:
            return norm_activation.rms_norm(x, weight, eps, residual)
        return None
    if residual is not None:
        if (x.dim() == 2 and x.dtype == weight.dtype == residual.dtype and x.stride(-1) == 1
                and residual.stride(-1) == 1 and cpu_support.available_for(x)):
            return cpu_norms.rms_norm(x, weight, eps, residual=residual)
        return None
    if x.dtype == weight.dtype and x.shape[-1] == weight.shape[0] and cpu_support.available_for(x):
        return cpu_norms.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    return None


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [N, 2I] ([gate | up], contiguous last dim) by the CPU kernel or, on a GPU, the
    Triton kernel; or None."""
    if _gpu(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        from tokenfab.kernels.gpu import norm_activation
        return norm_activation.silu_and_mul(gate_up)
    if gate_up.dim() == 2 and gate_up.stride(-1) == 1 and cpu_support.available_for(gate_up):
        return cpu_norms.silu_and_mul(gate_up)
    return None


def attn_res_mix(prefix: torch.Tensor, blocks: list, norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                 eps: float, cache: dict, delta: torch.Tensor | None = None,
                 out_norm: tuple[torch.Tensor, float] | None = None):
    """Kimi K3's block attention-residual mix of [*blocks, prefix] (each [T, H]) by the Triton kernel on a GPU
    (:func:`tokenfab.kernels.gpu.attn_res.attn_res_mix`), or None (the PyTorch reference runs). ``cache``: a dict
    the caller keeps, holding the float32 norm.weight * proj.weight once computed (its first call runs before any
    CUDA-graph capture). With ``delta`` the prefix is ``prefix + delta`` and (mix, that sum) is returned; with
    ``out_norm`` (weight [H] of the prefix's dtype, eps) the mix comes out through that RMSNorm."""
    if not _gpu(prefix):
        return None
    from tokenfab.kernels.gpu import attn_res
    if not attn_res.applies(prefix, blocks, delta, None if out_norm is None else out_norm[0]):
        return None
    w = cache.get("w")
    if w is None or w.device != prefix.device:
        w = cache["w"] = attn_res.mix_weight(norm_weight, proj_weight)
    return attn_res.attn_res_mix(prefix, blocks, w, eps, delta, out_norm)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor | None:
    """x * sigmoid(gate) (each rounded as the eager ops round) for 2-D x, gate of one dtype and shape by the Triton
    kernel on a GPU, or None."""
    if (_gpu(x) and x.dim() == 2 and x.shape == gate.shape and x.dtype == gate.dtype and x.stride(-1) == 1
            and gate.stride(-1) == 1):
        from tokenfab.kernels.gpu import norm_activation
        return norm_activation.sigmoid_mul(x, gate)
    return None


def mla_value_gate(o_lat: torch.Tensor, w_uv_t: torch.Tensor, gate: torch.Tensor) -> torch.Tensor | None:
    """Gated MLA's value heads o_lat W_UV times sigmoid(gate) in one launch on the GPU path
    (:func:`tokenfab.kernels.gpu.mla_decode_glue.mla_value_gate`: o_lat [T, H, C], w_uv_t [H, C, v], gate
    [T, H * v] of one dtype -> new [T, H, v]), or None (then the batched GEMM and :func:`sigmoid_mul`)."""
    if not (_gpu(o_lat) and o_lat.dim() == 3 and w_uv_t.dim() == 3 and gate.dim() == 2
            and o_lat.dtype == w_uv_t.dtype == gate.dtype and o_lat.stride(-1) == 1 and w_uv_t.stride(-1) == 1
            and gate.stride(-1) == 1 and w_uv_t.shape[:2] == o_lat.shape[1:]
            and gate.shape == (o_lat.shape[0], o_lat.shape[1] * w_uv_t.shape[2])):
        return None
    from tokenfab.kernels.gpu import mla_decode_glue
    return mla_decode_glue.mla_value_gate(o_lat, w_uv_t, gate)


def situ_and_mul(gate_up: torch.Tensor, beta: float, linear_beta: float | None,
                 out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Kimi K3's SiTU-GLU for gate_up [N, 2I] ([gate | up], contiguous last dim) by the Triton kernel on a GPU
    (:func:`tokenfab.kernels.gpu.norm_activation.situ_and_mul`; into ``out`` [N, I] when given), or None (the
    PyTorch reference runs)."""
    if (_gpu(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1
            and (out is None or (out.stride(-1) == 1 and out.dtype == gate_up.dtype))):
        from tokenfab.kernels.gpu import norm_activation
        return norm_activation.situ_and_mul(gate_up, beta, linear_beta, out)
    return None


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         interleave: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rotary embedding of q [T, Hq, dim] and k [T, Hk, dim] at positions [T] from float32 tables cos / sin
    [P, dim / 2] by the CPU kernel or, on a GPU, the Triton kernel (one pass per tensor), or None."""
    if (_gpu(q) and q.dtype == k.dtype and cos.dtype == torch.float32 and q.stride(-1) == 1 and k.stride(-1) == 1
            and q.shape[-1] % 2 == 0):
        from tokenfab.kernels.gpu import norm_activation
        return (norm_activation.rope(q, positions, cos, sin, interleave),
                norm_activation.rope(k, positions, cos, sin, interleave))
    if (q.dtype == k.dtype and cos.dtype == torch.float32 and q.stride(-1) == 1 and k.stride(-1) == 1
            and cpu_support.available_for(q)):
        return (cpu_rotary.rope(q, positions, cos, sin, interleave),
                cpu_rotary.rope(k, positions, cos, sin, interleave))
    return None


def qk_rope_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, interleave: bool, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  eps: float = 0.0) -> torch.Tensor | None:
    """On the GPU path: per-head q / k RMSNorm (optional), RoPE of q [T, H, D] and k [T, Hk, D] and the write of k
    and v [T, Hk, D] to the paged caches [num_blocks, block_size, Hk, D] at ``slot_mapping`` [T] in one Triton launch
    (:func:`tokenfab.kernels.gpu.rope_cache.qk_rope_cache`); returns the rotated q [T, H, D] (new, contiguous), or
    None where it does not apply (CPU tensors, full-width float32 tables missing, mixed dtypes, odd D, a cache dtype
    other than q's): the caller then runs the norms, RoPE and ``write_cache`` itself."""
    D = q.shape[-1]
    if not (_gpu(q) and q.dim() == 3 and k.dtype == q.dtype == v.dtype == k_cache.dtype == v_cache.dtype
            and cos.dtype == torch.float32 and cos.shape[-1] * 2 == D and D % 2 == 0
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k_cache.stride(-1) == v_cache.stride(-1) == 1
            and (q_norm is None or (q_norm.dtype == q.dtype and k_norm.dtype == q.dtype))):
        return None
    from tokenfab.kernels.gpu import rope_cache
    return rope_cache.qk_rope_cache(q, k, v, positions, cos, sin, interleave, slot_mapping, k_cache, v_cache,
                                    q_norm, k_norm, eps)


def mla_rope_cache(q: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, kv_norm: torch.Tensor, eps: float,
                   positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                   slot_mapping: torch.Tensor, cache: torch.Tensor) -> torch.Tensor | None:
    """On the GPU path, MLA's kv_a_layernorm, RoPE of q [T, H, nope + R] and k_rope [T, R], and the latent row
    [norm(c_kv [T, C]) | k_rope] written to ``cache`` [num_blocks, block_size, C + R] at ``slot_mapping``, in one
    Triton launch (:func:`tokenfab.kernels.gpu.rope_cache.mla_rope_cache`): returns the new q [T, H, nope + R], or
    None where it does not apply (CPU tensors, mixed dtypes, a cache dtype other than q's, float tables missing,
    strided last dims): the layer then runs its own norm, RoPE, cat and ``write_cache``."""
    R = k_rope.shape[-1]
    if not (_gpu(q) and q.dim() == 3 and c_kv.dim() == 2 and k_rope.dim() == 2
            and q.dtype == c_kv.dtype == k_rope.dtype == cache.dtype == kv_norm.dtype
            and cos.dtype == torch.float32 and cos.shape[-1] * 2 == R and R % 2 == 0
            and q.stride(-1) == c_kv.stride(-1) == k_rope.stride(-1) == cache.stride(-1) == 1):
        return None
    from tokenfab.kernels.gpu import rope_cache
    return rope_cache.mla_rope_cache(q, c_kv, k_rope, kv_norm, eps, positions, cos, sin, interleave, slot_mapping,
                                     cache)


def mla_decode_glue_applies(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """True when an MLA layer's decode-only step runs :mod:`tokenfab.kernels.gpu.mla_decode_glue` (q_a norm with
    the latent write, then the absorbed queries, one launch each): the GPU code path, float activations ``x``
    [T, hidden] and a latent pool of x's dtype with a unit last stride."""
    return (_gpu(x) and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and cache.dtype == x.dtype
            and cache.dim() == 3 and cache.stride(-1) == 1)


def gpu_tickets(x: torch.Tensor, launch: str, heads: int = 1) -> torch.Tensor | None:
    """On the GPU path, the zeroed int32 counters a layer keeps for a launch whose programs order their work by
    atomic tickets (each launch leaves them zero; made on the layer's first, prefill or warm-up, call, before any
    graph capture), on x's device; None elsewhere. ``launch``: "router" (the fused GEMM + selection,
    kernels/gpu/router.py ``TICKETS``), "moe_sum" (the k-sum with the norm after it, kernels/gpu/moe.py: one a token
    up to SUM_NORM_MAX_TOKENS) or "mla_chain" (an MLA layer of ``heads`` heads, kernels/gpu/mla_query_chain.py).

    Raises:
        ValueError: another ``launch``.
    """
    if launch not in ("router", "moe_sum", "mla_chain"):
        raise ValueError(f"gpu_tickets: unknown launch {launch!r} (router, moe_sum or mla_chain)")
    if not _gpu(x):
        return None
    from tokenfab.kernels.gpu import mla_query_chain, moe, router
    n = {"router": router.TICKETS, "moe_sum": moe.SUM_NORM_MAX_TOKENS,
         "mla_chain": mla_query_chain.tickets_needed(heads)}[launch]
    return torch.zeros(n, dtype=torch.int32, device=x.device)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, max_context: int, scale: float) -> torch.Tensor | None:
    """Decode attention q [B, H, D] straight from the paged pool (k_cache / v_cache [blocks, block_size, Hk, D / Dv],
    strided views allowed; MLA passes one latent pool as both): the Triton kernel on CUDA/ROCm, the C++ kernel on
    CPU (also float32 q over a bf16 / fp16 pool), or None (other mixed dtypes, no kernel, MLA on float32 FMAs in
    bf16 or with more than FUSED_LATENT_MAX_TOKENS context tokens): the caller gathers the context instead.
    Returns [B, H, Dv] in q's dtype."""
    if k_cache.dtype != v_cache.dtype:
        return None
    if k_cache.dtype != q.dtype and not (q.device.type == "cpu" and q.dtype == torch.float32
                                         and k_cache.dtype in (torch.bfloat16, torch.float16)):
        return None  # the CPU kernel also reads a bf16 / fp16 pool for float32 q (EngineConfig.kv_cache_dtype)
    if gpu_support.applies(q):
        from tokenfab.kernels.gpu import decode_attention  # imports triton: only when it applies
        return decode_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                       max_context)
    if not cpu_support.available_for(q):
        return None
    if v_cache.data_ptr() == k_cache.data_ptr() and not (q.dtype == torch.bfloat16 and cpu_support.has_bf16_dot()):
        # MLA on the kernel's float32 FMAs: the gathered path's GEMMs are faster with many context tokens (measured
        # with AVX512), and for bf16 at any length (an AVX2-only EPYC, 2026-12-06: 2-8x at 16-128 heads and 64-8K
        # tokens, its GEMMs on float32 copies: cpu_bf16_gemm_slow; NOTES 77)
        if q.dtype == torch.bfloat16 or q.shape[0] * max_context > FUSED_LATENT_MAX_TOKENS:
            return None
    return cpu_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


def cpu_bf16_gemm_slow(x: torch.Tensor) -> bool:
    """True for bf16 CPU tensors at the ``avx2`` ISA level (kernels/cpu/isa.py: no AVX512-BF16 dot products, oneDNN
    capped at AVX2), where PyTorch's bf16 batched GEMMs take a slow path: measured on an AVX2-only AMD EPYC
    (2026-12-06, torch 2.13), ``bmm`` [128 x 8192] x [8192 x 512] 967 ms in bf16 against 8 ms in float32 on the
    widened operands. Callers widen to float32 there (:func:`tokenfab.layers.paged_attention.attention`)."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and cpu_isa.selected_level() == "avx2"


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` ([n, p, q] x [n, q, r] -> [n, p, r] in a's dtype); where :func:`cpu_bf16_gemm_slow`, on
    float32 copies of the operands with the product rounded to bf16 once (what the bf16 GEMM's float32
    accumulation gives, up to summation order)."""
    if cpu_bf16_gemm_slow(a):
        return torch.bmm(a.float(), b.float()).to(a.dtype)
    return torch.bmm(a, b)


def causal_softmax_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when prefill attention of q / k / v should run its two GEMMs around :func:`causal_softmax_` (CPU kernel:
    one dtype, kernels built); else the caller's SDPA / float32-softmax path."""
    return k.dtype == q.dtype and v.dtype == q.dtype and cpu_support.available_for(q)


def flash_prefill_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when the CPU flash prefill kernel runs q / k / v: bf16 CPU tensors with contiguous last dimensions, D
    even, values Dv <= D, AVX512-BF16 dot products allowed by the ISA setting."""
    return (q.dtype == k.dtype == v.dtype == torch.bfloat16 and cpu_support.available_for(q)
            and cpu_support.has_bf16_dot() and q.shape[-1] % 2 == 0 and v.shape[-1] <= q.shape[-1]
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and hasattr(cpu_build.load(), "flash_prefill_attention"))


def flash_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Causal prefill attention in flash form (:func:`~tokenfab.kernels.cpu.ops.attention.flash_prefill_attention`;
    call where :func:`flash_prefill_applies`): q [B, H, Q, D], k [B, Hk, L, D], v [B, Hk, L, Dv] -> [B, H, Q, Dv] bf16."""
    return cpu_attention.flash_prefill_attention(q, k, v, query_pos, scale)


def causal_softmax_(scores: torch.Tensor, query_pos: torch.Tensor, q_len: int, scale: float) -> torch.Tensor:
    """In place: the causal softmax of scores [B, Hx, R, L] (:func:`~tokenfab.kernels.cpu.ops.attention.causal_softmax_`;
    call where :func:`causal_softmax_applies`). Returns ``scores``."""
    return cpu_attention.causal_softmax_(scores, query_pos, q_len, scale)


def sigmoid_group_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int,
                       top_k: int, norm: bool, scale: float, extra: int = 0,
                       tickets: torch.Tensor | None = None, align=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DeepSeek-V3 / Kimi-K2 routing of x [T, hidden] with the router weight [E, hidden] float32 -> (weights
    [T, top_k (+ extra)] float32, ids [T, top_k (+ extra)] int64), or None. GPU path: with ``tickets``
    (:data:`tokenfab.kernels.gpu.router.TICKETS` int32 zeros owned by the router) and up to FUSED_MAX_TOKENS tokens,
    GEMM and selection in one launch (:func:`~tokenfab.kernels.gpu.router.router_topk`), else the float32 GEMM then
    the selection kernel; ``extra`` always-chosen slots (ids E.., weight 1.0; shared experts folded into the routed
    stacks) appended; ``align`` (:func:`moe_alignment`'s buffers) filled by the one launch when it runs (left
    unfilled otherwise). CPU: the GEMM then the C++ selection (``extra`` must be 0)."""
    if _gpu(x):
        from tokenfab.kernels.gpu import router
        if not router.applies(weight.shape[0], n_group, top_k):
            return None
        if (tickets is not None and x.shape[0] <= router.FUSED_MAX_TOKENS and x.dim() == 2 and x.stride(-1) == 1
                and weight.stride(-1) == 1 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and router.fused_applies(weight.shape[0], n_group, top_k)):
            return router.router_topk(x, weight, bias, tickets, n_group, topk_group, top_k, norm, scale, extra,
                                      align)
        return router.sigmoid_group_topk(torch.nn.functional.linear(x.float(), weight), bias, n_group,
                                         topk_group, top_k, norm, scale, extra)
    if cpu_support.available_for(x) and not extra:
        return cpu_moe.sigmoid_group_topk(torch.nn.functional.linear(x.float(), weight), bias, n_group, topk_group,
                                          top_k, norm, scale)
    return None


def softmax_router(x: torch.Tensor, weight: torch.Tensor, top_k: int, norm: bool,
                   tickets: torch.Tensor | None, align=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Qwen3-MoE's whole router for x [T, hidden] with its weight [E, hidden] in one launch on the GPU path
    (:func:`tokenfab.kernels.gpu.router.router_softmax_topk`: GEMM, softmax, top-k, renormalization, cast) up to
    FUSED_MAX_TOKENS tokens with the router's ``tickets``, ``align`` filled as in :func:`sigmoid_group_topk`; None
    elsewhere (then the GEMM and :func:`softmax_topk`)."""
    if (tickets is not None and _gpu(x) and x.dim() == 2 and x.stride(-1) == 1 and weight.stride(-1) == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and 1 <= top_k <= weight.shape[0]):
        from tokenfab.kernels.gpu import router
        if x.shape[0] <= router.FUSED_MAX_TOKENS:
            return router.router_softmax_topk(x, weight, tickets, top_k, norm, align)
    return None


def softmax_topk(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Qwen3-MoE routing after the router GEMM: softmax of logits [T, E] in float32, top-k, renormalized when
    ``norm`` -> (weights [T, top_k] in logits' dtype, ids [T, top_k] int64), by the Triton kernel on the GPU path
    (:func:`tokenfab.kernels.gpu.router.softmax_topk`, one launch), or None (the layer's PyTorch path)."""
    if _gpu(logits) and logits.dim() == 2 and logits.stride(-1) == 1 and 1 <= top_k <= logits.shape[1]:
        from tokenfab.kernels.gpu import router
        return router.softmax_topk(logits, top_k, norm)
    return None


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, start: int, act,
                   w13: torch.Tensor | None = None, w2: torch.Tensor | None = None,
                   packed13: list[torch.Tensor] | None = None,
                   packed2: list[torch.Tensor] | None = None, plus: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, norm: tuple | None = None,
                   aligned=None) -> torch.Tensor | None:
    """The routed experts' weighted sum for x [T, hidden], weights / ids [T, k] (experts from ``start``):
    the C++ dispatch over per-expert packed SiLU-GLU weights ``packed13`` / ``packed2`` on CPU (pass None to keep
    the Python loop), the Triton grouped GEMMs over the stacks ``w13`` [E, 2I, hidden] / ``w2`` [E, hidden, I] on
    CUDA/ROCm (``act``: the activation between them as kernels/gpu/moe.py ``fused_moe`` takes it; None: SiLU-GLU
    in the gate|up GEMM's epilogue; ``out_dtype``: the result's, default x's; ``norm`` (weight, eps, tickets): the
    result is the RMSNorm of the float32 sum, GPU only; ``aligned``: the pairs aligned by the router's launch,
    :func:`moe_alignment`), or None. ``plus`` [T, hidden] (the shared experts' output) is added to the result:
    inside the Triton k-sum, after the C++ kernel's."""
    if packed13 is not None and norm is None and cpu_support.available_for(x):
        out = cpu_moe.moe_experts_packed(x, weights, ids, packed13, packed2, start)
        return out if plus is None else out + plus
    if w13 is not None and gpu_support.applies(x):  # grouped GEMMs in Triton, CUDA-graph safe
        from tokenfab.kernels.gpu import moe  # imports triton: only when it applies
        return moe.fused_moe(x, w13, w2, weights, ids, act, start, plus, out_dtype, norm, aligned)
    return None


def moe_alignment(x: torch.Tensor, k: int, start: int, num_local: int):
    """On the GPU path, unfilled buffers (kernels/gpu/moe.py ``Alignment``) for the router's launch to align a call
    of x's T tokens with ``k`` slots each over local experts [start, start + num_local) by expert, which the
    experts' GEMMs then take (``aligned=`` of :func:`routed_experts` / :func:`routed_experts_packed`); None elsewhere
    or above the one-program alignment's pair limit."""
    if not gpu_support.applies(x) or x.dim() != 2:
        return None
    from tokenfab.kernels.gpu import moe, router
    if x.shape[0] > router.FUSED_MAX_TOKENS:  # the router's GEMM and selection are not one launch there
        return None
    return moe.alignment_for(x.shape[0], k, start, num_local, x.device)


def routed_experts_packed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, fmt: str, p13: torch.Tensor,
                          s13: torch.Tensor, p2: torch.Tensor, s2: torch.Tensor, act, start: int,
                          out_dtype: torch.dtype | None, plus: torch.Tensor | None = None,
                          relaid: tuple[bool, bool] = (False, False), norm: tuple | None = None, aligned=None
                          ) -> torch.Tensor | None:
    """The routed experts' weighted sum over stacks kept packed (``fmt`` one of PACKED_MOE_FORMATS; arguments as
    :func:`tokenfab.kernels.gpu.packed_moe.fused_moe_packed`, ``plus`` added in its k-sum; ``relaid``: whether the
    gate|up / down stacks are in the GPU layout, PackedExperts.gpu_layout; ``norm``, ``aligned``: as
    :func:`routed_experts`): one Triton launch per
    projection on CUDA/ROCm with the weights decoded in registers, or None (on CPU the stacks' grouped linears pick
    their kernels themselves)."""
    if gpu_support.applies(x) and fmt in PACKED_MOE_FORMATS:
        from tokenfab.kernels.gpu import packed_moe  # imports triton: only when it applies
        return packed_moe.fused_moe_packed(x, fmt, p13, s13, p2, s2, weights, ids, act, start, out_dtype, plus,
                                           relaid, norm, aligned)
    return None


def sample_plain_applies(logits: torch.Tensor) -> bool:
    """True when :func:`sample_plain` runs for float32 ``logits`` [N, V] here (CPU kernel built)."""
    return logits.dtype == torch.float32 and cpu_support.available_for(logits)


def sample_plain(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row without top-k / top-p (:func:`tokenfab.kernels.cpu.ops.sampling.sample_plain`; call where
    :func:`sample_plain_applies`)."""
    return cpu_sampling.sample_plain(logits, temps, u)


GGUF_GPU_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")  # block types the Triton GGUF kernels read


def gguf_gemv_avx2(x: torch.Tensor, tiles: torch.Tensor, block, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T (+ bias) [..., n] float32 for a GGUF weight packed as tiles, by the AVX2 kernel
    (:func:`tokenfab.kernels.cpu.ops.gguf_linear.gguf_gemv_avx2`; bf16 x widened to float32 first). Call where
    :func:`~tokenfab.kernels.cpu.ops.gguf_linear.gguf_gemv_avx2_applies` (GGUFWeight.prepare decides)."""
    return cpu_gguf.gguf_gemv_avx2(x if x.dtype == torch.float32 else x.float(), tiles, block.ggml_type, n, bias)


def gguf_linear(x: torch.Tensor, tiles: torch.Tensor, block, n: int, bias: torch.Tensor | None,
                cpu_kernel: bool, out_f32: bool = False) -> torch.Tensor | None:
    """y = x W^T (+ bias) for a GGUF weight W [n, K] packed as tiles of ``block`` (tokenfab.quant.gguf_blocks): the
    C++ kernel where the weight chose it at load (``cpu_kernel``, GGUFWeight.prepare) for bf16 / float32 x, the
    Triton kernels on CUDA/ROCm for GGUF_GPU_TYPES, or None. ``out_f32``: float32 outputs from the kernel's
    accumulator (logits) instead of x's dtype."""
    if cpu_kernel and x.dtype in (torch.bfloat16, torch.float32):
        return cpu_gguf.gguf_linear(x, tiles, block.ggml_type, n, bias, out_f32=out_f32)
    if block.name in GGUF_GPU_TYPES and gpu_support.applies(x):
        from tokenfab.kernels.gpu import gguf_linear as gpu_gguf_linear  # imports triton: only when it applies
        return gpu_gguf_linear.gguf_linear(x, tiles, block, n, bias, out_dtype=torch.float32 if out_f32 else None)
    return None


def _fp8_cpu(x: torch.Tensor, cpu_kernel: bool) -> bool:
    return cpu_kernel and x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu"


def fp8_block_linear_applies(x: torch.Tensor, cpu_kernel: bool, cpu_avx2: bool = False) -> bool:
    """True when a kernel computes an FP8 block-scaled ``x W^T`` here: the C++ kernel where the weight chose it at
    load (``cpu_kernel``, or on CPUs without AVX512-BF16 ``cpu_avx2``: Fp8BlockWeight.prepare) for bf16 / float32
    CPU x, or the Triton kernel on CUDA/ROCm."""
    return _fp8_cpu(x, cpu_kernel or cpu_avx2) or gpu_support.applies(x)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None,
                     cpu_kernel: bool, mm_scale: torch.Tensor | None = None, cpu_avx2: bool = False,
                     cpu_tiled: bool = False) -> torch.Tensor:
    """``x [.., K] @ weight^T`` (+ bias) on the e4m3 matrix and its 128 x 128 block scales by the kernel of
    :func:`fp8_block_linear_applies` (call only where it is True); ``mm_scale``: :func:`fp8_block_prepare`'s;
    ``cpu_avx2``: the AVX2 kernel (float32 arithmetic, one rounding to x's dtype); ``cpu_tiled``: the weight's whole
    16-row tiles are in the C++ kernel's CPU tile layout (Fp8BlockWeight.prepare)."""
    if _fp8_cpu(x, cpu_avx2) and not cpu_kernel:
        return cpu_fp8.fp8_block_linear_avx2(x.float(), weight, scale_inv, bias).to(x.dtype)
    if _fp8_cpu(x, cpu_kernel):
        return cpu_fp8.fp8_block_linear(x, weight, scale_inv, bias, cpu_tiled)
    from tokenfab.kernels.gpu import fp8_linear  # CUDA/ROCm (tests: the interpreter)
    return fp8_linear.fp8_block_linear(x, weight, scale_inv, bias, mm_scale=mm_scale)


def fp8_block_prepare(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor | None:
    """At load, for an FP8 block weight [N, K] on a CUDA device where the Triton kernels apply: run the block-scaled
    scaled_mm probe once per device (kernels/gpu/fp8_scaled_mm.py) and, where it passed and N, K are multiples of
    128, return the weight scales in scaled_mm's layout; None everywhere else."""
    N, K = weight.shape
    if weight.device.type != "cuda" or N % 128 or K % 128 or not gpu_support.applies(weight):
        return None
    from tokenfab.kernels.gpu import fp8_scaled_mm
    return fp8_scaled_mm.weight_scale_layout(scale_inv) if fp8_scaled_mm.scaled_mm_ready(weight.device) else None


KDA_CHUNK_MIN_TOKENS = 64  # padded prefill tokens per sequence from which fla's chunked form replaces the recurrence


def kda_recurrent_applies(qkv: torch.Tensor, state: torch.Tensor) -> bool:
    """True when the fused recurrent KDA kernel (:func:`tokenfab.kernels.gpu.kda.kda_recurrent`) runs a KDA layer's
    groups here: the GPU code path and a float32 contiguous state pool [slots, H, D, D]."""
    return _gpu(qkv) and state.dtype == torch.float32 and state.dim() == 4 and state.is_contiguous()


def kda_short_conv_applies(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                           query_pos: torch.Tensor) -> bool:
    """True when :func:`kda_short_conv` runs these tensors: the GPU code path, a unit-stride channel axis, a
    contiguous state pool and float32 contiguous taps."""
    return (_gpu(x) and x.stride(-1) == 1 and state.is_contiguous() and weight.dtype == torch.float32
            and weight.is_contiguous() and query_pos.stride(-1) == 1)


def kda_short_conv(x: torch.Tensor, token_index: torch.Tensor, query_pos: torch.Tensor, rows: torch.Tensor,
                   state: torch.Tensor, weight: torch.Tensor,
                   hold: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """KDA's depthwise causal conv + SiLU of one padded group with the conv states updated in place (but for the
    ``hold`` [B] bool rows), by the GPU kernel (:func:`tokenfab.kernels.gpu.short_conv.short_conv`: (y [B, Q, C],
    num_tokens [B] int32)); or None where it does not apply (:func:`kda_short_conv_applies`)."""
    if not kda_short_conv_applies(x, state, weight, query_pos):
        return None
    from tokenfab.kernels.gpu import short_conv
    return short_conv.short_conv(x, token_index, query_pos, rows, state, weight, hold=hold)


def kda_decode_fused(x: torch.Tensor, g_raw: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                     lower_bound: float | None, b_raw: torch.Tensor, token_index: torch.Tensor, query_pos: torch.Tensor,
                     rows: torch.Tensor, cache, conv_weight: torch.Tensor, out: torch.Tensor, scale: float,
                     norm: tuple | None = None) -> bool:
    """A KDA decode group (``token_index`` / ``query_pos`` [B, 1]) in one launch on the GPU path: short conv, its
    state update and the gated delta rule (:func:`tokenfab.kernels.gpu.kda.kda_decode_fused`) with ``cache``'s
    (a KDAStateCache) conv / recurrent states and tickets, and with ``norm`` (gate, weight, eps, y) the gated
    output norm into y; True when it ran, False where it does not apply (then :func:`kda_short_conv` and
    :func:`kda_recurrent` run the group)."""
    B = token_index.shape[0]
    if (token_index.dim() != 2 or token_index.shape[1] != 1 or not kda_recurrent_applies(x, cache.recurrent)
            or not kda_short_conv_applies(x, cache.conv, conv_weight, query_pos)
            or cache.tickets.numel() < B * cache.recurrent.shape[1] or not out.is_contiguous()):
        return False
    from tokenfab.kernels.gpu import kda
    unit = lambda t: t if t.stride(-1) == 1 else t.contiguous()
    if norm is not None:
        norm = (unit(norm[0]), norm[1].contiguous(), norm[2], norm[3])
    kda.kda_decode_fused(x, unit(g_raw), dt_bias.contiguous(), a_log.contiguous(), lower_bound, unit(b_raw),
                         token_index, query_pos[:, 0], rows, cache.recurrent, cache.conv, conv_weight, cache.tickets,
                         out, scale, norm)
    return True


def kda_recurrent(qkv: torch.Tensor, g_raw: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                  lower_bound: float | None, b_raw: torch.Tensor, token_index: torch.Tensor,
                  num_tokens: torch.Tensor, first_pos: torch.Tensor, rows: torch.Tensor, state: torch.Tensor,
                  out: torch.Tensor, scale: float, hold: torch.Tensor | None = None) -> torch.Tensor:
    """The gated delta rule of one padded KDA group in one launch, state slots updated in place (but for the
    ``hold`` [B] bool rows, speculative verification rows committed later) and outputs stored
    at their token rows of ``out`` (arguments as :func:`tokenfab.kernels.gpu.kda.kda_recurrent`; call where
    :func:`kda_recurrent_applies`). ``qkv`` may be the layer's transposed view of its conv output, ``g_raw`` and
    ``b_raw`` slices of a wider projection output: each is copied only when its last dim is strided (a decode
    group's [B, 1, C] view is not; rows may be strided). Returns ``out``."""
    from tokenfab.kernels.gpu import kda  # imports triton: only when it applies
    unit = lambda t: t if t.stride(-1) == 1 else t.contiguous()
    return kda.kda_recurrent(unit(qkv), unit(g_raw), dt_bias.contiguous(), a_log.contiguous(), lower_bound,
                             unit(b_raw), token_index, num_tokens, first_pos, rows, state, out, scale, hold)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """KDA's output norm (w * x * rsqrt(mean(x^2) + eps) * sigmoid(gate), float32, rounded once) of x [T, H, D] and
    gate [T, H * D] by the GPU kernel (:func:`tokenfab.kernels.gpu.norm_activation.gated_rms_norm`: new [T, H * D]);
    or None off the GPU path or for strided last dims."""
    if not (_gpu(x) and x.stride(-1) == 1 and gate.stride(-1) == 1 and gate.dim() == 2):
        return None
    from tokenfab.kernels.gpu import norm_activation
    return norm_activation.gated_rms_norm(x, gate, weight, eps)


def kda_chunk_applies(x: torch.Tensor, tokens: int) -> bool:
    """True when a KDA prefill group of ``tokens`` padded tokens per sequence should run fla's chunked kernels
    (:mod:`tokenfab.kernels.gpu.kda_chunk`): a CUDA / ROCm tensor with Triton on, bfloat16 / float16 activations
    (float32 engines keep the exact recurrent kernel: fla multiplies float32 tiles in TF32), at least
    KDA_CHUNK_MIN_TOKENS tokens, and fla-core importable (checked last, so CPU paths never import it)."""
    if not (x.device.type == "cuda" and gpu_support.applies(x) and x.dtype in (torch.bfloat16, torch.float16)
            and tokens >= KDA_CHUNK_MIN_TOKENS):
        return False
    from tokenfab.kernels.gpu import kda_chunk
    return kda_chunk.importable()


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA prefill by fla-core (:func:`tokenfab.kernels.gpu.kda_chunk.chunk_prefill`; call where
    :func:`kda_chunk_applies`): q, k, v, g [B, L, H, D], beta [B, L, H], initial_state [B, H, D, D], all float32 ->
    (o [B, L, H, D], final state [B, H, D, D])."""
    from tokenfab.kernels.gpu import kda_chunk as chunk
    return chunk.chunk_prefill(q, k, v, g, beta, initial_state)
