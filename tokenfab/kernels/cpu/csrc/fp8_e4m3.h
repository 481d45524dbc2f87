// FP8 e4m3fn (OCP FP8, "fn": no infinities) to bf16 on AVX512: a 128-entry table of the magnitude codes' bf16 bit
// patterns, looked up 32 at a time by two `vpermt2w`, with the sign bit moved to bit 15 (exact: every e4m3 value
// has at most 4 significant bits); the scaled form gives each code times a block's scale rounded once to bf16.
// Used by fp8_linear.cpp and fp8_tiles.h.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tokenfab_fp8 {

// bf16 bits of the e4m3fn magnitude code c (0..127): e = c >> 3, m = c & 7; e == 0: m 2^-9, else (1 + m / 8) 2^(e - 7);
// c == 127: NaN. Exact (at most 4 significant bits).
inline uint16_t e4m3_magnitude_bf16(int c) {
  if (c == 0x7F) return 0x7FC0;
  const int e = c >> 3, m = c & 7;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return static_cast<uint16_t>(bits >> 16);
}

#if defined(__AVX512BF16__)

inline __m512 bf16_to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

struct Lut {
  __m512i t[4];  // bf16 of magnitude codes 0..31, 32..63, 64..95, 96..127
  Lut() {
    alignas(64) uint16_t v[128];
    for (int c = 0; c < 128; ++c) v[c] = e4m3_magnitude_bf16(c);
    for (int i = 0; i < 4; ++i) t[i] = _mm512_load_si512(v + 32 * i);
  }
  // The table of each magnitude times s, rounded once to bf16: the dequantized bf16 twin's value of every code in
  // a block of scale s (negative codes: the sign flipped after rounding, which round-to-nearest-even commutes with).
  Lut scaled(float s) const {
    Lut o(*this);
    const __m512 sv = _mm512_set1_ps(s);
    for (int i = 0; i < 4; ++i) {
      const __m512 lo = _mm512_mul_ps(bf16_to_f32(_mm512_castsi512_si256(t[i])), sv);
      const __m512 hi = _mm512_mul_ps(bf16_to_f32(_mm512_extracti64x4_epi64(t[i], 1)), sv);
      o.t[i] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    }
    return o;
  }
};

// 32 e4m3 bytes -> their 32 bf16 values (as u16 lanes, in order): the exact values with Lut(), the scaled ones with
// Lut::scaled (the sign bit flips the looked-up magnitude's).
inline __m512i e4m3x32(const uint8_t* p, const Lut& L) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i lo = _mm512_permutex2var_epi16(L.t[0], w, L.t[1]);  // index bits 0..5: codes 0..63
  const __m512i hi = _mm512_permutex2var_epi16(L.t[2], w, L.t[3]);  // codes 64..127
  const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), lo, hi);
  return _mm512_xor_si512(mag, _mm512_and_si512(_mm512_slli_epi16(w, 8), _mm512_set1_epi16(int16_t(0x8000))));
}

#endif  // __AVX512BF16__

}  // namespace tokenfab_fp8
