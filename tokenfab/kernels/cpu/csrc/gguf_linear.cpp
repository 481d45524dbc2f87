// Linear layers on GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, and the K-quants Q4_K, Q5_K, Q6_K) executed packed: the weight stays in its
// quantized bytes and is unpacked and scaled in registers.
//
// Layout (built by tokenfab/quant/gguf_blocks.py, same byte count as the GGUF file): W [n, K] becomes tiles of 16
// output rows; a tile is K / 32 consecutive tile-blocks, one per GGUF block along K, each holding the 16 rows'
// fp16 scales d (and Q4_1's fp16 minimums m) followed by their quants:
//   Q4_0 / Q4_1: 256 bytes = 4 groups of 32 little-endian u16 words; word 2j + e of group L holds, in its nibble s
//                (bits 4s..4s+3), the quant of row j at k = 2 (4L + s) + e of the block.
//   Q8_0:        512 bytes = 16 pairs of 32 bytes; byte 2j + e of pair p is the int8 quant of row j at k = 2p + e.
// So one 64-byte load of nibbles, a shift and a 32-entry `vpermw` table lookup give a `vdpbf16ps` operand with the
// two k values of a pair side by side for 16 rows (the VNNI layout of vnni_linear.cpp), each quant as an exact
// bf16 integer. Per block and row the products sum_k x_k q_k (exact bf16 products, float32 accumulation) are
// scaled once: y += d * sum_k x_k q_k (+ m * sum_k x_k for Q4_1), the same real number as sum_k x_k (d q_k + m).
//
// M <= 16 rows (decode batches): a GEMV over tiles, parallel over tiles, in passes of up to 4 rows per tile (the
// tile's bytes come from memory once, software-prefetched ahead: prefetch_distance below). bf16 x is used as is;
// float32 x is split into three bf16 parts (x = h + m + l up to 2^-24 relative), each multiplied exactly, so float32
// activations keep float32 accuracy. With AMX (AMX-BF16, granted by the kernel), bf16 x of 5..16 rows instead runs
// one TDPBF16PS per GGUF block and 16-row tile of x on the block's integer quants, each block's sum scaled in
// registers (amx_tiles below): about 2x the GEMV passes' speed at 16 rows.
// M > 16 (prefill): per 32-column block, the thread dequantizes its 32 weight rows once into a thread-local buffer
// that stays in cache and runs oneDNN's brgemm micro-kernel (the bf16 GEMM's) over all row tiles of x: bf16 x
// against the weight rounded once to bf16 (as the dequantized bf16 twin holds it), float32 x against the float32
// values d q + m (exactly as gguf's dequantize computes them). Never a full-size copy of the weight.
#include "gguf_linear.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include "cpu_isa.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;  // ggml type ids
constexpr int64_t TN = kGgufTileN, QK = kGgufBlockK;
constexpr int64_t kGemvRows = 4;      // rows of x one GEMV pass multiplies (accumulators held in registers)
constexpr int64_t kGemvMaxRows = 16;  // up to this many rows (decode batches) the GEMV passes or AMX tiles; more:
                                      // prefill, the dequantizing brgemm (gemm below)
constexpr int64_t kTileM = 64;

// Software prefetch of the GEMV's weight stream: each tile-block's bytes are requested this far ahead of their use
// (TOKENFAB_GGUF_PREFETCH bytes, read at the first call, or gguf_prefetch(bytes) from Python; 0 turns it off). At
// batch 1 the GEMV's unpack-and-dot instructions take about as long as the memory reads (Q4_1 from L2: 13-18 GB/s
// per core; a plain read stream from DRAM: ~14 GB/s on one core), and without the prefetch the two barely overlap:
// in a decode step one thread ran the Q4_1 GEMV at ~8 GB/s, about the rate of doing one after the other. With it,
// the batch-1 SmolLM2 Q4_1 step took 18-26% less time on one thread (benchmarks/gguf_prefetch_ab.py, results/
// 2026-12-02-smollm2-q4_1-decode-floor.md). Only requests change: the arithmetic, so every output bit, is the same.
constexpr int64_t kDefaultPrefetch = 2048;
std::atomic<int64_t> g_prefetch{-1};  // -1: not read yet
int64_t prefetch_distance() {
  int64_t d = g_prefetch.load(std::memory_order_relaxed);
  if (d < 0) {
    const char* e = std::getenv("TOKENFAB_GGUF_PREFETCH");
    d = e == nullptr || *e == 0 ? kDefaultPrefetch : std::max<int64_t>(0, std::atoll(e));
    g_prefetch.store(d, std::memory_order_relaxed);
  }
  return d;
}

