// The packed GGUF linears on CPUs without AVX512-BF16 (AVX2 + FMA + F16C: an AVX2-only EPYC, or any CPU with
// TOKENFAB_CPU_ISA=avx2): Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K tiles (gguf_linear.cpp's and gguf_tiles.h's layouts)
// times float32 x in float32 arithmetic: decode rows (up to 16) in a GEMV on the packed bytes, more rows (prefill)
// through float32 panels dequantized into a cache-resident buffer and PyTorch's float32 GEMM.
//
// A 256-bit vector holds 8 lanes = (row j, k parity e) for four rows of a 16-row tile: in a Q4 group L the u16 words
// 8i .. 8i + 7 (rows 4i .. 4i + 3) zero-extended to 32 bits, nibble s shifted down and masked (k = 8L + 2s + e); in
// Q8_0's pair p the int8 bytes 8i .. 8i + 7 sign-extended (k = 2p + e). Each multiplies the broadcast pair
// (x_k, x_k+1) with one FMA; quants are small integers, exact in float32. Per block and row the sum is scaled once,
// y_j += d_j * sum_k x_k q_jk + m_j * sum_k x_k: Q4_1's minimum m, Q4_0's q - 8 as m = -8 d, Q8_0 none. That is
// gguf's dequantized value (d q + m) times x, summed in another order: float32 accuracy. K-quants run each 32-input
// sub-block the same way with the tile-block's scales decoded once into float32 tables (d sc, -(dmin m); Q6_K's
// int8 scales per 16 inputs and q - 32 in the integer quants).
//
// Rows: one row keeps two accumulator chains per lane group in registers (k pairs alternating), the weight bytes
// read once; two or more rows unpack each block (sub-block) once into a 2 KB float buffer (L1) and run pairs of rows
// over it, so the quants are unpacked once per call however many rows there are. Tiles are split over threads. More
// than 16 rows: per panel of output columns their tiles dequantized once (the values gguf computes) into a
// [K, cols] buffer and one float32 GEMM (at::mm_out: the BLAS PyTorch links) of all rows against it (see gemm);
// never a full-size copy.
#include "gguf_linear.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "gguf_tiles.h"
#include "linear_io.h"

namespace {

using namespace tokenfab_gguf;  // TN, QK, the ggml type ids, tile_block_bytes (gguf_tiles.h)
constexpr int64_t kGemvMaxRows = 16;  // more rows of x: the dequantizing GEMM (prefill)
constexpr int64_t kCols = 64;         // the narrowest panel of output columns the GEMM dequantizes at a time

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

// Tile t's 16 outputs of rows m < M: acc [M * 4] (lanes (j, e)) reduced to rows, + mn [M * 2] (row order), + bias.
inline void store_tile_rows(const __m256* acc, const __m256* mn, int64_t M, float* y, int64_t ldy, int64_t t,
                            int64_t N, const float* bias) {
  const int64_t n0 = t * TN, nvalid = std::min<int64_t>(TN, N - n0);
  for (int64_t m = 0; m < M; ++m) {
    __m256 lo, hi;
    rows16(acc + m * 4, lo, hi);
    store16(y + m * ldy + n0, _mm256_add_ps(lo, mn[m * 2]), _mm256_add_ps(hi, mn[m * 2 + 1]),
            bias == nullptr ? nullptr : bias + n0, nvalid);
  }
}

// mn[0..1] += (lo, hi) * s: a block's 16 minimums (row order) times the row's x sum over the block.
inline void add_minimums(__m256* mn, __m256 lo, __m256 hi, float s) {
  const __m256 sv = _mm256_set1_ps(s);
  mn[0] = _mm256_fmadd_ps(lo, sv, mn[0]);
  mn[1] = _mm256_fmadd_ps(hi, sv, mn[1]);
}

// Lanes (j, e) of v into rows k and k + 1 of buf [K, ldb] at column col (e = 0 rows, then e = 1 rows).
inline void store_split(__m256 v, float* row, int64_t ldb) {
  v = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
  _mm_storeu_ps(row, _mm256_castps256_ps128(v));
  _mm_storeu_ps(row + ldb, _mm256_extractf128_ps(v, 1));
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
      if constexpr (QT != kQ8_0) add_minimums(mn, minimums<QT>(b, 0), minimums<QT>(b, 1), xsum[kb]);
    }
    store_tile_rows(acc, mn, 1, y, 0, t, N, bias);
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
        if constexpr (QT != kQ8_0)
          for (int r = 0; r < (two ? 2 : 1); ++r)
            add_minimums(&mn[(m + r) * 2], mins[0], mins[1], xsum[(m + r) * KB + kb]);
      }
    }
    store_tile_rows(acc.data(), mn.data(), M, y, ldy, t, N, bias);
  }
}

