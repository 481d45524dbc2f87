// Batched decode (5..16 rows of bf16 x) of the packed Q4_0 / Q4_1 / Q8_0 linears on int8 activations: each row of x
// is quantized per 32-input block to int8 with one float32 scale (dx = max |x| / 127, as llama.cpp's Q8_0 / Q8_1
// activations and vLLM's GGUF "a8" kernels do), and the integer quants of weight and activation are multiplied with
// AVX512-VNNI's vpdpbusd: 64 int8 products per instruction where the exact bf16 GEMV's vdpbf16ps does 32. At 5..16
// rows the GEMV is bound by its dot instructions, not by memory (results/2026-12-05-gguf-gemv-rows.md: 1.3-1.5x the
// bf16 twin's time with the same vdpbf16ps count plus unpacking), so half the dot instructions is the only way past
// the bf16 twin without AMX. Included by gguf_linear.cpp only; the tile layout is in its opening comment.
//
// Per weight block b (32 inputs) and row m of x, with d / m the block's fp16 scale / minimum and integer quants q:
//   Q4_0: y += (d dx) (sum_k q_k qx_k - 8 sum_k qx_k)          (w = d (q - 8))
//   Q4_1: y += (d dx) sum_k q_k qx_k + m * (float32 sum of x)  (w = d q + m; the minimum's term uses x itself)
//   Q8_0: y += (d dx) sum_k q_k qx_k                           (x enters as qx + 128, unsigned; 128 sum_k q_k
//         subtracted again, the weight sums taken with one vpdpbusd against ones per operand)
// The integer sums are exact (|sum| < 2^17); each block adds one rounded product and fma in float32. The only
// approximation beyond the exact GEMV is x's rounding to int8: |qx dx - x| <= dx / 2 per input.
//
// Quantization, exactly (the tests' reference computes the same float32 operations): amax = max |x_k| over the
// block, dx = amax / 127, qx_k = round-half-even(x_k * (127 / amax)) (0 when amax is 0), all in float32.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <vector>

#include "gguf_gemv.h"
#include "gguf_tiles.h"

namespace tokenfab_gguf_i8 {

using namespace tokenfab_gguf;

// Whether bf16 x of 5..16 rows takes the int8 path: an opt-in (TOKENFAB_GGUF_INT8_ACT=1, read at the first call;
// unset or 0: the exact bf16 GEMV), settable from Python (gguf_int8_activations). Off by default because the
// activation rounding costs fidelity: on SmolLM2-135M Q4_1 against its dequantized float32 twin, decode KL 1.3e-2
// against the exact GEMV's 1.3e-3 (benchmarks/results/2026-12-05-gguf-int8-activations.md).
inline std::atomic<int> g_int8{-1};
inline bool int8_enabled() {
  int v = g_int8.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* e = std::getenv("TOKENFAB_GGUF_INT8_ACT");
    v = (e != nullptr && *e != 0 && std::atoi(e) != 0) ? 1 : 0;
    g_int8.store(v, std::memory_order_relaxed);
  }
  return v != 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
constexpr bool kBuilt = true;

constexpr int64_t kPassRows = 8;  // rows of x per pass over a tile (float32 accumulators held in registers)

// x as the int8 path consumes it, per row m and block b: the 32 quantized inputs in the order of the weight
// operands (q [M][K]), dx [M][K / 32], the integer sum of the block's quants (Q4_0's -8 term) and the float32 sum of
// the block's inputs (Q4_1's minimum term).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> dx, xsum;
  std::vector<int32_t> qsum;
};