// Requests the TB bytes at p into L1 (lines already present cost one load slot each).
inline void prefetch_block(const uint8_t* p, int64_t TB) {
  for (int64_t i = 0; i < TB; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

int64_t tile_block_bytes(int64_t qt) {
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

// The K-quant GEMV over tiles [t0, t1), as gemv_tiles: per sub-block the exact bf16 products x_k q_k summed in four
// float32 chains, then scaled once: y += (d sc) * sum - (dmin m) * (sum of the sub-block's x) for Q4_K / Q5_K; for
// Q6_K, chains 0-1 hold k 0..15 and chains 2-3 k 16..31 of the sub-block, each half scaled by its own d * scale.
template <int QT, int M, int S, bool F32OUT>
void gemv_k_tiles(const uint16_t* xp, const float* xsum, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                  void* y, int64_t ldy, int64_t t0, int64_t t1) {
  const int64_t KB = K / 256, TB = tile_block_bytes(QT), KB32 = K / QK, pf = prefetch_distance();
  const __m512i tab0 = kq_table(QT, 0), tab1 = kq_table(QT, 1);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* b = w + (t * KB + kb) * TB;
      if (pf > 0) prefetch_block(b + pf, TB);
      for (int j = 0; j < 8; ++j) {
        const uint16_t* xk = xp + kb * 256 + 32 * j;
        __m512 c[4][M];
        for (int i = 0; i < 4; ++i)
          for (int m = 0; m < M; ++m) c[i][m] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int L = 0; L < 4; ++L) {
#pragma GCC unroll 4
          for (int s4 = 0; s4 < 4; ++s4) {
            const __m512i op = kq_operand<QT>(b, j, L, s4, tab0, tab1);
            const int ch = QT == kQ6_K ? 2 * (L / 2) + (s4 & 1) : s4;
            const int p = 4 * L + s4;
            for (int m = 0; m < M; ++m)
              for (int s = 0; s < S; ++s)
                c[ch][m] = _mm512_dpbf16_ps(c[ch][m], (__m512bh)bcast_pair(xk + (m * S + s) * K + 2 * p), (__m512bh)op);
          }
        }
        if constexpr (QT == kQ6_K) {
          const __m512 s0 = q6_scale(b, 2 * j), s1 = q6_scale(b, 2 * j + 1);
          for (int m = 0; m < M; ++m) {
            acc[m] = _mm512_fmadd_ps(_mm512_add_ps(c[0][m], c[1][m]), s0, acc[m]);
            acc[m] = _mm512_fmadd_ps(_mm512_add_ps(c[2][m], c[3][m]), s1, acc[m]);
          }
        } else {
          __m512 ds, dm;
          kq_scale_min(b, j, ds, dm);
          for (int m = 0; m < M; ++m) {
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(c[0][m], c[1][m]), _mm512_add_ps(c[2][m], c[3][m]));
            acc[m] = _mm512_fmadd_ps(sum, ds, acc[m]);
            acc[m] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(xsum[m * KB32 + kb * 8 + j]), acc[m]);
          }
        }
      }
    }
    const int64_t n0 = t * TN, nvalid = std::min<int64_t>(TN, N - n0);
    const float* bb = bias == nullptr ? nullptr : bias + n0;
    for (int m = 0; m < M; ++m) {
      void* yr = F32OUT ? static_cast<void*>(static_cast<float*>(y) + m * ldy + n0)
                        : static_cast<void*>(static_cast<uint16_t*>(y) + m * ldy + n0);
      store_tile<F32OUT>(yr, acc[m], bb, nvalid);
    }
  }
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

