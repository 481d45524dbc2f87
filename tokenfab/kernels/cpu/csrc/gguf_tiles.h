// The packed GGUF tile layout (built by tokenfab/quant/gguf_blocks.py and gguf_kquants.py) and the AVX512 register
// helpers that unpack it, shared by the GEMV / GEMM kernels (gguf_linear.cpp) and the embedding rows
// (gguf_embedding.cpp). See gguf_linear.cpp's opening comment for the byte layout of a tile-block.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_linear.h"

namespace tokenfab_gguf {

constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;  // ggml type ids
constexpr int64_t TN = kGgufTileN, QK = kGgufBlockK;

// Bytes of one tile-block (16 rows x one GGUF block along K) of ggml type qt; raises for a type not packed here.
inline int64_t tile_block_bytes(int64_t qt) {
  switch (qt) {
    case kQ4_0: return 2 * TN + TN * QK / 2;      // 288
    case kQ4_1: return 4 * TN + TN * QK / 2;      // 320
    case kQ8_0: return 2 * TN + TN * QK;          // 544
    case kQ4_K: return TN * 144;                  // 2304 (tokenfab/quant/gguf_kquants.py)
    case kQ5_K: return TN * 176;                  // 2816
    case kQ6_K: return TN * 210;                  // 3360
    default: TORCH_CHECK(false, "gguf_linear: ggml type ", qt, " is not packed by tokenfab (Q4_0, Q4_1, Q8_0, Q4_K, "
                         "Q5_K, Q6_K)");
  }
  return 0;
}

// K-quants: 256-value super-blocks of 8 sub-blocks of 32; their tile-blocks (gguf_kquants.py) hold, for 16 rows:
//   Q4_K: d [16] fp16 @0, dmin [16] fp16 @32, the 12 scale bytes as [12][16] @64, 8 x 256 nibble bytes @256;
//   Q5_K: as Q4_K, with 8 x 64 bytes of bit-4 words @256 (word 2j + e bit u: row j, k = 2u + e), nibbles @768;
//   Q6_K: d [16] fp16 @0, int8 scales [16][16] @32, 8 x 128 bytes of bits-4..5 words @288 (group H word 2j + e
//         bits 2u..2u+1: row j, k = 2 (8H + u) + e), nibbles @1312.
// Each sub-block's nibbles are the 256-byte Q4 layout above, so the GEMV operand of pair 4L + s is built as for Q4
// with the high bits merged in (one vpternlogd) before the vpermw / vpermt2w table lookup.
constexpr bool is_kquant(int qt) { return qt == kQ4_K || qt == kQ5_K || qt == kQ6_K; }
constexpr bool has_min(int qt) { return qt == kQ4_1 || qt == kQ4_K || qt == kQ5_K; }
constexpr int64_t block_k(int qt) { return is_kquant(qt) ? 256 : QK; }
constexpr int64_t kq_lo_off(int qt) { return qt == kQ4_K ? 256 : qt == kQ5_K ? 768 : 1312; }
constexpr int64_t kq_hi_off(int qt) { return qt == kQ5_K ? 256 : 288; }

#if defined(__AVX512BF16__)

// 32-entry table for vpermw: entry i is bf16(value of nibble i & 15), Q4_0's q - 8 or Q4_1's q.
inline __m512i nibble_table(int qt) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>((i & 15) - (qt == kQ4_0 ? 8 : 0));
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    t[i] = static_cast<uint16_t>(bits >> 16);  // small integers are exact in bf16
  }
  return _mm512_load_si512(t);
}

inline __m512 bf16_to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// Q4_1's minimum factor: the float32 sum of each 32 inputs of x [M, K] (row stride ldx; bf16 or float32) into
// sums [M][K / 32] (sums is resized to at least `rows` x K / 32, zeros past M). One vector add of the block's two
// halves, then a tree reduction (_mm512_reduce_add_ps): the same order for every row, path and batch.
template <typename T>
inline void block_sums(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t rows, std::vector<float>& sums) {
  const int64_t KB = K / QK;
  sums.assign(std::max(rows, M) * KB, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kb = 0; kb < KB; ++kb) {
      const T* xr = x + m * ldx + kb * QK;
      __m512 v;
      if constexpr (sizeof(T) == 4) {
        v = _mm512_add_ps(_mm512_loadu_ps(xr), _mm512_loadu_ps(xr + 16));
      } else {
        const __m512i h = _mm512_loadu_si512(xr);
        v = _mm512_add_ps(bf16_to_f32(_mm512_castsi512_si256(h)), bf16_to_f32(_mm512_extracti64x4_epi64(h, 1)));
      }
      sums[m * KB + kb] = _mm512_reduce_add_ps(v);
    }
}

