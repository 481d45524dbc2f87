// Linear layers on FP8 block-scaled weights (DeepSeek-V3 / Kimi-K2 as published) executed packed: the weight stays
// in its float8_e4m3fn bytes [n, K] with float32 scale_inv [ceil(n / 128), ceil(K / 128)] and is converted in
// registers.
//
// e4m3fn (OCP FP8, "fn": no infinities): sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
// (m * 2^-9), S.1111.111 is NaN. Every e4m3 value is exact in bf16 (8 exponent bits, 7 mantissa bits), so a
// 128-entry table of bf16 bit patterns (the magnitude codes 0..127) looked up by two `vpermt2w` (64 entries each, bit
// 6 of the code choosing between them) plus the sign bit moved to bit 15 gives the exact bf16 of 32 weights at once
// (fp8_e4m3.h).
//
// Products x_k q_k of bf16 x and the bf16 e4m3 values are exact in float32; per 128-input block (the scale block)
// the products are summed in float32 (`vdpbf16ps`) and scaled once by the block's scale_inv:
//   y[m, n] = sum_kb s[n / 128, kb] * sum_{k in kb} x[m, k] q[n, k]    (+ bias, one rounding to x's dtype)
// the same real number as sum_k x_k (q_k s) up to float32 rounding. float32 x is split into three bf16 parts
// (x = h + m + l up to 2^-24 relative), each multiplied exactly, so float32 activations keep float32 accuracy.
//
// Paths, by rows M of x (never a full-size copy of the weight):
// - GEMV (bf16 x with M <= 4 where the CPU has AMX, else M <= 8, or 12 for K >= 4096; float32 x with M <= 16): over
//   weight rows, parallel over rows: R weight rows x M rows of x per pass (R = 4 at M = 1, 2 at M = 2, else 1;
//   independent accumulator chains), passes of up to 8 rows of x. Where x outgrows L1 (gemv_tiled) the rows go in
//   tiles of 8, two weight rows per x load, over K chunks whose x stays in L1 (x relaid once per call by chunk_x).
// - AMX (bf16 x with M > 4, AMX-BF16 granted): per 16 weight rows converted once to bf16 A tiles, one TDPBF16PS per
//   32 inputs and 16-row tile of x, each 128-input block's float32 tile scaled in registers (amx_tiles below).
// - brgemm (bf16 x past the GEMV's rows without AMX, float32 x with M > 16): per 32 weight rows, the thread converts
//   them once into a small thread-local buffer that stays in cache and runs oneDNN's brgemm over 64-row tiles of x.
//   bf16 x: bf16 VNNI pairs [K / 2, 32, 2] of each value times its scale_inv, rounded once to bf16 (the dequantized
//   bf16 twin's weight), in one brgemm over all of K, as a bf16 GEMM runs. float32 x: the exact e4m3 values as
//   float32 [K, 32], one brgemm per 128-input block, each block's [64, 32] sums scaled by its scale_inv.
// Weights and routed expert stacks re-laid into the CPU tile layout (fp8_tiles.h, where fp8_tiles_preferred:
// AVX512-BF16 without AMX; a weight's rows past its last whole tile stay row-major and take the row GEMV) take the
// tile GEMV for up to kTileGemvMaxRows rows of x (16 weight rows in the 16 lanes, x's pairs broadcast, each weight
// converted once per call) and brgemm over tiles converted 32 rows at a time beyond; never AMX.
#include "fp8_linear.h"
#include "registrations.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include "cpu_isa.h"
#include "linear_io.h"
#include "vnni_transpose.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "fp8_e4m3.h"
#include "fp8_tiles.h"