// bf16 x [M rows, stride lda] -> QuantizedRows for ggml type qt. Q4_0 / Q4_1: within each 8 inputs the order
// 0 4 1 5 2 6 3 7 (the bytes the nibble masks below give per row: low nibbles k 0 4 1 5, high nibbles k 2 6 3 7);
// Q8_0: the natural order, offset by 128 (unsigned).
inline void quantize_rows(int qt, const uint16_t* x, int64_t M, int64_t lda, int64_t K, QuantizedRows& r) {
  const int64_t KB = K / QK;
  r.q.resize(M * K);
  r.dx.resize(M * KB);
  r.xsum.resize(M * KB);
  r.qsum.resize(M * KB);
  at::parallel_for(0, M * KB, 8, [&](int64_t i0, int64_t i1) {
  const __m128i order = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / KB, kb = i % KB;
      const __m512i h = _mm512_loadu_si512(x + m * lda + kb * QK);
      const __m512 lo = bf16_to_f32(_mm512_castsi512_si256(h)), hi = bf16_to_f32(_mm512_extracti64x4_epi64(h, 1));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));  // round half to even
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
      __m128i b0 = _mm512_cvtepi32_epi8(qlo), b1 = _mm512_cvtepi32_epi8(qhi);
      if (qt == kQ8_0) {
        b0 = _mm_xor_si128(b0, _mm_set1_epi8(static_cast<char>(0x80)));  // + 128, as unsigned bytes
        b1 = _mm_xor_si128(b1, _mm_set1_epi8(static_cast<char>(0x80)));
      } else {
        b0 = _mm_shuffle_epi8(b0, order);
        b1 = _mm_shuffle_epi8(b1, order);
      }
      int8_t* o = r.q.data() + m * K + kb * QK;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), b0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16), b1);
      r.dx[i] = amax / 127.f;
      if (qt == kQ4_0) r.qsum[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      if (qt == kQ4_1) r.xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  }
  });
}

// Tiles [t0, t1) for M (1..8) rows of quantized x. Per block the weight's 8 operands (4 inputs x 16 output rows
// each, one 32-bit lane per output row) are built once and shared by the M rows' 8 vpdpbusd each.
template <int QT, int M, bool F32OUT>
void gemv_i8_tiles(const QuantizedRows& xr, int64_t m0, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                   void* y, int64_t ldy, int64_t t0, int64_t t1) {
  const int64_t KB = K / QK, TB = tile_block_bytes(QT), pf = tokenfab_gguf_gemv::prefetch_distance();
  const int8_t* xq = xr.q.data() + m0 * K;
  const float* dx = xr.dx.data() + m0 * KB;
  const float* xs = xr.xsum.data() + m0 * KB;
  const int32_t* qs = xr.qsum.data() + m0 * KB;
  const __m512i nib = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi8(1);
  // Q8_0: dword j of an operand = row j's quants at k = 4i .. 4i + 3, from word j of pair 2i and of pair 2i + 1
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* b = w + (t * KB + kb) * TB;
      if (pf > 0) tokenfab_gguf_gemv::prefetch_block(b + pf, TB);
      __m512i op[8], wfix = _mm512_setzero_si512();
      if constexpr (QT == kQ8_0) {
        const uint8_t* q = b + 2 * TN;
        for (int i = 0; i < 8; ++i) {
          op[i] = _mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(q + 64 * i));
          wfix = _mm512_dpbusd_epi32(wfix, ones, op[i]);
        }
        wfix = _mm512_slli_epi32(wfix, 7);  // 128 * the row's sum of quants in this block
      } else {
        const uint8_t* q = b + (QT == kQ4_1 ? 4 : 2) * TN;
        for (int L = 0; L < 4; ++L) {
          const __m512i wd = _mm512_loadu_si512(q + 64 * L);
          op[2 * L] = _mm512_and_si512(wd, nib);                           // k 8L + 0 4 1 5
          op[2 * L + 1] = _mm512_and_si512(_mm512_srli_epi16(wd, 4), nib);  // k 8L + 2 6 3 7
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
      __m512i s[M];  // the M rows' integer sums, interleaved: M independent vpdpbusd chains
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) s[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {  // 4 bytes of x broadcast (bcast_pair reads any 4 bytes)
          const __m512i xm = bcast_pair(reinterpret_cast<const uint16_t*>(xq + m * K + kb * QK + 4 * i));
          s[m] = QT == kQ8_0 ? _mm512_dpbusd_epi32(s[m], xm, op[i]) : _mm512_dpbusd_epi32(s[m], op[i], xm);
        }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        if constexpr (QT == kQ8_0) s[m] = _mm512_sub_epi32(s[m], wfix);
        if constexpr (QT == kQ4_0) s[m] = _mm512_sub_epi32(s[m], _mm512_set1_epi32(8 * qs[m * KB + kb]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m]), _mm512_mul_ps(d, _mm512_set1_ps(dx[m * KB + kb])), acc[m]);
      }
      if constexpr (QT == kQ4_1) {
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2 * TN)));
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[m * KB + kb]), acc[m]);
      }
    }
    tokenfab_gguf_gemv::store_rows<M, F32OUT>(acc, y, ldy, t, N, bias);
  }
}