// Tiles [t0, t1) for M rows of x given as S bf16 parts each (xp [M][S][K], the parts of a row summing to it), with
// xsum [M][K / 32] the float32 block sums of x (Q4_1 only). Four accumulator chains per row and block (one
// vdpbf16ps chain of 16 would wait on its latency at M = 1).
template <int QT, int M, int S, bool F32OUT>
void gemv_tiles(const uint16_t* xp, const float* xsum, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                void* y, int64_t ldy, int64_t t0, int64_t t1) {
  const int64_t KB = K / QK, TB = tile_block_bytes(QT), pf = prefetch_distance();
  const __m512i table = nibble_table(QT);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* b = w + (t * KB + kb) * TB;
      if (pf > 0) prefetch_block(b + pf, TB);
      const uint16_t* xk = xp + kb * QK;
      __m512 c0[M], c1[M], c2[M], c3[M];
      for (int m = 0; m < M; ++m) c0[m] = c1[m] = c2[m] = c3[m] = _mm512_setzero_ps();
      auto step = [&](int p, __m512i op, __m512* c) {
        for (int m = 0; m < M; ++m)
          for (int s = 0; s < S; ++s)
            c[m] = _mm512_dpbf16_ps(c[m], (__m512bh)bcast_pair(xk + (m * S + s) * K + 2 * p), (__m512bh)op);
      };
      if constexpr (QT == kQ8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(b + 2 * TN);
#pragma GCC unroll 16
        for (int p = 0; p < 16; ++p) {
          __m512 lo, hi;
          q8_halves(q + 32 * p, lo, hi);
          const __m512i op = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
          switch (p & 3) {
            case 0: step(p, op, c0); break;
            case 1: step(p, op, c1); break;
            case 2: step(p, op, c2); break;
            default: step(p, op, c3); break;
          }
        }
      } else {
        const uint8_t* q = b + (QT == kQ4_1 ? 4 : 2) * TN;
#pragma GCC unroll 4
        for (int L = 0; L < 4; ++L) {
          const __m512i wd = _mm512_loadu_si512(q + 64 * L);
          step(4 * L, q4_operand<0>(wd, table), c0);
          step(4 * L + 1, q4_operand<1>(wd, table), c1);
          step(4 * L + 2, q4_operand<2>(wd, table), c2);
          step(4 * L + 3, q4_operand<3>(wd, table), c3);
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(c0[m], c1[m]), _mm512_add_ps(c2[m], c3[m])), d, acc[m]);
      if constexpr (QT == kQ4_1) {
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2 * TN)));
        for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[m * KB + kb]), acc[m]);
      }
    }
    const int64_t n0 = t * TN, nvalid = std::min<int64_t>(TN, N - n0);
    const float* bb = bias == nullptr ? nullptr : bias + n0;
    for (int m = 0; m < M; ++m) {
      void* yr = F32OUT ? static_cast<void*>(static_cast<float*>(y) + m * ldy + n0)
                        : static_cast<void*>(static_cast<uint16_t*>(y) + m * ldy + n0);
      store_tile<F32OUT>(yr, acc[m], bb, nvalid);
    }
  }
}

template <int QT, int S, bool F32OUT>
void gemv_rows4(const uint16_t* xp, const float* xsum, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                const float* bias, void* y, int64_t ldy, int64_t t0, int64_t t1) {
  if constexpr (is_kquant(QT)) {
    switch (M) {
      case 1: gemv_k_tiles<QT, 1, S, F32OUT>(xp, xsum, K, w, N, bias, y, ldy, t0, t1); break;
      case 2: gemv_k_tiles<QT, 2, S, F32OUT>(xp, xsum, K, w, N, bias, y, ldy, t0, t1); break;
      case 3: gemv_k_tiles<QT, 3, S, F32OUT>(xp, xsum, K, w, N, bias, y, ldy, t0, t1); break;
      default: gemv_k_tiles<QT, 4, S, F32OUT>(xp, xsum, K, w, N, bias, y, ldy, t0, t1); break;
    }
  } else {
    switch (M) {
      case 1: gemv_tiles<QT, 1, S, F32OUT>(xp, xsum, K, w, N, bias, y, ldy, t0, t1); break;
      case 2: gemv_tiles<QT, 2, S, F32OUT>(xp, xsum, K, w, N, bias, y, ldy, t0, t1); break;
      case 3: gemv_tiles<QT, 3, S, F32OUT>(xp, xsum, K, w, N, bias, y, ldy, t0, t1); break;
      default: gemv_tiles<QT, 4, S, F32OUT>(xp, xsum, K, w, N, bias, y, ldy, t0, t1); break;
    }
  }
}

// M <= kGemvMaxRows rows: per tile, GEMV passes over groups of up to 4 rows of x, so the tile's bytes are read from
// memory once (later passes find them in L1) and each output is the same sum as a single-pass GEMV would give.
template <int QT, int S, bool F32OUT>
void gemv_rows(const uint16_t* xp, const float* xsum, int64_t M, int64_t K, const uint8_t* w, int64_t N,
               const float* bias, void* y, int64_t ldy, int64_t t0, int64_t t1) {
  if (M <= kGemvRows) {
    gemv_rows4<QT, S, F32OUT>(xp, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    return;
  }
  const int64_t KB = K / QK;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t m0 = 0; m0 < M; m0 += kGemvRows) {
      void* ym = F32OUT ? static_cast<void*>(static_cast<float*>(y) + m0 * ldy)
                        : static_cast<void*>(static_cast<uint16_t*>(y) + m0 * ldy);
      gemv_rows4<QT, S, F32OUT>(xp + m0 * S * K, xsum == nullptr ? nullptr : xsum + m0 * KB,
                                std::min(kGemvRows, M - m0), K, w, N, bias, ym, ldy, t, t + 1);
    }
}