// Tile t's 16 rows as float32 values d q + m into columns [col0, col0 + 16) of buf [K, ldb] (k-major): the weight
// gguf's dequantize gives (d q, d (q - 8), or d q then + m; the compiler may fuse the last into one FMA).
template <int QT>
void dequant_tile(const uint8_t* w, int64_t t, int64_t K, int64_t col0, float* buf, int64_t ldb) {
  const int64_t KB = K / QK, TB = tile_block_bytes(QT);
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
        store_split(v, buf + (kb * QK + 2 * p) * ldb + col0 + 4 * i, ldb);
      }
    }
  }
}

// ---- K-quants (Q4_K, Q5_K, Q6_K: 16-row tile-blocks of 256 inputs, gguf_tiles.h / gguf_kquants.py) ----
//
// A tile-block's scales are decoded once into float32 tables with the rows innermost: the multiplier of scale group
// g, s[g][row] = d * sc (Q4_K / Q5_K: 8 groups of 32 inputs, sc 6 bits; Q6_K: 16 groups of 16, sc int8), and for
// Q4_K / Q5_K the negated minimum nm[g][row] = -(dmin * m). Both products are exact in float32 (gguf_kquants.py), so
// the dequantized value s q + nm (Q6_K: s (q - 32)) is gguf's. The GEMVs run each 32-input sub-block as Q4_1 runs
// its block: float32 FMAs on the integer quants, lanes (row, k parity), scaled per group, the minimum times the
// sub-block's x sum.
struct KScales {
  alignas(32) float s[16][16];
  alignas(32) float nm[8][16];
};

template <int QT>
inline void kscales(const uint8_t* b, KScales& ks) {
  for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * h)));
    if constexpr (QT == kQ6_K) {
      for (int g = 0; g < 16; ++g) {
        const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 32 + 16 * g + 8 * h));
        _mm256_store_ps(ks.s[g] + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
      }
    } else {
      const __m256 ndmin = _mm256_sub_ps(_mm256_setzero_ps(),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32 + 16 * h))));
      __m256i by[12];  // scale byte i of the 8 rows (gguf_kquants._scale_min's layout)
      for (int i = 0; i < 12; ++i)
        by[i] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 64 + 16 * i + 8 * h)));
      const __m256i m63 = _mm256_set1_epi32(63), m15 = _mm256_set1_epi32(15), m48 = _mm256_set1_epi32(48);
      for (int g = 0; g < 8; ++g) {
        __m256i sc, mn;
        if (g < 4) {
          sc = _mm256_and_si256(by[g], m63);
          mn = _mm256_and_si256(by[g + 4], m63);
        } else {
          sc = _mm256_or_si256(_mm256_and_si256(by[g + 4], m15),
                               _mm256_and_si256(_mm256_srli_epi32(by[g - 4], 2), m48));
          mn = _mm256_or_si256(_mm256_srli_epi32(by[g + 4], 4), _mm256_and_si256(_mm256_srli_epi32(by[g], 2), m48));
        }
        _mm256_store_ps(ks.s[g] + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
        _mm256_store_ps(ks.nm[g] + 8 * h, _mm256_mul_ps(ndmin, _mm256_cvtepi32_ps(mn)));
      }
    }
  }
}

