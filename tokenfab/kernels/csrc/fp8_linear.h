// Linear layers on FP8 block-scaled weights (DeepSeek-V3 / Kimi-K2 as published) executed packed (fp8_linear.cpp).
#pragma once
#include <torch/extension.h>

// Weights per scale block along both dimensions (weight_block_size [128, 128]).
constexpr int64_t kFp8Block = 128;

// y = x W^T (+ bias) for W [n, K] given as the checkpoint stores it: w uint8 [n, K] (the float8_e4m3fn bytes) and
// scale_inv float32 [ceil(n / 128), ceil(K / 128)], W[r, c] = e4m3(w[r, c]) * scale_inv[r / 128][c / 128]. x [..., K]
// bf16 or float32 with K a multiple of 32 -> y [..., n] in x's dtype. Needs AVX512-BF16 (raises otherwise).
at::Tensor fp8_block_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_inv,
                            const c10::optional<at::Tensor>& bias);

// Adds fp8_block_linear to the extension module.
void register_fp8_linear(pybind11::module_& m);
