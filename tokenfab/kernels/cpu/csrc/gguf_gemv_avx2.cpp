// The decode GEMV of the packed GGUF linears on CPUs without AVX512-BF16 (AVX2 + FMA + F16C: an AVX2-only EPYC,
// or any CPU with TOKENFAB_CPU_ISA=avx2): Q4_0, Q4_1 and Q8_0 tiles (gguf_linear.cpp's layout) times float32 x in
// float32 arithmetic: decode rows (up to 16) in a GEMV on the packed bytes, more rows (prefill) through float32
// tiles dequantized into a cache-resident buffer and PyTorch's float32 GEMM.
//
// A 256-bit vector holds 8 lanes = (row j, k parity e) for four rows of a 16-row tile: in a Q4 group L the u16 words
// 8i .. 8i + 7 (rows 4i .. 4i + 3) zero-extended to 32 bits, nibble s shifted down and masked (k = 8L + 2s + e); in
// Q8_0's pair p the int8 bytes 8i .. 8i + 7 sign-extended (k = 2p + e). Each multiplies the broadcast pair
// (x_k, x_k+1) with one FMA; quants are small integers, exact in float32. Per block and row the sum is scaled once,
// y_j += d_j * sum_k x_k q_jk + m_j * sum_k x_k: Q4_1's minimum m, Q4_0's q - 8 as m = -8 d, Q8_0 none. That is
// gguf's dequantized value (d q + m) times x, summed in another order: float32 accuracy.
//
// Rows: one row keeps two accumulator chains per lane group in registers (k pairs alternating), the weight bytes
// read once; two or more rows unpack each tile-block once into a 2 KB float buffer (L1) and run pairs of rows over it,
// so the quants are unpacked once per call however many rows there are. Tiles are split over threads. More than 16
// rows: per 64 output columns their tiles dequantized once (d q + m, as gguf computes them) into a [K, 64] buffer
// and one float32 GEMM (at::mm_out: the BLAS PyTorch links) of all rows against it; never a full-size copy.
#include "gguf_linear.h"

#include <ATen/Parallel.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "gguf_tiles.h"
#include "linear_io.h"

namespace {

using namespace tokenfab_gguf;  // TN, QK, the ggml type ids, tile_block_bytes (gguf_tiles.h)
constexpr int64_t kGemvMaxRows = 16;  // more rows of x: the dequantizing GEMM (prefill)
constexpr int64_t kCols = 64;         // output columns the GEMM dequantizes at a time (a multiple of 16)

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kBuilt = true;

// The fp16 values of rows 4i .. 4i + 3 at p, each twice: lanes (j, e) of a row group.
inline __m256 dup4(const uint8_t* p) {
  const __m128 v = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}

// Requests the n bytes at p into L1 (a tile-block a few blocks ahead of its use).
inline void prefetch_bytes(const uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// (x[0], x[1]) in every lane pair.
inline __m256 xpair(const float* x) {
  return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x)));
}

// The float32 quants of pair p (k = 2p, 2p + 1 of the block) for row group i of tile-block b: lanes (j, e).
template <int QT>
inline __m256 quants(const uint8_t* b, int p, int i) {
  if constexpr (QT == kQ8_0) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 * TN + 32 * p + 8 * i));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  } else {
    const int L = p / 4, s = p % 4;
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (QT == kQ4_1 ? 4 : 2) * TN + 64 * L + 16 * i));
    const __m256i v = _mm256_srli_epi32(_mm256_cvtepu16_epi32(w), 4 * s);
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  }
}

// The per-row minimum of the block (8 rows from row 8h): Q4_1 its m, Q4_0 -8 d.
template <int QT>
inline __m256 minimums(const uint8_t* b, int h) {
  if constexpr (QT == kQ4_1) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * TN + 16 * h)));
  return _mm256_mul_ps(_mm256_set1_ps(-8.f), _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * h))));
}

