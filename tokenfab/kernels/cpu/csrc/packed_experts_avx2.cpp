// Grouped linears over INT4 group-32 and MXFP4 routed-expert stacks (packed_experts.h's formats, in their checkpoint
// layout) on CPUs without AVX512-BF16: AVX2 + FMA + F16C, float32 x and float32 arithmetic.
//
// Both formats store a row of W [n, K] as K / 2 bytes, byte b holding value 2b in its low nibble and 2b + 1 in its
// high one, with one scale per 32 values. A group's 16 bytes give its 16 even codes (low nibbles) and 16 odd ones
// (high nibbles), each looked up as int8 in a 16-entry table with one byte shuffle (INT4: nibble - 8; MXFP4: twice
// the E2M1 value, so every code is an integer, and the scale is halved to match) and widened to float32 8 at a time.
// x is rearranged once per call to match (per group of 32: its 16 even values, then its 16 odd ones), so code vector
// i meets x's vector i and the sums are the same real dot product in another order.
//
// Decode (segments of up to kGemvMaxTokens tokens): per output row and pass of up to four tokens, each group's codes
// are made once; per token the products of codes and x are summed in float32 and scaled once by the group's
// scale (bf16 / fp16 / E8M0 as float32) into two accumulators, as the AVX512-BF16 kernel sums before it scales. The
// accumulators of a pass live in registers (the pass width and the scale kind are template constants). Prefill
// (longer segments): 64-row panels of the reference's own float32 values (code * scale, exact) in a thread-local
// buffer, multiplied with PyTorch's float32 GEMM (at::mm_out, single-threaded inside the region, written into y in
// place). Never a copy of more than 64 rows of one expert. Work: (segment, block of output rows) items over all
// segments in one parallel region.
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

// 2^(s - 128) for E8M0 byte s (half the scale: MXFP4 codes are twice the E2M1 value; exact in float32, 2^-128 a
// subnormal), NaN for 255: layers/mxfp4.py's values once the code's factor 2 is taken back.
const float* e8m0_half_table() {
  static const std::vector<float> t = [] {
    std::vector<float> v(256);
    for (int s = 0; s < 255; ++s) v[s] = std::ldexp(1.0f, s - 128);
    v[255] = std::numeric_limits<float>::quiet_NaN();
    return v;
  }();
  return t.data();
}

// Scale i of a row (its group) as float32, by kind.
template <int KIND>
inline float scale_at(const void* s, int64_t i, const float* e8m0) {
  if constexpr (KIND == kE8m0) {
    return e8m0[static_cast<const uint8_t*>(s)[i]];
  } else if constexpr (KIND == kFp16) {
    return _cvtsh_ss(static_cast<const uint16_t*>(s)[i]);
  } else {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(s)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
}

// The int8 code of each nibble: INT4 nibble - 8; MXFP4 twice its E2M1 value (bit 3 the sign).
template <int FMT>
inline __m128i code_table() {
  if constexpr (FMT == kExpertsInt4Group)
    return _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  else
    return _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
}

// The 32 codes of the group at p (16 bytes) as float32, in x's rearranged order: v[0] k = 0, 2, .., 14,
// v[1] k = 16, .., 30, v[2] k = 1, .., 15, v[3] k = 17, .., 31.
template <int FMT>
inline void group_codes(const uint8_t* p, __m256 v[4]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m15 = _mm_set1_epi8(15), table = code_table<FMT>();
  const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(b, m15));
  const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), m15));
  v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

