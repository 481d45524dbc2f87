// Linear layers on tokenfab's VNNI-blocked bf16 weight layout (vnni_linear.cpp).
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

// Block width of the packed layout: weight [N, K] is stored as [ceil(N / 32), K / 2, 32, 2].
constexpr int64_t kVnniBlockN = 32;

// w [N, K] bf16 (K even) -> [ceil(N / 32), K / 2, 32, 2] bf16, rows past N zero.
at::Tensor pack_linear_weight(const at::Tensor& w);

// y = x W^T (+ bias): x [..., K] bf16 (last dim contiguous), wp from pack_linear_weight of W [n, K], bias [n] or
// none (any float dtype) -> y [..., n] bf16, one rounding per output of its float32 accumulator; with out_f32 the
// accumulator itself, float32 (the LM head's logits: no bf16 rounding that could tie two tokens).
at::Tensor vnni_linear(const at::Tensor& x, const at::Tensor& wp, int64_t n, const c10::optional<at::Tensor>& bias,
                       bool out_f32 = false);

// Several linears of few rows each (decode: experts, a shared expert) in one parallel region: ys[i] = xs[i] W_i^T
// for wps[i] from pack_linear_weight of W_i [ns[i], K_i], no bias; the same values as one vnni_linear per item. The
// threads split all items' 32-row blocks together, so the step forks and joins once instead of once per item, and a
// thread streams several weights in turn (NOTES.md entry 47). Items of more than 4 rows, or a CPU without
// AVX512-BF16, run vnni_linear one by one.
std::vector<at::Tensor> vnni_linear_group(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& wps,
                                          const std::vector<int64_t>& ns);
