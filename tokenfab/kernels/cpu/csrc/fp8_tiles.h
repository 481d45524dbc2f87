// The CPU tile layout of FP8 block-scaled weights and routed expert stacks and the kernels that read it; included by
// fp8_linear.cpp only.
//
// At prepare() (tokenfab/quant/fp8_block_weight.py: a linear's whole 16-row tiles, the rows past them staying
// row-major; tokenfab/quant/fp8_block_experts.py: a stack whose row parts are whole 16-row tiles) the bytes are
// re-laid once, in place, 16 rows at a time: per four inputs k = 4q .. 4q + 3 of the tile, 64 bytes whose 16-bit word
// 2j + e holds row j's code at k = 4q + e in its low byte and at k = 4q + 2 + e in its high byte. One 64-byte load
// gives two vdpbf16ps operands, each converted in its words by the e4m3 table (fp8_e4m3.h): the low bytes hold every
// row's pair (4q, 4q + 1), the high bytes (4q + 2, 4q + 3), dword j being row j's pair. Multiplied by x's pair
// broadcast, an operand sums 16 rows in the 16 lanes: each weight is converted once per call for all tokens (the
// row-major GEMV converts it once per pass of 8 tokens and reads x as vectors, one load per weight row or two), no
// horizontal reduction, the bytes read as one sequential stream. The scales keep their layout: a tile lies in one
// 128-row scale block. Prefill reads the same operands as rows of brgemm's VNNI layout (no transpose).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fp8_e4m3.h"
#include "gguf_tiles.h"  // bcast_pair

namespace tokenfab_fp8_tiles {

constexpr int64_t kTileRows = 16, kQuadBytes = 64, kBlock = 128;

// One tile in place: rows [16, K] (the checkpoint layout, K a multiple of 4) <-> the tile layout; to_tiles false:
// the inverse (exact). tmp: scratch, resized to the tile's bytes.
inline void relayout_tile(uint8_t* w, int64_t K, bool to_tiles, std::vector<uint8_t>& tmp) {
  tmp.assign(w, w + kTileRows * K);
  for (int64_t q = 0; q < K / 4; ++q)
    for (int64_t j = 0; j < kTileRows; ++j)
      for (int64_t e = 0; e < 2; ++e)
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t tiled = q * kQuadBytes + 2 * (2 * j + e) + h, row = j * K + 4 * q + 2 * h + e;
          if (to_tiles) w[tiled] = tmp[row];
          else w[row] = tmp[tiled];
        }
}

#if defined(__AVX512BF16__)

using tokenfab_fp8::Lut;
using tokenfab_gguf::bcast_pair;

// The two operands of one 64-byte quad (a: the low bytes, b: the high bytes), each word the bf16 of its code by L
// (exact, or times a block's scale: Lut::scaled). vpermt2w reads index bits 0..5 only, so the low byte needs no mask.
inline void quad_operands(const uint8_t* p, const Lut& L, __m512i& a, __m512i& b) {
  const __m512i w = _mm512_loadu_si512(p);
  const __m512i sign = _mm512_set1_epi16(static_cast<int16_t>(0x8000));
  constexpr int kXorAnd = 0x78;  // ternary logic: A ^ (B & C)
  const __m512i alo = _mm512_permutex2var_epi16(L.t[0], w, L.t[1]);  // codes 0..63
  const __m512i ahi = _mm512_permutex2var_epi16(L.t[2], w, L.t[3]);  // codes 64..127
  const __m512i amag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x0040)), alo, ahi);
  a = _mm512_ternarylogic_epi32(amag, _mm512_slli_epi16(w, 8), sign, kXorAnd);  // the low byte's sign to bit 15
  const __m512i wb = _mm512_srli_epi16(w, 8);
  const __m512i blo = _mm512_permutex2var_epi16(L.t[0], wb, L.t[1]);
  const __m512i bhi = _mm512_permutex2var_epi16(L.t[2], wb, L.t[3]);
  const __m512i bmag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x4000)), blo, bhi);
  b = _mm512_ternarylogic_epi32(bmag, w, sign, kXorAnd);  // the high byte's sign is bit 15 already
}