template <int S, bool F32OUT>
void gemv(int qt, const uint16_t* xp, const float* xsum, int64_t M, int64_t K, const uint8_t* w, int64_t N,
          const float* bias, void* y, int64_t ldy) {
  at::parallel_for(0, (N + TN - 1) / TN, 1, [&](int64_t t0, int64_t t1) {
    if (qt == kQ4_0) gemv_rows<kQ4_0, S, F32OUT>(xp, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    else if (qt == kQ4_1) gemv_rows<kQ4_1, S, F32OUT>(xp, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    else if (qt == kQ4_K) gemv_rows<kQ4_K, S, F32OUT>(xp, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    else if (qt == kQ5_K) gemv_rows<kQ5_K, S, F32OUT>(xp, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    else if (qt == kQ6_K) gemv_rows<kQ6_K, S, F32OUT>(xp, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    else gemv_rows<kQ8_0, S, F32OUT>(xp, xsum, M, K, w, N, bias, y, ldy, t0, t1);
  });
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


// Tile t of the weight (16 rows; rows past the weight's last tile are zero) -> columns [col0, col0 + 16) of a
// 32-column block buffer: bf16 VNNI pairs [K / 2, 32, 2] holding each float32 value rounded once to bf16 (round to
// nearest even: the weight the dequantized bf16 twin holds; bf16 x), or float32 [K, 32] (float32 x, exact).
template <int QT, bool F32W>
void dequant_tile(const uint8_t* w, int64_t t, int64_t NT, int64_t K, int64_t col0, void* buf) {
  constexpr int PAIRS = static_cast<int>(block_k(QT) / 2);
  const int64_t KB = K / block_k(QT), TB = tile_block_bytes(QT);
  const __m512i table = QT == kQ8_0 ? _mm512_setzero_si512() : is_kquant(QT) ? kq_table(QT, 0) : nibble_table(QT);
  const __m512i table1 = is_kquant(QT) ? kq_table(QT, 1) : _mm512_setzero_si512();
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* b = w + (t * KB + kb) * TB;
    for (int p = 0; p < PAIRS; ++p) {
      __m512 v[2];
      if (t < NT) {
        if constexpr (is_kquant(QT)) pair_values_k<QT>(b, p, table, table1, v);
        else pair_values<QT>(b, p, table, v);
      } else {
        v[0] = v[1] = _mm512_setzero_ps();
      }
      const int64_t kp = kb * PAIRS + p;
      if constexpr (F32W) {
        float* f = static_cast<float*>(buf);
        _mm512_storeu_ps(f + (2 * kp) * 32 + col0, _mm512_permutex2var_ps(v[0], even, v[1]));
        _mm512_storeu_ps(f + (2 * kp + 1) * 32 + col0, _mm512_permutex2var_ps(v[0], odd, v[1]));
      } else {
        uint16_t* part = static_cast<uint16_t*>(buf);
        for (int h = 0; h < 2; ++h)  // lanes already in VNNI order (row 8h + i / 2, k = 2p + i % 2)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(part + kp * 64 + (col0 + 8 * h) * 2),
                              (__m256i)_mm512_cvtneps_pbh(v[h]));
      }
    }
  }
}

template <bool F32W>
void dequant_block32(int qt, const uint8_t* w, int64_t nb, int64_t NT, int64_t K, void* buf) {
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t t = 2 * nb + half;
    if (qt == kQ4_0) dequant_tile<kQ4_0, F32W>(w, t, NT, K, 16 * half, buf);
    else if (qt == kQ4_1) dequant_tile<kQ4_1, F32W>(w, t, NT, K, 16 * half, buf);
    else if (qt == kQ4_K) dequant_tile<kQ4_K, F32W>(w, t, NT, K, 16 * half, buf);
    else if (qt == kQ5_K) dequant_tile<kQ5_K, F32W>(w, t, NT, K, 16 * half, buf);
    else if (qt == kQ6_K) dequant_tile<kQ6_K, F32W>(w, t, NT, K, 16 * half, buf);
    else dequant_tile<kQ8_0, F32W>(w, t, NT, K, 16 * half, buf);
  }
}

// Prefill (M > kGemvMaxRows): per 32-column block, dequantize once into a thread-local buffer that stays in cache
// (bf16 [K, 32]: K * 64 bytes), then one brgemm over each 64-row tile of x: the bf16 GEMM's micro-kernel (AMX or
// AVX512-BF16, as oneDNN picks under TOKENFAB_CPU_ISA) plus a dequantization of N * K values per call. bf16 x
// multiplies the bf16-rounded weight (the dequantized bf16 twin's products); float32 x the float32 weight (exact).
// TX: uint16_t (bf16) or float; F32OUT: float32 outputs (else x's dtype).
template <typename TX, bool F32OUT>
void gemm(int qt, const TX* x, int64_t M, int64_t lda, int64_t K, const uint8_t* w, int64_t N, const float* bias,
          void* y, int64_t ldy) {
  constexpr bool F32 = std::is_same_v<TX, float>;
  using TY = std::conditional_t<F32OUT, float, TX>;
  const int64_t NT = (N + TN - 1) / TN, NB = (N + 31) / 32;
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    std::vector<uint16_t> wb(F32 ? 0 : K * 32);
    std::vector<float> wf(F32 ? K * 32 : 0), c(kTileM * 32);
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      dequant_block32<F32>(qt, w, nb, NT, K, F32 ? static_cast<void*>(wf.data()) : static_cast<void*>(wb.data()));
      const int64_t nvalid = std::min<int64_t>(32, N - nb * 32);
      const float* bb = bias == nullptr ? nullptr : bias + nb * 32;
      for (int64_t m0 = 0; m0 < M; m0 += kTileM) {
        const int64_t mt = std::min(kTileM, M - m0);
        if constexpr (F32) {
          at::native::cpublas::brgemm(mt, 32, K, lda, 32, 32, false, x + m0 * lda, wf.data(), c.data(), false);
        } else {
          at::native::cpublas::brgemm(mt, 32, K, lda, 32, 32, false,
                                      reinterpret_cast<const at::BFloat16*>(x + m0 * lda),
                                      reinterpret_cast<const at::BFloat16*>(wb.data()), c.data(), true);
        }
        for (int64_t r = 0; r < mt; ++r) {
          TY* yr = static_cast<TY*>(y) + (m0 + r) * ldy + nb * 32;
          const float* cr = c.data() + r * 32;
          store_tile<std::is_same_v<TY, float>>(yr, _mm512_loadu_ps(cr), bb, nvalid);
          if (nvalid > 16) store_tile<std::is_same_v<TY, float>>(yr + 16, _mm512_loadu_ps(cr + 16),
                                                                 bb == nullptr ? nullptr : bb + 16, nvalid - 16);
        }
      }
    }
    at::native::cpublas::brgemm_release(!F32);
  });
}

