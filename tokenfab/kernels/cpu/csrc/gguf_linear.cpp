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
// M <= 16 rows (decode batches): a GEMV over tiles, parallel over tiles, in passes of up to 4 rows per tile (5..16
// rows: the tile unpacked once into a cache-resident operand buffer the passes share; the
// tile's bytes come from memory once, software-prefetched ahead: prefetch_distance below; x re-laid once per call
// in 32-input blocks, gguf_gemv.h block_x). bf16 x is used as is;
// float32 x is split into three bf16 parts (x = h + m + l up to 2^-24 relative), each multiplied exactly, so float32
// activations keep float32 accuracy. With AMX (AMX-BF16, granted by the kernel), bf16 x of 5..16 rows instead runs
// one TDPBF16PS per GGUF block and 16-row tile of x on the block's integer quants, each block's sum scaled in
// registers (amx_tiles below): about 2x the GEMV passes' speed at 16 rows.
// Opt-in (TOKENFAB_GGUF_INT8_ACT=1), without AMX: bf16 x of 5..16 rows on Q4_0 / Q4_1 / Q8_0 runs on int8 activations
// instead (gguf_gemv_i8.h: x quantized per 32 inputs as llama.cpp's Q8_0 activations, vpdpbusd products): 0.7-0.95x
// the bf16 twin's time at 16 rows where the exact GEMV takes 1.3-1.5x, at a fidelity cost (see there).
// M > 16 (prefill): per 32-column block, the thread dequantizes its 32 weight rows once into a thread-local buffer
// that stays in cache and runs oneDNN's brgemm micro-kernel (the bf16 GEMM's) over all row tiles of x: bf16 x
// against the weight rounded once to bf16 (as the dequantized bf16 twin holds it), float32 x against the float32
// values d q + m (exactly as gguf's dequantize computes them). Never a full-size copy of the weight.
#include "gguf_linear.h"
#include "registrations.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include "cpu_isa.h"
#include "linear_io.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "gguf_gemv.h"
#include "gguf_gemv_i8.h"
#include "gguf_tiles.h"

namespace {

using namespace tokenfab_gguf;
using namespace tokenfab_gguf_gemv;

constexpr int64_t kTileM = 64;

#if defined(__AVX512BF16__)
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
  auto rows = tokenfab_cpu::linear_rows(x, K, n, out_f32 ? at::kFloat : x.scalar_type());
  at::Tensor x2 = rows.x2, y = rows.y;
  const int64_t M = rows.M;
  if (M == 0) return y;
  at::Tensor bf;
  const float* bp = tokenfab_cpu::float_bias(bias, n, "gguf_linear", bf);
#if defined(__AVX512BF16__)
  const bool f32 = x.scalar_type() == at::kFloat;
  const auto* wp = w.data_ptr<uint8_t>();
#if defined(TOKENFAB_AMX)
  if (!f32 && !out_f32 && M > kGemvRows && M <= kGemvMaxRows && !is_kquant(static_cast<int>(qtype)) &&
      tokenfab_cpu::amx_ready()) {
    const int64_t lda = x2.stride(0);
    const auto* xb = reinterpret_cast<const c10::BFloat16*>(x2.data_ptr());
    std::vector<float> xsum;
    if (qtype == kQ4_1) block_sums(reinterpret_cast<const uint16_t*>(xb), lda, M, K, (M + 15) / 16 * 16, xsum);
    amx_gemm(static_cast<int>(qtype), reinterpret_cast<const uint16_t*>(xb), lda, xsum.data(), M, K, wp, n, bp,
             reinterpret_cast<uint16_t*>(y.data_ptr()), n);
    return y;
  }
#endif
#if defined(__AVX512VNNI__)  // opt-in, without AMX: bf16 decode batches on int8 activations (gguf_gemv_i8.h)
#if defined(TOKENFAB_AMX)
  const bool amx = tokenfab_cpu::amx_ready();
#else
  const bool amx = false;
#endif
  if (!f32 && !amx && M > kGemvRows && M <= kGemvMaxRows && tokenfab_gguf_i8::covers(static_cast<int>(qtype)) &&
      tokenfab_gguf_i8::int8_enabled()) {
    const auto* xb = reinterpret_cast<const uint16_t*>(x2.data_ptr());
    if (out_f32) tokenfab_gguf_i8::gemv_i8<true>(static_cast<int>(qtype), xb, x2.stride(0), M, K, wp, n, bp,
                                                   y.data_ptr(), n);
    else tokenfab_gguf_i8::gemv_i8<false>(static_cast<int>(qtype), xb, x2.stride(0), M, K, wp, n, bp, y.data_ptr(),
                                          n);
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
  const at::Tensor parts = tokenfab_cpu::bf16_parts(x2);  // [M, 3, K] for float32 x, else [M, K]
  std::vector<float> xsum;
  if (has_min(static_cast<int>(qtype))) {  // float32 sums of x per 32 inputs (the minimum's factor)
    if (f32) block_sums(x2.data_ptr<float>(), x2.stride(0), M, K, M, xsum);
    else block_sums(reinterpret_cast<const uint16_t*>(x2.data_ptr()), x2.stride(0), M, K, M, xsum);
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

void register_gguf_linear(pybind11::module_& m) {
  m.def("gguf_prefetch", [](int64_t bytes) {
          const int64_t before = prefetch_distance();
          if (bytes >= 0) g_prefetch.store(bytes, std::memory_order_relaxed);
          return before;
        },
        "the GEMV's software prefetch distance in bytes (TOKENFAB_GGUF_PREFETCH, default 2048): returns the current "
        "value and sets ``bytes`` when >= 0 (0: off; the arithmetic and so the results are the same either way)",
        pybind11::arg("bytes") = -1);
  m.attr("gguf_int8_built") = tokenfab_gguf_i8::kBuilt;
  m.def("gguf_int8_activations", [](int64_t on) {
          const bool before = tokenfab_gguf_i8::int8_enabled();
          if (on >= 0) tokenfab_gguf_i8::g_int8.store(on ? 1 : 0, std::memory_order_relaxed);
          return before;
        },
        "the setting whether bf16 x of 5..16 rows of a Q4_0 / Q4_1 / Q8_0 linear runs on int8 activations where the "
        "kernels have them (gguf_int8_built; TOKENFAB_GGUF_INT8_ACT, default 0): returns it and sets it when ``on`` >= 0",
        pybind11::arg("on") = -1);
  m.def("gguf_linear", &gguf_linear, "x W^T (+ b) over packed GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K tiles (CPU, AVX512-BF16)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("qtype"), pybind11::arg("n"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("out_f32") = false);
  m.attr("gguf_gemv_avx2_built") = gguf_gemv_avx2_built();
  m.def("gguf_gemv_avx2", &gguf_gemv_avx2, "x W^T (+ b) over packed GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K "
        "tiles, float32 x and y (CPU, AVX2 + FMA: the packed path of CPUs without AVX512-BF16)", pybind11::arg("x"),
        pybind11::arg("w"), pybind11::arg("qtype"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none());
  m.def("gguf_embedding", &gguf_embedding, "rows ids of a packed GGUF Q4_0 / Q4_1 / Q8_0 / K-quant weight, dequantized (CPU)",
        pybind11::arg("w"), pybind11::arg("qtype"), pybind11::arg("n"), pybind11::arg("ids"), pybind11::arg("bf16_out"));
}
