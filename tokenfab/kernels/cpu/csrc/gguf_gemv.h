// The decode GEMV of the packed GGUF linears (M <= 16 rows of x): passes over 16-row weight tiles with the
// quants unpacked in registers into vdpbf16ps operands, software-prefetched. Included by gguf_linear.cpp only (its
// layout comment describes the tiles); split out to keep each file one concern: decode here, prefill and the entry
// point there.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_tiles.h"

namespace tokenfab_gguf_gemv {

using namespace tokenfab_gguf;

constexpr int64_t kGemvRows = 4;      // rows of x one GEMV pass multiplies (accumulators held in registers)
constexpr int64_t kGemvMaxRows = 16;  // up to this many rows (decode batches) the GEMV passes or AMX tiles; more:
                                      // prefill, the dequantizing brgemm (gemm below)

// Software prefetch of the GEMV's weight stream: each tile-block's bytes are requested this far ahead of their use
// (TOKENFAB_GGUF_PREFETCH bytes, read at the first call, or gguf_prefetch(bytes) from Python; 0 turns it off). At
// batch 1 the GEMV's unpack-and-dot instructions take about as long as the memory reads (Q4_1 from L2: 13-18 GB/s
// per core; a plain read stream from DRAM: ~14 GB/s on one core), and without the prefetch the two barely overlap:
// in a decode step one thread ran the Q4_1 GEMV at ~8 GB/s, about the rate of doing one after the other. With it,
// the batch-1 SmolLM2 Q4_1 step took 18-26% less time on one thread (benchmarks/gguf_prefetch_ab.py, results/
// 2026-12-02-smollm2-q4_1-decode-floor.md). Only requests change: the arithmetic, so every output bit, is the same.
constexpr int64_t kDefaultPrefetch = 2048;
inline std::atomic<int64_t> g_prefetch{-1};  // -1: not read yet
inline int64_t prefetch_distance() {
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

#if defined(__AVX512BF16__)
// Tile t's outputs for M rows of x: row m's 16 accumulators (+ bias) into y[m][t * 16 ...], the last tile cut at N.
template <int M, bool F32OUT>
inline void store_rows(const __m512* acc, void* y, int64_t ldy, int64_t t, int64_t N, const float* bias) {
  const int64_t n0 = t * TN, nvalid = std::min<int64_t>(TN, N - n0);
  const float* bb = bias == nullptr ? nullptr : bias + n0;
  for (int m = 0; m < M; ++m) {
    void* yr = F32OUT ? static_cast<void*>(static_cast<float*>(y) + m * ldy + n0)
                      : static_cast<void*>(static_cast<uint16_t*>(y) + m * ldy + n0);
    store_tile<F32OUT>(yr, acc[m], bb, nvalid);
  }
}

// The K-quant GEMV over tiles [t0, t1), as gemv_tiles: per sub-block the exact bf16 products x_k q_k summed in four
// float32 chains, then scaled once: y += (d sc) * sum - (dmin m) * (sum of the sub-block's x) for Q4_K / Q5_K; for
// Q6_K, chains 0-1 hold k 0..15 and chains 2-3 k 16..31 of the sub-block, each half scaled by its own d * scale.
//
// CHAINS = 2 (Q4_K / Q5_K passes of 5..8 rows): two chains per row and sub-block (even and odd pairs), as
// gemv_tiles' CHAINS = 2.
template <int QT, int M, int S, bool F32OUT, bool BUF = false, int CHAINS = 4>
void gemv_k_tiles(const uint16_t* xp, int64_t ldb, const float* xsum, int64_t K, const uint8_t* w, int64_t N,
                  const float* bias, void* y, int64_t ldy, int64_t t0, int64_t t1, const __m512i* ops = nullptr) {
  static_assert(CHAINS == 4 || (CHAINS == 2 && QT != kQ6_K), "Q6_K scales its two halves apart: four chains");
  const int64_t KB = K / 256, TB = tile_block_bytes(QT), KB32 = K / QK, pf = prefetch_distance();
  const __m512i tab0 = kq_table(QT, 0), tab1 = kq_table(QT, 1);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* b = w + (t * KB + kb) * TB;
      if (!BUF && pf > 0) prefetch_block(b + pf, TB);
      for (int j = 0; j < 8; ++j) {
        const uint16_t* xk = xp + (kb * 8 + j) * ldb;
        __m512 c[CHAINS][M];
        for (int i = 0; i < CHAINS; ++i)
          for (int m = 0; m < M; ++m) c[i][m] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int L = 0; L < 4; ++L) {
#pragma GCC unroll 4
          for (int s4 = 0; s4 < 4; ++s4) {
            const __m512i op = BUF ? _mm512_load_si512(ops + kb * 128 + 16 * j + 4 * L + s4)
                                   : kq_operand<QT>(b, j, L, s4, tab0, tab1);
            const int ch = CHAINS == 2 ? (s4 & 1) : QT == kQ6_K ? 2 * (L / 2) + (s4 & 1) : s4;
            const int p = 4 * L + s4;
            for (int m = 0; m < M; ++m)
              for (int s = 0; s < S; ++s)
                c[ch][m] = _mm512_dpbf16_ps(c[ch][m], (__m512bh)bcast_pair(xk + (m * S + s) * QK + 2 * p),
                                            (__m512bh)op);
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
            const __m512 sum = CHAINS == 2 ? _mm512_add_ps(c[0][m], c[1][m])
                                           : _mm512_add_ps(_mm512_add_ps(c[0][m], c[1][m]),
                                                           _mm512_add_ps(c[2][m], c[3][m]));
            acc[m] = _mm512_fmadd_ps(sum, ds, acc[m]);
            acc[m] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(xsum[m * KB32 + kb * 8 + j]), acc[m]);
          }
        }
      }
    }
    store_rows<M, F32OUT>(acc, y, ldy, t, N, bias);
  }
}