// TB tokens (S bf16 parts each, part s of token t at xt[t] + s * K) times one tile over all of K: acc [TB][16]
// (lane j: row j). Per 128-input block the exact products are summed in float32 chains and scaled once by the
// block's sc[kb] (the GEMV's sum: y = sum_kb s_kb sum_{k in kb} x_k q_k).
template <int S, int TB>
void tile_pass(const uint8_t* tile, int64_t K, const float* sc, const uint16_t* const* xt, const Lut& L,
               float* acc) {
  constexpr int CH = TB == 1 ? 4 : TB <= 8 ? 2 : 1;  // independent chains per token (vdpbf16ps latency)
  for (int t = 0; t < TB; ++t) _mm512_store_ps(acc + 16 * t, _mm512_setzero_ps());
  const int64_t Q = K / 4;
  for (int64_t q0 = 0; q0 < Q; q0 += kBlock / 4) {
    const int64_t q1 = std::min(Q, q0 + kBlock / 4);  // K is a multiple of 32: a block holds an even count of quads
    __m512 c[TB][CH];
    for (int t = 0; t < TB; ++t)
      for (int h = 0; h < CH; ++h) c[t][h] = _mm512_setzero_ps();
    for (int64_t q = q0; q < q1; q += 2) {
#pragma GCC unroll 2
      for (int u = 0; u < 2; ++u) {
        __m512i a, b;
        quad_operands(tile + (q + u) * kQuadBytes, L, a, b);
        const int64_t k = 4 * (q + u);
        for (int t = 0; t < TB; ++t)
          for (int s = 0; s < S; ++s) {
            c[t][(2 * u) % CH] = _mm512_dpbf16_ps(c[t][(2 * u) % CH], (__m512bh)a,
                                                  (__m512bh)bcast_pair(xt[t] + s * K + k));
            c[t][(2 * u + 1) % CH] = _mm512_dpbf16_ps(c[t][(2 * u + 1) % CH], (__m512bh)b,
                                                      (__m512bh)bcast_pair(xt[t] + s * K + k + 2));
          }
      }
    }
    const __m512 sv = _mm512_set1_ps(sc[q0 / (kBlock / 4)]);
    for (int t = 0; t < TB; ++t) {
      __m512 sum = c[t][0];
      for (int h = 1; h < CH; ++h) sum = _mm512_add_ps(sum, c[t][h]);
      _mm512_store_ps(acc + 16 * t, _mm512_fmadd_ps(sum, sv, _mm512_load_ps(acc + 16 * t)));
    }
  }
}

// Tokens per pass of tile_gemv: each pass converts every weight of the tile once.
constexpr int64_t kTilePass = 16;

// Elements between consecutive tokens' rows of x for the tile GEMV: S K, plus 32 where that is an even number of
// 64-byte lines. The pass reads up to 16 tokens' rows in step, one 4-byte broadcast each; at a row stride that is a
// multiple of 4 KB (K = 2048 in bf16) all of them fall in one L1 set, 8 ways for 16 rows. An odd number of lines puts
// every row in its own set. Measured (fp8_linear.py, [7168, 2048], 2 threads): 12 / 16 rows took 1637-1958 /
// 2647-2652 µs at the natural stride, 1321-1375 / 1583-1596 µs at this one (benchmarks/NOTES.md 97).
inline int64_t tile_x_stride(int64_t S, int64_t K) {
  const int64_t row = S * K;  // K is a multiple of 32: whole 64-byte lines
  return (row * 2 / 64) % 2 == 0 ? row + 32 : row;
}

// x [M][S][K] (natural order) -> out [M][ldx] with ldx = tile_x_stride(S, K) (the padding left as it is).
inline void stride_x(const uint16_t* x, int64_t M, int64_t S, int64_t K, int64_t ldx, uint16_t* out) {
  for (int64_t m = 0; m < M; ++m) std::memcpy(out + m * ldx, x + m * S * K, S * K * sizeof(uint16_t));
}

