// NOTES.md entry 71: a Q4_1-style 16-row tile GEMV at 16 rows of x, one thread, in three pass structures: two passes
// of 8 rows over the whole matrix, two passes of 8 rows per tile, one pass of 16 rows with the per-tile accumulators
// in L1. Synthetic tiles (per 32-input block: 16 fp16 scales, 16 fp16 mins, 256 nibble bytes), the operand built as
// the real kernel builds it (a shift and a vpermw per 16 rows x one k pair). Prints microseconds per call.
//   g++ -O3 -march=native -o /tmp/q4pass benchmarks/experiments/gguf_q4_pass16.cpp
//   /tmp/q4pass N K [MB]   (MB of distinct weight copies streamed in turn; none: one copy, cache-resident)
#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <chrono>
#include <vector>
#include <cstdlib>
// synthetic Q4_1-like tiles: per tile (16 rows) per block of 32 k: d[16] f16 (32B), m[16] f16 (32B), 256B nibbles
constexpr int TB = 320;
static inline __m512i bcast_pair(const uint16_t* p) { uint32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
template <int P> static inline __m512i q4op(__m512i wd, __m512i tab) {
  return _mm512_permutexvar_epi16(_mm512_srli_epi16(wd, 4 * P), tab);  // vpermw uses low 5 bits: approx of real (mask)
}
template <int M, bool MEMACC>
void pass(const uint16_t* xp, const float* xsum, int K, const uint8_t* w, int t0, int t1, float* y, __m512i tab) {
  const int KB = K / 32;
  for (int t = t0; t < t1; ++t) {
    alignas(64) float accm[M][16];
    __m512 acc[MEMACC ? 1 : M];
    if constexpr (MEMACC) { for (int m = 0; m < M; ++m) _mm512_store_ps(accm[m], _mm512_setzero_ps()); }
    else for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int kb = 0; kb < KB; ++kb) {
      const uint8_t* b = w + ((int64_t)t * KB + kb) * TB;
      const uint16_t* xk = xp + kb * 32;
      __m512 c[M];
      for (int m = 0; m < M; ++m) c[m] = _mm512_setzero_ps();
      const uint8_t* q = b + 64;
#pragma GCC unroll 4
      for (int L = 0; L < 4; ++L) {
        const __m512i wd = _mm512_loadu_si512(q + 64 * L);
        __m512i ops[4] = {q4op<0>(wd, tab), q4op<1>(wd, tab), q4op<2>(wd, tab), q4op<3>(wd, tab)};
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s)
#pragma GCC unroll 16
          for (int m = 0; m < M; ++m)
            c[m] = _mm512_dpbf16_ps(c[m], (__m512bh)bcast_pair(xk + m * K + 2 * (4 * L + s)), (__m512bh)ops[s]);
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)b));
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b + 32)));
      for (int m = 0; m < M; ++m) {
        if constexpr (MEMACC) {
          __m512 a = _mm512_fmadd_ps(c[m], d, _mm512_load_ps(accm[m]));
          _mm512_store_ps(accm[m], _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[m * KB + kb]), a));
        } else {
          acc[m] = _mm512_fmadd_ps(c[m], d, acc[m]);
          acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[m * KB + kb]), acc[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(y + m * 4096 + t * 16, MEMACC ? _mm512_load_ps(accm[m]) : acc[m]);
  }
}
int main(int argc, char** argv) {
  int N = atoi(argv[1]), K = atoi(argv[2]); int T = N / 16, KB = K / 32;
  const size_t one = (size_t)T * KB * TB; const int NC = argc > 3 ? (size_t)atoi(argv[3]) * (1 << 20) / one + 1 : 1;
  std::vector<uint8_t> w(one * NC); for (auto& v : w) v = rand();
  for (size_t o = 0; o < one * NC; o += TB) { uint16_t* h = (uint16_t*)&w[o]; for (int i=0;i<32;++i) h[i]=0x3c00; }
  std::vector<uint16_t> x(16 * K); for (auto& v : x) v = 0x3f80 + (rand() & 0x7f);
  std::vector<float> xs(16 * KB, 1.f), y(16 * 4096);
  alignas(64) uint16_t tb[32]; for (int i = 0; i < 32; ++i) tb[i] = 0x3f80 + i; __m512i tab = _mm512_load_si512(tb);
  auto run = [&](int mode) {
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < 2000; ++r) { const uint8_t* wp = w.data() + one * (r % NC);
      if (mode == 0) { pass<8, false>(x.data(), xs.data(), K, wp, 0, T, y.data(), tab);
                       pass<8, false>(x.data() + 8 * K, xs.data() + 8 * KB, K, wp, 0, T, y.data() + 8 * 4096, tab); }
      else if (mode == 1) { for (int t = 0; t < T; ++t) { pass<8, false>(x.data(), xs.data(), K, wp, t, t+1, y.data(), tab);
                       pass<8, false>(x.data() + 8 * K, xs.data() + 8 * KB, K, wp, t, t+1, y.data() + 8 * 4096, tab);} }
      else pass<16, true>(x.data(), xs.data(), K, wp, 0, T, y.data(), tab);
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 2000 * 1e6;
  };
  for (int rep = 0; rep < 3; ++rep) printf("8+8 whole %.1f us | 8+8 per tile %.1f us | 16 memacc %.1f us\n", run(0), run(1), run(2));
}