// Tiles [t0, t1) for M rows of x given as S bf16 parts each, the parts of a row summing to it, in x blocks
// (block_x): the 32 inputs of block kb of row m, part s at xp + kb * ldb + (m * S + s) * 32, so that every x
// broadcast is one base register plus a constant offset; xsum [M][K / 32] the float32 block sums of x (Q4_1 only).
// Four accumulator chains per row and block (one vdpbf16ps chain of 16 would wait on its latency at M = 1).
//
// CHAINS = 2 (Q4_0 / Q4_1 passes of 5..8 rows): two chains per row (even and odd pairs): 2 M chains in flight,
// enough for two vdpbf16ps a cycle, with one add per row and block to join them (one chain per row left the 8-row
// pass bound by the vdpbf16ps latency; NOTES 91).
template <int QT, int M, int S, bool F32OUT, bool BUF = false, int CHAINS = 4>
void gemv_tiles(const uint16_t* xp, int64_t ldb, const float* xsum, int64_t K, const uint8_t* w, int64_t N,
                const float* bias, void* y, int64_t ldy, int64_t t0, int64_t t1, const __m512i* ops = nullptr) {
  static_assert(CHAINS == 2 || CHAINS == 4, "two or four accumulator chains per row");
  const int64_t KB = K / QK, TB = tile_block_bytes(QT), pf = prefetch_distance();
  const __m512i table = nibble_table(QT);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* b = w + (t * KB + kb) * TB;
      if (!BUF && pf > 0) prefetch_block(b + pf, TB);
      const uint16_t* xk = xp + kb * ldb;
      __m512 c0[M], c1[M], c2[M], c3[M];
      for (int m = 0; m < M; ++m) c0[m] = c1[m] = c2[m] = c3[m] = _mm512_setzero_ps();
      auto step = [&](int p, __m512i op, __m512* c) {
        if constexpr (CHAINS == 2) c = (p & 1) ? c1 : c0;
        for (int m = 0; m < M; ++m)
          for (int s = 0; s < S; ++s)
            c[m] = _mm512_dpbf16_ps(c[m], (__m512bh)bcast_pair(xk + (m * S + s) * QK + 2 * p), (__m512bh)op);
      };
      if constexpr (BUF) {  // the operands unpack_tile wrote, in the same order and chains as below
        const __m512i* o = ops + kb * 16;
#pragma GCC unroll 4
        for (int L = 0; L < 4; ++L) {
          step(4 * L, _mm512_load_si512(o + 4 * L), c0);
          step(4 * L + 1, _mm512_load_si512(o + 4 * L + 1), c1);
          step(4 * L + 2, _mm512_load_si512(o + 4 * L + 2), c2);
          step(4 * L + 3, _mm512_load_si512(o + 4 * L + 3), c3);
        }
      } else if constexpr (QT == kQ8_0) {
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
        acc[m] = _mm512_fmadd_ps(CHAINS == 2 ? _mm512_add_ps(c0[m], c1[m])
                                             : _mm512_add_ps(_mm512_add_ps(c0[m], c1[m]), _mm512_add_ps(c2[m], c3[m])),
                                 d, acc[m]);
      if constexpr (QT == kQ4_1) {
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2 * TN)));
        for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[m * KB + kb]), acc[m]);
      }
    }
    store_rows<M, F32OUT>(acc, y, ldy, t, N, bias);
  }
}

