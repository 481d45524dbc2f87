// Linear layers for CPU decode and prefill on one VNNI-blocked copy of each bf16 weight.
//
// Layout: W [N, K] becomes wp[N / 32, K / 2, 32, 2]: 32 output rows per block, and within a block the two k values
// of each pair side by side for every row, so one `vdpbf16ps` of a broadcast (x[2k'], x[2k' + 1]) pair against 64
// bytes of the block adds two products to 16 outputs (no horizontal sums), and a block is one contiguous stream of
// K * 64 bytes. The same layout is what oneDNN's brgemm micro-kernel takes as a VNNI B operand.
//
// M <= 4 rows (decode): a hand-written GEMV streams each block once for all rows; it is memory-bound and reaches
// 22-40 GB/s on the 2-core AVX512-BF16 VM, where oneDNN's packed inner product reaches 14-29 GB/s at the same
// shapes (benchmarks/NOTES.md entry 32, benchmarks/linear_kernels.py). M > 4 (prefill, batched decode): oneDNN's
// brgemm micro-kernel (at::native::cpublas::brgemm) on 64 x 32 tiles, float32 tiles rounded once to bf16.
// The switch between the two is what makes a row's bits depend on its batch (the GEMV sums even and odd k pairs in
// two accumulators, brgemm in its own order). brgemm's order for an output does not depend on M or on the row's
// tile: rows of M = 1..600 at any offset are bit-identical (tests/test_batch_invariant.py). So in batch-invariant
// mode (batch_invariant.h) every M, decode rows included, runs the brgemm tiles.
#include "vnni_linear.h"

#include "batch_invariant.h"

#include "linear_io.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t BN = kVnniBlockN;
constexpr int64_t kGemvRows = 4;  // M <= this: the GEMV; above: brgemm tiles
constexpr int64_t kTileM = 64;

#if defined(__AVX512BF16__)
// Outputs [n0, n0 + nvalid) of one row from two 16-lane float32 accumulators: + bias, then stored as float32
// (F32OUT: the accumulator's value, e.g. the LM head's logits) or rounded to bf16 (nearest even).
template <bool F32OUT = false>
inline void store_block(void* yv, __m512 lo, __m512 hi, const float* bias, int64_t nvalid) {
  const __mmask16 ml = nvalid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nvalid) - 1u);
  const __mmask16 mh = nvalid >= 32 ? 0xFFFF : nvalid <= 16 ? 0 : static_cast<__mmask16>((1u << (nvalid - 16)) - 1u);
  if (bias != nullptr) {
    lo = _mm512_add_ps(lo, _mm512_maskz_loadu_ps(ml, bias));
    hi = _mm512_add_ps(hi, _mm512_maskz_loadu_ps(mh, bias + 16));
  }
  if constexpr (F32OUT) {
    float* y = static_cast<float*>(yv);
    _mm512_mask_storeu_ps(y, ml, lo);
    _mm512_mask_storeu_ps(y + 16, mh, hi);
    return;
  }
  uint16_t* y = static_cast<uint16_t*>(yv);
  const __m256i l = (__m256i)_mm512_cvtneps_pbh(lo), h = (__m256i)_mm512_cvtneps_pbh(hi);
  if (nvalid >= 32) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), l);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 16), h);
  } else {
    _mm256_mask_storeu_epi16(y, ml, l);
    if (nvalid > 16) _mm256_mask_storeu_epi16(y + 16, mh, h);
  }
}

// Blocks [b0, b1) for M rows of x (row stride lda): per block 2 x 16 outputs, with the even and odd k pairs in
// separate accumulators (two independent dependency chains per output vector), summed at the end.
template <int M, bool F32OUT = false>
void gemv_blocks(const uint16_t* x, int64_t lda, int64_t K, const uint16_t* wp, int64_t N, const float* bias,
                 void* y, int64_t ldy, int64_t b0, int64_t b1) {
  using OutT = std::conditional_t<F32OUT, float, uint16_t>;
  const int64_t KP = K / 2;
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* w = wp + b * K * BN;
    __m512 acc[M][2][2];
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h) acc[m][h][0] = acc[m][h][1] = _mm512_setzero_ps();
    int64_t kp = 0;
    for (; kp + 2 <= KP; kp += 2) {
      const uint16_t* wk = w + kp * 2 * BN;
      const __m512bh w00 = (__m512bh)_mm512_loadu_si512(wk), w01 = (__m512bh)_mm512_loadu_si512(wk + 32);
      const __m512bh w10 = (__m512bh)_mm512_loadu_si512(wk + 64), w11 = (__m512bh)_mm512_loadu_si512(wk + 96);
      for (int m = 0; m < M; ++m) {
        uint32_t p0, p1;
        std::memcpy(&p0, x + m * lda + 2 * kp, 4);
        std::memcpy(&p1, x + m * lda + 2 * kp + 2, 4);
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(p0));
        const __m512bh x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(p1));
        acc[m][0][0] = _mm512_dpbf16_ps(acc[m][0][0], x0, w00);
        acc[m][1][0] = _mm512_dpbf16_ps(acc[m][1][0], x0, w01);
        acc[m][0][1] = _mm512_dpbf16_ps(acc[m][0][1], x1, w10);
        acc[m][1][1] = _mm512_dpbf16_ps(acc[m][1][1], x1, w11);
      }
    }
    if (kp < KP) {  // K / 2 odd: the last pair
      const uint16_t* wk = w + kp * 2 * BN;
      const __m512bh w00 = (__m512bh)_mm512_loadu_si512(wk), w01 = (__m512bh)_mm512_loadu_si512(wk + 32);
      for (int m = 0; m < M; ++m) {
        uint32_t p0;
        std::memcpy(&p0, x + m * lda + 2 * kp, 4);
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(p0));
        acc[m][0][0] = _mm512_dpbf16_ps(acc[m][0][0], x0, w00);
        acc[m][1][0] = _mm512_dpbf16_ps(acc[m][1][0], x0, w01);
      }
    }
    const int64_t nvalid = std::min<int64_t>(BN, N - b * BN);
    const float* bb = bias == nullptr ? nullptr : bias + b * BN;
    for (int m = 0; m < M; ++m)
      store_block<F32OUT>(static_cast<OutT*>(y) + m * ldy + b * BN, _mm512_add_ps(acc[m][0][0], acc[m][0][1]),
                  _mm512_add_ps(acc[m][1][0], acc[m][1][1]), bb, nvalid);
  }
}

