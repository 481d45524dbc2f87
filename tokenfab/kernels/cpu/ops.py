"""Fused CPU kernels (csrc/: one file per kernel concept, entry points in cpu_kernels.h, Python bindings in
bindings.cpp), compiled on first use, with the PyTorch paths as the fallback.

Eager PyTorch spends most of a CPU decode step on dispatch and small-tensor passes (~150 ops per layer-step,
benchmarks/NOTES.md). These kernels fold the hottest chains into one call each: paged decode attention straight
from the block table (no gathered copy of the context), the causal softmax of prefill attention, RMSNorm
(optionally with the residual add), SiLU-GLU and rotary embedding, bf16 linears on VNNI-blocked weights, the
attention of a decode-only step (MLA and grouped-query) and sampling without top-k / top-p.

The extension is built with ``torch.utils.cpp_extension.load`` by :mod:`tokenfab.kernels.cpu.build`
(needs a C++ compiler; ninja comes with tokenfab's dependencies; about 2 minutes once on a quiet 2-core machine,
longer when other jobs share the cores, then cached under ``~/.cache/tokenfab/kernels/<torch version>-<cpu>-<digest>``,
override with ``TOKENFAB_KERNEL_CACHE``); :func:`load` / :func:`load_error` come from there.
``TOKENFAB_CPU_KERNELS=0`` disables them; a failed build logs one warning and every caller keeps its PyTorch path.
Only CPU tensors take these paths; CUDA/ROCm use kernels/gpu/, and an engine there builds these kernels only when
routed experts run on the host (:func:`~tokenfab.kernels.cpu.build.wanted`). Layers reach both through
:mod:`tokenfab.kernels.dispatch`.
"""
from __future__ import annotations

import os
import threading

import torch

from tokenfab.kernels.cpu.build import load, load_error