namespace {

constexpr int64_t BK = kFp8Block;
constexpr int64_t kGemvMaxRows = 16, kGemvPass = 8, kTileM = 64;
// bf16 x without AMX: the GEMV up to kGemvMaxRowsBf16 rows (kGemvMaxRowsBf16Wide where K >= kGemvWideK), brgemm
// beyond. Measured (benchmarks/fp8_linear.py and packed_experts.py, 2 threads, thresholds alternated twice): at 13-16
// rows brgemm took 0.7-0.9x the GEMV's time on [7168, 2048] and expert shapes, within ~10% either way on [2048,
// 7168]; at 6-8 rows the GEMV took 0.7-0.9x brgemm's. At 9-12 rows (2026-12-07, Zen 4, the GEMV tiled where x
// outgrows L1): on [7168, 2048] brgemm took 1.02-1.49x bf16's time against the GEMV's 1.73-2.26x (two passes of
// x convert each weight row twice, and K = 2048 does not tile well); on [2048, 7168] the GEMV 1.12-1.29x against
// brgemm's 1.36-1.58x.
constexpr int64_t kGemvMaxRowsBf16 = 8, kGemvMaxRowsBf16Wide = 12, kGemvWideK = 4096;
inline int64_t gemv_max_rows(bool f32, int64_t K) {
  return f32 ? kGemvMaxRows : K >= kGemvWideK ? kGemvMaxRowsBf16Wide : kGemvMaxRowsBf16;
}
// Weights and expert stacks in the tile layout (fp8_tiles.h): up to kTileGemvMaxRows rows of x (an expert's
// segment) take the tile GEMV, more rows brgemm over tiles converted 32 rows at a time. Measured (benchmarks/packed_experts.py, 2 threads,
// DeepSeek-V3 expert shapes, Zen 4): with the GEMV up to 64 rows, 24 rows per expert took 0.97-0.98x the time of
// brgemm over tiles, 32 rows 1.01-1.04x, 48-64 rows 1.07-1.17x (benchmarks/results/2026-12-07-fp8-expert-tiles).
constexpr int64_t kTileGemvMaxRows = 16;

#if defined(__AVX512BF16__)

using tokenfab_fp8::bf16_to_f32;
using tokenfab_fp8::e4m3x32;
using tokenfab_fp8::Lut;

template <bool F32OUT>
inline void store_one(void* y, int64_t idx, float v) {
  if constexpr (F32OUT) {
    static_cast<float*>(y)[idx] = v;
  } else {
    static_cast<c10::BFloat16*>(y)[idx] = c10::BFloat16(v);  // round to nearest even
  }
}

// Weight rows [n0, n0 + R) for M rows of x over scale blocks [kb0, kb1): xp holds those blocks' inputs of the M rows
// as S bf16 parts each, [M][S][ldx] from input kb0 * 128 (a chunk of chunk_x's layout, or all of K with ldx = K).
// Each x load feeds R weight rows. Per block, the exact products go to R * M float32 chains and are scaled once into
// the rows' accumulators: in registers where R * M <= 8, else in memory (L1) beside the chains. The accumulators
// start at zero where kb0 == 0, else from accp (vector (r, m) at accp + (r * kGemvPass + m) * 16), and are stored
// back there where kb1 < KB, else summed into y [M, ldy]. Splitting K this way leaves every sum's order unchanged.
template <int R, int M, int S, bool F32OUT>
void gemv_rows(const uint16_t* xp, int64_t ldx, int64_t K, const uint8_t* w, const float* sc, int64_t KB,
               const float* bias, void* y, int64_t ldy, int64_t n0, const Lut& L, int64_t kb0, int64_t kb1,
               float* accp) {
  static_assert(M <= kGemvPass, "one pass holds at most kGemvPass rows of x");
  constexpr bool kRegAcc = R * M <= 8;
  __m512 acc[kRegAcc ? R : 1][kRegAcc ? M : 1];
  alignas(64) float accm[kRegAcc ? 16 : R * M * 16];
  auto acc_at = [&](int r, int m) -> float* { return accm + (r * M + m) * 16; };
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      const __m512 a0 = kb0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(accp + (r * kGemvPass + m) * 16);
      if constexpr (kRegAcc) acc[r][m] = a0;
      else _mm512_store_ps(acc_at(r, m), a0);
    }
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    const int64_t k0 = kb * BK, kl = std::min(BK, K - k0);
    __m512 c[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) c[r][m] = _mm512_setzero_ps();
    for (int64_t j = 0; j < kl; j += 32) {
      __m512i wv[R];
      for (int r = 0; r < R; ++r) wv[r] = e4m3x32(w + (n0 + r) * K + k0 + j, L);
      for (int m = 0; m < M; ++m)
        for (int s = 0; s < S; ++s) {
          const __m512i xv = _mm512_loadu_si512(xp + (m * S + s) * ldx + k0 - kb0 * BK + j);
          for (int r = 0; r < R; ++r) c[r][m] = _mm512_dpbf16_ps(c[r][m], (__m512bh)xv, (__m512bh)wv[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(sc[((n0 + r) / BK) * KB + kb]);
      for (int m = 0; m < M; ++m) {
        if constexpr (kRegAcc) acc[r][m] = _mm512_fmadd_ps(c[r][m], s, acc[r][m]);
        else _mm512_store_ps(acc_at(r, m), _mm512_fmadd_ps(c[r][m], s, _mm512_load_ps(acc_at(r, m))));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      __m512 a;
      if constexpr (kRegAcc) a = acc[r][m];
      else a = _mm512_load_ps(acc_at(r, m));
      if (kb1 < KB) {
        _mm512_store_ps(accp + (r * kGemvPass + m) * 16, a);
        continue;
      }
      float v = _mm512_reduce_add_ps(a);
      if (bias != nullptr) v += bias[n0 + r];
      store_one<F32OUT>(y, m * ldy + n0 + r, v);
    }
}

// One pass of M <= 8 rows of x over R weight rows from n (the template's M chosen at run time).
template <int R, int S, bool F32OUT>
void gemv_pass(const uint16_t* xp, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, const float* sc, int64_t KB,
               const float* bias, void* y, int64_t ldy, int64_t n, const Lut& L, int64_t kb0, int64_t kb1,
               float* accp) {
#define TF_ROWS(MM) gemv_rows<R, MM, S, F32OUT>(xp, ldx, K, w, sc, KB, bias, y, ldy, n, L, kb0, kb1, accp)
  switch (M) {
    case 1: TF_ROWS(1); break;
    case 2: TF_ROWS(2); break;
    case 3: TF_ROWS(3); break;
    case 4: TF_ROWS(4); break;
    case 5: TF_ROWS(5); break;
    case 6: TF_ROWS(6); break;
    case 7: TF_ROWS(7); break;
    default: TF_ROWS(8); break;
  }
#undef TF_ROWS
}

// Weight rows per tile of the GEMV's passes; the bytes of x from which the GEMV tiles (about L1: 32 KB on Zen 4,
// 48 KB on Sapphire Rapids) and the bytes of x one K chunk of a tiled pass spans.
constexpr int64_t kGemvTileRows = 8, kGemvTiledBytes = 32768, kGemvChunkBytes = 16384;
static_assert(kGemvMaxRows <= 2 * kGemvPass, "gemv keeps at most two passes of accumulators per tile row");

// Whether the GEMV over M rows of x in S parts tiles: its x outgrows L1 (M * S * K * 2 > kGemvTiledBytes, never for
// M <= 2). Measured (one thread, [2048, 7168] and [7168, 2048], 4-12 rows): tiled, 7,168 inputs took 0.69-0.87x the
// untiled time; 2,048 inputs (x within L1 up to 8 rows) took 1.0-1.6x, so those stay untiled.
inline bool gemv_tiled(int64_t M, int64_t S, int64_t K) { return M > 2 && M * S * K * 2 > kGemvTiledBytes; }

// Scale blocks per K chunk of the GEMV: all of K where it does not tile, else as many whole blocks as keep the
// chunk's rows of x within kGemvChunkBytes (at least one).
inline int64_t gemv_chunk_blocks(int64_t M, int64_t S, int64_t K, int64_t KB) {
  return gemv_tiled(M, S, K) ? std::min(KB, std::max<int64_t>(1, kGemvChunkBytes / (M * S * BK * 2))) : KB;
}

// x [M][S][K] (bf16 parts) -> the GEMV's chunked layout: per chunk of cb scale blocks (the last may be shorter), its
// inputs of all M rows contiguous, [M][S][kc] with kc the chunk's inputs; chunk q starts at M * S * q * cb * 128.
// With cb covering all of K (an untiled GEMV) that is x as it is, copied.
void chunk_x(const uint16_t* x, int64_t M, int64_t S, int64_t K, int64_t cb, uint16_t* out) {
  for (int64_t k0 = 0; k0 < K; k0 += cb * BK) {
    const int64_t kc = std::min(cb * BK, K - k0);
    uint16_t* o = out + M * S * k0;
    for (int64_t i = 0; i < M * S; ++i) std::memcpy(o + i * kc, x + i * K + k0, kc * sizeof(uint16_t));
  }
}

// M <= 16 rows of x, weight rows [r0, r1). xp: x in chunk_x's layout for cb = gemv_chunk_blocks(M, S, K, KB)
// (where the GEMV does not tile, x itself). M <= 2: R rows at a time over all of K. Else tiles of kGemvTileRows
// weight rows in passes of up to 8 rows of x. Where x outgrows L1 (gemv_tiled), each pass runs over one K chunk at a
// time, so every row of the tile reads the chunk of x from L1 instead of streaming all of x from L2 once per weight
// row (8 rows of x over K = 7168 are 114 KB), and takes two weight rows at a time (each x load feeds both).
template <int S, bool F32OUT>
void gemv(const uint16_t* xp, int64_t M, int64_t K, const uint8_t* w, const float* sc, int64_t KB,
          const float* bias, void* y, int64_t ldy, int64_t r0, int64_t r1, const Lut& L) {
  int64_t n = r0;
  if (M == 1)
    for (; n + 4 <= r1; n += 4) gemv_rows<4, 1, S, F32OUT>(xp, K, K, w, sc, KB, bias, y, ldy, n, L, 0, KB, nullptr);
  if (M == 2)
    for (; n + 2 <= r1; n += 2) gemv_rows<2, 2, S, F32OUT>(xp, K, K, w, sc, KB, bias, y, ldy, n, L, 0, KB, nullptr);
  if (n == r1) return;
  const int64_t passes = (M + kGemvPass - 1) / kGemvPass, cb = gemv_chunk_blocks(M, S, K, KB);
  const bool pair = gemv_tiled(M, S, K);
  alignas(64) float accbuf[2 * kGemvTileRows * kGemvPass * 16];  // [pass][tile row][8 vectors]
  for (int64_t t0 = n; t0 < r1; t0 += kGemvTileRows) {
    const int64_t t1 = std::min(r1, t0 + kGemvTileRows);
    for (int64_t kb0 = 0; kb0 < KB; kb0 += cb) {
      const int64_t kb1 = std::min(KB, kb0 + cb), kc = std::min(K, kb1 * BK) - kb0 * BK;
      const uint16_t* xq = xp + M * S * kb0 * BK;
      for (int64_t p = 0; p < passes; ++p) {
        const int64_t m0 = p * kGemvPass, mp = std::min(kGemvPass, M - m0);
        void* ym = F32OUT ? static_cast<void*>(static_cast<float*>(y) + m0 * ldy)
                          : static_cast<void*>(static_cast<c10::BFloat16*>(y) + m0 * ldy);
        for (int64_t r = t0; r < t1; r += pair ? 2 : 1) {
          float* accp = accbuf + (p * kGemvTileRows + (r - t0)) * kGemvPass * 16;
          if (pair && r + 1 < t1)
            gemv_pass<2, S, F32OUT>(xq + m0 * S * kc, kc, mp, K, w, sc, KB, bias, ym, ldy, r, L, kb0, kb1, accp);
          else
            gemv_pass<1, S, F32OUT>(xq + m0 * S * kc, kc, mp, K, w, sc, KB, bias, ym, ldy, r, L, kb0, kb1, accp);
        }
      }
    }
  }
}

// Rows [32 nb, 32 nb + 32) of the weight (rows past n are zero) -> float32 [K][32], the exact e4m3 values (F32W), or
// bf16 VNNI pairs (uint32 [K / 2][32]: pair k / 2 of row j at [k / 2][j]) of each value times its block's scale_inv
// (srow: the 32 rows' scales per 128-input block), rounded once to bf16: the dequantized bf16 twin's weight. bf16:
// per 128-input block one table of every code's scaled value (Lut::scaled), then per 32 inputs 16 rows' 16 pairs
// each looked up in order and transposed (vnni_transpose.h), so each layout row is one contiguous store.
// j_begin (0 or 16): the first of the 32 rows converted (a tile-layout weight's last tile fills the columns before).
template <bool F32W>
void convert_rows32(const uint8_t* w, int64_t nb, int64_t N, int64_t K, void* buf, const Lut& L, const float* srow,
                    int64_t j_begin = 0) {
  if constexpr (F32W) {
    const __m512i k_idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(32));
    for (int64_t j = j_begin; j < 32; ++j) {
      const int64_t row = nb * 32 + j;
      for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const __m512i v = row < N ? e4m3x32(w + row * K + k0, L) : _mm512_setzero_si512();
        float* f = static_cast<float*>(buf) + k0 * 32 + j;
        _mm512_i32scatter_ps(f, k_idx, bf16_to_f32(_mm512_castsi512_si256(v)), 4);
        _mm512_i32scatter_ps(f + 16 * 32, k_idx, bf16_to_f32(_mm512_extracti64x4_epi64(v, 1)), 4);
      }
    }
  } else {
    Lut block = L;
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      if (k0 % BK == 0) block = L.scaled(srow[k0 / BK]);
      for (int64_t j0 = j_begin; j0 < 32; j0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t row = nb * 32 + j0 + i;
          // dword p: the row's pair (k0 + 2p, k0 + 2p + 1)
          r[i] = row < N ? e4m3x32(w + row * K + k0, block) : _mm512_setzero_si512();
        }
        tokenfab_cpu::transpose16x16_epi32(r);
        uint32_t* p = static_cast<uint32_t*>(buf) + (k0 / 2) * 32 + j0;
        for (int q = 0; q < 16; ++q) _mm512_storeu_si512(p + q * 32, r[q]);
      }
    }
  }
}

