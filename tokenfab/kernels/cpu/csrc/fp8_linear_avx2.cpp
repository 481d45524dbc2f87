// FP8 block-scaled linears (DeepSeek-V3 / Kimi-K2's e4m3 weights with float32 scale_inv per 128 x 128 block, as
// published) on CPUs without AVX512-BF16: AVX2 + FMA + F16C, float32 x and float32 arithmetic.
//
// An e4m3 byte s|eeee|mmm widened to 16 bits and placed as the fp16 pattern s at bit 15, eeee|mmm at bits 7..13 is the
// fp16 number e4m3 * 2^-8 (fp16's exponent bias 15 against e4m3's 7, subnormals included); 0x7F / 0xFF (e4m3's NaN)
// get fp16's NaN exponent. F16C converts 8 of them to float32 at a time, and the block's scale_inv times 2^8 (exact)
// restores the value: e4m3 * scale_inv rounded once, the value PyTorch's float8_e4m3fn -> float32 conversion and
// the reference's product give.
//
// Up to kGemvMaxRows rows of x (decode): per output row the weight bytes are converted once per pass of four x rows,
// two accumulator chains per x row; rows split over threads in blocks of 8. More rows (prefill): 64-row panels of W
// converted into a thread-local float32 buffer and multiplied by PyTorch's float32 GEMM (at::mm_out, single-threaded
// inside the parallel region, written into y in place). Never a copy of more than 64 rows of W.
//
// The grouped form (fp8_experts_avx2: routed experts, tokenfab/quant/fp8_block_experts.py) runs the same two paths per
// (segment, block of rows) work item, all segments in one parallel region; an expert's rows come in parts (gate | up)
// with their own 128-row scale blocks, which ScaleRows resolves (a dense linear is one part).
#include "fp8_linear.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "cpu_common.h"  // hsum
#include "linear_io.h"

namespace {

constexpr int64_t kGemvMaxRows = 16;  // more rows of x: the panels and a GEMM
constexpr int64_t kPanel = 64;        // rows of W per converted prefill panel
constexpr int64_t kRowBlock = 8;      // rows of W per GEMV work item

// The scale_inv row of weight row r: rows come in parts of part_rows rows, each with ceil(part_rows / 128) block rows
// of kb_n scales (a dense linear: one part of n rows, so block row r / 128).
struct ScaleRows {
  const float* sc;
  int64_t kb_n, part_rows, block_rows;
  const float* row(int64_t r) const {
    return sc + ((r / part_rows) * block_rows + (r % part_rows) / kFp8Block) * kb_n;
  }
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kBuilt = true;

// 16 e4m3 bytes at p -> their values times 2^-8 as two float32 vectors (bytes 0-7, 8-15).
inline void e4m3x16(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i em = _mm256_and_si256(v, _mm256_set1_epi16(0x7F));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8),
                              _mm256_slli_epi16(em, 7));
  h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(em, _mm256_set1_epi16(0x7F)),
                                          _mm256_set1_epi16(0x7E00)));  // NaN
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// Row r of W times rows [m0, m0 + NT) of x into y (+ bias): the accumulators stay in registers (NT a constant).
template <int NT>
inline void row_pass(const float* x, int64_t ldx, int64_t m0, int64_t K, const uint8_t* row, const float* srow,
                     int64_t kb_n, int64_t n, const float* bias, float* y, int64_t r) {
  __m256 a[NT][2];
  for (int t = 0; t < NT; ++t) a[t][0] = a[t][1] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < kb_n; ++kb) {
    const __m256 s = _mm256_set1_ps(srow[kb] * 256.f);
    const int64_t c1 = std::min<int64_t>(K, (kb + 1) * kFp8Block);
    for (int64_t c = kb * kFp8Block; c < c1; c += 16) {
      __m256 lo, hi;
      e4m3x16(row + c, lo, hi);
      lo = _mm256_mul_ps(lo, s);
      hi = _mm256_mul_ps(hi, s);
      for (int t = 0; t < NT; ++t) {
        const float* xt = x + (m0 + t) * ldx + c;
        a[t][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xt), a[t][0]);
        a[t][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xt + 8), a[t][1]);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    y[(m0 + t) * n + r] = tokenfab_cpu::hsum(_mm256_add_ps(a[t][0], a[t][1])) + (bias == nullptr ? 0.f : bias[r]);
}

// Rows [r0, r1) of W times the M rows of x into y [M, n] (+ bias): per row, passes of up to four x rows.
void gemv(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, const ScaleRows& sr, int64_t n,
          const float* bias, float* y, int64_t r0, int64_t r1) {
  const int64_t kb_n = sr.kb_n;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * K;
    const float* srow = sr.row(r);
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      switch (std::min<int64_t>(4, M - m0)) {
        case 1: row_pass<1>(x, ldx, m0, K, row, srow, kb_n, n, bias, y, r); break;
        case 2: row_pass<2>(x, ldx, m0, K, row, srow, kb_n, n, bias, y, r); break;
        case 3: row_pass<3>(x, ldx, m0, K, row, srow, kb_n, n, bias, y, r); break;
        default: row_pass<4>(x, ldx, m0, K, row, srow, kb_n, n, bias, y, r);
      }
    }
  }
}

