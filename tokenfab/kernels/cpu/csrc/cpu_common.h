// What every fused CPU kernel file shares: the float32 / bf16 dispatch, bit-level bf16 conversions, per-dtype
// access, a vectorizable exp and the 16-lane float helpers.
//
// The kernels (one concept per file: paged_attention*.cpp, norms_activations.cpp, rotary.cpp, prefill_softmax.cpp,
// head_gemm.cpp, cache_writes.cpp, decode_blocks.cpp, moe.cpp, sampling.cpp; entry points in cpu_kernels.h, Python
// bindings in bindings.cpp) each replace a chain of small eager-PyTorch ops on the decode hot path
// (benchmarks/NOTES.md). They are built on first use by tokenfab/kernels/cpu/build.py (torch.utils.cpp_extension,
// -O3 -march=native) and checked against the PyTorch paths in tests/test_cpu_kernels.py. Elementwise kernels round
// intermediates to the activation dtype in the same order as the PyTorch code they replace (transformers' reference
// order), so bf16 results match those paths bit for bit up to the order of the RMSNorm sum.
//
// Kernel files include ATen's Tensor and the per-operator headers they call, not <ATen/ATen.h> (every operator,
// ~2x the compile time) nor torch/extension.h (pybind11 and torch's API, ~6x; only bindings.cpp and decode_stack.cpp
// need it): the extension is compiled on first use.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// Run the lambda with scalar_t = float or c10::BFloat16 (the dtypes tokenfab computes in on CPU).
#define DISPATCH_F32_BF16(TYPE, NAME, ...)                                              \
  do {                                                                                  \
    if ((TYPE) == at::kFloat) {                                                         \
      using scalar_t = float;                                                           \
      __VA_ARGS__();                                                                    \
    } else if ((TYPE) == at::kBFloat16) {                                               \
      using scalar_t = c10::BFloat16;                                                   \
      __VA_ARGS__();                                                                    \
    } else {                                                                            \
      TORCH_CHECK(false, NAME ": float32 or bfloat16 tensors expected, got ", (TYPE)); \
    }                                                                                   \
  } while (0)

namespace tokenfab_cpu {

// Scalar conversions written on the bit patterns so that loops over them vectorize (c10::BFloat16's own
// conversions do not). bf16 -> float is exact; float -> bf16 rounds to nearest even, NaN stays NaN, as c10 does.
inline float bf16_to_f(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

// Per-dtype access: Raw is the storage type read and written in loops.
template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
  using Raw = float;
  static inline float load(float v) { return v; }
  static inline float store(float v) { return v; }
  static inline float round(float v) { return v; }
};
template <>
struct Cvt<c10::BFloat16> {
  using Raw = uint16_t;
  static inline float load(uint16_t v) { return bf16_to_f(v); }
  static inline uint16_t store(float v) { return f_to_bf16(v); }
  static inline float round(float v) { return bf16_to_f(f_to_bf16(v)); }
};

template <typename T>
inline const typename Cvt<T>::Raw* raw(const at::Tensor& t) {
  return reinterpret_cast<const typename Cvt<T>::Raw*>(t.data_ptr<T>());
}
template <typename T>
inline typename Cvt<T>::Raw* raw_mut(at::Tensor& t) {
  return reinterpret_cast<typename Cvt<T>::Raw*>(t.data_ptr<T>());
}

// Round a float to the activation dtype and back (what a PyTorch op in that dtype stores).
template <typename T>
inline float round_to(float x) { return Cvt<T>::round(x); }

// exp(x) for float, branch-free so that loops over it vectorize: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p the
// degree-6 Taylor polynomial (relative error ~2e-7, below float32's own rounding of the result; the callers round
// to bf16 or compare against 1e-6 tolerances). Inputs are clamped to [-87, 88] (exp underflows to ~1e-38 there).
// exp's degree-6 Taylor polynomial at r, Horner's order, for a float or a GCC vector of floats (V); p holds 1/720
// in every lane.
template <typename V>
inline V exp_taylor6(V r, V p) {
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

inline float exp_approx(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  const float p = exp_taylor6(r, 1.0f / 720.0f);
  const int32_t e = static_cast<int32_t>(n) + 127;
  const uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// 16 floats in one value (GCC/Clang vector extension: one AVX-512 register, two AVX2 ones elsewhere).
typedef float vf16 __attribute__((vector_size(64)));

inline vf16 loadv(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storev(float* p, vf16 v) { std::memcpy(p, &v, sizeof(v)); }

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

#if defined(__AVX__)
// The sum of an AVX vector's 8 floats (the AVX2 kernels' row results).
inline float hsum(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#endif

// Horizontal sum by halving (a lane-by-lane loop costs ~16 extracts per call).
inline float hsum(vf16 v) {
  vf8 lo, hi;
  std::memcpy(&lo, &v, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + 32, 32);
  const vf8 s8 = lo + hi;
  vf4 a, b;
  std::memcpy(&a, &s8, 16);
  std::memcpy(&b, reinterpret_cast<const char*>(&s8) + 16, 16);
  const vf4 s4 = a + b;
  return (s4[0] + s4[1]) + (s4[2] + s4[3]);
}

// Dot product with four independent accumulators (a single chain would wait on the FMA latency every step).
inline float dot(const float* a, const float* b, int64_t n) {
  vf16 s0 = {}, s1 = {}, s2 = {}, s3 = {};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    s0 += loadv(a + i) * loadv(b + i);
    s1 += loadv(a + i + 16) * loadv(b + i + 16);
    s2 += loadv(a + i + 32) * loadv(b + i + 32);
    s3 += loadv(a + i + 48) * loadv(b + i + 48);
  }
  for (; i + 16 <= n; i += 16) s0 += loadv(a + i) * loadv(b + i);
  float r = hsum((s0 + s1) + (s2 + s3));
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

// y[0:n] += p * x[0:n]
inline void axpy(float* y, float p, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) storev(y + i, loadv(y + i) + p * loadv(x + i));
  for (; i < n; ++i) y[i] += p * x[i];
}

typedef uint16_t vu16x16 __attribute__((vector_size(32)));
typedef uint32_t vu32x16 __attribute__((vector_size(64)));

// Load n values of dtype T (float or bf16) into float: bf16 widened 16 lanes at a time (zero-extend, shift).
inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const auto* r = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    vu16x16 h;
    std::memcpy(&h, r + i, sizeof(h));
    const vu32x16 w = __builtin_convertvector(h, vu32x16) << 16;
    std::memcpy(dst + i, &w, sizeof(w));
  }
  for (; i < n; ++i) dst[i] = bf16_to_f(r[i]);
}

}  // namespace tokenfab_cpu
