// 16 x 16 transpose of 32-bit lanes: how a prefill path turns 16 weight rows, each read contiguously, into rows of
// oneDNN brgemm's bf16 VNNI B layout [K / 2][columns][2], where one 32-bit word holds a row's value pair (2p, 2p + 1)
// and a layout row holds pair p of consecutive weight rows. Loads of whole rows and this transpose replace per-lane
// gathers or scatters (16 scattered 4-byte accesses each).
#pragma once

#include <immintrin.h>

namespace tokenfab_cpu {

#if defined(__AVX512F__)
// In place: r[i] holds dwords 0-15 of row i -> r[j] holds dword j of rows 0-15 (3 stages of unpacks / 128-bit lane
// shuffles, 64 instructions).
inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}
#endif

}  // namespace tokenfab_cpu
