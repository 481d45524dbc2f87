// Linear layers on FP8 block-scaled weights (DeepSeek-V3 / Kimi-K2 as published) executed packed (fp8_linear.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

// Weights per scale block along both dimensions (weight_block_size [128, 128]).
constexpr int64_t kFp8Block = 128;

// The shape of an FP8 expert stack (fp8_experts_linear's buffers), checked.
struct Fp8ExpertShape {
  int64_t E, n, K, kb_n;  // experts, rows, inputs, scale columns (ceil(K / 128))
  int64_t block_rows;     // scale rows per part (ceil(part_rows / 128)); an expert's scale rows: parts * block_rows
};

// w uint8 [E, n, K] (K = x's inputs, a multiple of 32), part_rows dividing n, scale float32 [E, (n / part_rows) *
// ceil(part_rows / 128), ceil(K / 128)], contiguous; raises naming ``who`` otherwise.
inline Fp8ExpertShape check_fp8_expert_buffers(int64_t K, const at::Tensor& w, const at::Tensor& scale,
                                               int64_t part_rows, const char* who) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() && w.size(2) == K && K % 32 == 0,
              who, ": weight ", w.sizes(), " is not uint8 e4m3 bytes [E, n, K] with K = ", K, " a multiple of 32");
  const int64_t E = w.size(0), n = w.size(1), kb_n = (K + kFp8Block - 1) / kFp8Block;
  TORCH_CHECK(part_rows > 0 && n % part_rows == 0, who, ": part_rows ", part_rows, " does not divide n ", n);
  const int64_t block_rows = (part_rows + kFp8Block - 1) / kFp8Block;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 3 && scale.size(0) == E &&
              scale.size(1) == (n / part_rows) * block_rows && scale.size(2) == kb_n,
              who, ": scale ", scale.sizes(), " is not float32 [E, parts * ceil(part_rows / 128), ceil(K / 128)]");
  return {E, n, K, kb_n, block_rows};
}

// y = x W^T (+ bias) for W [n, K] given as the checkpoint stores it: w uint8 [n, K] (the float8_e4m3fn bytes) and
// scale_inv float32 [ceil(n / 128), ceil(K / 128)], W[r, c] = e4m3(w[r, c]) * scale_inv[r / 128][c / 128]. x [..., K]
// bf16 or float32 with K a multiple of 32 -> y [..., n] in x's dtype. tiled: w's whole 16-row tiles as
// fp8_tiles_relayout left them (the rows past the last whole tile row-major): up to 16 rows of x take the tile GEMV,
// more brgemm over converted tiles. Needs AVX512-BF16 (raises otherwise).
at::Tensor fp8_block_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_inv,
                            const c10::optional<at::Tensor>& bias, bool tiled = false);

// As fp8_block_linear for float32 x on AVX2 + FMA + F16C (fp8_linear_avx2.cpp: CPUs without AVX512-BF16): the e4m3
// values converted through fp16 in registers, float32 FMAs; y [..., n] float32. Raises for another dtype or shape, or
// where the kernels were built without those instructions (fp8_block_linear_avx2_built()).
at::Tensor fp8_block_linear_avx2(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_inv,
                                 const c10::optional<at::Tensor>& bias);
bool fp8_block_linear_avx2_built();

// The grouped form over a stack of E routed experts kept packed (tokenfab/quant/fp8_block_experts.py): for every
// segment a, y[offsets[a]:offsets[a+1]] = x[offsets[a]:offsets[a+1]] W_{experts[a]}^T. w uint8 [E, n, K] (e4m3 bytes);
// an expert's n rows are n / part_rows parts of part_rows rows (gate | up: two parts of I rows; down: one part), each
// with its own 128-row scale blocks as the checkpoint stores gate_proj and up_proj apart, so a part's last block may
// be partial: scale float32 [E, (n / part_rows) * ceil(part_rows / 128), ceil(K / 128)], row r of part p scaled by
// block row p * ceil(part_rows / 128) + r / 128. x [N, K] bf16 or float32 (K a multiple of 32), experts int64 [A]
// local ids, offsets int64 [A + 1] from 0 to N. Returns y [N, n] in x's dtype (the kernels of fp8_block_linear per
// segment and part: GEMV for up to 16 rows, AMX / brgemm above). tiled: w as fp8_tiles_relayout left it (the tile
// layout of fp8_tiles.h, part_rows a multiple of 16): segments of up to 16 rows take the tile GEMV, longer ones
// brgemm over converted tiles. Needs AVX512-BF16 (raises otherwise).
at::Tensor fp8_experts_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                              const at::Tensor& experts, const at::Tensor& offsets, int64_t part_rows,
                              bool tiled = false);

// As fp8_experts_linear for float32 x on AVX2 + FMA + F16C (fp8_linear_avx2.cpp: CPUs without AVX512-BF16): the
// e4m3 values converted through fp16 in registers and scaled per part's block rows, float32 FMAs (GEMV for segments
// of up to 16 rows, 64-row converted panels and a float32 GEMM above); y [N, n] float32. Raises for another dtype or
// shape, or where the kernels were built without those instructions (fp8_block_linear_avx2_built()).
at::Tensor fp8_experts_avx2(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                            const at::Tensor& experts, const at::Tensor& offsets, int64_t part_rows);