// Lane sums of the four (j, e) groups -> the 16 rows' values [r0 .. r7], [r8 .. r15].
inline void rows16(const __m256* a, __m256& lo, __m256& hi) {
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  lo = _mm256_permutevar8x32_ps(_mm256_hadd_ps(a[0], a[1]), order);
  hi = _mm256_permutevar8x32_ps(_mm256_hadd_ps(a[2], a[3]), order);
}

inline void store16(float* y, __m256 lo, __m256 hi, const float* bias, int64_t nvalid) {
  alignas(32) float v[16];
  _mm256_store_ps(v, lo);
  _mm256_store_ps(v + 8, hi);
  for (int64_t j = 0; j < nvalid; ++j) y[j] = v[j] + (bias == nullptr ? 0.f : bias[j]);
}

// One row: tiles [t0, t1), the quants unpacked in registers, two chains per row group.
template <int QT>
void gemv1(const float* x, const float* xsum, int64_t K, const uint8_t* w, int64_t N, const float* bias, float* y,
           int64_t t0, int64_t t1) {
  const int64_t KB = K / QK, TB = tile_block_bytes(QT);
  for (int64_t t = t0; t < t1; ++t) {
    __m256 acc[4], mn[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* b = w + (t * KB + kb) * TB;
      prefetch_bytes(b + 4 * TB, TB);
      const float* xk = x + kb * QK;
      __m256 c0[4], c1[4];
      for (int i = 0; i < 4; ++i) c0[i] = c1[i] = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int p = 0; p < 16; p += 2) {
        const __m256 x0 = xpair(xk + 2 * p), x1 = xpair(xk + 2 * p + 2);
        for (int i = 0; i < 4; ++i) {
          c0[i] = _mm256_fmadd_ps(quants<QT>(b, p, i), x0, c0[i]);
          c1[i] = _mm256_fmadd_ps(quants<QT>(b, p + 1, i), x1, c1[i]);
        }
      }
      for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(_mm256_add_ps(c0[i], c1[i]), dup4(b + 8 * i), acc[i]);
      if constexpr (QT != kQ8_0) {
        const __m256 s = _mm256_set1_ps(xsum[kb]);
        mn[0] = _mm256_fmadd_ps(minimums<QT>(b, 0), s, mn[0]);
        mn[1] = _mm256_fmadd_ps(minimums<QT>(b, 1), s, mn[1]);
      }
    }
    __m256 lo, hi;
    rows16(acc, lo, hi);
    const int64_t n0 = t * TN;
    store16(y + n0, _mm256_add_ps(lo, mn[0]), _mm256_add_ps(hi, mn[1]), bias == nullptr ? nullptr : bias + n0,
            std::min<int64_t>(TN, N - n0));
  }
}

