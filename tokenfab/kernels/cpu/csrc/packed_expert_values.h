// Values and scales of the packed routed-expert formats (INT4 group-32, MXFP4) as the kernels build them in
// registers, shared by the checkpoint-layout kernels (packed_experts.cpp) and the tile-layout ones
// (packed_expert_tiles.h): the 32-entry vpermw table of a format's codes, a group's 16 scales as float32, and the
// scaling of an operand of 16 rows' value pairs into a row of brgemm's bf16 VNNI layout.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "packed_experts.h"

namespace tokenfab_experts {

// The format's value of code c (0..15): INT4 c - 8 (stored as q + 8), MXFP4 the E2M1 value (sign bit 3).
inline float code_value(int64_t fmt, int c) {
  static const float e2m1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                 -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  return fmt == kExpertsInt4Group ? static_cast<float>(c - 8) : e2m1[c];
}

#if defined(__AVX512BF16__)

// vpermw table: entry i = bf16 bits of the format's value of nibble i & 15 (entries 16-31 repeat 0-15, so an index
// with bit 4 set from a neighbouring nibble still reads its own nibble's value: vpermw reads only index bits 0-4).
inline __m512i value_table(int64_t fmt) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float v = code_value(fmt, i & 15);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    t[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers and E2M1 values fit bf16
  }
  return _mm512_load_si512(t);
}

// Up to 16 scales (lanes in ``m``; the others zero) as float32: E8M0 s is 2^(s - 127) built from its bits (s = 0:
// the float32 subnormal 2^-127; s = 255: NaN); INT4's bf16 (scale_kind 0) or fp16 (1) widened exactly.
inline __m512 scales16(bool mxfp4, int scale_kind, const uint8_t* p, __mmask16 m = 0xFFFF) {
  if (mxfp4) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p));
    __m512i bits = _mm512_slli_epi32(e, 23);
    bits = _mm512_mask_mov_epi32(bits, _mm512_mask_cmpeq_epi32_mask(m, e, _mm512_setzero_si512()),
                                 _mm512_set1_epi32(0x00400000));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)),
                                 _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(bits);
  }
  const __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(p));
  return scale_kind == 0 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

// One scale group of 16 rows (lane j: row j's scale, sv) applied to operands whose dword j holds row j's value pair
// as bf16 bits (even value in the low word): pairs() gives the brgemm layout row, each value times its scale rounded
// once to bf16, as the dequantized bf16 twin holds it.
// MXFP4 whose valid lanes all have 2 <= e <= 252 (scale 2^(e - 127)) works on bf16 bits: each nonzero E2M1 value
// (exponent field 126-129) times the scale is a normal bf16 whose exponent field is the value's plus e - 127, so the
// product is one 16-bit integer add (no rounding, no subnormal, no overflow). Otherwise (INT4, extreme scales) in
// float32: both halves times the scales, rounded by one vcvtne2ps2bf16 and interleaved back by one vpermw.
struct GroupScale {
  __m512 sv;
  __m512i shift;  // bits: e - 127 in the exponent field of both 16-bit halves of each lane
  bool bits;

  GroupScale(__m512 s, bool mxfp4, __mmask16 valid = 0xFFFF) : sv(s), shift(_mm512_setzero_si512()), bits(false) {
    const __m512i sb = _mm512_castps_si512(s);
    bits = mxfp4 && (_mm512_mask_cmplt_epu32_mask(valid, sb, _mm512_set1_epi32(2 << 23)) |
                     _mm512_mask_cmpgt_epu32_mask(valid, sb, _mm512_set1_epi32(252 << 23))) == 0;
    if (bits) {
      const __m512i e = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_srli_epi32(sb, 23), _mm512_set1_epi32(127)), 7);
      shift = _mm512_or_si512(_mm512_and_si512(e, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(e, 16));
    }
  }

  // The pair's even / odd values as float32 (exact: bf16 bits widened).
  static __m512 even(__m512i op) { return _mm512_castsi512_ps(_mm512_slli_epi32(op, 16)); }
  static __m512 odd(__m512i op) {
    return _mm512_castsi512_ps(_mm512_and_si512(op, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }

  __m512i pairs(__m512i op) const {
    if (bits)  // zero words (±0) stay zero
      return _mm512_mask_add_epi16(op, _mm512_test_epi16_mask(op, _mm512_set1_epi16(0x7FFF)), op, shift);
    return pairs(even(op), odd(op));
  }

  // The float32 form from the pair's unscaled even / odd values (lane j: row j), for callers that have them.
  __m512i pairs(__m512 fe, __m512 fo) const {
    static const __m512i interleave = [] {  // word 2r <- even value r (lane r), word 2r + 1 <- odd value r (16 + r)
      alignas(64) uint16_t inter[32];
      for (int r = 0; r < 16; ++r) inter[2 * r] = static_cast<uint16_t>(r), inter[2 * r + 1] = static_cast<uint16_t>(16 + r);
      return _mm512_load_si512(inter);
    }();
    return _mm512_permutexvar_epi16(interleave,
                                    (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(fo, sv), _mm512_mul_ps(fe, sv)));
  }
};

#endif  // __AVX512BF16__

}  // namespace tokenfab_experts