template <int QT, int S, bool F32OUT, bool BUF = false>
void gemv_rows4(const uint16_t* xp, int64_t ldb, const float* xsum, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                const float* bias, void* y, int64_t ldy, int64_t t0, int64_t t1, const __m512i* ops = nullptr) {
  if constexpr (is_kquant(QT)) {
    switch (M) {
      case 1: gemv_k_tiles<QT, 1, S, F32OUT, BUF>(xp, ldb, xsum, K, w, N, bias, y, ldy, t0, t1, ops); break;
      case 2: gemv_k_tiles<QT, 2, S, F32OUT, BUF>(xp, ldb, xsum, K, w, N, bias, y, ldy, t0, t1, ops); break;
      case 3: gemv_k_tiles<QT, 3, S, F32OUT, BUF>(xp, ldb, xsum, K, w, N, bias, y, ldy, t0, t1, ops); break;
      default: gemv_k_tiles<QT, 4, S, F32OUT, BUF>(xp, ldb, xsum, K, w, N, bias, y, ldy, t0, t1, ops); break;
    }
  } else {
    switch (M) {
      case 1: gemv_tiles<QT, 1, S, F32OUT, BUF>(xp, ldb, xsum, K, w, N, bias, y, ldy, t0, t1, ops); break;
      case 2: gemv_tiles<QT, 2, S, F32OUT, BUF>(xp, ldb, xsum, K, w, N, bias, y, ldy, t0, t1, ops); break;
      case 3: gemv_tiles<QT, 3, S, F32OUT, BUF>(xp, ldb, xsum, K, w, N, bias, y, ldy, t0, t1, ops); break;
      default: gemv_tiles<QT, 4, S, F32OUT, BUF>(xp, ldb, xsum, K, w, N, bias, y, ldy, t0, t1, ops); break;
    }
  }
}

// Every vdpbf16ps operand of tile t (K / 2 of them, 64 bytes each: per GGUF block its 16 pairs, for a K-quant
// super-block its 8 x 16) into ops, in the order the GEMV passes consume them; the weight bytes stream in once,
// software-prefetched as in the single pass.
template <int QT>
void unpack_tile(const uint8_t* w, int64_t t, int64_t K, __m512i* ops) {
  const int64_t TB = tile_block_bytes(QT), pf = prefetch_distance();
  if constexpr (is_kquant(QT)) {
    const int64_t KB = K / 256;
    const __m512i tab0 = kq_table(QT, 0), tab1 = kq_table(QT, 1);
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* b = w + (t * KB + kb) * TB;
      if (pf > 0) prefetch_block(b + pf, TB);
      for (int j = 0; j < 8; ++j)
#pragma GCC unroll 4
        for (int L = 0; L < 4; ++L)
#pragma GCC unroll 4
          for (int s4 = 0; s4 < 4; ++s4)
            _mm512_store_si512(ops + kb * 128 + 16 * j + 4 * L + s4, kq_operand<QT>(b, j, L, s4, tab0, tab1));
    }
  } else {
    const int64_t KB = K / QK;
    const __m512i table = nibble_table(QT);
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* b = w + (t * KB + kb) * TB;
      if (pf > 0) prefetch_block(b + pf, TB);
      __m512i* o = ops + kb * 16;
      if constexpr (QT == kQ8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(b + 2 * TN);
#pragma GCC unroll 16
        for (int p = 0; p < 16; ++p) {
          __m512 lo, hi;
          q8_halves(q + 32 * p, lo, hi);
          _mm512_store_si512(o + p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
      } else {
        const uint8_t* q = b + (QT == kQ4_1 ? 4 : 2) * TN;
#pragma GCC unroll 4
        for (int L = 0; L < 4; ++L) {
          const __m512i wd = _mm512_loadu_si512(q + 64 * L);
          _mm512_store_si512(o + 4 * L, q4_operand<0>(wd, table));
          _mm512_store_si512(o + 4 * L + 1, q4_operand<1>(wd, table));
          _mm512_store_si512(o + 4 * L + 2, q4_operand<2>(wd, table));
          _mm512_store_si512(o + 4 * L + 3, q4_operand<3>(wd, table));
        }
      }
    }
  }
}