// x's M rows of S bf16 parts ([M][S][K]) for the tile GEMV: the rows at tile_x_stride (a copy) where more than one
// row is read in step, else x itself; ldx receives the row stride.
at::Tensor tile_x(const at::Tensor& parts, int64_t M, int64_t S, int64_t K, bool many_rows, int64_t& ldx) {
  ldx = many_rows ? tokenfab_fp8_tiles::tile_x_stride(S, K) : S * K;
  if (ldx == S * K) return parts;
  auto out = at::empty({M * ldx}, parts.options());
  tokenfab_fp8_tiles::stride_x(reinterpret_cast<const uint16_t*>(parts.data_ptr()), M, S, K, ldx,
                               reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

// tiled: w's first N / 16 * 16 rows in the tile layout of fp8_tiles.h, the rest row-major; else all row-major.
template <typename T>
void gemm(const T* x, int64_t M, int64_t lda, int64_t K, const uint8_t* w, const float* sc, int64_t N,
          const float* bias, T* y, int64_t ldy, const Lut& L, bool tiled = false) {
  constexpr bool F32 = std::is_same_v<T, float>;
  const int64_t NB = (N + 31) / 32, KB = (K + BK - 1) / BK;
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    std::vector<uint32_t> buf(F32 ? K * 32 : K * 16);
    std::vector<float> c(F32 ? kTileM * 32 : 0), acc(kTileM * 32);  // c: one block's sums (float32 x only)
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const float* srow = sc + (nb * 32 / BK) * KB;  // the 32 rows lie in one 128-row scale block
      // whole tiles among the 32 rows (0 without tiles), then the rest row-major (rows past N zero)
      const int64_t ntiles = tiled ? std::clamp<int64_t>((N / 16 * 16 - nb * 32) / 16, 0, 2) : 0;
      tokenfab_fp8_tiles::tiles_to_brgemm<F32>(w + nb * 32 * K, ntiles, K, buf.data(), L, srow);
      if (ntiles < 2) convert_rows32<F32>(w, nb, N, K, buf.data(), L, srow, 16 * ntiles);
      const int64_t nvalid = std::min<int64_t>(32, N - nb * 32);
      for (int64_t m0 = 0; m0 < M; m0 += kTileM) {
        const int64_t mt = std::min(kTileM, M - m0);
        if constexpr (F32) {  // exact e4m3 values: per 128-input block, scaled once
          for (int64_t kb = 0; kb < KB; ++kb) {
            const int64_t k0 = kb * BK, kl = std::min(BK, K - k0);
            at::native::cpublas::brgemm(mt, 32, kl, lda, 32, 32, false, x + m0 * lda + k0,
                                        reinterpret_cast<const float*>(buf.data()) + k0 * 32, c.data(), false);
            const __m512 s = _mm512_set1_ps(srow[kb]);
            for (int64_t i = 0; i < mt * 32; i += 16) {
              const __m512 ci = _mm512_mul_ps(_mm512_loadu_ps(c.data() + i), s);
              _mm512_storeu_ps(acc.data() + i, kb == 0 ? ci : _mm512_add_ps(_mm512_loadu_ps(acc.data() + i), ci));
            }
          }
        } else {  // scaled bf16 weights: one brgemm over all of K, as the bf16 GEMM
          at::native::cpublas::brgemm(mt, 32, K, lda, 32, 32, false,
                                      reinterpret_cast<const at::BFloat16*>(x + m0 * lda),
                                      reinterpret_cast<const at::BFloat16*>(buf.data()), acc.data(), true);
        }
        for (int64_t r = 0; r < mt; ++r)
          for (int64_t j = 0; j < nvalid; ++j) {
            float v = acc[r * 32 + j];
            if (bias != nullptr) v += bias[nb * 32 + j];
            store_one<F32>(y, (m0 + r) * ldy + nb * 32 + j, v);
          }
      }
    }
    at::native::cpublas::brgemm_release(!F32);
  });
}

