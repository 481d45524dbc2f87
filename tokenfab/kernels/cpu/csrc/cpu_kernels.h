// Entry points of the fused CPU kernels, each defined in the file named above it (bindings.cpp exposes them to
// Python; decode_blocks.cpp and decode_stack.cpp chain them). Shapes, dtypes and the rounding each one follows are
// documented at their definitions and in tokenfab/kernels/cpu/ops/.
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

// ---- paged_attention.cpp
// Paged decode attention: q [B, H, D], k_cache [NB, bs, Hk, D], v_cache [NB, bs, Hk, Dv] (any strides, last dim
// contiguous), block_tables [B, max_blocks], context_lens [B] -> [B, H, Dv] = softmax(scale q k^T) v.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);

// ---- prefill_softmax.cpp
// In-place causal softmax of prefill scores s [B, Hx, R, L] at query positions query_pos [B, >= q_len].
void causal_softmax_(at::Tensor& s, const at::Tensor& query_pos, int64_t q_len, double scale);

// ---- flash_prefill.cpp
// Causal prefill attention of bf16 q [B, H, Q, D] over k [B, Hk, L, D], v [B, Hk, L, Dv] (last dims contiguous, D
// even) at query positions query_pos [B, Q] (-1 padding): online softmax over key blocks, [B, H, Q, Dv] bf16.
at::Tensor flash_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& query_pos, double scale);

// ---- norms_activations.cpp
// RMSNorm of x [N, hidden]; with residual: {norm(x + residual), x + residual}, else {norm(x)}.
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                 const at::Tensor& weight, double eps);

// SiLU-GLU: x [N, 2I] laid out [gate | up] -> [N, I].
at::Tensor silu_and_mul(const at::Tensor& x);

// ---- rotary.cpp
// Rotary embedding of x [T, H, dim] at positions [T] with float32 cos/sin [P, dim/2] -> new contiguous [T, H, dim].
at::Tensor rope(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                bool interleave);

// ---- head_gemm.cpp
// Per-head GEMM into y [B, G, N] (may be strided): y[b, g] = x[b, g] W_g, wp [G, K/2, Np, 2] (AVX512-BF16 only).
void head_gemm_(const at::Tensor& x, const at::Tensor& wp, at::Tensor& y);

// ---- cache_writes.cpp
// slot_mapping as int64, every slot checked to lie in cache [blocks, block_size, ...] (who names the caller).
at::Tensor checked_slots(const at::Tensor& slot_mapping, const at::Tensor& cache, const char* who);
// Copy each token's bf16 row of rows [T, ...] into cache row slots[t], columns col.. on.
void write_slots(at::Tensor& cache, const at::Tensor& slots, int64_t col, const at::Tensor& rows);

// ---- decode_blocks.cpp
// MLA absorbed decode block, x [T, hidden] -> o_proj output [T, hidden] (writes the latent cache).
at::Tensor mla_decode(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping,
                      at::Tensor& cache, const at::Tensor& block_tables, const at::Tensor& context_lens,
                      const std::vector<at::Tensor>& w, const std::vector<int64_t>& dims, const at::Tensor& cos,
                      const at::Tensor& sin, bool interleave, double eps_q, double eps_kv, double scale);

// Grouped-query attention decode block, x [T, hidden] -> o_proj output [T, hidden] (writes the k/v caches).
at::Tensor gqa_decode(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, const std::vector<at::Tensor>& w,
                      const std::vector<c10::optional<at::Tensor>>& biases, const std::vector<int64_t>& dims,
                      const at::Tensor& cos, const at::Tensor& sin, bool interleave, double eps, double scale);

// gqa_decode without its two projections: q [T, H, D], k, v [T, Hk, D] -> attention output [T, H, D] (optional
// per-head q/k norms {q_norm, k_norm} or {}, RoPE, k/v cache writes, paged decode attention).
at::Tensor gqa_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                      const at::Tensor& slot_mapping, at::Tensor& k_cache, at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens,
                      const std::vector<at::Tensor>& qk_norms, const at::Tensor& cos, const at::Tensor& sin,
                      bool interleave, double eps, double scale);

// ---- moe.cpp
// Routed experts over packed weights: x [T, H], weights / ids [T, k] -> [T, H]; with a shared expert (VNNI-packed
// gate_up and down) the routed sum + the shared expert's output.
at::Tensor moe_experts_packed(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                              const std::vector<at::Tensor>& p13, const std::vector<at::Tensor>& p2, int64_t start,
                              const c10::optional<at::Tensor>& shared_gate_up,
                              const c10::optional<at::Tensor>& shared_down);

// DeepSeek-V3 sigmoid group-limited top-k: router logits [T, E] float32 -> {weights [T, k] float32, ids [T, k]}.
std::vector<at::Tensor> sigmoid_group_topk(const at::Tensor& logits, const at::Tensor& bias, int64_t n_group,
                                           int64_t topk_group, int64_t top_k, bool norm, double scale);

// ---- sampling.cpp
// One token per row of float32 logits [N, V] by inverse CDF at temperatures [N] with uniforms [N] (t < 1e-5:
// first argmax) -> int64 [N].
at::Tensor sample_plain(const at::Tensor& logits, const at::Tensor& temps, const at::Tensor& u);