// Row r of one expert times tokens [t, t + NT) of the rearranged x (xd [N, K]) into y [N, n].
template <int FMT, int KIND, int NT>
inline void row_pass(const uint8_t* row, const void* sc, int64_t s0, int64_t ng, const float* e8m0, const float* xd,
                     int64_t K, int64_t t, float* y, int64_t n, int64_t r) {
  __m256 acc[NT][2];
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m256 v[4];
    group_codes<FMT>(row + 16 * g, v);
    const __m256 s = _mm256_set1_ps(scale_at<KIND>(sc, s0 + g, e8m0));
    for (int j = 0; j < NT; ++j) {
      const float* xg = xd + (t + j) * K + 32 * g;
      __m256 p0 = _mm256_mul_ps(v[0], _mm256_loadu_ps(xg));
      __m256 p1 = _mm256_mul_ps(v[1], _mm256_loadu_ps(xg + 8));
      p0 = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xg + 16), p0);
      p1 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xg + 24), p1);
      acc[j][0] = _mm256_fmadd_ps(p0, s, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(p1, s, acc[j][1]);
    }
  }
  for (int j = 0; j < NT; ++j) y[(t + j) * n + r] = tokenfab_cpu::hsum(_mm256_add_ps(acc[j][0], acc[j][1]));
}

// Rows [r0, r1) of one expert times tokens [t0, t1) into y: per row, passes of up to four tokens.
template <int FMT, int KIND>
void gemv_block(const uint8_t* w, const void* sc, const float* e8m0, int64_t K, int64_t r0, int64_t r1,
                const float* xd, int64_t t0, int64_t t1, float* y, int64_t n) {
  const int64_t ng = K / kGroup;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * (K / 2);
    for (int64_t t = t0; t < t1; t += 4) {
      switch (std::min<int64_t>(4, t1 - t)) {
        case 1: row_pass<FMT, KIND, 1>(row, sc, r * ng, ng, e8m0, xd, K, t, y, n, r); break;
        case 2: row_pass<FMT, KIND, 2>(row, sc, r * ng, ng, e8m0, xd, K, t, y, n, r); break;
        case 3: row_pass<FMT, KIND, 3>(row, sc, r * ng, ng, e8m0, xd, K, t, y, n, r); break;
        default: row_pass<FMT, KIND, 4>(row, sc, r * ng, ng, e8m0, xd, K, t, y, n, r);
      }
    }
  }
}

// Rows [r0, r1) of one expert as the reference's float32 values (code * scale: exact), rearranged order, into
// buf [r1 - r0, K].
template <int FMT, int KIND>
void dequant_rows(const uint8_t* w, const void* sc, const float* e8m0, int64_t K, int64_t r0, int64_t r1,
                  float* buf) {
  const int64_t ng = K / kGroup;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < ng; ++g) {
      __m256 v[4];
      group_codes<FMT>(w + r * (K / 2) + 16 * g, v);
      const __m256 s = _mm256_set1_ps(scale_at<KIND>(sc, r * ng + g, e8m0));
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(buf + (r - r0) * K + 32 * g + 8 * i, _mm256_mul_ps(v[i], s));
    }
}

struct Item {
  int64_t a, r0, r1;
};

template <int FMT, int KIND>
void run(const float* xd, int64_t K, const uint8_t* packed, const uint8_t* scales, int64_t scale_bytes, int64_t n,
         const int64_t* ep, const int64_t* op, int64_t A, float* y) {
  const float* e8m0 = e8m0_half_table();
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
        gemv_block<FMT, KIND>(w, sc, e8m0, K, it.r0, it.r1, xd, t0, t1, y, n);
        continue;
      }
      const int64_t rows = it.r1 - it.r0;
      buf.resize(kPanel * K);
      dequant_rows<FMT, KIND>(w, sc, e8m0, K, it.r0, it.r1, buf.data());
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
  float* yp = y.data_ptr<float>();
  if (fmt == kExpertsMxfp4)
    run<kExpertsMxfp4, kE8m0>(xo, K, pp, sp, 1, n, seg.ep(), seg.op(), seg.A, yp);
  else if (kind == kFp16)
    run<kExpertsInt4Group, kFp16>(xo, K, pp, sp, 2, n, seg.ep(), seg.op(), seg.A, yp);
  else
    run<kExpertsInt4Group, kBf16>(xo, K, pp, sp, 2, n, seg.ep(), seg.op(), seg.A, yp);
#endif
  return y;
}