template <int QT, bool F32OUT>
void gemv_i8_pass(const QuantizedRows& xr, int64_t m0, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                  const float* bias, void* y, int64_t ldy, int64_t t0, int64_t t1) {
  switch (M) {
    case 1: gemv_i8_tiles<QT, 1, F32OUT>(xr, m0, K, w, N, bias, y, ldy, t0, t1); break;
    case 2: gemv_i8_tiles<QT, 2, F32OUT>(xr, m0, K, w, N, bias, y, ldy, t0, t1); break;
    case 3: gemv_i8_tiles<QT, 3, F32OUT>(xr, m0, K, w, N, bias, y, ldy, t0, t1); break;
    case 4: gemv_i8_tiles<QT, 4, F32OUT>(xr, m0, K, w, N, bias, y, ldy, t0, t1); break;
    case 5: gemv_i8_tiles<QT, 5, F32OUT>(xr, m0, K, w, N, bias, y, ldy, t0, t1); break;
    case 6: gemv_i8_tiles<QT, 6, F32OUT>(xr, m0, K, w, N, bias, y, ldy, t0, t1); break;
    case 7: gemv_i8_tiles<QT, 7, F32OUT>(xr, m0, K, w, N, bias, y, ldy, t0, t1); break;
    default: gemv_i8_tiles<QT, 8, F32OUT>(xr, m0, K, w, N, bias, y, ldy, t0, t1); break;
  }
}

// y [M, ldy] (bf16, or float32 with F32OUT) = x W^T (+ bias) for bf16 x [M, lda], M rows (any; the dispatch sends
// 5..16), W the packed tiles of ggml type qt (Q4_0, Q4_1 or Q8_0). Parallel over tiles; per tile, passes of up to
// kPassRows rows (the tile's bytes come from memory once; later passes find them in L1).
template <bool F32OUT>
void gemv_i8(int qt, const uint16_t* x, int64_t lda, int64_t M, int64_t K, const uint8_t* w, int64_t N,
             const float* bias, void* y, int64_t ldy) {
  QuantizedRows xr;
  quantize_rows(qt, x, M, lda, K, xr);
  at::parallel_for(0, (N + TN - 1) / TN, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
        const int64_t mr = std::min(kPassRows, M - m0);
        void* ym = F32OUT ? static_cast<void*>(static_cast<float*>(y) + m0 * ldy)
                          : static_cast<void*>(static_cast<uint16_t*>(y) + m0 * ldy);
        if (qt == kQ4_0) gemv_i8_pass<kQ4_0, F32OUT>(xr, m0, mr, K, w, N, bias, ym, ldy, t, t + 1);
        else if (qt == kQ4_1) gemv_i8_pass<kQ4_1, F32OUT>(xr, m0, mr, K, w, N, bias, ym, ldy, t, t + 1);
        else gemv_i8_pass<kQ8_0, F32OUT>(xr, m0, mr, K, w, N, bias, ym, ldy, t, t + 1);
      }
  });
}
#else
constexpr bool kBuilt = false;
#endif  // __AVX512BF16__ && __AVX512VNNI__

// The formats the int8 path covers (the K-quants keep the exact GEMV).
constexpr bool covers(int qt) { return qt == kQ4_0 || qt == kQ4_1 || qt == kQ8_0; }

}  // namespace tokenfab_gguf_i8
