// Grouped linears over routed-expert weights kept in their published packed formats (packed_experts.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

// Format ids (tokenfab/quant/packed_experts.py names them).
constexpr int64_t kExpertsInt4Group = 0;  // compressed-tensors pack-quantized, 4-bit symmetric, group 32
constexpr int64_t kExpertsMxfp4 = 1;      // compressed-tensors mxfp4-pack-quantized (E2M1 + E8M0 per 32)
// Added to a format id: the stack's whole 16-row tiles are in the CPU tile layout (packed_expert_tiles.h), the rows
// past them in the checkpoint layout.
constexpr int64_t kExpertsTiles = 16;

// Checks a stack's buffers for format fmt (kExpertsInt4Group or kExpertsMxfp4, no tile offset) against x's K:
// contiguous packed [E, n, .] and scale [E, n, K / 32] of the format's dtypes (below). Returns INT4's scale kind
// (0 bf16, 1 fp16; 0 for MXFP4). Raises naming `who`.
inline int check_expert_buffers(int64_t fmt, const at::Tensor& packed, const at::Tensor& scale, int64_t K,
                                const char* who) {
  TORCH_CHECK(packed.dim() == 3 && scale.dim() == 3 && packed.is_contiguous() && scale.is_contiguous(), who,
              ": contiguous packed [E, n, .] and scale [E, n, K / 32] expected");
  TORCH_CHECK(K % 32 == 0 && scale.size(0) == packed.size(0) && scale.size(1) == packed.size(1) &&
              scale.size(2) == K / 32, who, ": scale shape does not match K = ", K);
  if (fmt == kExpertsInt4Group) {
    TORCH_CHECK(packed.scalar_type() == at::kInt && packed.size(2) * 8 == K, who,
                ": int4 packed must be int32 [E, n, K / 8]");
    TORCH_CHECK(scale.scalar_type() == at::kBFloat16 || scale.scalar_type() == at::kHalf, who,
                ": int4 scales must be bf16 or fp16");
    return scale.scalar_type() == at::kHalf ? 1 : 0;
  }
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.size(2) * 2 == K && scale.scalar_type() == at::kByte, who,
              ": mxfp4 packed must be uint8 [E, n, K / 2] with uint8 scales");
  return 0;
}

// y[offsets[a]:offsets[a+1]] = x[offsets[a]:offsets[a+1]] W_{experts[a]}^T for every segment a, W_e [n, K] of a
// stack of E experts in format ``fmt``:
//   int4:  packed int32 [E, n, K / 8] (value k of a row at bits 4 (k % 8) of word k / 8, stored as q + 8),
//          scale bf16 or fp16 [E, n, K / 32]; W = (nibble - 8) * scale.
//   mxfp4: packed uint8 [E, n, K / 2] (even k in the low nibble), scale uint8 [E, n, K / 32] (E8M0);
//          W = E2M1(nibble) * 2^(scale - 127) (NaN for scale 255).
// x [N, K] bf16 or float32 (rows contiguous), experts int64 [A] local ids, offsets int64 [A + 1] (offsets[0] = 0,
// non-decreasing, offsets[A] = N). fmt + kExpertsTiles: the stack as packed_experts_relayout left it. Returns
// y [N, n] in x's dtype: float32 accumulation of exact products (bf16 x as is, float32 x split into three bf16
// parts), one rounding per output. Needs AVX512-BF16 (raises otherwise).
at::Tensor packed_experts_linear(const at::Tensor& x, int64_t fmt, const at::Tensor& packed, const at::Tensor& scale,
                                 const at::Tensor& experts, const at::Tensor& offsets);

// As packed_experts_linear for the two formats in the checkpoint layout (fmt 0 or 1, no tiles) and float32 x, on
// AVX2 + FMA + F16C (packed_experts_avx2.cpp: CPUs without AVX512-BF16): decode sums the products of x and the
// integer codes per 32-value group in float32 and scales once; prefill multiplies the reference's float32 values
// with a float32 GEMM; y [N, n] float32. Raises for another format or dtype, or where the kernels were built
// without those instructions (packed_experts_avx2_built()).
at::Tensor packed_experts_avx2(const at::Tensor& x, int64_t fmt, const at::Tensor& packed, const at::Tensor& scale,
                               const at::Tensor& experts, const at::Tensor& offsets);
bool packed_experts_avx2_built();

// In place: every whole 16-row tile of every expert of a stack (formats as above) into the CPU tile layout
// (to_tiles) or back to the checkpoint layout (exact inverse).
void packed_experts_relayout(int64_t fmt, at::Tensor& packed, at::Tensor& scale, bool to_tiles);