#if defined(TOKENFAB_AMX)
// AMX path for bf16 x with more than kAmxMinRows rows (decode batches and prefill). The weight is the A operand, so
// its row-major bytes need no transpose: per 16 weight rows, their e4m3 values are converted once into A tiles
// (bf16 [16 rows, 32 inputs] per 32 inputs, exact). x is laid out once per call as B tiles (bf16 pairs [16 pairs,
// 16 rows of x, 2], zero-padded to 16 rows). Per 16-row tile of x and 128-input scale block, four TDPBF16PS
// accumulate the block's exact products in a float32 tile C [16 weight rows, 16 rows of x], scaled once in AVX512
// registers: acc += s * C, the GEMV's sum per block. The linux kernel hands out AMX tile state only on request.
constexpr int64_t kAmxMinRows = 4;

// x [M, K] bf16 (row stride lda) -> xb [ceil(M / 16)][K / 32][16 pairs][16 rows][2], rows past M zero.
void pack_x_tiles(const uint16_t* x, int64_t lda, int64_t M, int64_t K, uint16_t* xb) {
  const int64_t KC = K / 32;
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(16));
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      uint32_t* dst = reinterpret_cast<uint32_t*>(xb) + (m / 16) * KC * 256 + m % 16;
      for (int64_t kc = 0; kc < KC; ++kc)
        _mm512_i32scatter_epi32(dst + kc * 256, idx, _mm512_loadu_si512(x + m * lda + kc * 32), 4);
    }
  });
}