// M >= 2 rows: per tile-block the 64 quant vectors unpacked once into an L1 buffer, then pairs of rows over it.
template <int QT>
void gemv_rows(const float* x, int64_t ldx, const float* xsum, int64_t M, int64_t K, const uint8_t* w, int64_t N,
               const float* bias, float* y, int64_t ldy, int64_t t0, int64_t t1) {
  const int64_t KB = K / QK, TB = tile_block_bytes(QT);
  alignas(32) float buf[16 * 4 * 8];
  std::vector<__m256> acc(M * 4), mn(M * 2);
  for (int64_t t = t0; t < t1; ++t) {
    std::fill(acc.begin(), acc.end(), _mm256_setzero_ps());
    std::fill(mn.begin(), mn.end(), _mm256_setzero_ps());
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* b = w + (t * KB + kb) * TB;
      prefetch_bytes(b + 2 * TB, TB);
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p)
        for (int i = 0; i < 4; ++i) _mm256_store_ps(buf + (4 * p + i) * 8, quants<QT>(b, p, i));
      __m256 d[4];
      for (int i = 0; i < 4; ++i) d[i] = dup4(b + 8 * i);
      __m256 mins[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      if constexpr (QT != kQ8_0) mins[0] = minimums<QT>(b, 0), mins[1] = minimums<QT>(b, 1);
      for (int64_t m = 0; m < M; m += 2) {
        const bool two = m + 1 < M;
        const float* xa = x + m * ldx + kb * QK;
        const float* xb = two ? xa + ldx : xa;
        __m256 ca[4], cb[4];
        for (int i = 0; i < 4; ++i) ca[i] = cb[i] = _mm256_setzero_ps();
#pragma GCC unroll 16
        for (int p = 0; p < 16; ++p) {
          const __m256 pa = xpair(xa + 2 * p), pb = xpair(xb + 2 * p);
          for (int i = 0; i < 4; ++i) {
            const __m256 q = _mm256_load_ps(buf + (4 * p + i) * 8);
            ca[i] = _mm256_fmadd_ps(q, pa, ca[i]);
            cb[i] = _mm256_fmadd_ps(q, pb, cb[i]);
          }
        }
        for (int i = 0; i < 4; ++i) {
          acc[m * 4 + i] = _mm256_fmadd_ps(ca[i], d[i], acc[m * 4 + i]);
          if (two) acc[(m + 1) * 4 + i] = _mm256_fmadd_ps(cb[i], d[i], acc[(m + 1) * 4 + i]);
        }
        if constexpr (QT != kQ8_0) {
          for (int r = 0; r < (two ? 2 : 1); ++r) {
            const __m256 s = _mm256_set1_ps(xsum[(m + r) * KB + kb]);
            mn[(m + r) * 2] = _mm256_fmadd_ps(mins[0], s, mn[(m + r) * 2]);
            mn[(m + r) * 2 + 1] = _mm256_fmadd_ps(mins[1], s, mn[(m + r) * 2 + 1]);
          }
        }
      }
    }
    const int64_t n0 = t * TN, nvalid = std::min<int64_t>(TN, N - n0);
    for (int64_t m = 0; m < M; ++m) {
      __m256 lo, hi;
      rows16(acc.data() + m * 4, lo, hi);
      store16(y + m * ldy + n0, _mm256_add_ps(lo, mn[m * 2]), _mm256_add_ps(hi, mn[m * 2 + 1]),
              bias == nullptr ? nullptr : bias + n0, nvalid);
    }
  }
}

// Tile t's 16 rows as float32 values d q + m into columns [col0, col0 + 16) of buf [K, kCols] (k-major): the weight
// gguf's dequantize gives (d q, d (q - 8), or d q then + m; the compiler may fuse the last into one FMA).
template <int QT>
void dequant_tile(const uint8_t* w, int64_t t, int64_t K, int64_t col0, float* buf) {
  const int64_t KB = K / QK, TB = tile_block_bytes(QT);
  const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // lanes (j, e) -> [e = 0 rows | e = 1 rows]
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* b = w + (t * KB + kb) * TB;
    for (int i = 0; i < 4; ++i) {
      const __m256 d = dup4(b + 8 * i);
      const __m256 m = QT == kQ4_1 ? dup4(b + 2 * TN + 8 * i) : _mm256_setzero_ps();
      for (int p = 0; p < 16; ++p) {
        __m256 q = quants<QT>(b, p, i);
        if constexpr (QT == kQ4_0) q = _mm256_sub_ps(q, _mm256_set1_ps(8.f));  // d (q - 8)
        __m256 v = _mm256_mul_ps(q, d);
        if constexpr (QT == kQ4_1) v = _mm256_add_ps(v, m);  // d q + m
        v = _mm256_permutevar8x32_ps(v, split);
        float* row = buf + (kb * QK + 2 * p) * kCols + col0 + 4 * i;
        _mm_storeu_ps(row, _mm256_castps256_ps128(v));
        _mm_storeu_ps(row + kCols, _mm256_extractf128_ps(v, 1));
      }
    }
  }
}

