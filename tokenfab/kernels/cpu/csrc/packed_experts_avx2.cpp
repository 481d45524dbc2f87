// Grouped linears over INT4 group-32 and MXFP4 routed-expert stacks (packed_experts.h's formats, in their checkpoint
// layout) on CPUs without AVX512-BF16: AVX2 + FMA + F16C, float32 x and float32 arithmetic.
//
// Both formats store a row of W [n, K] as K / 2 bytes, byte b holding value 2b in its low nibble and 2b + 1 in its
// high one, with one scale per 32 values. A group's 16 bytes give its 16 even values (low nibbles) and 16 odd ones
// (high nibbles), each widened to 8 int32 lanes at a time: INT4 (nibble - 8) converted to float32, MXFP4 the E2M1
// magnitude of the nibble's low 3 bits from an 8-entry permute table with its sign bit moved to bit 31. Times the
// group's scale (bf16 / fp16 / E8M0 as float32) that is the value the PyTorch reference dequantizes (the product is
// exact in float32). x is rearranged once per call to match (per group of 32: its 16 even values, then its 16 odd
// ones), so value vector i meets x's vector i and the sums are the same real dot product in another order.
//
// Work: (segment, block of output rows) items over all segments in one parallel region. A segment of up to
// kGemvMaxTokens tokens (decode) runs blocks of 16 rows, each group's values made once per row and pass of two
// tokens, four accumulator chains per token. A longer one (prefill) dequantizes 64-row panels (rearranged order) into
// a thread-local buffer and multiplies them with PyTorch's float32 GEMM (at::mm_out, single-threaded inside the
// region, written into y in place). Never a copy of more than 64 rows of one expert.
#include "packed_experts.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_common.h"  // hsum
#include "linear_io.h"

namespace {

constexpr int64_t kGroup = 32;          // values per scale
constexpr int64_t kRows = 16;           // output rows per decode work item
constexpr int64_t kPanel = 64;          // rows per dequantized prefill panel
constexpr int64_t kGemvMaxTokens = 16;  // more tokens in a segment: panels and a GEMM

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kBuilt = true;

enum ScaleKind { kBf16 = 0, kFp16 = 1, kE8m0 = 2 };

// 2^(s - 127) for E8M0 byte s (exact in float32, 2^-127 a subnormal), NaN for 255: layers/mxfp4.py's values.
const float* e8m0_table() {
  static const std::vector<float> t = [] {
    std::vector<float> v(256);
    for (int s = 0; s < 255; ++s) v[s] = std::ldexp(1.0f, s - 127);
    v[255] = std::numeric_limits<float>::quiet_NaN();
    return v;
  }();
  return t.data();
}

inline float scale_at(const void* s, int kind, int64_t i, const float* e8m0) {
  if (kind == kE8m0) return e8m0[static_cast<const uint8_t*>(s)[i]];
  const uint16_t h = static_cast<const uint16_t*>(s)[i];
  if (kind == kFp16) return _cvtsh_ss(h);
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The 32 values of the group at p (16 bytes) times scale s, in x's rearranged order: v[0] k = 0, 2, .., 14,
// v[1] k = 16, .., 30, v[2] k = 1, .., 15, v[3] k = 17, .., 31.
template <int FMT>
inline void group_values(const uint8_t* p, __m256 s, __m256 v[4]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m15 = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(b, m15), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m15);
  const __m256i c[4] = {_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
                        _mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))};
  for (int i = 0; i < 4; ++i) {
    __m256 f;
    if constexpr (FMT == kExpertsInt4Group) {
      f = _mm256_cvtepi32_ps(_mm256_sub_epi32(c[i], _mm256_set1_epi32(8)));
    } else {  // E2M1: |value| from the low 3 bits (the permute reads them alone), bit 3 the sign
      const __m256 mag = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f), c[i]);
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c[i], _mm256_set1_epi32(8)), 28);
      f = _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
    }
    v[i] = _mm256_mul_ps(f, s);
  }
}

// Rows [r0, r1) of one expert times tokens [t0, t1) of the rearranged x (xd [N, K]) into y [N, n].
template <int FMT>
void gemv_block(const uint8_t* w, const void* sc, int kind, const float* e8m0, int64_t K, int64_t r0, int64_t r1,
                const float* xd, int64_t t0, int64_t t1, float* y, int64_t n) {
  const int64_t ng = K / kGroup;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * (K / 2);
    for (int64_t t = t0; t < t1; t += 2) {
      const bool two = t + 1 < t1;
      const float* xa = xd + t * K;
      const float* xb = two ? xa + K : xa;
      __m256 a[4], b[4];
      for (int i = 0; i < 4; ++i) a[i] = b[i] = _mm256_setzero_ps();
      for (int64_t g = 0; g < ng; ++g) {
        __m256 v[4];
        group_values<FMT>(row + 16 * g, _mm256_set1_ps(scale_at(sc, kind, r * ng + g, e8m0)), v);
        for (int i = 0; i < 4; ++i) {
          a[i] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xa + 32 * g + 8 * i), a[i]);
          if (two) b[i] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xb + 32 * g + 8 * i), b[i]);
        }
      }
      y[t * n + r] = tokenfab_cpu::hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
      if (two)
        y[(t + 1) * n + r] = tokenfab_cpu::hsum(_mm256_add_ps(_mm256_add_ps(b[0], b[1]), _mm256_add_ps(b[2], b[3])));
    }
  }
}