template <bool F32OUT>
void amx_tiles(const uint16_t* xb, int64_t M, int64_t K, const uint8_t* w, const float* sc, int64_t N,
               const float* bias, void* y, int64_t ldy, int64_t t0, int64_t t1, const Lut& L) {
  const int64_t KB = (K + BK - 1) / BK, KC = K / 32;
  uint16_t* at = static_cast<uint16_t*>(std::aligned_alloc(64, K * 32));  // A tiles [K / 32][16 rows][32]
  alignas(64) float ct[16 * 16];
  tokenfab_cpu::amx_load_config(16, 16, 16);  // C [16, 16] fp32, A [16, 32] bf16, B [16 pairs, 16 x 2] bf16
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t row = t * 16 + j;
      for (int64_t kc = 0; kc < KC; ++kc)
        _mm512_store_si512(at + kc * 512 + j * 32,
                           row < N ? e4m3x32(w + row * K + kc * 32, L) : _mm512_setzero_si512());
    }
    const float* srow = sc + (t * 16 / BK) * KB;  // the 16 rows lie in one 128-row scale block
    const int64_t n0 = t * 16, nvalid = std::min<int64_t>(16, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      const uint16_t* xt = xb + (m0 / 16) * KC * 512;
      for (int64_t kb = 0; kb < KB; ++kb) {
        const int64_t kc0 = kb * (BK / 32), kc1 = std::min(KC, kc0 + BK / 32);
        asm volatile("tilezero %%tmm0" ::: "memory");
        for (int64_t kc = kc0; kc < kc1; ++kc) {
          const uint16_t* a = at + kc * 512;
          const uint16_t* b = xt + kc * 512;
          const int64_t stride = 64;
          asm volatile("tileloadd (%0,%1,1), %%tmm1" ::"r"(a), "r"(stride) : "memory");
          asm volatile("tileloadd (%0,%1,1), %%tmm2" ::"r"(b), "r"(stride) : "memory");
          asm volatile("tdpbf16ps %%tmm2, %%tmm1, %%tmm0" ::: "memory");
        }
        const int64_t stride = 64;
        asm volatile("tilestored %%tmm0, (%0,%1,1)" ::"r"(ct), "r"(stride) : "memory");
        const __m512 s = _mm512_set1_ps(srow[kb]);
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(_mm512_load_ps(ct + 16 * r), s, acc[r]);
      }
      const int64_t mt = std::min<int64_t>(16, M - m0);
      alignas(64) float out[16 * 16];  // acc[j] lane i = y[m0 + i, n0 + j]
      for (int r = 0; r < 16; ++r) _mm512_store_ps(out + 16 * r, acc[r]);
      for (int64_t i = 0; i < mt; ++i)
        for (int64_t j = 0; j < nvalid; ++j) {
          float v = out[16 * j + i];
          if (bias != nullptr) v += bias[n0 + j];
          store_one<F32OUT>(y, (m0 + i) * ldy + n0 + j, v);
        }
    }
  }
  std::free(at);
  asm volatile("tilerelease" ::: "memory");
  // oneDNN's brgemm tracks the tile configuration it loaded per thread: forget it, so its next call loads its own
  at::native::cpublas::brgemm_release(true);
}
#endif  // TOKENFAB_AMX

#endif  // __AVX512BF16__

}  // namespace

at::Tensor fp8_block_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_inv,
                            const c10::optional<at::Tensor>& bias, bool tiled) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "fp8_block_linear: x must be bfloat16 or float32, got ", x.scalar_type());
  const int64_t K = x.size(-1);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) == K && K % 32 == 0 &&
              w.size(0) > 0, "fp8_block_linear: weight ", w.sizes(), " does not hold rows of ", K,
              " inputs (uint8 e4m3 bytes [n, K], K a multiple of 32)");
  const int64_t N = w.size(0), KB = (K + BK - 1) / BK;
  TORCH_CHECK(scale_inv.scalar_type() == at::kFloat && scale_inv.is_contiguous() && scale_inv.dim() == 2 &&
              scale_inv.size(0) == (N + BK - 1) / BK && scale_inv.size(1) == KB,
              "fp8_block_linear: scale_inv ", scale_inv.sizes(), " is not float32 [ceil(n / 128), ceil(K / 128)]");
  auto rows = tokenfab_cpu::linear_rows(x, K, N, x.scalar_type());
  at::Tensor x2 = rows.x2, y = rows.y;
  const int64_t M = rows.M;
  if (M == 0) return y;
  at::Tensor bf;
  const float* bp = tokenfab_cpu::float_bias(bias, N, "fp8_block_linear", bf);