// Q4_0 / Q4_1 / Q4_K / Q5_K passes of 5..8 rows, two accumulator chains per row (and sub-block): gemv_tiles /
// gemv_k_tiles with CHAINS = 2.
template <int QT, int S, bool F32OUT>
void gemv_rows8(const uint16_t* xp, int64_t ldb, const float* xsum, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                const float* bias, void* y, int64_t ldy, int64_t t0, int64_t t1) {
  auto pass = [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    if constexpr (is_kquant(QT)) gemv_k_tiles<QT, R, S, F32OUT, false, 2>(xp, ldb, xsum, K, w, N, bias, y, ldy, t0, t1);
    else gemv_tiles<QT, R, S, F32OUT, false, 2>(xp, ldb, xsum, K, w, N, bias, y, ldy, t0, t1);
  };
  switch (M) {
    case 5: pass(std::integral_constant<int, 5>{}); break;
    case 6: pass(std::integral_constant<int, 6>{}); break;
    case 7: pass(std::integral_constant<int, 7>{}); break;
    default: pass(std::integral_constant<int, 8>{}); break;
  }
}

constexpr int64_t kGemvBufferMaxK = 2048;  // operand buffer of a tile: K / 2 x 64 bytes, at most 64 KiB (L1 / L2)

// M <= kGemvMaxRows rows. Up to 4: one GEMV pass per tile (four chains per row).
// 5..16, Q4_0 / Q4_1 / Q4_K (an operand costs a shift and a table lookup) and Q5_K past kGemvBufferMaxK: per tile,
// passes of up to 8 rows with two chains per row (the tile's bytes come from memory once; the second pass finds them
// in L1; NOTES 61, 64).
// 5..16, Q8_0, Q5_K and Q6_K with K <= kGemvBufferMaxK (an operand costs 4-6 instructions, against 4
// vdpbf16ps): per tile, its operands are unpacked once into a thread-local buffer (unpack_tile) that passes of up
// to 4 rows read, with the same chains in the same order as the unpacking pass: every output is bit for bit the sum
// a single-pass GEMV of its row alone gives. Q8_0 and Q6_K with larger K (the buffer would leave L2's fast reach):
// passes of up to 4 rows that unpack again, the same sums (measured: benchmarks/gguf_linear.py,
// results/2026-12-05-gguf-gemv-rows.md).
// xp: the M rows' x blocks (block_x), ldb = M * S * 32; a pass over rows m0.. reads them from xp + m0 * S * 32.
template <int QT, int S, bool F32OUT>
void gemv_rows(const uint16_t* xp, const float* xsum, int64_t M, int64_t K, const uint8_t* w, int64_t N,
               const float* bias, void* y, int64_t ldy, int64_t t0, int64_t t1) {
  const int64_t ldb = M * S * QK;
  if (M <= kGemvRows) {
    gemv_rows4<QT, S, F32OUT>(xp, ldb, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    return;
  }
  const int64_t KB = K / QK;
  auto rows_at = [&](int64_t m0) {
    return F32OUT ? static_cast<void*>(static_cast<float*>(y) + m0 * ldy)
                  : static_cast<void*>(static_cast<uint16_t*>(y) + m0 * ldy);
  };
  if constexpr (QT == kQ4_0 || QT == kQ4_1 || QT == kQ4_K || QT == kQ5_K) {
    if (QT != kQ5_K || K > kGemvBufferMaxK) {
      if (M <= 2 * kGemvRows) {
        gemv_rows8<QT, S, F32OUT>(xp, ldb, xsum, M, K, w, N, bias, y, ldy, t0, t1);
        return;
      }
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t m0 = 0; m0 < M; m0 += 2 * kGemvRows) {
          const int64_t mr = std::min(2 * kGemvRows, M - m0);
          const float* xs = xsum == nullptr ? nullptr : xsum + m0 * KB;
          const uint16_t* xm = xp + m0 * S * QK;
          if (mr > kGemvRows) gemv_rows8<QT, S, F32OUT>(xm, ldb, xs, mr, K, w, N, bias, rows_at(m0), ldy, t, t + 1);
          else gemv_rows4<QT, S, F32OUT>(xm, ldb, xs, mr, K, w, N, bias, rows_at(m0), ldy, t, t + 1);
        }
      return;
    }
  }
  if (K > kGemvBufferMaxK) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < M; m0 += kGemvRows)
        gemv_rows4<QT, S, F32OUT>(xp + m0 * S * QK, ldb, xsum == nullptr ? nullptr : xsum + m0 * KB,
                                  std::min(kGemvRows, M - m0), K, w, N, bias, rows_at(m0), ldy, t, t + 1);
    return;
  }
  thread_local std::vector<__m512i> buf;
  if (static_cast<int64_t>(buf.size()) < K / 2) buf.resize(K / 2);
  for (int64_t t = t0; t < t1; ++t) {
    unpack_tile<QT>(w, t, K, buf.data());
    for (int64_t m0 = 0; m0 < M; m0 += kGemvRows)
      gemv_rows4<QT, S, F32OUT, true>(xp + m0 * S * QK, ldb, xsum == nullptr ? nullptr : xsum + m0 * KB,
                                      std::min(kGemvRows, M - m0), K, w, N, bias, rows_at(m0), ldy, t, t + 1,
                                      buf.data());
  }
}