// Rows [r0, r1) of one expert dequantized (rearranged order, scaled) into buf [r1 - r0, K].
template <int FMT>
void dequant_rows(const uint8_t* w, const void* sc, int kind, const float* e8m0, int64_t K, int64_t r0, int64_t r1,
                  float* buf) {
  const int64_t ng = K / kGroup;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < ng; ++g) {
      __m256 v[4];
      group_values<FMT>(w + r * (K / 2) + 16 * g, _mm256_set1_ps(scale_at(sc, kind, r * ng + g, e8m0)), v);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(buf + (r - r0) * K + 32 * g + 8 * i, v[i]);
    }
}

struct Item {
  int64_t a, r0, r1;
};

template <int FMT>
void run(const float* xd, int64_t K, const uint8_t* packed, const uint8_t* scales, int64_t scale_bytes, int kind,
         int64_t n, const int64_t* ep, const int64_t* op, int64_t A, float* y) {
  const float* e8m0 = e8m0_table();
  std::vector<Item> items;
  for (int64_t a = 0; a < A; ++a) {
    const int64_t nt = op[a + 1] - op[a], step = nt > kGemvMaxTokens ? kPanel : kRows;
    for (int64_t r = 0; nt > 0 && r < n; r += step) items.push_back({a, r, std::min(n, r + step)});
  }
  const int64_t ew = n * (K / 2), es = n * (K / kGroup) * scale_bytes;  // bytes per expert
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf;
    for (int64_t i = i0; i < i1; ++i) {
      const Item it = items[i];
      const int64_t e = ep[it.a], t0 = op[it.a], t1 = op[it.a + 1];
      const uint8_t* w = packed + e * ew;
      const void* sc = scales + e * es;
      if (t1 - t0 <= kGemvMaxTokens) {
        gemv_block<FMT>(w, sc, kind, e8m0, K, it.r0, it.r1, xd, t0, t1, y, n);
        continue;
      }
      const int64_t rows = it.r1 - it.r0;
      buf.resize(kPanel * K);
      dequant_rows<FMT>(w, sc, kind, e8m0, K, it.r0, it.r1, buf.data());
      tokenfab_cpu::mm_into(y + t0 * n + it.r0, n, xd + t0 * K, K, t1 - t0, K, buf.data(), 1, K, rows);
    }
  });
}
#else
constexpr bool kBuilt = false;
#endif

}  // namespace

bool packed_experts_avx2_built() { return kBuilt; }

at::Tensor packed_experts_avx2(const at::Tensor& x, int64_t fmt, const at::Tensor& packed, const at::Tensor& scale,
                               const at::Tensor& experts, const at::Tensor& offsets) {
  TORCH_CHECK(kBuilt, "packed_experts_avx2: the kernels were built without AVX2 / FMA / F16C");
  TORCH_CHECK(fmt == kExpertsInt4Group || fmt == kExpertsMxfp4, "packed_experts_avx2: format ", fmt,
              " is not int4 group-32 (0) or MXFP4 (1) in the checkpoint layout");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "packed_experts_avx2: x must be float32 [N, K]");
  const int int4_kind = check_expert_buffers(fmt, packed, scale, x.size(1), "packed_experts_avx2");
  const int kind = fmt == kExpertsMxfp4 ? 2 : int4_kind;  // ScaleKind
  const int64_t N = x.size(0), K = x.size(1), E = packed.size(0), n = packed.size(1);
  const auto seg = tokenfab_cpu::expert_segments(experts, offsets, E, N, "packed_experts_avx2");
  at::Tensor y = seg.A == 0 ? at::zeros({N, n}, x.options()) : at::empty({N, n}, x.options());
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  // x rearranged per group of 32: its 16 even values, then its 16 odd ones (group_values' order)
  const auto xc = x.contiguous();
  at::Tensor xd = at::empty({N, K}, x.options());
  const float* xs = xc.data_ptr<float>();
  float* xo = xd.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k = 0; k < K; ++k)
        xo[m * K + (k / kGroup) * kGroup + (k % 2) * 16 + (k % kGroup) / 2] = xs[m * K + k];
  });
  const auto* pp = static_cast<const uint8_t*>(packed.data_ptr());
  const auto* sp = static_cast<const uint8_t*>(scale.data_ptr());
  if (fmt == kExpertsInt4Group)
    run<kExpertsInt4Group>(xo, K, pp, sp, 2, kind, n, seg.ep(), seg.op(), seg.A, y.data_ptr<float>());
  else
    run<kExpertsMxfp4>(xo, K, pp, sp, 1, kind, n, seg.ep(), seg.op(), seg.A, y.data_ptr<float>());
#endif
  return y;
}