// Prefill (many rows): per kCols output columns, their tiles dequantized once into a thread-local [K, kCols] buffer
// (K * 256 bytes, cache-resident), then one float32 GEMM of every row of x against it (at::mm_out, written into y in
// place). Wider column blocks would pack x fewer times, narrower ones split small N more evenly over threads.
template <int QT>
void gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy) {
  const int64_t NT = (N + TN - 1) / TN, NB = (N + kCols - 1) / kCols;
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    std::vector<float> buf(K * kCols, 0.f);
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      for (int64_t c = 0; c < kCols / TN; ++c)
        if (nb * (kCols / TN) + c < NT) dequant_tile<QT>(w, nb * (kCols / TN) + c, K, TN * c, buf.data());
      const int64_t nvalid = std::min<int64_t>(kCols, N - nb * kCols);
      at::Tensor out = at::from_blob(y + nb * kCols, {M, nvalid}, {ldy, 1}, f32);  // written in place (ldc = ldy)
      at::mm_out(out, at::from_blob(const_cast<float*>(x), {M, K}, {ldx, 1}, f32),
                 at::from_blob(buf.data(), {K, nvalid}, {kCols, 1}, f32));
    }
  });
}

template <int QT>
void run(const float* x, int64_t ldx, const float* xsum, int64_t M, int64_t K, const uint8_t* w, int64_t N,
         const float* bias, float* y, int64_t ldy) {
  if (M > kGemvMaxRows) {
    gemm<QT>(x, ldx, M, K, w, N, y, ldy);
    for (int64_t m = 0; bias != nullptr && m < M; ++m)
      for (int64_t j = 0; j < N; ++j) y[m * ldy + j] += bias[j];
    return;
  }
  const int64_t NT = (N + TN - 1) / TN;
  at::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
    if (M == 1) gemv1<QT>(x, xsum, K, w, N, bias, y, t0, t1);
    else gemv_rows<QT>(x, ldx, xsum, M, K, w, N, bias, y, ldy, t0, t1);
  });
}
#else
constexpr bool kBuilt = false;
#endif

}  // namespace

bool gguf_gemv_avx2_built() { return kBuilt; }

at::Tensor gguf_gemv_avx2(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kBuilt, "gguf_gemv_avx2: the kernels were built without AVX2 / FMA / F16C");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gguf_gemv_avx2: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0,
              "gguf_gemv_avx2: ggml type ", qtype, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  const int64_t K = x.size(-1);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const int64_t TB = tile_block_bytes(static_cast<int>(qtype));
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() && w.size(2) == TB &&
              w.size(1) * QK == K && w.size(0) == (n + TN - 1) / TN && n > 0,
              "gguf_gemv_avx2: weight ", w.sizes(), " does not hold ", n, " rows of ", K, " inputs of ggml type ",
              qtype);
  auto rows = tokenfab_cpu::linear_rows(x, K, n, at::kFloat);
  const int64_t M = rows.M;
  if (M == 0) return rows.y;
  at::Tensor bf;
  const float* bp = tokenfab_cpu::float_bias(bias, n, "gguf_gemv_avx2", bf);
  const float* xp = rows.x2.data_ptr<float>();
  const int64_t ldx = rows.x2.stride(0), KB = K / QK;
  std::vector<float> xsum(qtype == kQ8_0 || M > kGemvMaxRows ? 0 : M * KB);
  for (int64_t m = 0; m < M && !xsum.empty(); ++m)
    for (int64_t kb = 0; kb < KB; ++kb) {
      float s = 0.f;
      for (int64_t k = 0; k < QK; ++k) s += xp[m * ldx + kb * QK + k];
      xsum[m * KB + kb] = s;
    }
  float* yp = rows.y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (qtype == kQ4_0) run<kQ4_0>(xp, ldx, xsum.data(), M, K, wp, n, bp, yp, n);
  else if (qtype == kQ4_1) run<kQ4_1>(xp, ldx, xsum.data(), M, K, wp, n, bp, yp, n);
  else run<kQ8_0>(xp, ldx, xsum.data(), M, K, wp, n, bp, yp, n);
  return rows.y;
#else
  return at::Tensor();
#endif
}