// x [M][S][K] (S bf16 parts a row) -> x blocks [K / 32][M][S][32]: what the passes read (gemv_tiles). One row of
// one part is already in that layout and is returned as is; otherwise the blocks go to this thread's buffer, reused
// from call to call (a decode step makes hundreds of these calls).
inline const uint16_t* block_x(const uint16_t* x, int64_t M, int64_t S, int64_t K) {
  if (M * S == 1) return x;
  thread_local std::vector<uint16_t> xb;
  xb.resize(M * S * K);
  const int64_t KB = K / QK;
  for (int64_t kb = 0; kb < KB; ++kb)
    for (int64_t r = 0; r < M * S; ++r) std::memcpy(&xb[(kb * M * S + r) * QK], x + r * K + kb * QK, QK * 2);
  return xb.data();
}

// xp: x as [M][S][K] bf16 parts.
template <int S, bool F32OUT>
void gemv(int qt, const uint16_t* xp_rows, const float* xsum, int64_t M, int64_t K, const uint8_t* w, int64_t N,
          const float* bias, void* y, int64_t ldy) {
  const uint16_t* xp = block_x(xp_rows, M, S, K);
  at::parallel_for(0, (N + TN - 1) / TN, 1, [&](int64_t t0, int64_t t1) {
    if (qt == kQ4_0) gemv_rows<kQ4_0, S, F32OUT>(xp, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    else if (qt == kQ4_1) gemv_rows<kQ4_1, S, F32OUT>(xp, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    else if (qt == kQ4_K) gemv_rows<kQ4_K, S, F32OUT>(xp, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    else if (qt == kQ5_K) gemv_rows<kQ5_K, S, F32OUT>(xp, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    else if (qt == kQ6_K) gemv_rows<kQ6_K, S, F32OUT>(xp, xsum, M, K, w, N, bias, y, ldy, t0, t1);
    else gemv_rows<kQ8_0, S, F32OUT>(xp, xsum, M, K, w, N, bias, y, ldy, t0, t1);
  });
}
#endif  // __AVX512BF16__

}  // namespace tokenfab_gguf_gemv