#if defined(TOKENFAB_AMX)
// AMX path for bf16 x with more than 4 rows (decode batches, prefill): per tile of 16 weight rows and 16-row tile of
// x, per GGUF block, one TDPBF16PS multiplies x [16 m, 32 k] by the block's integer quants [32 k, 16 n] (each an
// exact bf16, laid out by the same vpermw / int8 conversion as the GEMV's operands: a tile-block's pair p is row p of
// the AMX B tile), then the block's sum is scaled in AVX512 registers: acc += d * C (+ m * the block sum of x for
// Q4_1), as the GEMV does. The linux kernel hands out AMX tile state only on request (arch_prctl).
inline void amx_block(const uint16_t* a, int64_t lda_bytes, const uint16_t* b, float* c) {  // C = A B (one block)
  const int64_t b_stride = 64, c_stride = 64;
  asm volatile("tilezero %%tmm0" ::: "memory");
  asm volatile("tileloadd (%0,%1,1), %%tmm1" ::"r"(a), "r"(lda_bytes) : "memory");
  asm volatile("tileloadd (%0,%1,1), %%tmm2" ::"r"(b), "r"(b_stride) : "memory");
  asm volatile("tdpbf16ps %%tmm2, %%tmm1, %%tmm0" ::: "memory");
  asm volatile("tilestored %%tmm0, (%0,%1,1)" ::"r"(c), "r"(c_stride) : "memory");
}

template <int QT, bool F32OUT>
void amx_tiles(const uint16_t* x, int64_t lda, const float* xsum, int64_t M, int64_t K, const uint8_t* w, int64_t N,
               const float* bias, void* y, int64_t ldy, int64_t t0, int64_t t1) {
  const int64_t KB = K / QK, TB = tile_block_bytes(QT);
  const __m512i table = QT == kQ8_0 ? _mm512_setzero_si512() : nibble_table(QT);
  alignas(64) uint16_t bt[16 * 32];
  alignas(64) float ct[16 * 16] = {};
  int64_t configured = -1;
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int64_t mt = std::min<int64_t>(16, M - m0);
      if (mt != configured) {
        tokenfab_cpu::amx_load_config(mt, mt, 16);  // C [mt, 16] fp32, A [mt, 32] bf16, B [16 pairs, 32]
        configured = mt;
      }
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t kb = 0; kb < KB; ++kb) {
        const uint8_t* b = w + (t * KB + kb) * TB;
        if constexpr (QT == kQ8_0) {
          const int8_t* q = reinterpret_cast<const int8_t*>(b + 2 * TN);
          for (int p = 0; p < 16; ++p) {
            __m512 lo, hi;
            q8_halves(q + 32 * p, lo, hi);
            _mm512_store_si512(bt + 32 * p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
          }
        } else {
          const uint8_t* q = b + (QT == kQ4_1 ? 4 : 2) * TN;
          for (int L = 0; L < 4; ++L) {
            const __m512i wd = _mm512_loadu_si512(q + 64 * L);
            _mm512_store_si512(bt + 32 * (4 * L), q4_operand<0>(wd, table));
            _mm512_store_si512(bt + 32 * (4 * L + 1), q4_operand<1>(wd, table));
            _mm512_store_si512(bt + 32 * (4 * L + 2), q4_operand<2>(wd, table));
            _mm512_store_si512(bt + 32 * (4 * L + 3), q4_operand<3>(wd, table));
          }
        }
        amx_block(x + m0 * lda + kb * QK, lda * 2, bt, ct);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
        // rows past mt hold zeros or an earlier tile's sums: their accumulators are never stored
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(_mm512_load_ps(ct + 16 * r), d, acc[r]);
        if constexpr (QT == kQ4_1) {
          const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2 * TN)));
          for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[(m0 + r) * KB + kb]), acc[r]);
        }
      }
      const int64_t n0 = t * TN, nvalid = std::min<int64_t>(TN, N - n0);
      const float* bb = bias == nullptr ? nullptr : bias + n0;
      for (int64_t r = 0; r < mt; ++r) {
        void* yr = F32OUT ? static_cast<void*>(static_cast<float*>(y) + (m0 + r) * ldy + n0)
                          : static_cast<void*>(static_cast<uint16_t*>(y) + (m0 + r) * ldy + n0);
        store_tile<F32OUT>(yr, acc[r], bb, nvalid);
      }
    }
  }
  asm volatile("tilerelease" ::: "memory");
  // oneDNN's brgemm (vnni_linear, the GEMM path) tracks the tile configuration it loaded per thread: forget it, so
  // its next call loads its own again instead of running on this one
  at::native::cpublas::brgemm_release(true);
}