#if defined(__AVX512BF16__)
  static const Lut lut;
    const bool f32 = x.scalar_type() == at::kFloat;
  const auto* wp = w.data_ptr<uint8_t>();
  const float* sp = scale_inv.data_ptr<float>();
#if defined(TOKENFAB_AMX)
  if (!f32 && !tiled && M > kAmxMinRows && tokenfab_cpu::amx_ready()) {
    auto xt = at::zeros({(M + 15) / 16 * 16 * K}, x.options());  // x as B tiles (rows past M zero)
    auto* xb = reinterpret_cast<uint16_t*>(xt.data_ptr());
    pack_x_tiles(reinterpret_cast<const uint16_t*>(x2.data_ptr()), x2.stride(0), M, K, xb);
    at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t t0, int64_t t1) {
      amx_tiles<false>(xb, M, K, wp, sp, N, bp, y.data_ptr(), N, t0, t1, lut);
    });
    return y;
  }
#endif
  if (M > (tiled ? kTileGemvMaxRows : gemv_max_rows(f32, K))) {
    if (f32) gemm<float>(x2.data_ptr<float>(), M, x2.stride(0), K, wp, sp, N, bp, y.data_ptr<float>(), N, lut, tiled);
    else gemm<uint16_t>(reinterpret_cast<const uint16_t*>(x2.data_ptr()), M, x2.stride(0), K, wp, sp, N, bp,
                        reinterpret_cast<uint16_t*>(y.data_ptr()), N, lut, tiled);
    return y;
  }
  at::Tensor parts = tokenfab_cpu::bf16_parts(x2);  // [M, 3, K] for float32 x, else [M, K]
  const int64_t S = f32 ? 3 : 1, cb = gemv_chunk_blocks(M, S, K, KB);
  if (tiled) {  // whole tiles on the tile GEMV (x in natural order), the rows past them on the row GEMV
    const int64_t tiles = N / tokenfab_fp8_tiles::kTileRows, n16 = tiles * tokenfab_fp8_tiles::kTileRows;
    const auto* xn = reinterpret_cast<const uint16_t*>(parts.data_ptr());
    int64_t ldx;
    const at::Tensor strided = tile_x(parts, M, S, K, M > 1, ldx);
    const auto* xs = reinterpret_cast<const uint16_t*>(strided.data_ptr());
    at::Tensor chunked = parts;
    if (n16 < N && cb < KB) {
      chunked = at::empty_like(parts);
      chunk_x(xn, M, S, K, cb, reinterpret_cast<uint16_t*>(chunked.data_ptr()));
    }
    const auto* xc = reinterpret_cast<const uint16_t*>(chunked.data_ptr());
    void* yp = y.data_ptr();
    at::parallel_for(0, tiles + (n16 < N ? 1 : 0), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        if (i == tiles) {  // the last rows, fewer than 16, row-major
          if (f32) gemv<3, true>(xc, M, K, wp, sp, KB, bp, yp, N, n16, N, lut);
          else gemv<1, false>(xc, M, K, wp, sp, KB, bp, yp, N, n16, N, lut);
          continue;
        }
        const uint8_t* tile = wp + i * tokenfab_fp8_tiles::kTileRows * K;
        const float* sc = sp + (i * tokenfab_fp8_tiles::kTileRows / BK) * KB;
        const float* bt = bp != nullptr ? bp + i * tokenfab_fp8_tiles::kTileRows : nullptr;
        if (f32)
          tokenfab_fp8_tiles::tile_gemv<3, true>(tile, K, sc, xs, ldx, M, lut, static_cast<float*>(yp) + i * 16, N,
                                                 bt);
        else
          tokenfab_fp8_tiles::tile_gemv<1, false>(tile, K, sc, xs, ldx, M, lut, static_cast<uint16_t*>(yp) + i * 16,
                                                  N, bt);
      }
    });
    return y;
  }
  if (cb < KB) {  // the GEMV's chunked layout of x
    auto chunked = at::empty_like(parts);
    chunk_x(reinterpret_cast<const uint16_t*>(parts.data_ptr()), M, S, K, cb,
            reinterpret_cast<uint16_t*>(chunked.data_ptr()));
    parts = chunked;
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(parts.data_ptr());
  void* yp = y.data_ptr();
  const int64_t grain = M == 1 ? 16 : 4;  // rows per task (the R = 4 passes need whole groups of 4)
  at::parallel_for(0, N, grain, [&](int64_t r0, int64_t r1) {
    if (f32) gemv<3, true>(xp, M, K, wp, sp, KB, bp, yp, N, r0, r1, lut);
    else gemv<1, false>(xp, M, K, wp, sp, KB, bp, yp, N, r0, r1, lut);
  });
  return y;
#else
  TORCH_CHECK(false, "fp8_block_linear needs AVX512-BF16 (has_bf16_dot is False): use the PyTorch path");
  return y;
#endif
}

