// Per-head GEMM for MLA's absorbed decode: y[b, g, :] = x[b, g, :] W_g for every head g, i.e. the two small
// batched matmuls q_nope W_UK (K = qk_nope_head_dim, N = kv_lora_rank) and o_lat W_UV (K = kv_lora_rank,
// N = v_head_dim). W is packed once per layer in the VNNI pair layout wp[g, k / 2, n, 2] (the two k values of a
// pair side by side), so one `vdpbf16ps` of a broadcast (x[2k'], x[2k' + 1]) pair against 32 packed values adds two
// products to 16 outputs: no horizontal reductions. Register tile: up to 4 rows x 64 outputs (16 accumulators).
// Float32 accumulation, one rounding to bf16 per output (what a bf16 `bmm` stores). y may be a strided view (e.g.
// the first N columns of the concatenated [q_lat | q_rope] buffer).
#include "cpu_common.h"
#include "cpu_kernels.h"

namespace {

#if defined(__AVX512BF16__)
template <int BB, int NV>
inline void head_gemm_tile(const uint16_t* x, int64_t xs0, const uint16_t* w, int64_t N, int64_t K2, uint16_t* y,
                           int64_t ys0, int64_t nvalid) {
  __m512 acc[BB][NV];
  for (int i = 0; i < BB; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512bh wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + (kp * N + 16 * v) * 2);
    for (int i = 0; i < BB; ++i) {
      uint32_t pair;
      std::memcpy(&pair, x + i * xs0 + 2 * kp, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xb, wv[v]);
    }
  }
  // outputs past nvalid (the zero padding of N to a multiple of 16) are not stored
  const int64_t rem = nvalid - 16 * (NV - 1);
  const __mmask16 last = rem >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rem) - 1u);
  for (int i = 0; i < BB; ++i)
    for (int v = 0; v < NV; ++v) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(acc[i][v]);
      if (v + 1 < NV) _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * ys0 + 16 * v), h);
      else _mm256_mask_storeu_epi16(y + i * ys0 + 16 * v, last, h);
    }
}

template <int BB>
inline void head_gemm_rows(const uint16_t* x, int64_t xs0, const uint16_t* w, int64_t N, int64_t K2, uint16_t* y,
                           int64_t ys0, int64_t nv, int64_t nvalid) {
  switch (nv) {
    case 4: head_gemm_tile<BB, 4>(x, xs0, w, N, K2, y, ys0, nvalid); break;
    case 3: head_gemm_tile<BB, 3>(x, xs0, w, N, K2, y, ys0, nvalid); break;
    case 2: head_gemm_tile<BB, 2>(x, xs0, w, N, K2, y, ys0, nvalid); break;
    default: head_gemm_tile<BB, 1>(x, xs0, w, N, K2, y, ys0, nvalid); break;
  }
}
#endif

}  // namespace

// Declared in cpu_kernels.h.
void head_gemm_(const at::Tensor& x, const at::Tensor& wp, at::Tensor& y) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 3 && wp.dim() == 4 && y.dim() == 3 && wp.size(3) == 2, "head_gemm_: x [B, G, K], "
              "wp [G, K/2, Np, 2] (Np = N rounded up to 16), y [B, G, N] expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16 &&
              y.scalar_type() == at::kBFloat16, "head_gemm_: bfloat16 tensors expected");
  const int64_t B = x.size(0), G = x.size(1), K = x.size(2), N = wp.size(2), K2 = wp.size(1), Ny = y.size(2);
  TORCH_CHECK(wp.size(0) == G && 2 * K2 == K && y.size(0) == B && y.size(1) == G && N % 16 == 0 &&
              N == (Ny + 15) / 16 * 16, "head_gemm_: shapes do not match (K even, packed N = y's N rounded up to 16)");
  TORCH_CHECK(x.stride(2) == 1 && y.stride(2) == 1 && wp.is_contiguous(), "head_gemm_: last dims must be contiguous");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wpp = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), ys0 = y.stride(0), ys1 = y.stride(1);
  const int64_t tiles = (N + 63) / 64;
  at::parallel_for(0, G * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t g = it / tiles, n0 = (it % tiles) * 64, nv = std::min<int64_t>(64, N - n0) / 16;
      const int64_t nvalid = std::min<int64_t>(64, Ny - n0);
      const uint16_t* w = wpp + (g * K2 * N + n0) * 2;
      for (int64_t b0 = 0; b0 < B; b0 += 4) {
        const uint16_t* xr = xp + b0 * xs0 + g * xs1;
        uint16_t* yr = yp + b0 * ys0 + g * ys1 + n0;
        switch (std::min<int64_t>(4, B - b0)) {
          case 4: head_gemm_rows<4>(xr, xs0, w, N, K2, yr, ys0, nv, nvalid); break;
          case 3: head_gemm_rows<3>(xr, xs0, w, N, K2, yr, ys0, nv, nvalid); break;
          case 2: head_gemm_rows<2>(xr, xs0, w, N, K2, yr, ys0, nv, nvalid); break;
          default: head_gemm_rows<1>(xr, xs0, w, N, K2, yr, ys0, nv, nvalid); break;
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "head_gemm_ needs AVX512-BF16 (has_bf16_dot is False)");
#endif
}