// Rows 4i .. 4i + 3 of a 16-float table, each twice: lanes (j, e).
inline __m256 dupf(const float* v) {
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_load_ps(v)), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}

// 32-bit lanes shifted so that bit sh lands at bit 4 (sh < 4: shifted left; sh == 4: as they are).
inline __m256i shift_to4(__m256i v, int sh) {
  return sh > 4 ? _mm256_srli_epi32(v, sh - 4) : sh < 4 ? _mm256_slli_epi32(v, 4 - sh) : v;
}

// The float32 quants of pair p (0..15: k = 2p, 2p + 1) of sub-block g for row group i: lanes (j, e); Q5_K with its
// bit 4, Q6_K with bits 4..5 and minus 32.
template <int QT>
inline __m256 kquants(const uint8_t* b, int g, int p, int i) {
  const int L = p / 4, s = p % 4;
  const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kq_lo_off(QT) + 256 * g + 64 * L + 16 * i));
  __m256i q = _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu16_epi32(w), 4 * s), _mm256_set1_epi32(15));
  // the high bits are shifted straight to bit 4 and masked there (one shift and one mask, not two shifts)
  if constexpr (QT == kQ5_K) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kq_hi_off(QT) + 64 * g + 16 * i));
    const __m256i bit = _mm256_and_si256(shift_to4(_mm256_cvtepu16_epi32(h), p), _mm256_set1_epi32(16));
    q = _mm256_or_si256(q, bit);
  } else if constexpr (QT == kQ6_K) {
    const int H = p / 8, u = p % 8;
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kq_hi_off(QT) + 128 * g + 64 * H + 16 * i));
    const __m256i bits = _mm256_and_si256(shift_to4(_mm256_cvtepu16_epi32(h), 2 * u), _mm256_set1_epi32(48));
    q = _mm256_sub_epi32(_mm256_or_si256(q, bits), _mm256_set1_epi32(32));
  }
  return _mm256_cvtepi32_ps(q);
}

// 16-bit lanes shifted so that bit sh lands at bit 4 (sh < 4: shifted left; sh == 4: as they are).
inline __m256i shift16_to4(__m256i v, int sh) {
  return sh > 4 ? _mm256_srli_epi16(v, sh - 4) : sh < 4 ? _mm256_slli_epi16(v, 4 - sh) : v;
}

// The float32 quants of pair p of sub-block g for all four row groups: q[i] as kquants(b, g, p, i). Q5_K and Q6_K
// merge their high bits in 16-bit lanes over two row groups at once (one 32-byte load of each: the groups' words lie
// side by side), then widen each half: about 6.5 instead of 8 instructions per 8 Q6_K weights, the same integers.
template <int QT>
inline void kquants4(const uint8_t* b, int g, int p, __m256* q) {
  if constexpr (QT == kQ4_K) {
    for (int i = 0; i < 4; ++i) q[i] = kquants<QT>(b, g, p, i);
  } else {
    const int L = p / 4, s = p % 4;
    for (int i2 = 0; i2 < 2; ++i2) {
      const __m256i w = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(b + kq_lo_off(QT) + 256 * g + 64 * L + 32 * i2));
      __m256i v = _mm256_and_si256(_mm256_srli_epi16(w, 4 * s), _mm256_set1_epi16(15));
      if constexpr (QT == kQ5_K) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kq_hi_off(QT) + 64 * g + 32 * i2));
        v = _mm256_or_si256(v, _mm256_and_si256(shift16_to4(h, p), _mm256_set1_epi16(16)));
      } else {
        const int H = p / 8, u = p % 8;
        const __m256i h = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(b + kq_hi_off(QT) + 128 * g + 64 * H + 32 * i2));
        v = _mm256_sub_epi16(_mm256_or_si256(v, _mm256_and_si256(shift16_to4(h, 2 * u), _mm256_set1_epi16(48))),
                             _mm256_set1_epi16(32));
      }
      q[2 * i2] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)));
      q[2 * i2 + 1] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1)));
    }
  }
}