// bf16 x [M, K] (row stride lda) -> y [M, N] bf16, over the packed tiles; xsum [ceil16(M), KB] (Q4_1).
void amx_gemm(int qt, const uint16_t* x, int64_t lda, const float* xsum, int64_t M, int64_t K, const uint8_t* w,
              int64_t N, const float* bias, uint16_t* y, int64_t ldy) {
  at::parallel_for(0, (N + TN - 1) / TN, 1, [&](int64_t t0, int64_t t1) {
    if (qt == kQ4_0) amx_tiles<kQ4_0, false>(x, lda, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    else if (qt == kQ4_1) amx_tiles<kQ4_1, false>(x, lda, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    else amx_tiles<kQ8_0, false>(x, lda, xsum, M, K, w, N, bias, y, ldy, t0, t1);
  });
}
#endif  // TOKENFAB_AMX

#endif  // __AVX512BF16__

}  // namespace

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n,
                       const c10::optional<at::Tensor>& bias, bool out_f32) {
  const int64_t TB = tile_block_bytes(qtype);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "gguf_linear: x must be bfloat16 or float32, got ", x.scalar_type());
  const int64_t K = x.size(-1);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() && w.size(2) == TB &&
              w.size(1) * block_k(static_cast<int>(qtype)) == K && w.size(0) == (n + TN - 1) / TN && n > 0,
              "gguf_linear: weight ", w.sizes(), " does not hold ", n, " rows of ", K, " inputs of ggml type ", qtype);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  auto y = at::empty(shape, out_f32 ? x.options().dtype(at::kFloat) : x.options());
  auto x2 = x.reshape({-1, K});
  if (x2.stride(1) != 1 || (x2.size(0) > 1 && x2.stride(0) < K)) x2 = x2.contiguous();
  const int64_t M = x2.size(0);
  if (M == 0) return y;
  at::Tensor bf;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "gguf_linear: bias has ", bias->numel(), " values for ", n, " outputs");
    bf = bias->to(at::kFloat).contiguous();
    bp = bf.data_ptr<float>();
  }
#if defined(__AVX512BF16__)
  const bool f32 = x.scalar_type() == at::kFloat;
  const auto* wp = w.data_ptr<uint8_t>();
#if defined(TOKENFAB_AMX)
  if (!f32 && !out_f32 && M > kGemvRows && M <= kGemvMaxRows && !is_kquant(static_cast<int>(qtype)) &&
      tokenfab_cpu::amx_ready()) {
    const int64_t KB = K / QK, lda = x2.stride(0);
    const auto* xb = reinterpret_cast<const c10::BFloat16*>(x2.data_ptr());
    std::vector<float> xsum(qtype == kQ4_1 ? ((M + 15) / 16 * 16) * KB : 0, 0.f);
    for (int64_t m = 0; qtype == kQ4_1 && m < M; ++m)
      for (int64_t kb = 0; kb < KB; ++kb) {
        float s = 0.f;
        for (int64_t k = 0; k < QK; ++k) s += static_cast<float>(xb[m * lda + kb * QK + k]);
        xsum[m * KB + kb] = s;
      }
    amx_gemm(static_cast<int>(qtype), reinterpret_cast<const uint16_t*>(xb), lda, xsum.data(), M, K, wp, n, bp,
             reinterpret_cast<uint16_t*>(y.data_ptr()), n);
    return y;
  }
