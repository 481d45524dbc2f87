// The CPU tile layout of packed routed experts (INT4 group-32, MXFP4) and the kernels that read it; included by
// packed_experts.cpp only.
//
// At prepare() a CPU stack is re-laid once, in place, 16 rows at a time (rows past the last whole 16 stay in the
// checkpoint layout and take the row kernels). Per tile of 16 rows (the 16 rows' bytes, reused) and per 32-value
// group g, 256 bytes: four blocks L of 64 bytes whose 16-bit word 2j + e holds, in its nibble s (bits 4s..4s+3), row
// j's code at k = 32 g + 2 (4L + s) + e; the tile's scales (the 16 rows' scale entries, reused) become [group][row].
// One 64-byte load, a shift and a 32-entry vpermw table give a vdpbf16ps operand holding, in dword j, row j's value
// pair (k, k + 1); multiplied by x's pair broadcast, it sums 16 rows in the 16 lanes: no horizontal reduction, the
// bytes read as one sequential stream (GGUF's tile layout, gguf_linear.cpp). Measured against the checkpoint layout
// in a standalone GEMV at 1 token: about 2x the streaming rate (benchmarks/NOTES.md 67, 69).
// The prefill conversion reads the same operands: each is one row of brgemm's VNNI layout for 16 rows, no transpose.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_tiles.h"  // bcast_pair: the tile layout is GGUF's (gguf_linear.cpp)
#include "packed_expert_values.h"

namespace tokenfab_tiles {

constexpr int64_t kTileRows = 16;
constexpr int64_t kGroupBytes = 256;  // codes of one tile and group: 16 rows x 32 values x 4 bits

inline int code_at(const uint8_t* row, int64_t k) { return (row[k / 2] >> (4 * (k & 1))) & 15; }

// One tile in place: rows [16, row_bytes] (checkpoint layout) <-> the tile layout, and its scales
// [16, ng] of es bytes <-> [ng, 16]. to_tiles false: the inverse (exact).
inline void relayout_tile(uint8_t* codes, int64_t row_bytes, uint8_t* scales, int64_t ng, int64_t es, bool to_tiles,
                          std::vector<uint8_t>& tmp) {
  const int64_t bytes = kTileRows * row_bytes;
  tmp.assign(codes, codes + bytes);
  for (int64_t g = 0; g < ng; ++g) {
    for (int L = 0; L < 4; ++L)
      for (int j = 0; j < kTileRows; ++j)
        for (int e = 0; e < 2; ++e) {
          uint8_t* word = (to_tiles ? codes : tmp.data()) + g * kGroupBytes + 64 * L + 2 * (2 * j + e);
          for (int s = 0; s < 4; ++s) {
            const int64_t k = 32 * g + 2 * (4 * L + s) + e;
            if (to_tiles) {
              const int c = code_at(tmp.data() + j * row_bytes, k);
              uint16_t w;
              std::memcpy(&w, word, 2);
              w = static_cast<uint16_t>(s == 0 ? c : w | (c << (4 * s)));
              std::memcpy(word, &w, 2);
            } else {
              uint16_t w;
              std::memcpy(&w, word, 2);
              const int c = (w >> (4 * s)) & 15;
              uint8_t& b = codes[j * row_bytes + k / 2];
              b = static_cast<uint8_t>((k & 1) ? (b & 0x0F) | (c << 4) : (b & 0xF0) | c);
            }
          }
        }
  }
  tmp.assign(scales, scales + kTileRows * ng * es);  // the codes are done: tmp holds the scales now
  for (int64_t j = 0; j < kTileRows; ++j)
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t rowmajor = (j * ng + g) * es, tiled = (g * kTileRows + j) * es;
      std::memcpy(scales + (to_tiles ? tiled : rowmajor), tmp.data() + (to_tiles ? rowmajor : tiled), es);
    }
}

#if defined(__AVX512BF16__)

using tokenfab_experts::GroupScale;
using tokenfab_experts::scales16;
using tokenfab_gguf::bcast_pair;