def available_for(x: torch.Tensor) -> bool:
    """True when the fused kernels apply to ``x``: a CPU tensor in float32 or bfloat16 and a built extension."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and load() is not None


def has_bf16_dot() -> bool:
    """True when the built kernels use AVX512-BF16 dot products (``vdpbf16ps``): built with them and not capped
    below ``avx512_bf16`` by ``TOKENFAB_CPU_ISA`` (:mod:`tokenfab.kernels.cpu.isa`)."""
    m = load()
    return bool(m is not None and m.has_bf16_dot and m.isa_cap() >= 1)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * q k^T) v for one query token per sequence, reading K/V in place from the paged pool.

    Args:
        q: [B, H, D] (last dim contiguous).
        k_cache: [num_blocks, block_size, Hk, D]; v_cache: [num_blocks, block_size, Hk, Dv] (any strides with a
            contiguous last dim: MLA passes the latent pool as both, its first Dv columns as values). H % Hk == 0;
            query head h uses KV head h // (H / Hk).
        block_tables: [B, max_blocks] int64 block ids; context_lens: [B] int64 tokens to attend (<= max_blocks *
            block_size), the current token's K/V already written.
        scale: softmax scale.

    Returns:
        [B, H, Dv] in q's dtype; scores, softmax and the weighted sum accumulate in float32. With AVX512-BF16
        (:func:`has_bf16_dot`), bf16 inputs and D, Dv multiples of 32, products are bf16 x bf16 (exact in float32)
        and the softmax weights are rounded to bf16 before the value products, as the eager path does.

    Raises:
        RuntimeError: on shapes or dtypes outside the above (q, k_cache, v_cache must share a dtype).
    """
    return load().paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, float(scale))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [N, hidden] (weight [hidden], x's dtype) in transformers' order (float32 statistics, cast, then
    the weight multiply). With ``residual`` [N, hidden]: returns (norm(x + residual), x + residual), the sum
    rounded to x's dtype first, as ``h = h + x`` followed by the norm would."""
    out = load().rms_norm(x, residual, weight, float(eps))
    return out[0] if residual is None else (out[0], out[1])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x [N, 2I] laid out [gate | up] -> [N, I], rounded like the PyTorch ops."""
    return load().silu_and_mul(x)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         interleave: bool) -> torch.Tensor:
    """Rotary embedding of x [T, H, dim] at positions [T] (int64) with float32 tables cos/sin [P, dim/2]; returns
    a new contiguous [T, H, dim] in x's dtype. ``interleave``: DeepSeek's (2i, 2i+1) pairs, output in halves."""
    return load().rope(x, positions, cos, sin, interleave)


def causal_softmax_(scores: torch.Tensor, query_pos: torch.Tensor, q_len: int, scale: float) -> torch.Tensor:
    """In place: scores [B, Hx, R, L] (contiguous q k^T) -> causal softmax(scale * scores) in scores' dtype.

    Row r of (b, h) is query ``r % q_len`` of sequence b at absolute position ``query_pos[b, r % q_len]``
    (query_pos [B, q_len] int64, -1 for padding); key j is visible when j <= that position (padding rows see key 0
    only). Statistics in float32; masked keys get probability 0. Returns ``scores``.
    """
    load().causal_softmax_(scores, query_pos, int(q_len), float(scale))
    return scores


def flash_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Causal prefill attention (csrc/flash_prefill.cpp): q [B, H, Q, D], k [B, Hk, L, D], v [B, Hk, L, Dv], all
    bf16 with a contiguous last dimension, H a multiple of Hk, D even; query i of sequence b sits at position
    ``query_pos[b, i]`` (int64 [B, Q], -1 for padding, which sees key 0 only) and sees keys j <= it. Online softmax
    in float32 over blocks of 64 keys, probabilities rounded to bf16 for the PV product, float32 accumulation.
    Returns [B, H, Q, Dv] bf16. Raises RuntimeError on other shapes or dtypes."""
    return load().flash_prefill_attention(q, k, v, query_pos, float(scale))


def pack_head_weights(w: torch.Tensor) -> torch.Tensor:
    """Per-head weights w [G, K, N] (K even) -> the VNNI pair layout [G, K / 2, Np, 2] of :func:`head_gemm_`, N
    zero-padded to Np, the next multiple of 16."""
    G, K, N = w.shape
    w = torch.nn.functional.pad(w, (0, -N % 16))
    return w.reshape(G, K // 2, 2, w.shape[2]).transpose(2, 3).contiguous()


def head_gemm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when :func:`head_gemm_` runs for activations like ``x`` and per-head weights ``w`` [G, K, N]: built
    kernels with AVX512-BF16 dot products, bf16 CPU tensors and K even."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and w.shape[1] % 2 == 0 and has_bf16_dot())


def head_gemm_(x: torch.Tensor, w_packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[b, g, :] = x[b, g, :] @ W_g for every head g: MLA's absorbed-decode matmuls (q_nope W_UK, o_lat W_UV).

    Args:
        x: [B, G, K] bf16, last dim contiguous (any other strides).
        w_packed: :func:`pack_head_weights` of W [G, K, N] (N padded to a multiple of 16 there; only N are written).
        out: [B, G, N] bf16, last dim contiguous (may be a column slice of a wider buffer); written in place.

    Returns ``out``. Float32 accumulation, one bf16 rounding per output, as a bf16 ``torch.bmm`` stores.

    Raises:
        RuntimeError: shapes or dtypes outside the above, or kernels without AVX512-BF16 (check
            :func:`head_gemm_applies` first).
    """
    load().head_gemm_(x, w_packed, out)
    return out


def moe_experts_packed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, p13: list[torch.Tensor],
                       p2: list[torch.Tensor], start: int, shared_gate_up: torch.Tensor | None = None,
                       shared_down: torch.Tensor | None = None) -> torch.Tensor:
    """Routed SiLU-GLU experts over packed weights in one call: sum over slots j of weights[t, j] *
    expert_{ids[t, j]}(x[t]) for the experts this rank owns, optionally plus a shared expert.

    Args:
        x: [T, hidden] bf16. weights: [T, k] float32 routing weights. ids: [T, k] int64 global expert ids.
        p13, p2: per local expert ``e`` (global id ``start + e``), the packed gate_up [2I, hidden] and down
            [hidden, I] weights (:func:`tokenfab.layers.linear.pack_weight`: tokenfab's VNNI blocks or oneDNN's).
            Pairs routed to other experts add 0.
        shared_gate_up, shared_down: a shared expert's gate_up [2I_s, hidden] and down [hidden, I_s] weights from
            :func:`pack_linear_weight` (no bias; VNNI-packed routed experts only), or None.

    Returns [T, hidden] bf16, bit-identical to ``RoutedExperts.forward``'s packed Python path (same grouping,
    GEMMs, rounding and summation order) without its ~25 small ops per layer; with a shared expert, to that result
    ``+ GatedMLP(x)`` as bf16 tensors (DeepseekV3MoE.forward). With VNNI weights all experts' gate_up GEMVs run in one
    parallel region and all down GEMVs in another (:func:`vnni_linear_group`).

    Raises:
        RuntimeError: shapes outside the above, or a shared expert with oneDNN-packed routed experts.
    """
    return load().moe_experts_packed(x, weights, ids, p13, p2, int(start), shared_gate_up, shared_down)


def vnni_linear_group(xs: list[torch.Tensor], packed: list[torch.Tensor], ns: list[int]) -> list[torch.Tensor]:
    """Several linears without bias in one call: ``[vnni_linear(x, p, n) for x, p, n in zip(xs, packed, ns)]``, the
    same bits, with the items of <= 4 rows (decode GEMVs) sharing one parallel region over all their 32-row weight
    blocks instead of one region each (fewer fork/joins; benchmarks/NOTES.md entry 47).

    Args:
        xs: per item x [..., K_i] bf16. packed: per item :func:`pack_linear_weight` of W_i [n_i, K_i]. ns: the n_i.

    Returns per item y [..., n_i] bf16.

    Raises:
        RuntimeError: mismatched lengths or an item whose shapes do not match its weight.
    """
    return load().vnni_linear_group(xs, packed, [int(n) for n in ns])


def sigmoid_group_topk(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                       norm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Kimi-K2 routing (noaux_tc) from router logits [T, E] float32 and the score-correction bias [E]
    float32: returns (weights [T, top_k] float32, expert ids [T, top_k] int64), the same selection and weights as
    :class:`tokenfab.layers.moe.SigmoidGroupRouter`'s PyTorch path (transformers' ``DeepseekV3TopkRouter``), one
    pass per token. Experts come in descending choice-score order; ties go to the lower index.

    Raises:
        RuntimeError: dtypes or shapes outside the above, E not divisible by n_group, or top_k larger than the
            experts of the kept groups.
    """
    w, ids = load().sigmoid_group_topk(logits, bias, int(n_group), int(topk_group), int(top_k), bool(norm),
                                       float(scale))
    return w, ids


def vnni_linear_applies(weight: torch.Tensor) -> bool:
    """True when :func:`vnni_linear` can run ``weight`` [N, K]: bf16 on CPU, K even, and built kernels with
    AVX512-BF16 dot products."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and weight.shape[0] > 0 and has_bf16_dot())


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 (K even) -> VNNI blocks [ceil(N / 32), K / 2, 32, 2] bf16 for :func:`vnni_linear`
    (rows past N zero): each block of 32 output rows is one contiguous stream with the two k values of each pair
    side by side, the B layout of ``vdpbf16ps`` and of oneDNN's brgemm micro-kernel."""
    return load().pack_linear_weight(weight.detach())


def vnni_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                out_f32: bool = False) -> torch.Tensor:
    """y = x W^T (+ bias) over :func:`pack_linear_weight` of W [n, K].

    Args:
        x: [..., K] bf16 (last dim contiguous; 2-D row strides are kept).
        packed: the packed weight. n: output features (W's rows). bias: [n] (any float dtype) or None.
        out_f32: return the float32 accumulator itself (+ bias), unrounded: the LM head's logits.

    Returns:
        [..., n] bf16 (float32 with ``out_f32``): float32 accumulation, + bias in float32, one rounding to nearest
        even per output. Up to 4
        rows run a GEMV that streams each weight block once for all rows (decode); more rows run oneDNN's brgemm
        micro-kernel on 64 x 32 tiles (prefill). benchmarks/linear_kernels.py measures both against oneDNN's
        packed inner product.

    Raises:
        RuntimeError: x not bf16, or x's last dim / ``n`` not matching ``packed``.
    """
    return load().vnni_linear(x, packed, int(n), bias, bool(out_f32))


def mla_decode(x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, weights: list[torch.Tensor], dims: list[int],
               cos: torch.Tensor, sin: torch.Tensor, interleave: bool, eps_q: float, eps_kv: float,
               scale: float) -> torch.Tensor:
    """MLA's absorbed decode for a decode-only batch in one call, from the layer input to o_proj's output.

    The same kernels in the same order as :class:`tokenfab.layers.mla.MLAttention`'s Python path (fused q_a|kv_a
    GEMM, q_a / kv_a RMSNorm, q_b GEMM, RoPE, cache write, q_nope W_UK, paged latent attention, W_UV, o_proj), so
    the output and the latent rows written to ``cache`` are bit-identical to it, without its ~25 Python-level ops.

    Args:
        x: [T, hidden] bf16, one token per sequence. positions, slot_mapping: [T] int64.
        cache: [num_blocks, block_size, C + R] bf16 latent pool, written at ``slot_mapping``.
        block_tables: [T, max_blocks] int64; context_lens: [T] int64 (including this step's token).
        weights: [qkv_a, q_a_norm, kv_a_norm, q_b, w_uk, w_uv_t, o_proj]: linears from :func:`pack_linear_weight`,
            head weights from :func:`pack_head_weights`, norm weights bf16.
        dims: [q_lora_rank, C (kv_lora_rank), R (rope dim), heads, qk_nope_head_dim, v_head_dim, hidden].
        cos, sin: float32 RoPE tables [P, R / 2]; interleave: DeepSeek's pair layout.
        eps_q, eps_kv: the two RMSNorm epsilons; scale: softmax scale.

    Returns:
        [T, hidden] bf16.

    Raises:
        RuntimeError: shapes or dtypes outside the above, or a slot outside the cache.
    """
    return load().mla_decode(x, positions, slot_mapping, cache, block_tables, context_lens, weights, dims, cos, sin,
                             bool(interleave), float(eps_q), float(eps_kv), float(scale))


def sample_plain(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row without top-k / top-p, in one pass per row.

    Args:
        logits: [N, V] float32 (-inf for forbidden tokens). temps: [N] float32 temperatures (< 1e-5: greedy).
        u: [N] uniforms in [0, 1).

    Returns:
        int64 [N]: for sampled rows the first j with cdf_j > u * cdf_{V-1} (capped just below the total) over
        exp(x / t - max), summed in float64: the draw of :func:`tokenfab.engine.sampler.inverse_cdf_sample` on
        ``softmax(x / t)`` up to float32 rounding of the exponentials; for greedy rows the first argmax.
    """
    return load().sample_plain(logits, temps, u)


def gqa_decode(x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
               weights: list[torch.Tensor], biases: list[torch.Tensor | None], dims: list[int], cos: torch.Tensor,
               sin: torch.Tensor, interleave: bool, eps: float, scale: float) -> torch.Tensor:
    """Grouped-query attention (Llama, Qwen3) for a decode-only batch in one call, from the layer input to o_proj's
    output: the kernels of :class:`tokenfab.models.llama.LlamaAttention`'s Python path in the same order (fused
    q|k|v GEMM, Qwen3's per-head q/k RMSNorm, RoPE, k/v cache writes, paged decode attention, o_proj), so the
    output and the cache rows written are bit-identical to it.

    Args:
        x: [T, hidden] bf16, one token per sequence. positions, slot_mapping: [T] int64.
        k_cache, v_cache: [num_blocks, block_size, Hk, D] bf16, written at ``slot_mapping``.
        block_tables: [T, max_blocks] int64; context_lens: [T] int64 (including this step's token).
        weights: [qkv, o_proj] from :func:`pack_linear_weight` (qkv rows = q | k | v), then [q_norm, k_norm] [D]
            bf16 for Qwen3. biases: [qkv bias [(H + 2 Hk) D] or None, o_proj bias or None].
        dims: [H, Hk, D, hidden]. cos, sin: float32 RoPE tables [P, D / 2]; interleave: pair layout.
        eps: the q/k RMSNorm epsilon (unused without them); scale: softmax scale.

    Returns:
        [T, hidden] bf16.

    Raises:
        RuntimeError: shapes or dtypes outside the above, or a slot outside the cache.
    """
    return load().gqa_decode(x, positions, slot_mapping, k_cache, v_cache, block_tables, context_lens, weights,
                             biases, dims, cos, sin, bool(interleave), float(eps), float(scale))


def gguf_linear_applies() -> bool:
    """True when :func:`gguf_linear` runs: built kernels with AVX512-BF16 dot products."""
    m = load()
    return bool(m is not None and has_bf16_dot() and hasattr(m, "gguf_linear"))


AVX2_GEMV_TYPES = (2, 3, 8, 12, 13, 14)  # Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K: the ggml types gguf_gemv_avx2 reads
AVX2_GEMV_MAX_ROWS = 16  # rows up to which the packed GEMV runs where the AVX2 kernel is the packed path


def gguf_gemv_avx2_applies(ggml_type: int) -> bool:
    """True when :func:`gguf_gemv_avx2` runs for this ggml type: kernels built with AVX2 + FMA + F16C, and no
    AVX512-BF16 GEMV selected (``TOKENFAB_CPU_ISA`` at ``avx2``, or a CPU without it: :func:`gguf_linear_applies`
    False); Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K."""
    m = load()
    return bool(m is not None and getattr(m, "gguf_gemv_avx2_built", False) and not gguf_linear_applies()
                and int(ggml_type) in AVX2_GEMV_TYPES)


def gguf_gemv_avx2(x: torch.Tensor, tiles: torch.Tensor, ggml_type: int, n: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for W [n, K] in Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K packed as tiles (as
    :func:`gguf_linear`), on AVX2: csrc/gguf_gemv_avx2.cpp, the packed path of CPUs without AVX512-BF16.

    Args:
        x: [..., K] float32, K a multiple of the block (32; 256 for K-quants). tiles: uint8 [ceil(n / 16),
            K / block, tile-block bytes]. ggml_type: 2, 3, 8, 12, 13 or 14. n: output features. bias: [n] (any
            float dtype) or None.

    Returns:
        [..., n] float32: per 32-input block (K-quant scale group) sum_k x_k q_k (float32 FMAs on the integer
        quants) scaled by d (d sc), + m (-(dmin m)) * the block's x sum (Q4_1, Q4_K, Q5_K; Q4_0 as m = -8 d),
        + bias: gguf's dequantized weight times x in float32 arithmetic. One row streams the packed bytes once with
        the quants unpacked in registers; up to 16 rows unpack each (sub-)block once into an L1 buffer shared by
        pairs of rows; more rows multiply panels of gguf's dequantized values with PyTorch's float32 GEMM.

    Raises:
        RuntimeError: another dtype or ggml type, mis-shaped tiles, or kernels built without AVX2 / FMA / F16C
            (check :func:`gguf_gemv_avx2_applies`).
    """
    return load().gguf_gemv_avx2(x, tiles, int(ggml_type), int(n), bias)


INT8_ENV = "TOKENFAB_GGUF_INT8_ACT"


def gguf_int8_setting() -> bool:
    """``TOKENFAB_GGUF_INT8_ACT`` read: unset, empty or ``0`` False (the default: exact bf16 products), ``1`` True.

    Raises:
        EngineConfigError: any other value (the message names the variable and its two values).
    """
    value = os.environ.get(INT8_ENV, "").strip()
    if value not in ("", "0", "1"):
        from tokenfab.errors import EngineConfigError
        raise EngineConfigError(f"{INT8_ENV}={value!r} is not a setting; use 1 (int8 activations for packed Q4_0 / "
                                "Q4_1 / Q8_0 decode batches of 5-16 rows) or 0 (exact bf16 products, the default).")
    return value == "1"


def gguf_int8_available() -> bool:
    """True when this machine's kernels can run :func:`gguf_linear`'s int8-activation GEMV: built with AVX512-VNNI,
    AVX512-BF16 dot products allowed, and no AMX path (AMX tiles run those rows exactly and faster)."""
    from tokenfab.kernels.cpu import isa
    m = load()
    return bool(gguf_linear_applies() and getattr(m, "gguf_int8_built", False) and isa.selected_level() != "amx")


def gguf_int8_activations(on: bool | None = None) -> bool:
    """The setting whether bf16 x of 5..16 rows of a Q4_0 / Q4_1 / Q8_0 :func:`gguf_linear` runs on int8
    activations where :func:`gguf_int8_available` (see :func:`gguf_linear`); sets it when ``on`` is not None and
    returns the value before. Starts from ``TOKENFAB_GGUF_INT8_ACT`` (:func:`gguf_int8_setting`). False without
    built kernels."""
    m = load()
    if m is None or not hasattr(m, "gguf_int8_activations"):
        return False
    return bool(m.gguf_int8_activations(-1 if on is None else int(bool(on))))


def gguf_int8_path(ggml_type: int, rows: int, dtype: torch.dtype) -> bool:
    """True when :func:`gguf_linear` of ``rows`` rows of ``dtype`` x on ``ggml_type`` takes the int8-activation
    GEMV here: bf16 x of 5..16 rows, Q4_0 / Q4_1 / Q8_0, :func:`gguf_int8_available` and the setting on."""
    return (dtype == torch.bfloat16 and 5 <= rows <= 16 and int(ggml_type) in (2, 3, 8) and gguf_int8_available()
            and gguf_int8_activations())


def gguf_linear(x: torch.Tensor, tiles: torch.Tensor, ggml_type: int, n: int,
                bias: torch.Tensor | None = None, out_f32: bool = False) -> torch.Tensor:
    """y = x W^T (+ bias) with W [n, K] in a GGUF block type, packed as tiles (tokenfab.quant.gguf_blocks).

    Args:
        x: [..., K] bf16 or float32 (last dim contiguous), K a multiple of 32 (256 for the K-quants).
        tiles: uint8 [ceil(n / 16), K / 32 (K / 256), 16 * block bytes] from ``gguf_blocks.pack_tiles``.
        ggml_type: 2 (Q4_0), 3 (Q4_1), 8 (Q8_0), 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K). n: output features. bias: [n]
            (any float dtype) or None. out_f32: float32 outputs (the accumulator, unrounded) for bf16 x too.

    Returns:
        [..., n] in x's dtype (float32 with ``out_f32``): per 32-input block the exact products of x and the integer quants summed in float32,
        scaled by the block's d (+ m * the block sum of x for Q4_1; K-quants: d * sc - dmin * m * the sub-block sum
        of x, Q6_K a scale per 16 inputs), + bias, one rounding per output. The K-quants never take the AMX path. Float32 x is
        split into three bf16 parts, so it keeps float32 accuracy. Up to 16 rows run a GEMV that streams the packed
        bytes once (decode); more rows dequantize 32 weight rows at a time into a thread-local buffer for oneDNN's
        brgemm (prefill); on CPUs with AMX, bf16 x of more than 4 rows runs one AMX tile product per GGUF block
        instead. Opt-in (``TOKENFAB_GGUF_INT8_ACT=1``), without AMX, bf16 x of 5..16 rows on Q4_0 / Q4_1 / Q8_0
        runs on int8 activations (:func:`gguf_int8_path`; csrc/gguf_gemv_i8.h): each row quantized per 32 inputs
        to int8 with scale dx = max |x| / 127 (llama.cpp's Q8_0 activations), the integer products exact, so x
        differs from the exact product's by at most dx / 2 per input. benchmarks/gguf_linear.py measures them against :func:`vnni_linear`.

    Raises:
        RuntimeError: shapes or dtypes outside the above, or kernels without AVX512-BF16 (check
            :func:`gguf_linear_applies` first).
    """
    return load().gguf_linear(x, tiles, int(ggml_type), int(n), bias, bool(out_f32))


def fp8_block_linear_applies() -> bool:
    """True when :func:`fp8_block_linear` runs: built kernels with AVX512-BF16 dot products."""
    m = load()
    return bool(m is not None and has_bf16_dot() and hasattr(m, "fp8_block_linear"))


def fp8_block_linear_avx2_applies() -> bool:
    """True when :func:`fp8_block_linear_avx2` runs: kernels built with AVX2 + FMA + F16C and no AVX512-BF16 FP8
    kernel selected (:func:`fp8_block_linear_applies` False: a CPU without it, or ``TOKENFAB_CPU_ISA=avx2``)."""
    m = load()
    return bool(m is not None and getattr(m, "fp8_block_linear_avx2_built", False) and not fp8_block_linear_applies())


def fp8_block_linear_avx2(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) with W [n, K] FP8 block-scaled as published (as :func:`fp8_block_linear`), on AVX2:
    kernels/cpu/csrc/fp8_linear_avx2.cpp, the FP8 path of CPUs without AVX512-BF16.

    Args:
        x: [..., K] float32, K a multiple of 32. weight: float8_e4m3fn (or its uint8 bytes) [n, K], contiguous.
        scale_inv: float32 [ceil(n / 128), ceil(K / 128)], contiguous. bias: [n] (any float dtype) or None.

    Returns:
        [..., n] float32: float32 FMAs of x with the weight's float32 values (e4m3 * scale_inv, each rounded once as
        the reference computes it), + bias. Up to 16 rows of x: a GEMV converting the e4m3 bytes in registers;
        more: 64-row panels converted into a thread-local buffer for PyTorch's float32 GEMM.

    Raises:
        RuntimeError: shapes or dtypes outside the above, or kernels built without AVX2 / FMA / F16C (check
            :func:`fp8_block_linear_avx2_applies` first).
    """
    return load().fp8_block_linear_avx2(x, weight.view(torch.uint8), scale_inv, bias)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) with W [n, K] FP8 block-scaled as published: W[r, c] = float32(weight[r, c]) *
    scale_inv[r // 128, c // 128] (tokenfab.quant.fp8_block_weight).

    Args:
        x: [..., K] bf16 or float32, K a multiple of 32.
        weight: float8_e4m3fn [n, K] (contiguous). scale_inv: float32 [ceil(n / 128), ceil(K / 128)].
        bias: [n] (any float dtype) or None.

    Returns:
        [..., n] in x's dtype: per 128-input block the exact products of x and the e4m3 values summed in float32,
        scaled once by the block's scale_inv, + bias, one rounding per output. Float32 x is split into three bf16
        parts, so it keeps float32 accuracy. Up to :func:`fp8_gemv_max_rows` rows (16 float32, 12 bf16) run a GEMV
        that streams the FP8 bytes once (decode); on CPUs with AMX, bf16 x of more than 4 rows runs AMX tile
        products on 16 converted weight rows at a time; else more rows convert 32 weight rows at a time into a
        thread-local buffer for oneDNN's brgemm (bf16 x: each weight rounded once to bf16, the bf16 twin's).
        benchmarks/fp8_linear.py measures the GEMV against :func:`vnni_linear`.

    Raises:
        RuntimeError: shapes or dtypes outside the above, or kernels without AVX512-BF16 (check
            :func:`fp8_block_linear_applies` first).
    """
    return load().fp8_block_linear(x, weight.view(torch.uint8), scale_inv, bias)


def fp8_gemv_max_rows(dtype: torch.dtype) -> int:
    """Rows of x up to which :func:`fp8_block_linear` and :func:`fp8_experts_linear` run their GEMV on a CPU without
    AMX (float32 x: the exact e4m3 values, scaled per block; beyond: brgemm); bf16 x past it multiplies each weight
    rounded once to bf16, as the dequantized bf16 twin holds it. The kernels' own constant (fp8_linear.cpp)."""
    return int(load().fp8_gemv_max_rows(dtype == torch.float32))


def fp8_experts_applies() -> bool:
    """True when :func:`fp8_experts_linear` runs: built kernels with AVX512-BF16 dot products."""
    m = load()
    return bool(m is not None and has_bf16_dot() and hasattr(m, "fp8_experts_linear"))


def fp8_experts_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, experts: torch.Tensor,
                       offsets: torch.Tensor, part_rows: int) -> torch.Tensor:
    """Grouped y = x W_e^T over a stack of routed experts kept as FP8 block-scaled bytes
    (kernels/cpu/csrc/fp8_linear.cpp).

    Args:
        x: [N, K] bf16 or float32, rows grouped by expert; K a multiple of 32.
        packed: uint8 [E, n, K] e4m3 bytes; scale: float32 [E, (n / part_rows) * ceil(part_rows / 128),
            ceil(K / 128)], each part of ``part_rows`` rows with its own 128-row blocks
            (tokenfab/quant/fp8_block_experts.py).
        experts: int64 [A] local expert ids; offsets: int64 [A + 1], rows [offsets[a], offsets[a + 1]) of x go to
            experts[a].

    Returns:
        [N, n] in x's dtype. Raises RuntimeError on shape mismatches or without AVX512-BF16 (check
        :func:`fp8_experts_applies` first).
    """
    return load().fp8_experts_linear(x, packed, scale, experts, offsets, int(part_rows))


def fp8_experts_avx2(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, experts: torch.Tensor,
                     offsets: torch.Tensor, part_rows: int) -> torch.Tensor:
    """:func:`fp8_experts_linear` on AVX2 (kernels/cpu/csrc/fp8_linear_avx2.cpp: the FP8 expert path of CPUs without
    AVX512-BF16); runs where :func:`fp8_block_linear_avx2_applies`.

    Args:
        x: [N, K] float32, rows grouped by expert; K a multiple of 32. packed, scale, experts, offsets, part_rows:
            as :func:`fp8_experts_linear` takes them.

    Returns:
        [N, n] float32: float32 FMAs of x with the reference's float32 weights (e4m3 * scale_inv of the row's part
        block, rounded once). Segments of up to 16 rows run the GEMV over the e4m3 bytes; longer ones multiply 64-row
        converted panels with PyTorch's float32 GEMM.

    Raises:
        RuntimeError: another dtype, mis-shaped buffers, part_rows not dividing n, bad experts / offsets, or kernels
            built without AVX2 / FMA / F16C.
    """
    return load().fp8_experts_avx2(x, packed, scale, experts, offsets, int(part_rows))


def packed_experts_applies() -> bool:
    """True when :func:`packed_experts_linear` runs: built kernels with AVX512-BF16 dot products."""
    m = load()
    return bool(m is not None and has_bf16_dot() and hasattr(m, "packed_experts_linear"))


def packed_experts_linear(x: torch.Tensor, fmt: int, packed: torch.Tensor, scale: torch.Tensor,
                          experts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped y = x W_e^T over a stack of routed experts kept packed (kernels/cpu/csrc/packed_experts.cpp).

    Args:
        x: [N, K] bf16 or float32, rows sorted by expert. fmt: 0 = INT4 group-32 (packed int32 [E, n, K / 8],
            scale bf16 / fp16 [E, n, K / 32]), 1 = MXFP4 (packed uint8 [E, n, K / 2], scale uint8 E8M0); plus 16
            when the stack's whole 16-row tiles are in the CPU tile layout (:func:`packed_experts_relayout`).
        experts: int64 [A] local expert ids; offsets: int64 [A + 1], rows offsets[a]:offsets[a+1] use experts[a].

    Returns:
        [N, n] in x's dtype: per 32 values the exact products of x and the integer / E2M1 codes summed in float32
        and scaled once, float32 x split into three bf16 parts; one rounding per output.

    Raises:
        RuntimeError: shapes / dtypes outside the above, or kernels without AVX512-BF16 (check
            :func:`packed_experts_applies` first).
    """
    return load().packed_experts_linear(x, int(fmt), packed, scale, experts, offsets)


def packed_experts_avx2_applies() -> bool:
    """True when :func:`packed_experts_avx2` runs: kernels built with AVX2 + FMA + F16C and no AVX512-BF16 expert
    kernel selected (:func:`packed_experts_applies` False: a CPU without it, or ``TOKENFAB_CPU_ISA=avx2``)."""
    m = load()
    return bool(m is not None and getattr(m, "packed_experts_avx2_built", False) and not packed_experts_applies())


def packed_experts_avx2(x: torch.Tensor, fmt: int, packed: torch.Tensor, scale: torch.Tensor,
                        experts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped y = x W_e^T over an INT4 group-32 or MXFP4 expert stack in the checkpoint layout, on AVX2
    (kernels/cpu/csrc/packed_experts_avx2.cpp: the packed expert path of CPUs without AVX512-BF16).

    Args:
        x: [N, K] float32, rows sorted by expert. fmt: 0 (int4 group-32) or 1 (MXFP4).
        packed, scale: the stack's buffers as :func:`packed_experts_linear` takes them (no tile layout).
        experts: int64 [A] local expert ids; offsets: int64 [A + 1] row offsets into x (0 .. N).

    Returns:
        [N, n] float32 within float32 summation error of x times the reference's values ((nibble - 8) * scale,
        E2M1 * 2^(e - 127)). Segments of up to 16 rows run a register GEMV over the packed bytes (per 32-value group
        the products of x and the integer codes summed in float32, scaled once); longer ones
        multiply 64-row panels dequantized into a thread-local buffer with PyTorch's float32 GEMM.

    Raises:
        RuntimeError: another format or dtype, mis-shaped buffers, bad experts / offsets, or kernels built without
            AVX2 / FMA / F16C (check :func:`packed_experts_avx2_applies`).
    """
    return load().packed_experts_avx2(x, int(fmt), packed, scale, experts, offsets)


def packed_experts_relayout(fmt: int, packed: torch.Tensor, scale: torch.Tensor, to_tiles: bool) -> None:
    """In place: every whole 16 rows of every expert of an INT4 / MXFP4 stack (``fmt`` 0 / 1, buffers as in
    :func:`packed_experts_linear`, contiguous, on the CPU) into the CPU tile layout (``to_tiles``; per tile and
    32-value group, 16-bit words each holding four rows' codes as vdpbf16ps operands, and the scales group-major:
    kernels/cpu/csrc/packed_expert_tiles.h), or back to the checkpoint layout (exact). Rows past the last whole 16
    are left as they are.

    Raises:
        RuntimeError: buffers that are not such a stack.
    """
    load().packed_experts_relayout(int(fmt), packed, scale, bool(to_tiles))


class batch_invariant:
    """Context manager: the calling thread's kernels run in batch-invariant mode inside it (``on=True``), restored
    on exit; ``on=False`` changes nothing.

    In that mode every kernel reduces in an order independent of the number of rows, a row's place among them and
    the thread count (csrc/batch_invariant.cpp): :func:`vnni_linear` (and everything built on it: the decode blocks,
    the MoE dispatch, the decode stack) runs oneDNN's brgemm tiles for every number of rows instead of switching to
    its GEMV at 4 rows and fewer (brgemm's order per output does not depend on the row count or the row's tile;
    the GEMV's differs from it), :func:`paged_decode_attention` never splits a context across threads, and the
    decode stack's MoE routers run :func:`rowwise_linear_f32`. The flag is per thread (the thread that steps the engine sets
    it), so engines in other threads keep their own mode. Python callers ask :func:`batch_invariant_active`.

    Raises:
        RuntimeError: ``on=True`` without built kernels.
    """

    def __init__(self, on: bool = True):
        self.on = bool(on)
        self._was: bool | None = None

    def __enter__(self) -> "batch_invariant":
        if self.on:
            m = load()
            if m is None:
                raise RuntimeError(f"batch-invariant mode needs tokenfab's CPU kernels ({load_error()})")
            self._was = m.set_batch_invariant(True)
            _mode.active = True
        return self

    def __exit__(self, *exc) -> None:
        if self._was is not None:
            load().set_batch_invariant(self._was)
            _mode.active = self._was
            self._was = None


_mode = threading.local()


def batch_invariant_active() -> bool:
    """True inside :class:`batch_invariant` (``on=True``) on this thread."""
    return getattr(_mode, "active", False)


def rowwise_linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w [E, K]^T in float32 -> [T, E] float32, each output one dot product in a fixed order (16-lane
    partial sums in four chains, one fixed reduction), so a row gets the same bits whatever T is; the routers' GEMM
    in batch-invariant mode (MKL's and oneDNN's GEMMs pick kernels, and so summation orders, by shape).

    Raises:
        RuntimeError: shapes or dtypes outside the above.
    """
    return load().rowwise_linear_f32(x, w)


def gguf_embedding(tiles: torch.Tensor, ggml_type: int, n: int, ids: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of a GGUF weight W [n, K] packed as tiles (as for :func:`gguf_linear`), dequantized.

    Args:
        tiles, ggml_type, n: the packed weight, as for :func:`gguf_linear`.
        ids: int64 row indices, any shape, each in [0, n).
        dtype: torch.bfloat16 or torch.float32.

    Returns:
        ids.shape + [K] in ``dtype``: gguf's float32 values (d q for Q8_0, d (q - 8) for Q4_0, q d + m for Q4_1;
        gguf-py ``quants.dequantize``), rounded to nearest even for bfloat16. Plain C++: needs the kernels built, not
        AVX512-BF16.

    Raises:
        RuntimeError: an id outside [0, n) or tiles that do not hold n rows of that type.
    """
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"gguf_embedding: dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    return load().gguf_embedding(tiles, int(ggml_type), int(n), ids, dtype == torch.bfloat16)