#endif
  if (M > kGemvMaxRows) {
    const int q = static_cast<int>(qtype);
    void* yp = y.data_ptr();
    if (f32) gemm<float, true>(q, x2.data_ptr<float>(), M, x2.stride(0), K, wp, n, bp, yp, n);
    else if (out_f32) gemm<uint16_t, true>(q, reinterpret_cast<const uint16_t*>(x2.data_ptr()), M, x2.stride(0), K,
                                            wp, n, bp, yp, n);
    else gemm<uint16_t, false>(q, reinterpret_cast<const uint16_t*>(x2.data_ptr()), M, x2.stride(0), K, wp, n, bp,
                               yp, n);
    return y;
  }
  // The GEMV's operands: x as [M][S][K] bf16 parts (float32 rows split in three) and Q4_1's float32 block sums.
  at::Tensor parts;
  if (f32) {
    const auto h = x2.to(at::kBFloat16), r = x2 - h.to(at::kFloat), mid = r.to(at::kBFloat16);
    const auto lo = (r - mid.to(at::kFloat)).to(at::kBFloat16);
    parts = at::stack({h, mid, lo}, 1).contiguous();  // [M, 3, K]
  } else {
    parts = x2.contiguous();
  }
  std::vector<float> xsum;
  if (has_min(static_cast<int>(qtype))) {  // float32 sums of x per 32 inputs (the minimum's factor)
    const int64_t KB = K / QK;
    xsum.assign(M * KB, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t kb = 0; kb < KB; ++kb) {
        float s = 0.f;
        if (f32) {
          const float* xr = x2.data_ptr<float>() + m * x2.stride(0) + kb * QK;
          for (int64_t k = 0; k < QK; ++k) s += xr[k];
        } else {
          const auto* xr = reinterpret_cast<const c10::BFloat16*>(x2.data_ptr()) + m * x2.stride(0) + kb * QK;
          for (int64_t k = 0; k < QK; ++k) s += static_cast<float>(xr[k]);
        }
        xsum[m * KB + kb] = s;
      }
  }
  const float* sp = xsum.empty() ? nullptr : xsum.data();
  const auto* xp = reinterpret_cast<const uint16_t*>(parts.data_ptr());
  if (f32) gemv<3, true>(static_cast<int>(qtype), xp, sp, M, K, wp, n, bp, y.data_ptr(), n);
  else if (out_f32) gemv<1, true>(static_cast<int>(qtype), xp, sp, M, K, wp, n, bp, y.data_ptr(), n);
  else gemv<1, false>(static_cast<int>(qtype), xp, sp, M, K, wp, n, bp, y.data_ptr(), n);
  return y;
#else
  TORCH_CHECK(false, "gguf_linear needs AVX512-BF16 (has_bf16_dot is False): use the PyTorch path");
  return y;
#endif
}

// Row j of one K-quant tile (KB tile-blocks at b) dequantized into r [KB * 256], as gguf's dequantize computes it:
// float32 (d sc) q - dmin m (Q4_K, Q5_K; (d sc) q is exact, so one rounding) or (d scale) (q - 32) (Q6_K).
static void kq_embedding_row(int qt, const uint8_t* b0, int64_t KB, int64_t j, float* r) {
  const int64_t TB = tile_block_bytes(qt), lo_off = kq_lo_off(qt), hi_off = kq_hi_off(qt);
  auto word = [](const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return static_cast<int>(v); };
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* b = b0 + kb * TB;
    c10::Half dh;
    std::memcpy(&dh, b + 2 * j, 2);
    const float d = static_cast<float>(dh);
    float dmin = 0.f;
    if (qt != kQ6_K) {
      std::memcpy(&dh, b + 32 + 2 * j, 2);
      dmin = static_cast<float>(dh);
    }
    for (int sub = 0; sub < 8; ++sub) {
      float ds = 0.f, dm = 0.f;
      if (qt != kQ6_K) {
        const auto sb = [&](int i) { return static_cast<int>(b[64 + 16 * i + j]); };
        const int sc = sub < 4 ? sb(sub) & 63 : (sb(sub + 4) & 15) | ((sb(sub - 4) >> 6) << 4);
        const int mn = sub < 4 ? sb(sub + 4) & 63 : (sb(sub + 4) >> 4) | ((sb(sub) >> 6) << 4);
        ds = d * static_cast<float>(sc);
        dm = dmin * static_cast<float>(mn);
      }
      for (int kk = 0; kk < 32; ++kk) {
        const int pair = kk / 2, e = kk % 2, L = pair / 4, s = pair % 4;
        int q = (word(b + lo_off + 256 * sub + 64 * L + 2 * (2 * j + e)) >> (4 * s)) & 15;
        float v;
        if (qt == kQ6_K) {
          q |= ((word(b + hi_off + 128 * sub + 64 * (pair / 8) + 2 * (2 * j + e)) >> (2 * (pair % 8))) & 3) << 4;
          const float dsc = d * static_cast<float>(static_cast<int8_t>(b[32 + 16 * (2 * sub + kk / 16) + j]));
          v = dsc * static_cast<float>(q - 32);
        } else {
          if (qt == kQ5_K) q |= ((word(b + hi_off + 64 * sub + 2 * (2 * j + e)) >> pair) & 1) << 4;
          v = ds * static_cast<float>(q) - dm;  // ds q is exact: fused or not, one rounding
        }
        r[kb * 256 + 32 * sub + kk] = v;
      }
    }
  }
}

