// Entry points of cpu_kernels.cpp that other translation units call (decode_stack.cpp). Shapes, dtypes and the
// rounding each one follows are documented at their definitions and in tokenfab/kernels/cpu_kernels.py.
#pragma once
#include <torch/extension.h>

#include <vector>

// RMSNorm of x [N, hidden]; with residual: {norm(x + residual), x + residual}, else {norm(x)}.
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                 const at::Tensor& weight, double eps);

// SiLU-GLU: x [N, 2I] laid out [gate | up] -> [N, I].
at::Tensor silu_and_mul(const at::Tensor& x);

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

// Routed experts over packed weights: x [T, H], weights / ids [T, k] -> [T, H]; with a shared expert (VNNI-packed
// gate_up and down) the routed sum + the shared expert's output.
at::Tensor moe_experts_packed(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                              const std::vector<at::Tensor>& p13, const std::vector<at::Tensor>& p2, int64_t start,
                              const c10::optional<at::Tensor>& shared_gate_up,
                              const c10::optional<at::Tensor>& shared_down);

// DeepSeek-V3 sigmoid group-limited top-k: router logits [T, E] float32 -> {weights [T, k] float32, ids [T, k]}.
std::vector<at::Tensor> sigmoid_group_topk(const at::Tensor& logits, const at::Tensor& bias, int64_t n_group,
                                           int64_t topk_group, int64_t top_k, bool norm, double scale);

// One token per row of float32 logits [N, V] by inverse CDF at temperatures [N] with uniforms [N] (t < 1e-5:
// first argmax) -> int64 [N].
at::Tensor sample_plain(const at::Tensor& logits, const at::Tensor& temps, const at::Tensor& u);

// Adds the DecodeStack class (decode_stack.cpp) to the extension module.
void register_decode_stack(pybind11::module_& m);