// Scale group of pairs [8 half, 8 half + 8) of sub-block g.
template <int QT>
constexpr int kgroup(int g, int half) { return QT == kQ6_K ? 2 * g + half : g; }

// One row over K-quant tiles [t0, t1): the quants in registers, two chains per row group and half sub-block.
template <int QT>
void kgemv1(const float* x, const float* xsum, int64_t K, const uint8_t* w, int64_t N, const float* bias, float* y,
            int64_t t0, int64_t t1) {
  const int64_t KB = K / 256, TB = tile_block_bytes(QT);
  KScales ks;
  for (int64_t t = t0; t < t1; ++t) {
    __m256 acc[4], mn[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* b = w + (t * KB + kb) * TB;
      prefetch_bytes(b + TB, TB);
      kscales<QT>(b, ks);
      for (int g = 0; g < 8; ++g) {
        const float* xk = x + kb * 256 + 32 * g;
        for (int half = 0; half < 2; ++half) {
          __m256 c0[4], c1[4];
          for (int i = 0; i < 4; ++i) c0[i] = c1[i] = _mm256_setzero_ps();
#pragma GCC unroll 8
          for (int p = 8 * half; p < 8 * half + 8; p += 2) {
            const __m256 x0 = xpair(xk + 2 * p), x1 = xpair(xk + 2 * p + 2);
            __m256 q0[4], q1[4];
            kquants4<QT>(b, g, p, q0);
            kquants4<QT>(b, g, p + 1, q1);
            for (int i = 0; i < 4; ++i) {
              c0[i] = _mm256_fmadd_ps(q0[i], x0, c0[i]);
              c1[i] = _mm256_fmadd_ps(q1[i], x1, c1[i]);
            }
          }
          const float* sg = ks.s[kgroup<QT>(g, half)];
          for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(_mm256_add_ps(c0[i], c1[i]), dupf(sg + 4 * i), acc[i]);
        }
        if constexpr (QT != kQ6_K)
          add_minimums(mn, _mm256_load_ps(ks.nm[g]), _mm256_load_ps(ks.nm[g] + 8), xsum[kb * 8 + g]);
      }
    }
    store_tile_rows(acc, mn, 1, y, 0, t, N, bias);
  }
}

// M >= 2 rows over K-quant tiles: per sub-block the 64 quant vectors unpacked once into an L1 buffer, then pairs of
// rows over it (as gemv_rows).
template <int QT>
void kgemv_rows(const float* x, int64_t ldx, const float* xsum, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                const float* bias, float* y, int64_t ldy, int64_t t0, int64_t t1) {
  const int64_t KB = K / 256, TB = tile_block_bytes(QT), KS = K / QK;
  alignas(32) float buf[16 * 4 * 8];
  KScales ks;
  std::vector<__m256> acc(M * 4), mn(M * 2);
  for (int64_t t = t0; t < t1; ++t) {
    std::fill(acc.begin(), acc.end(), _mm256_setzero_ps());
    std::fill(mn.begin(), mn.end(), _mm256_setzero_ps());
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* b = w + (t * KB + kb) * TB;
      prefetch_bytes(b + TB, TB);
      kscales<QT>(b, ks);
      for (int g = 0; g < 8; ++g) {
#pragma GCC unroll 16
        for (int p = 0; p < 16; ++p) {
          __m256 q[4];
          kquants4<QT>(b, g, p, q);
          for (int i = 0; i < 4; ++i) _mm256_store_ps(buf + (4 * p + i) * 8, q[i]);
        }
        for (int64_t m = 0; m < M; m += 2) {
          const bool two = m + 1 < M;
          const float* xa = x + m * ldx + kb * 256 + 32 * g;
          const float* xb = two ? xa + ldx : xa;
          for (int half = 0; half < 2; ++half) {
            __m256 ca[4], cb[4];
            for (int i = 0; i < 4; ++i) ca[i] = cb[i] = _mm256_setzero_ps();
#pragma GCC unroll 8
            for (int p = 8 * half; p < 8 * half + 8; ++p) {
              const __m256 pa = xpair(xa + 2 * p), pb = xpair(xb + 2 * p);
              for (int i = 0; i < 4; ++i) {
                const __m256 q = _mm256_load_ps(buf + (4 * p + i) * 8);
                ca[i] = _mm256_fmadd_ps(q, pa, ca[i]);
                cb[i] = _mm256_fmadd_ps(q, pb, cb[i]);
              }
            }
            const float* sg = ks.s[kgroup<QT>(g, half)];
            for (int i = 0; i < 4; ++i) {
              const __m256 d = dupf(sg + 4 * i);
              acc[m * 4 + i] = _mm256_fmadd_ps(ca[i], d, acc[m * 4 + i]);
              if (two) acc[(m + 1) * 4 + i] = _mm256_fmadd_ps(cb[i], d, acc[(m + 1) * 4 + i]);
            }
          }
          if constexpr (QT != kQ6_K)
            for (int r = 0; r < (two ? 2 : 1); ++r)
              add_minimums(&mn[(m + r) * 2], _mm256_load_ps(ks.nm[g]), _mm256_load_ps(ks.nm[g] + 8),
                           xsum[(m + r) * KS + kb * 8 + g]);
        }
      }
    }
    store_tile_rows(acc.data(), mn.data(), M, y, ldy, t, N, bias);
  }
}

