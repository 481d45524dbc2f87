// Linear layers on GGUF block-quantized weights kept packed (gguf_linear.cpp).
#pragma once
#include <torch/extension.h>

// Output rows per packed tile and weights per GGUF block along the input dimension.
constexpr int64_t kGgufTileN = 16;
constexpr int64_t kGgufBlockK = 32;

// y = x W^T (+ bias) for W [n, K] from the tile layout of tokenfab/quant/gguf_blocks.py (uint8 [ceil(n / 16),
// K / 32, tile-block bytes]), ``qtype`` the ggml type id (2 = Q4_0, 3 = Q4_1, 8 = Q8_0). x [..., K] bf16 or float32
// -> y [..., n] in x's dtype. Needs AVX512-BF16 (raises otherwise).
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n,
                       const c10::optional<at::Tensor>& bias);

// Adds gguf_linear to the extension module.
void register_gguf_linear(pybind11::module_& m);