at::Tensor gguf_embedding(const at::Tensor& w, int64_t qtype, int64_t n, const at::Tensor& ids,
                          bool bf16_out) {
  const int64_t TB = tile_block_bytes(qtype);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() && w.size(2) == TB &&
              w.size(0) == (n + TN - 1) / TN && n > 0,
              "gguf_embedding: weight ", w.sizes(), " does not hold ", n, " rows of ggml type ", qtype);
  TORCH_CHECK(ids.scalar_type() == at::kLong, "gguf_embedding: int64 ids expected, got ", ids.scalar_type());
  const auto dtype = bf16_out ? at::kBFloat16 : at::kFloat;
  const int64_t KB = w.size(1), K = KB * block_k(static_cast<int>(qtype));
  const auto idc = ids.contiguous();
  const int64_t T = idc.numel();
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K);
  auto y = at::empty(shape, ids.options().dtype(dtype));
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "gguf_embedding: id ", ip[i], " is outside the ", n, " rows");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t qoff = (qtype == kQ4_1 ? 4 : 2) * TN;
  at::parallel_for(0, T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(K);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = ip[i] / TN, j = ip[i] % TN;
      if (is_kquant(static_cast<int>(qtype))) {
        kq_embedding_row(static_cast<int>(qtype), wp + t * KB * TB, KB, j, row.data());
      }
      for (int64_t kb = 0; !is_kquant(static_cast<int>(qtype)) && kb < KB; ++kb) {
        const uint8_t* b = wp + (t * KB + kb) * TB;
        c10::Half dh, mh;
        std::memcpy(&dh, b + 2 * j, 2);
        const float d = static_cast<float>(dh);
        float mn = 0.f;
        if (qtype == kQ4_1) {
          std::memcpy(&mh, b + 2 * TN + 2 * j, 2);
          mn = static_cast<float>(mh);
        }
        float* r = row.data() + kb * QK;
        for (int64_t k = 0; k < QK; ++k) {
          const int64_t pair = k / 2, e = k % 2;
          if (qtype == kQ8_0) {
            r[k] = d * static_cast<float>(static_cast<int8_t>(b[qoff + pair * 32 + 2 * j + e]));
          } else {  // word 2j + e of group pair / 4 holds the quant in nibble pair % 4
            uint16_t word;
            std::memcpy(&word, b + qoff + 64 * (pair / 4) + 2 * (2 * j + e), 2);
            const int q = (word >> (4 * (pair % 4))) & 15;
            // q d is exact in float32 (a 4-bit integer times an fp16), so q d + m rounds once, as gguf computes it
            r[k] = qtype == kQ4_1 ? static_cast<float>(q) * d + mn : d * static_cast<float>(q - 8);
          }
        }
      }
      if (dtype == at::kFloat) {
        std::memcpy(y.data_ptr<float>() + i * K, row.data(), K * sizeof(float));
      } else {
        auto* yr = y.data_ptr<at::BFloat16>() + i * K;
        for (int64_t k = 0; k < K; ++k) yr[k] = at::BFloat16(row[k]);  // round to nearest even, as Tensor.to
      }
    }
  });
  return y;
}

void register_gguf_linear(pybind11::module_& m) {
  m.def("gguf_prefetch", [](int64_t bytes) {
          const int64_t before = prefetch_distance();
          if (bytes >= 0) g_prefetch.store(bytes, std::memory_order_relaxed);
          return before;
        },
        "the GEMV's software prefetch distance in bytes (TOKENFAB_GGUF_PREFETCH, default 2048): returns the current "
        "value and sets ``bytes`` when >= 0 (0: off; the arithmetic and so the results are the same either way)",
        pybind11::arg("bytes") = -1);
  m.def("gguf_linear", &gguf_linear, "x W^T (+ b) over packed GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K tiles (CPU, AVX512-BF16)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("qtype"), pybind11::arg("n"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("out_f32") = false);
  m.def("gguf_embedding", &gguf_embedding, "rows ids of a packed GGUF Q4_0 / Q4_1 / Q8_0 / K-quant weight, dequantized (CPU)",
        pybind11::arg("w"), pybind11::arg("qtype"), pybind11::arg("n"), pybind11::arg("ids"), pybind11::arg("bf16_out"));
}