at::Tensor fp8_experts_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                              const at::Tensor& experts, const at::Tensor& offsets, int64_t part_rows, bool tiled) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "fp8_experts_linear: x [N, K] bf16 or float32 expected");
  const int64_t N = x.size(0), K = x.size(1);
  const auto sh = check_fp8_expert_buffers(K, w, scale, part_rows, "fp8_experts_linear");
  TORCH_CHECK(!tiled || part_rows % tokenfab_fp8_tiles::kTileRows == 0,
              "fp8_experts_linear: a stack in the tile layout has parts of whole 16-row tiles, not ", part_rows);
  const int64_t E = sh.E, n = sh.n, KB = sh.kb_n, parts = n / part_rows, SB = sh.block_rows;
  const auto seg = tokenfab_cpu::expert_segments(experts, offsets, E, N, "fp8_experts_linear");
  const int64_t A = seg.A;
  const int64_t* ep = seg.ep();
  const int64_t* op = seg.op();
  auto y = at::empty({N, n}, x.options());
  if (N == 0 || A == 0) return y;
#if defined(__AVX512BF16__)
  static const Lut lut;
    const bool f32 = x.scalar_type() == at::kFloat;
  const auto xc = x.contiguous();
  const auto* wbase = w.data_ptr<uint8_t>();
  const float* sbase = scale.data_ptr<float>();
  auto wpart = [&](int64_t a, int64_t p) { return wbase + (ep[a] * n + p * part_rows) * K; };
  auto spart = [&](int64_t a, int64_t p) { return sbase + (ep[a] * parts * SB + p * SB) * KB; };
  auto ypart = [&](int64_t t0, int64_t p) -> void* {
    return f32 ? static_cast<void*>(y.data_ptr<float>() + t0 * n + p * part_rows)
               : static_cast<void*>(reinterpret_cast<uint16_t*>(y.data_ptr()) + t0 * n + p * part_rows);
  };
  std::vector<int64_t> small, large;  // segments for the GEMV (one parallel region) and the GEMM paths
#if defined(TOKENFAB_AMX)
  const bool amx = !f32 && !tiled && tokenfab_cpu::amx_ready();
#else
  const bool amx = false;
#endif
  // rows of x up to which segments take the GEMV: as fp8_block_linear (kAmxMinRows with AMX), on tiles kTileGemvMaxRows
  const int64_t gemv_rows = tiled ? kTileGemvMaxRows : amx ? 4 : gemv_max_rows(f32, K);
  for (int64_t a = 0; a < A; ++a) {
    const int64_t M = op[a + 1] - op[a];
    if (M == 0) continue;
    (M > gemv_rows ? large : small).push_back(a);
  }
  if (!small.empty()) {
    at::Tensor xs;
    if (f32) {  // three bf16 parts per row, as fp8_block_linear's GEMV: [N, 3, K]
      const auto h = xc.to(at::kBFloat16), r = xc - h.to(at::kFloat), mid = r.to(at::kBFloat16);
      xs = at::stack({h, mid, (r - mid.to(at::kFloat)).to(at::kBFloat16)}, 1).contiguous();
    } else {
      xs = xc;
    }
    const int64_t S = f32 ? 3 : 1;
    int64_t ldx = S * K;  // the tile GEMV's row stride
    if (tiled) xs = tile_x(xs, N, S, K, N > 1, ldx);  // one token (batch-1 decode): read in place, no copy
    bool chunked = false;  // the GEMV segments' rows in its chunked layout (the GEMM segments read xc, not these)
    for (const int64_t a : small) chunked |= !tiled && gemv_chunk_blocks(op[a + 1] - op[a], S, K, KB) < KB;
    if (chunked) {
      auto xl = at::empty_like(xs);
      const auto* src = reinterpret_cast<const uint16_t*>(xs.data_ptr());
      auto* dst = reinterpret_cast<uint16_t*>(xl.data_ptr());
      for (const int64_t a : small) {
        const int64_t M = op[a + 1] - op[a];
        chunk_x(src + op[a] * S * K, M, S, K, gemv_chunk_blocks(M, S, K, KB), dst + op[a] * S * K);
      }
      xs = xl;
    }
    const auto* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr());
    constexpr int64_t kRows = 16;  // weight rows per work item (whole groups of 4 for the M = 1 passes; one tile)
    static_assert(kRows == tokenfab_fp8_tiles::kTileRows, "a work item is one tile of the tile layout");
    const int64_t chunks = (part_rows + kRows - 1) / kRows, per = parts * chunks;
    at::parallel_for(0, static_cast<int64_t>(small.size()) * per, 1, [&](int64_t b, int64_t e) {
      for (int64_t it = b; it < e; ++it) {
        const int64_t a = small[it / per], p = (it % per) / chunks, c = it % chunks;
        const int64_t t0 = op[a], M = op[a + 1] - t0, r0 = c * kRows, r1 = std::min(part_rows, r0 + kRows);
        if (tiled) {  // one 16-row tile (kRows == kTileRows): x in natural order, one pass per 16 tokens
          const uint8_t* tile = wpart(a, p) + r0 * K;
          const float* sc = spart(a, p) + (r0 / BK) * KB;
          if (f32)
            tokenfab_fp8_tiles::tile_gemv<3, true>(tile, K, sc, xp + t0 * ldx, ldx, M, lut,
                                                   static_cast<float*>(ypart(t0, p)) + r0, n);
          else
            tokenfab_fp8_tiles::tile_gemv<1, false>(tile, K, sc, xp + t0 * ldx, ldx, M, lut,
                                                    static_cast<uint16_t*>(ypart(t0, p)) + r0, n);
          continue;
        }
        if (f32) gemv<3, true>(xp + t0 * 3 * K, M, K, wpart(a, p), spart(a, p), KB, nullptr, ypart(t0, p), n, r0, r1, lut);
        else gemv<1, false>(xp + t0 * K, M, K, wpart(a, p), spart(a, p), KB, nullptr, ypart(t0, p), n, r0, r1, lut);
      }
    });
  }
  for (const int64_t a : large) {
    const int64_t t0 = op[a], M = op[a + 1] - t0;
#if defined(TOKENFAB_AMX)
    if (amx) {  // this expert's rows of x as B tiles once, then each part's 16-row weight tiles in parallel
      auto xt = at::zeros({(M + 15) / 16 * 16 * K}, x.options());
      auto* xb = reinterpret_cast<uint16_t*>(xt.data_ptr());
      pack_x_tiles(reinterpret_cast<const uint16_t*>(xc.data_ptr()) + t0 * K, K, M, K, xb);
      const int64_t tiles = (part_rows + 15) / 16;
      at::parallel_for(0, parts * tiles, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t p = b0 / tiles; p * tiles < b1; ++p) {
          const int64_t lo = std::max(b0, p * tiles) - p * tiles, hi = std::min(b1, (p + 1) * tiles) - p * tiles;
          amx_tiles<false>(xb, M, K, wpart(a, p), spart(a, p), part_rows, nullptr, ypart(t0, p), n, lo, hi, lut);
        }
      });
      continue;
    }