// Rows [r0, r1) of W as float32 values into buf [r1 - r0, K].
void convert_rows(const uint8_t* w, const ScaleRows& sr, int64_t K, int64_t r0, int64_t r1, float* buf) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* srow = sr.row(r);
    for (int64_t c = 0; c < K; c += 16) {
      const __m256 s = _mm256_set1_ps(srow[c / kFp8Block] * 256.f);
      __m256 lo, hi;
      e4m3x16(w + r * K + c, lo, hi);
      _mm256_storeu_ps(buf + (r - r0) * K + c, _mm256_mul_ps(lo, s));
      _mm256_storeu_ps(buf + (r - r0) * K + c + 8, _mm256_mul_ps(hi, s));
    }
  }
}
#else
constexpr bool kBuilt = false;
#endif

}  // namespace

bool fp8_block_linear_avx2_built() { return kBuilt; }

at::Tensor fp8_block_linear_avx2(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_inv,
                                 const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kBuilt, "fp8_block_linear_avx2: the kernels were built without AVX2 / FMA / F16C");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "fp8_block_linear_avx2: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "fp8_block_linear_avx2: w must be contiguous uint8 [n, K] (the e4m3 bytes)");
  const int64_t n = w.size(0), K = w.size(1), kb_n = (K + kFp8Block - 1) / kFp8Block;
  TORCH_CHECK(x.size(-1) == K && K % 32 == 0, "fp8_block_linear_avx2: x has ", x.size(-1), " inputs for w [", n,
              ", ", K, "] (K must be a multiple of 32)");
  TORCH_CHECK(scale_inv.scalar_type() == at::kFloat && scale_inv.is_contiguous() && scale_inv.dim() == 2 &&
              scale_inv.size(0) == (n + kFp8Block - 1) / kFp8Block && scale_inv.size(1) == kb_n,
              "fp8_block_linear_avx2: scale_inv must be contiguous float32 [ceil(n / 128), ceil(K / 128)]");
  auto rows = tokenfab_cpu::linear_rows(x, K, n, at::kFloat);
  const int64_t M = rows.M;
  if (M == 0 || n == 0) return rows.y;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  at::Tensor bf;
  const float* bp = tokenfab_cpu::float_bias(bias, n, "fp8_block_linear_avx2", bf);
  const float* xp = rows.x2.data_ptr<float>();
  const int64_t ldx = rows.x2.stride(0);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale_inv.data_ptr<float>();
  float* yp = rows.y.data_ptr<float>();
  const ScaleRows sr{sp, kb_n, n, (n + kFp8Block - 1) / kFp8Block};
  if (M <= kGemvMaxRows) {
    at::parallel_for(0, (n + kRowBlock - 1) / kRowBlock, 1, [&](int64_t b0, int64_t b1) {
      gemv(xp, ldx, M, K, wp, sr, n, bp, yp, b0 * kRowBlock, std::min(n, b1 * kRowBlock));
    });
    return rows.y;
  }
  at::parallel_for(0, (n + kPanel - 1) / kPanel, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> buf(kPanel * K);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r0 = p * kPanel, r1 = std::min(n, r0 + kPanel);
      convert_rows(wp, sr, K, r0, r1, buf.data());
      tokenfab_cpu::mm_into(yp + r0, n, xp, ldx, M, K, buf.data(), 1, K, r1 - r0);
    }
  });
  for (int64_t m = 0; bp != nullptr && m < M; ++m)
    for (int64_t j = 0; j < n; ++j) yp[m * n + j] += bp[j];
#endif
  return rows.y;
}

at::Tensor fp8_experts_avx2(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                           const at::Tensor& experts, const at::Tensor& offsets, int64_t part_rows) {
  TORCH_CHECK(kBuilt, "fp8_experts_avx2: the kernels were built without AVX2 / FMA / F16C");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "fp8_experts_avx2: x must be float32 [N, K]");
  const int64_t N = x.size(0), K = x.size(1);
  const auto sh = check_fp8_expert_buffers(K, w, scale, part_rows, "fp8_experts_avx2");
  const int64_t E = sh.E, n = sh.n, kb_n = sh.kb_n, block_rows = sh.block_rows;
  const int64_t srows = (n / part_rows) * block_rows;
  const auto seg = tokenfab_cpu::expert_segments(experts, offsets, E, N, "fp8_experts_avx2");
  at::Tensor y = seg.A == 0 ? at::zeros({N, n}, x.options()) : at::empty({N, n}, x.options());
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t* ep = seg.ep();
  const int64_t* op = seg.op();
  struct Item {
    int64_t a, r0, r1;
  };
  std::vector<Item> items;  // (segment, rows): kRowBlock rows for a GEMV segment, a kPanel-row panel above
  for (int64_t a = 0; a < seg.A; ++a) {
    const int64_t nt = op[a + 1] - op[a], step = nt > kGemvMaxRows ? kPanel : kRowBlock;
    for (int64_t r = 0; nt > 0 && r < n; r += step) items.push_back({a, r, std::min(n, r + step)});
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf;
    for (int64_t i = i0; i < i1; ++i) {
      const Item it = items[i];
      const int64_t e = ep[it.a], t0 = op[it.a], M = op[it.a + 1] - t0;
      const uint8_t* we = wp + e * n * K;
      const ScaleRows sr{sp + e * srows * kb_n, kb_n, part_rows, block_rows};
      if (M <= kGemvMaxRows) {
        gemv(xp + t0 * K, K, M, K, we, sr, n, nullptr, yp + t0 * n, it.r0, it.r1);
        continue;
      }
      buf.resize(kPanel * K);
      convert_rows(we, sr, K, it.r0, it.r1, buf.data());
      tokenfab_cpu::mm_into(yp + t0 * n + it.r0, n, xp + t0 * K, K, M, K, buf.data(), 1, K, it.r1 - it.r0);
    }
  });
#endif
  return y;
}