// K-quant tile t's 16 rows as float32 values into columns [col0, col0 + 16) of buf [K, ldb]: gguf's (d sc) q -
// (dmin m), or Q6_K's (d sc) (q - 32) (a product then a sum, as gguf computes them; the compiler may fuse them).
template <int QT>
void kdequant_tile(const uint8_t* w, int64_t t, int64_t K, int64_t col0, float* buf, int64_t ldb) {
  const int64_t KB = K / 256, TB = tile_block_bytes(QT);
  KScales ks;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* b = w + (t * KB + kb) * TB;
    kscales<QT>(b, ks);
    for (int g = 0; g < 8; ++g)
      for (int i = 0; i < 4; ++i)
        for (int p = 0; p < 16; ++p) {
          __m256 v = _mm256_mul_ps(kquants<QT>(b, g, p, i), dupf(ks.s[kgroup<QT>(g, p / 8)] + 4 * i));
          if constexpr (QT != kQ6_K) v = _mm256_add_ps(v, dupf(ks.nm[g] + 4 * i));
          store_split(v, buf + (kb * 256 + 32 * g + 2 * p) * ldb + col0 + 4 * i, ldb);
        }
  }
}

// Tile t's values into columns [col0, col0 + 16) of buf [K, ldb].
template <int QT>
inline void dequant_any(const uint8_t* w, int64_t t, int64_t K, int64_t col0, float* buf, int64_t ldb) {
  if constexpr (is_kquant(QT)) kdequant_tile<QT>(w, t, K, col0, buf, ldb);
  else dequant_tile<QT>(w, t, K, col0, buf, ldb);
}

// Output columns per shared panel: the widest multiple of 16 (at most 512) whose [K, cols] float32 panel fits ~2 MB,
// at least kCols. Each panel is one GEMM over every row of x, which the BLAS packs again per call: wider panels pack
// x fewer times.
inline int64_t panel_cols(int64_t K, int64_t N) {
  const int64_t fit = (int64_t{2} << 20) / (4 * K) / TN * TN;
  return std::min<int64_t>(std::max<int64_t>(kCols, std::min<int64_t>(fit, 512)), (N + TN - 1) / TN * TN);
}

// Prefill (more than 16 rows), never a full-size copy of W. Up to kThreadPanelRows rows: the kCols-column panels
// split over threads, each dequantized into the thread's own [K, kCols] buffer and multiplied by a single-threaded
// GEMM (small GEMMs gain little from the BLAS's own threads). More rows: one wide panel at a time (panel_cols),
// dequantized by all threads into a shared buffer, then one GEMM the BLAS threads itself (at::mm_out, written into
// y in place).
constexpr int64_t kThreadPanelRows = 128;