#endif
    for (int64_t p = 0; p < parts; ++p) {
      if (f32)
        gemm<float>(xc.data_ptr<float>() + t0 * K, M, K, K, wpart(a, p), spart(a, p), part_rows, nullptr,
                    static_cast<float*>(ypart(t0, p)), n, lut, tiled);
      else
        gemm<uint16_t>(reinterpret_cast<const uint16_t*>(xc.data_ptr()) + t0 * K, M, K, K, wpart(a, p), spart(a, p),
                       part_rows, nullptr, static_cast<uint16_t*>(ypart(t0, p)), n, lut, tiled);
    }
  }
  return y;
#else
  TORCH_CHECK(false, "fp8_experts_linear needs AVX512-BF16 (has_bf16_dot is False): use the PyTorch path");
  return y;
#endif
}

void fp8_tiles_relayout(at::Tensor& w, bool to_tiles) {
  TORCH_CHECK(w.scalar_type() == at::kByte && (w.dim() == 2 || w.dim() == 3) && w.is_contiguous() &&
              w.device().is_cpu() && w.size(-2) % tokenfab_fp8_tiles::kTileRows == 0 && w.size(-1) % 4 == 0,
              "fp8_tiles_relayout: contiguous CPU uint8 [E, n, K] or [n, K] with n a multiple of 16 and K of 4 "
              "expected, got ", w.sizes());
  const int64_t K = w.size(-1), tiles = w.numel() / K / tokenfab_fp8_tiles::kTileRows;
  auto* p = w.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
    std::vector<uint8_t> tmp;
    for (int64_t i = b; i < e; ++i)
      tokenfab_fp8_tiles::relayout_tile(p + i * tokenfab_fp8_tiles::kTileRows * K, K, to_tiles, tmp);
  });
}

bool fp8_tiles_preferred() {
#if defined(TOKENFAB_AMX)
  return tokenfab_cpu::bf16_dot_allowed() && !tokenfab_cpu::amx_ready();  // AMX machines keep the AMX tile path
#elif defined(__AVX512BF16__)
  return tokenfab_cpu::bf16_dot_allowed();
#else
  return false;
#endif
}

void register_fp8_linear(pybind11::module_& m) {
  m.def("fp8_block_linear", &fp8_block_linear,
        "x W^T (+ b) over FP8 e4m3 block-scaled weights as published, or with whole 16-row tiles in the CPU tile "
        "layout (tiled; CPU, AVX512-BF16)", pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("scale_inv"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("tiled") = false);
  m.attr("fp8_block_linear_avx2_built") = fp8_block_linear_avx2_built();
  m.def("fp8_block_linear_avx2", &fp8_block_linear_avx2,
        "x W^T (+ b) over FP8 e4m3 block-scaled weights, float32 x and y (CPU, AVX2 + FMA: CPUs without "
        "AVX512-BF16)", pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("scale_inv"),
        pybind11::arg("bias") = pybind11::none());
  m.def("fp8_experts_avx2", &fp8_experts_avx2,
        "grouped x W_e^T over routed experts kept as FP8 e4m3 block-scaled bytes, float32 x and y (CPU, AVX2 + "
        "FMA: CPUs without AVX512-BF16)", pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("scale"),
        pybind11::arg("experts"), pybind11::arg("offsets"), pybind11::arg("part_rows"));
  m.def("fp8_gemv_max_rows", &gemv_max_rows,
        "rows of x up to which the FP8 kernels run their GEMV without AMX (float32 x: True, bf16 x: False) for K "
        "inputs", pybind11::arg("f32"), pybind11::arg("K"));
  m.def("fp8_experts_linear", &fp8_experts_linear,
        "grouped x W_e^T over routed experts kept as FP8 e4m3 block-scaled bytes (CPU, AVX512-BF16)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("scale"), pybind11::arg("experts"),
        pybind11::arg("offsets"), pybind11::arg("part_rows"), pybind11::arg("tiled") = false);
  m.attr("fp8_tiles_gemv_max_rows") = kTileGemvMaxRows;
  m.def("fp8_tiles_relayout", &fp8_tiles_relayout,
        "in place: an FP8 weight's or expert stack's 16-row tiles into the CPU tile layout (fp8_tiles.h), or back",
        pybind11::arg("w"), pybind11::arg("to_tiles"));
  m.def("fp8_tiles_preferred", &fp8_tiles_preferred,
        "True where FP8 weights and expert stacks take the tile layout: AVX512-BF16 kernels without AMX");
}