// TB tokens (S bf16 parts each, natural order: xt[t] + s * K) times one tile: acc[t] lane j += row j's sum.
template <int S, int TB>
inline void tile_pass(const uint8_t* codes, const uint8_t* scales, bool mxfp4, int scale_kind, int64_t es, int64_t ng,
                      const uint16_t* const* xt, int64_t K, __m512i table, __m512* acc) {
  constexpr int CH = TB == 1 ? 4 : TB <= 4 ? 2 : 1;  // independent accumulator chains per token
  for (int64_t g = 0; g < ng; ++g) {
    __m512 c[TB][CH];
    for (int t = 0; t < TB; ++t)
      for (int h = 0; h < CH; ++h) c[t][h] = _mm512_setzero_ps();
    const uint8_t* q = codes + g * kGroupBytes;
#pragma GCC unroll 4
    for (int L = 0; L < 4; ++L) {
      const __m512i wd = _mm512_loadu_si512(q + 64 * L);
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const __m512bh op = (__m512bh)_mm512_permutexvar_epi16(s == 0 ? wd : _mm512_srli_epi16(wd, 4 * s), table);
        const int64_t k = 32 * g + 2 * (4 * L + s);
        for (int t = 0; t < TB; ++t)
          for (int p = 0; p < S; ++p)
            c[t][s % CH] = _mm512_dpbf16_ps(c[t][s % CH], op, (__m512bh)bcast_pair(xt[t] + p * K + k));
      }
    }
    const __m512 sv = scales16(mxfp4, scale_kind, scales + g * kTileRows * es);
    for (int t = 0; t < TB; ++t) {
      __m512 sum = c[t][0];
      for (int h = 1; h < CH; ++h) sum = _mm512_add_ps(sum, c[t][h]);
      acc[t] = _mm512_fmadd_ps(sum, sv, acc[t]);
    }
  }
}

// Tokens per pass of tile_rows: each pass decodes every code of the tile once; its accumulators and chains stay in
// registers.
constexpr int kPassTokens = 8;

// Tokens [t0, t1) (x parts xn [N][S][K], natural order) times one tile: out[(t - t0) * ldo + j] for its 16 rows.
template <int S>
void tile_rows(const uint8_t* codes, const uint8_t* scales, bool mxfp4, int scale_kind, int64_t es, int64_t ng,
               const uint16_t* xn, int64_t K, int64_t t0, int64_t t1, __m512i table, float* out, int64_t ldo) {
  for (int64_t t = t0; t < t1; t += kPassTokens) {
    const int nt = static_cast<int>(std::min<int64_t>(kPassTokens, t1 - t));
    const uint16_t* xt[kPassTokens];
    for (int i = 0; i < nt; ++i) xt[i] = xn + (t + i) * S * K;
    __m512 acc[kPassTokens];
    for (int i = 0; i < kPassTokens; ++i) acc[i] = _mm512_setzero_ps();
    switch (nt) {
#define TF_PASS(TB) \
  case TB: tile_pass<S, TB>(codes, scales, mxfp4, scale_kind, es, ng, xt, K, table, acc); break;
      TF_PASS(1) TF_PASS(2) TF_PASS(3) TF_PASS(4) TF_PASS(5) TF_PASS(6) TF_PASS(7) TF_PASS(8)
#undef TF_PASS
    }
    for (int i = 0; i < nt; ++i) _mm512_storeu_ps(out + (t - t0 + i) * ldo, acc[i]);
  }
}

// Prefill: one tile's values into columns [c0, c0 + 16) of a brgemm buffer of 32 columns: bf16 VNNI pairs
// (uint32 [K / 2][32], each value times its scale rounded once to bf16, as the dequantized bf16 twin holds it; MXFP4
// with every scale of a group in 2^-125..2^125 by adding the exponent to the bf16 bits, exact) or, F32, float32
// [K][32] (the exact values).
template <bool F32>
void tile_dequant(const uint8_t* codes, const uint8_t* scales, bool mxfp4, int scale_kind, int64_t es, int64_t ng,
                  __m512i table, void* buf, int64_t c0) {
  for (int64_t g = 0; g < ng; ++g) {
    const GroupScale gs(scales16(mxfp4, scale_kind, scales + g * kTileRows * es), mxfp4 && !F32);
    const uint8_t* q = codes + g * kGroupBytes;
    for (int L = 0; L < 4; ++L) {
      const __m512i wd = _mm512_loadu_si512(q + 64 * L);
      for (int s = 0; s < 4; ++s) {
        const __m512i op = _mm512_permutexvar_epi16(s == 0 ? wd : _mm512_srli_epi16(wd, 4 * s), table);
        const int64_t p = 16 * g + 4 * L + s;  // the value pair (2p, 2p + 1) of every row
        if constexpr (F32) {
          float* f = static_cast<float*>(buf);
          _mm512_storeu_ps(f + (2 * p) * 32 + c0, _mm512_mul_ps(GroupScale::even(op), gs.sv));
          _mm512_storeu_ps(f + (2 * p + 1) * 32 + c0, _mm512_mul_ps(GroupScale::odd(op), gs.sv));
        } else {
          _mm512_storeu_si512(static_cast<int32_t*>(buf) + p * 32 + c0, gs.pairs(op));
        }
      }
    }
  }
}

#endif  // __AVX512BF16__

}  // namespace tokenfab_tiles