// Q8_0 pair operand: 32 int8 quants -> their fp32 values in two halves (lane i of half h: row 8h + i / 2, k = i % 2).
inline void q8_halves(const int8_t* q, __m512& lo, __m512& hi) {
  lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
}

// Nibble s (0..3) of every word of a quant group -> the bf16 operand of pair 4L + s.
template <int S>
inline __m512i q4_operand(__m512i words, __m512i table) {
  return _mm512_permutexvar_epi16(S == 0 ? words : _mm512_srli_epi16(words, 4 * S), table);
}

inline __m512i bcast_pair(const uint16_t* x) {
  uint32_t p;
  std::memcpy(&p, x, 4);
  return _mm512_set1_epi32(static_cast<int>(p));
}

// One tile-row store: 16 outputs from a float32 accumulator, + bias, as bf16 (round to nearest even) or float32.
template <bool F32OUT>
inline void store_tile(void* y, __m512 v, const float* bias, int64_t nvalid) {
  const __mmask16 mk = nvalid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nvalid) - 1u);
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, bias));
  if constexpr (F32OUT) {
    _mm512_mask_storeu_ps(static_cast<float*>(y), mk, v);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y), mk, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// ---- K-quants (Q4_K, Q5_K, Q6_K) ----

// Table for the K-quants' quant values as exact bf16 integers: Q4_K nibble i & 15, Q5_K i (5 bits: 0..31), Q6_K
// entries 32 h + i of the two-table lookup = 32 h + i - 32.
inline __m512i kq_table(int qt, int half) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float v = qt == kQ4_K ? static_cast<float>(i & 15)
                    : qt == kQ5_K ? static_cast<float>(i) : static_cast<float>(32 * half + i - 32);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    t[i] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(t);
}

// Words shifted so that bits [sh, sh + w) land at bit 4 (negative sh: shifted left).
inline __m512i shift_to4(__m512i v, int sh) {
  return sh >= 4 ? _mm512_srli_epi16(v, sh - 4) : _mm512_slli_epi16(v, 4 - sh);
}

// The bf16 operand of pair pp = 4L + s (0..15) of sub-block j of a K-quant tile-block b: lane 2r + e the quant of
// row r at k = 2 pp + e, as an exact bf16 integer (Q6_K: q - 32).
template <int QT>
inline __m512i kq_operand(const uint8_t* b, int j, int L, int s, __m512i t0, __m512i t1) {
  const __m512i lo = _mm512_srli_epi16(_mm512_loadu_si512(b + kq_lo_off(QT) + 256 * j + 64 * L), 4 * s);
  if constexpr (QT == kQ4_K) {
    return _mm512_permutexvar_epi16(lo, t0);  // index bits 0..4: the nibble and a bit the table ignores
  } else if constexpr (QT == kQ5_K) {
    const int pp = 4 * L + s;
    const __m512i h = shift_to4(_mm512_loadu_si512(b + kq_hi_off(QT) + 64 * j), pp);
    const __m512i idx = _mm512_ternarylogic_epi32(_mm512_set1_epi16(0x000F), lo, h, 0xCA);  // lo bits 0..3, h bit 4
    return _mm512_permutexvar_epi16(idx, t0);
  } else {
    const int H = L / 2, u = 4 * (L % 2) + s;
    const __m512i h = shift_to4(_mm512_loadu_si512(b + kq_hi_off(QT) + 128 * j + 64 * H), 2 * u);
    const __m512i idx = _mm512_ternarylogic_epi32(_mm512_set1_epi16(0x000F), lo, h, 0xCA);  // bits 4..5 from h
    return _mm512_permutex2var_epi16(t0, idx, t1);
  }
}

