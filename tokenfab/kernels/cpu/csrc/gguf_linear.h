// Linear layers on GGUF block-quantized weights kept packed (gguf_linear.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

// Output rows per packed tile and weights per GGUF block along the input dimension.
constexpr int64_t kGgufTileN = 16;
constexpr int64_t kGgufBlockK = 32;

// y = x W^T (+ bias) for W [n, K] from the tile layout of tokenfab/quant/gguf_blocks.py (uint8 [ceil(n / 16),
// K / 32 (K / 256 for K-quants), tile-block bytes]), ``qtype`` the ggml type id (2 = Q4_0, 3 = Q4_1, 8 = Q8_0,
// 12 = Q4_K, 13 = Q5_K, 14 = Q6_K; tokenfab/quant/gguf_kquants.py). x [..., K] bf16 or float32
// -> y [..., n] in x's dtype, or float32 with out_f32 (the float32 accumulator: the LM head's logits). Needs
// AVX512-BF16 (raises otherwise).
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n,
                       const c10::optional<at::Tensor>& bias, bool out_f32 = false);

// Rows ``ids`` (int64, any shape) of the same packed weight, dequantized as gguf does (float32 d q, d (q - 8) or
// q d + m): ids.shape + [K], bfloat16 (rounded to nearest even) when ``bf16_out``, else float32. Plain C++ (no
// AVX512 needed). Raises for an id outside [0, n).
at::Tensor gguf_embedding(const at::Tensor& w, int64_t qtype, int64_t n, const at::Tensor& ids,
                          bool bf16_out);

// y = x W^T (+ bias) for Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K tiles as gguf_linear, x [..., K] float32 -> y
// [..., n] float32, on AVX2 + FMA + F16C (gguf_gemv_avx2.cpp: the packed path of CPUs without AVX512-BF16). Raises
// for another type or dtype, or where the kernels were built without those instructions (gguf_gemv_avx2_built()).
at::Tensor gguf_gemv_avx2(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n,
                          const c10::optional<at::Tensor>& bias);
bool gguf_gemv_avx2_built();