template <int QT>
void gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy) {
  const int64_t NT = (N + TN - 1) / TN;
  if (M <= kThreadPanelRows) {
    at::parallel_for(0, (N + kCols - 1) / kCols, 1, [&](int64_t nb0, int64_t nb1) {
      std::vector<float> buf(K * kCols, 0.f);
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        for (int64_t c = 0; c < kCols / TN && nb * (kCols / TN) + c < NT; ++c)
          dequant_any<QT>(w, nb * (kCols / TN) + c, K, TN * c, buf.data(), kCols);
        const int64_t nvalid = std::min<int64_t>(kCols, N - nb * kCols);
        tokenfab_cpu::mm_into(y + nb * kCols, ldy, x, ldx, M, K, buf.data(), kCols, 1, nvalid);
      }
    });
    return;
  }
  const int64_t NC = panel_cols(K, N);
  std::vector<float> buf(K * NC, 0.f);
  for (int64_t n0 = 0; n0 < N; n0 += NC) {
    const int64_t t0 = n0 / TN, t1 = std::min<int64_t>(NT, (n0 + NC) / TN), nvalid = std::min<int64_t>(NC, N - n0);
    at::parallel_for(t0, t1, 1, [&](int64_t a, int64_t b) {
      for (int64_t t = a; t < b; ++t) dequant_any<QT>(w, t, K, (t - t0) * TN, buf.data(), NC);
    });
    tokenfab_cpu::mm_into(y + n0, ldy, x, ldx, M, K, buf.data(), NC, 1, nvalid);
  }
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
    if constexpr (is_kquant(QT)) {
      if (M == 1) kgemv1<QT>(x, xsum, K, w, N, bias, y, t0, t1);
      else kgemv_rows<QT>(x, ldx, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    } else {
      if (M == 1) gemv1<QT>(x, xsum, K, w, N, bias, y, t0, t1);
      else gemv_rows<QT>(x, ldx, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    }
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
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0 || is_kquant(static_cast<int>(qtype)),
              "gguf_gemv_avx2: ggml type ", qtype, " is not Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), Q5_K (13) or ",
              "Q6_K (14)");
  const int64_t K = x.size(-1);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const int64_t TB = tile_block_bytes(static_cast<int>(qtype));
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() && w.size(2) == TB &&
              w.size(1) * block_k(static_cast<int>(qtype)) == K && w.size(0) == (n + TN - 1) / TN && n > 0,
              "gguf_gemv_avx2: weight ", w.sizes(), " does not hold ", n, " rows of ", K, " inputs of ggml type ",
              qtype);
  auto rows = tokenfab_cpu::linear_rows(x, K, n, at::kFloat);
  const int64_t M = rows.M;
  if (M == 0) return rows.y;
  at::Tensor bf;
  const float* bp = tokenfab_cpu::float_bias(bias, n, "gguf_gemv_avx2", bf);
  const float* xp = rows.x2.data_ptr<float>();
  const int64_t ldx = rows.x2.stride(0), KB = K / QK;
  std::vector<float> xsum(qtype == kQ8_0 || qtype == kQ6_K || M > kGemvMaxRows ? 0 : M * KB);  // the minimums' x sums
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
  else if (qtype == kQ8_0) run<kQ8_0>(xp, ldx, xsum.data(), M, K, wp, n, bp, yp, n);
  else if (qtype == kQ4_K) run<kQ4_K>(xp, ldx, xsum.data(), M, K, wp, n, bp, yp, n);
  else if (qtype == kQ5_K) run<kQ5_K>(xp, ldx, xsum.data(), M, K, wp, n, bp, yp, n);
  else run<kQ6_K>(xp, ldx, xsum.data(), M, K, wp, n, bp, yp, n);
  return rows.y;
#else
  return at::Tensor();
#endif
}