// gemv_blocks for M (1..kGemvRows) rows chosen at run time; y bf16, or float32 with F32OUT.
template <bool F32OUT = false>
void gemv_rows(const uint16_t* x, int64_t M, int64_t lda, int64_t K, const uint16_t* wp, int64_t N,
               const float* bias, void* y, int64_t ldy, int64_t b0, int64_t b1) {
  switch (M) {
    case 1: gemv_blocks<1, F32OUT>(x, lda, K, wp, N, bias, y, ldy, b0, b1); break;
    case 2: gemv_blocks<2, F32OUT>(x, lda, K, wp, N, bias, y, ldy, b0, b1); break;
    case 3: gemv_blocks<3, F32OUT>(x, lda, K, wp, N, bias, y, ldy, b0, b1); break;
    default: gemv_blocks<4, F32OUT>(x, lda, K, wp, N, bias, y, ldy, b0, b1); break;
  }
}

template <bool F32OUT>
void gemv(const uint16_t* x, int64_t M, int64_t lda, int64_t K, const uint16_t* wp, int64_t N, const float* bias,
          void* y, int64_t ldy) {
  at::parallel_for(0, (N + BN - 1) / BN, 1, [&](int64_t b0, int64_t b1) {
    gemv_rows<F32OUT>(x, M, lda, K, wp, N, bias, y, ldy, b0, b1);
  });
}

#endif  // __AVX512BF16__