// M tokens (x: token m's S bf16 parts at x + m * ldx + s * K) times one tile (its 128-input blocks scaled by sc[kb]):
// y[m * ldy + j] for the tile's 16 rows (+ bias[j] where bias is given), float32 (F32OUT) or bf16 (rounded to
// nearest even), in passes of up to kTilePass tokens (the callers pass at most one pass).
template <int S, bool F32OUT>
void tile_gemv(const uint8_t* tile, int64_t K, const float* sc, const uint16_t* x, int64_t ldx, int64_t M,
               const Lut& L, void* y, int64_t ldy, const float* bias = nullptr) {
  const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  alignas(64) float acc[kTilePass * 16];
  for (int64_t m0 = 0; m0 < M; m0 += kTilePass) {
    const int nt = static_cast<int>(std::min<int64_t>(kTilePass, M - m0));
    const uint16_t* xt[kTilePass];
    for (int i = 0; i < nt; ++i) xt[i] = x + (m0 + i) * ldx;
    switch (nt) {
#define TF_PASS(TB) \
  case TB: tile_pass<S, TB>(tile, K, sc, xt, L, acc); break;
      TF_PASS(1) TF_PASS(2) TF_PASS(3) TF_PASS(4) TF_PASS(5) TF_PASS(6) TF_PASS(7) TF_PASS(8)
      TF_PASS(9) TF_PASS(10) TF_PASS(11) TF_PASS(12) TF_PASS(13) TF_PASS(14) TF_PASS(15) TF_PASS(16)
#undef TF_PASS
    }
    for (int i = 0; i < nt; ++i) {
      const __m512 v = bias != nullptr ? _mm512_add_ps(_mm512_load_ps(acc + 16 * i), bv) : _mm512_load_ps(acc + 16 * i);
      if constexpr (F32OUT) {
        _mm512_storeu_ps(static_cast<float*>(y) + (m0 + i) * ldy, v);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(y) + (m0 + i) * ldy),
                            (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

// Prefill: ntiles (0, 1 or 2) consecutive tiles into columns [0, 16 ntiles) of a brgemm buffer of 32 columns: bf16
// VNNI pairs (uint32 [K / 2][32]) of each value times its block's scale srow[kb] rounded once to bf16 (the
// dequantized bf16 twin's weight), or, F32W, the exact values as float32 [K][32]. The caller fills any other columns.
template <bool F32W>
void tiles_to_brgemm(const uint8_t* tiles, int64_t ntiles, int64_t K, void* buf, const Lut& L, const float* srow) {
  const int64_t Q = K / 4;
  for (int64_t h = 0; h < ntiles; ++h) {
    const int64_t c0 = 16 * h;
    const uint8_t* tile = tiles + h * kTileRows * K;
    Lut block = L;
    for (int64_t q = 0; q < Q; ++q) {
      if constexpr (!F32W)
        if (q % (kBlock / 4) == 0) block = L.scaled(srow[q / (kBlock / 4)]);
      __m512i a, b;
      quad_operands(tile + q * kQuadBytes, block, a, b);
      if constexpr (F32W) {  // the pair's even value in the low word: float32 bits are the bf16 bits shifted up
        float* f = static_cast<float*>(buf) + 4 * q * 32 + c0;
        const __m512i hi16 = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
        _mm512_storeu_ps(f, _mm512_castsi512_ps(_mm512_slli_epi32(a, 16)));
        _mm512_storeu_ps(f + 32, _mm512_castsi512_ps(_mm512_and_si512(a, hi16)));
        _mm512_storeu_ps(f + 64, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
        _mm512_storeu_ps(f + 96, _mm512_castsi512_ps(_mm512_and_si512(b, hi16)));
      } else {
        uint32_t* p = static_cast<uint32_t*>(buf) + 2 * q * 32 + c0;
        _mm512_storeu_si512(p, a);
        _mm512_storeu_si512(p + 32, b);
      }
    }
  }
}

#endif  // __AVX512BF16__

}  // namespace tokenfab_fp8_tiles