// Sub-block j's scale and minimum of the 16 rows of a Q4_K / Q5_K tile-block (6-bit fields, ggml's get_scale_min_k4)
// as float32 d * sc and dmin * m (exact products).
inline void kq_scale_min(const uint8_t* b, int j, __m512& ds, __m512& dm) {
  const auto sb = [&](int i) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64 + 16 * i)); };
  __m128i sc, mn;
  if (j < 4) {
    sc = _mm_and_si128(sb(j), _mm_set1_epi8(0x3F));
    mn = _mm_and_si128(sb(j + 4), _mm_set1_epi8(0x3F));
  } else {
    const __m128i md = sb(j + 4);
    sc = _mm_or_si128(_mm_and_si128(md, _mm_set1_epi8(0x0F)),
                      _mm_and_si128(_mm_srli_epi16(sb(j - 4), 2), _mm_set1_epi8(0x30)));
    mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(md, 4), _mm_set1_epi8(0x0F)),
                      _mm_and_si128(_mm_srli_epi16(sb(j), 2), _mm_set1_epi8(0x30)));
  }
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32)));
  ds = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
  dm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
}

// Q6_K: scale i (0..15, one per 16 values) of the 16 rows times d, float32 (exact).
inline __m512 q6_scale(const uint8_t* b, int i) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32 + 16 * i));
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
}

// Float32 values of pair p (0..127) of a K-quant tile-block, in two halves as pair_values: Q4_K / Q5_K
// (d sc) q - dmin m (one rounding: (d sc) q is exact), Q6_K (d scale) (q - 32), as gguf's dequantize computes them.
template <int QT>
inline void pair_values_k(const uint8_t* b, int p, __m512i t0, __m512i t1, __m512 v[2]) {
  const int j = p / 16, pp = p % 16;
  const __m512i op = kq_operand<QT>(b, j, pp / 4, pp % 4, t0, t1);
  const __m512 q[2] = {bf16_to_f32(_mm512_castsi512_si256(op)), bf16_to_f32(_mm512_extracti64x4_epi64(op, 1))};
  __m512 ds, dm = _mm512_setzero_ps();
  if constexpr (QT == kQ6_K) ds = q6_scale(b, p / 8);
  else kq_scale_min(b, j, ds, dm);
  for (int h = 0; h < 2; ++h) {
    const __m512i idx = _mm512_set_epi32(8 * h + 7, 8 * h + 7, 8 * h + 6, 8 * h + 6, 8 * h + 5, 8 * h + 5, 8 * h + 4,
                                         8 * h + 4, 8 * h + 3, 8 * h + 3, 8 * h + 2, 8 * h + 2, 8 * h + 1, 8 * h + 1,
                                         8 * h, 8 * h);
    const __m512 dh = _mm512_permutexvar_ps(idx, ds);
    v[h] = QT == kQ6_K ? _mm512_mul_ps(q[h], dh) : _mm512_fmsub_ps(q[h], dh, _mm512_permutexvar_ps(idx, dm));
  }
}

// Float32 weight values (d q, or d q + m for Q4_1: q d is exact in float32, so one rounding, as gguf computes them)
// of pair p of one tile-block, in two halves (lane i of half h: row 8h + i / 2 of the tile, k = 2p + i % 2).
template <int QT>
inline void pair_values(const uint8_t* b, int p, __m512i table, __m512 v[2]) {
  __m512 q[2];
  if constexpr (QT == kQ8_0) {
    q8_halves(reinterpret_cast<const int8_t*>(b + 2 * TN) + 32 * p, q[0], q[1]);
  } else {
    const __m512i wd = _mm512_loadu_si512(b + (QT == kQ4_1 ? 4 : 2) * TN + 64 * (p / 4));
    const __m512i op = _mm512_permutexvar_epi16(_mm512_srli_epi16(wd, 4 * (p % 4)), table);
    q[0] = bf16_to_f32(_mm512_castsi512_si256(op));
    q[1] = bf16_to_f32(_mm512_extracti64x4_epi64(op, 1));
  }
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  const __m512 mn = QT == kQ4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2 * TN)))
                                : _mm512_setzero_ps();
  for (int h = 0; h < 2; ++h) {
    const __m512i idx = _mm512_set_epi32(8 * h + 7, 8 * h + 7, 8 * h + 6, 8 * h + 6, 8 * h + 5, 8 * h + 5, 8 * h + 4,
                                         8 * h + 4, 8 * h + 3, 8 * h + 3, 8 * h + 2, 8 * h + 2, 8 * h + 1, 8 * h + 1,
                                         8 * h, 8 * h);
    const __m512 dh = _mm512_permutexvar_ps(idx, d);
    v[h] = QT == kQ4_1 ? _mm512_fmadd_ps(q[h], dh, _mm512_permutexvar_ps(idx, mn)) : _mm512_mul_ps(q[h], dh);
  }
}

#endif  // __AVX512BF16__

}  // namespace tokenfab_gguf