// M > kGemvRows: tiles of kTileM rows x one 32-wide block through oneDNN's brgemm micro-kernel; the row tile is the
// outer index, so a thread keeps one tile of x (64 x K) in cache while it walks the weight blocks.
template <bool F32OUT>
void gemm(const uint16_t* x, int64_t M, int64_t lda, int64_t K, const uint16_t* wp, int64_t N, const float* bias,
          void* y, int64_t ldy) {
  using OutT = std::conditional_t<F32OUT, float, uint16_t>;
  const int64_t NB = (N + BN - 1) / BN, MB = (M + kTileM - 1) / kTileM;
  const auto* xb = reinterpret_cast<const at::BFloat16*>(x);
  const auto* wb = reinterpret_cast<const at::BFloat16*>(wp);
  at::parallel_for(0, MB * NB, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(kTileM * BN);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t nb = it % NB, mb = it / NB;
      const int64_t m0 = mb * kTileM, mt = std::min(kTileM, M - m0), nvalid = std::min<int64_t>(BN, N - nb * BN);
      at::native::cpublas::brgemm(mt, BN, K, lda, BN, BN, false, xb + m0 * lda, wb + nb * K * BN, c.data(), true);
      const float* bb = bias == nullptr ? nullptr : bias + nb * BN;
      for (int64_t r = 0; r < mt; ++r) {
        OutT* yr = static_cast<OutT*>(y) + (m0 + r) * ldy + nb * BN;
        const float* cr = c.data() + r * BN;
#if defined(__AVX512BF16__)
        store_block<F32OUT>(yr, _mm512_loadu_ps(cr), _mm512_loadu_ps(cr + 16), bb, nvalid);
#else
        for (int64_t j = 0; j < nvalid; ++j) {
          const float v = bb == nullptr ? cr[j] : cr[j] + bb[j];
          if constexpr (F32OUT) {
            yr[j] = v;
          } else {
            const c10::BFloat16 h(v);  // round to nearest even
            std::memcpy(yr + j, &h, 2);
          }
        }
#endif
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0,
              "pack_linear_weight: a bf16 weight [N, K] with K even expected, got ", w.sizes(), " ", w.scalar_type());
  const int64_t N = w.size(0), K = w.size(1), NB = (N + BN - 1) / BN;
  auto padded = at::constant_pad_nd(w, {0, 0, 0, NB * BN - N});
  return padded.view({NB, BN, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

namespace {

// The operands of one linear on a packed weight: x as rows [M, K] with a contiguous last dim (a copy only when its
// strides need one) and the output y [..., n] allocated. ``who`` (and ``item`` when >= 0) start the error messages,
// which are formatted only on failure.
struct LinearOperands {
  at::Tensor x2, y;
  int64_t M, K;
};

inline std::string item_label(int64_t item) { return item >= 0 ? " item " + std::to_string(item) : std::string(); }

LinearOperands linear_operands(const at::Tensor& x, const at::Tensor& wp, int64_t n, const char* who,
                               int64_t item = -1, bool out_f32 = false) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16 && wp.dim() == 4 &&
              wp.size(2) == BN && wp.size(3) == 2 && wp.is_contiguous(),
              who, item_label(item), ": bf16 x [..., K] and a weight from pack_linear_weight expected");
  const int64_t K = x.size(-1);
  TORCH_CHECK(wp.size(1) * 2 == K && n > 0 && (n + BN - 1) / BN == wp.size(0),
              who, item_label(item), ": x's last dim ", K, " or n ", n, " does not match the packed weight ",
              wp.sizes());
  auto rows = tokenfab_cpu::linear_rows(x, K, n, out_f32 ? at::kFloat : at::kBFloat16);
  return {rows.x2, rows.y, rows.M, K};
}

inline const uint16_t* u16(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

}  // namespace

at::Tensor vnni_linear(const at::Tensor& x, const at::Tensor& wp, int64_t n, const c10::optional<at::Tensor>& bias,
                       bool out_f32) {
  auto io = linear_operands(x, wp, n, "vnni_linear", -1, out_f32);
  if (io.M == 0) return io.y;
  at::Tensor bf;
  const float* bp = tokenfab_cpu::float_bias(bias, n, "vnni_linear", bf);
#if defined(__AVX512BF16__)
  if (io.M <= kGemvRows && !tokenfab_cpu::batch_invariant()) {  // batch-invariant mode: brgemm tiles for every M
    if (out_f32) gemv<true>(u16(io.x2), io.M, io.x2.stride(0), io.K, u16(wp), n, bp, io.y.data_ptr(), n);
    else gemv<false>(u16(io.x2), io.M, io.x2.stride(0), io.K, u16(wp), n, bp, io.y.data_ptr(), n);
    return io.y;
  }
#endif
  if (out_f32) gemm<true>(u16(io.x2), io.M, io.x2.stride(0), io.K, u16(wp), n, bp, io.y.data_ptr(), n);
  else gemm<false>(u16(io.x2), io.M, io.x2.stride(0), io.K, u16(wp), n, bp, io.y.data_ptr(), n);
  return io.y;
}

std::vector<at::Tensor> vnni_linear_group(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& wps,
                                          const std::vector<int64_t>& ns) {
  TORCH_CHECK(xs.size() == wps.size() && xs.size() == ns.size(), "vnni_linear_group: one weight and n per input");
  const size_t J = xs.size();
  std::vector<at::Tensor> ys(J);
#if defined(__AVX512BF16__)
  std::vector<LinearOperands> gemvs;   // the items of 1..kGemvRows rows, run together below
  std::vector<const uint16_t*> w;      // their weights
  std::vector<int64_t> n, first_block{0};  // gemvs[j] owns blocks [first_block[j], first_block[j + 1]) of the region
  for (size_t j = 0; j < J; ++j) {
    const int64_t K = xs[j].size(-1), M = K == 0 ? 0 : xs[j].numel() / K;
    // not a GEMV (or batch-invariant mode, where every M runs brgemm tiles): its own call, before the group runs
    if (M > kGemvRows || M == 0 || tokenfab_cpu::batch_invariant()) {
      ys[j] = vnni_linear(xs[j], wps[j], ns[j], std::nullopt, false);
      continue;
    }
    auto io = linear_operands(xs[j], wps[j], ns[j], "vnni_linear_group:", static_cast<int64_t>(j));
    ys[j] = io.y;
    gemvs.push_back(std::move(io));
    w.push_back(u16(wps[j]));
    n.push_back(ns[j]);
    first_block.push_back(first_block.back() + (ns[j] + BN - 1) / BN);
  }
  at::parallel_for(0, first_block.back(), 1, [&](int64_t begin, int64_t end) {
    size_t j = std::upper_bound(first_block.begin(), first_block.end(), begin) - first_block.begin() - 1;
    for (int64_t b = begin; b < end; ++j) {  // this thread's blocks, item by item
      auto& o = gemvs[j];
      const int64_t b0 = b - first_block[j], b1 = std::min(end, first_block[j + 1]) - first_block[j];
      gemv_rows<false>(u16(o.x2), o.M, o.x2.stride(0), o.K, w[j], n[j], nullptr, o.y.data_ptr(), n[j], b0, b1);
      b = first_block[j] + b1;
    }
  });
#else
  for (size_t j = 0; j < J; ++j) ys[j] = vnni_linear(xs[j], wps[j], ns[j], std::nullopt, false);
#endif
  return ys;
}
