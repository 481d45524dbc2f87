// Grouped linears over routed-expert weights kept packed in their published formats (INT4 group-quantized and
// MXFP4, both compressed-tensors layouts): the weights are unpacked and scaled in registers, never copied out.
//
// Both formats store a row of W [n, K] as K / 2 bytes, byte b holding value 2b in its low nibble and 2b + 1 in its
// high one (int4: the little-endian int32 words of pack_to_int32, value k at bits 4 (k % 8) of word k / 8), with one
// scale per 32 values. A 64-value chunk of a row is 32 bytes: widened to 32 16-bit lanes, the lanes (low nibble, as
// vpermw reads index bits 0-4 of a table that repeats) and the lanes `>> 4` index a 32-entry `vpermw` table that
// turns them into exact bf16 values
// (int4: nibble - 8; MXFP4: the E2M1 value). x is rearranged once per call to match (per 64-chunk its 32 even
// values, then its 32 odd ones), so two `vdpbf16ps` give 16 float32 lanes of pair sums, lanes 0-7 from the chunk's
// first scale group and 8-15 from its second; one FMA with the two scales broadcast to their halves accumulates
// sum_k x_k (q_k s_g) as sum_g s_g sum_k x_k q_k: bf16 x bf16 products are exact in float32, so the only roundings
// are float32 sums (the reference dequantizes to float32 and runs a float32 matmul: the same real number).
// float32 x is split into three bf16 parts (x = h + m + l to 2^-24 relative), each multiplied exactly.
//
// CPU tile layout (packed_expert_tiles.h): prepare() re-lays every whole 16 rows of a stack so that a 64-byte load,
// a shift and a vpermw give an operand of 16 rows, multiplied by x's broadcast pair; those rows take the tile
// kernels there (register path and prefill conversion), the rows past them the checkpoint-layout kernels below.
// Prefill (a segment of more than 12 tokens; bf16 x on tiles without AMX: 256): the item's 32 rows are dequantized
// once into a thread-local buffer for oneDNN's brgemm over 64-token tiles (the bf16 GEMM's micro-kernel), never a
// copy larger than 32 rows: float32 values for float32 x; for bf16 x the values rounded once to bf16 (MXFP4 values
// are bf16 values already; INT4's (q - 8) s is rounded as the dequantized bf16 twin holds it).
// Work: (segment, block of 32 output rows) items over all segments in one parallel region; per block the scales are
// decoded once, then tiles of up to 4 tokens reuse each unpacked chunk and groups of 4 (1-2 tokens) or 2 rows share
// each x chunk load (decode: 1-12 tokens per expert).
#include "packed_experts.h"
#include "registrations.h"

#include "cpu_common.h"
#include "amx_tiles.h"
#include "linear_io.h"
#include "packed_expert_tiles.h"
#include "packed_expert_values.h"
#include "vnni_transpose.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

using tokenfab_cpu::f_to_bf16;

namespace {

constexpr int64_t kGroup = 32;     // values per scale
constexpr int64_t kChunk = 64;     // values per inner step (two scale groups)
constexpr int64_t kRowBlock = 32;  // output rows per work item (one brgemm column tile)
constexpr int kTokTile = 4;        // tokens per register tile
// A segment with more tokens than this dequantizes its row blocks for brgemm. Measured (benchmarks/packed_experts.py,
// expert shapes H 7168 / I 2048, 2 threads, bf16 x, thresholds 8 / 16 / 32 alternated twice): with the gather-free
// conversion the register path took 0.85-0.93x brgemm's time at 12 tokens; at 16 brgemm took 0.93-1.02x the
// register path's, at 24-32 0.8-0.9x.
constexpr int64_t kGemmMinTokens = 12;
// The same for bf16 x on a stack in the tile layout without AMX: its register path (packed_expert_tiles.h) measured
// 0.8-0.86x brgemm's time at 16 tokens, 0.85-0.9x at 24-48, 0.9-0.96x at 128-256 and even at 1024 (2 threads,
// thresholds alternated twice). With AMX, brgemm's tiles are expected to win early: the threshold above (unmeasured).
constexpr int64_t kTileGemmMinTokens = 256;
constexpr int64_t kGemmTileM = 64;      // tokens per brgemm call

#if defined(__AVX512BF16__)

using tokenfab_experts::GroupScale;
using tokenfab_experts::scales16;
using tokenfab_experts::value_table;

// The row's scales as float32 (scales16; ngroups values, then zeros: a half chunk reads a zero second scale, and the
// chunk's 16-float load of its two scales stays inside the row's padded slot of ng + 16).
inline void row_scales(int64_t fmt, int scale_kind, const void* s, int64_t ng, float* out) {
  const int64_t es = fmt == kExpertsMxfp4 ? 1 : 2;
  for (int64_t g = 0; g < ng; g += 16) {  // 16 scales per step
    const __mmask16 m = ng - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (ng - g)) - 1u);
    _mm512_mask_storeu_ps(out + g, m,
                          scales16(fmt == kExpertsMxfp4, scale_kind, static_cast<const uint8_t*>(s) + g * es, m));
  }
  for (int i = 0; i < 16; ++i) out[ng + i] = 0.f;
}

// R output rows for TB tokens (S bf16 parts each; xt: each token's rearranged [S][Kp] row): sums[r * TB + t].
// Every unpacked chunk is used by all TB tokens and every x chunk load by all R rows.
template <int S, int TB, int R>
inline void rows_tile(const uint8_t* const* wrow, const float* const* sc, int64_t K, const uint16_t* const* xt,
                      int64_t Kp, __m512i table, float* sums) {
  __m512 acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const int64_t nfull = K / kChunk;
  const int64_t nchunks = nfull + ((K % kChunk) != 0 ? 1 : 0);
  for (int64_t c = 0; c < nchunks; ++c) {
    __m512bh wlo[R], whi[R];
    __m512 sv[R];
    for (int r = 0; r < R; ++r) {
      const __m256i bytes = c < nfull ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow[r] + c * 32))
                                      : _mm256_maskz_loadu_epi8(0xFFFFu, wrow[r] + c * 32);
      const __m512i v = _mm512_cvtepu8_epi16(bytes);
      wlo[r] = (__m512bh)_mm512_permutexvar_epi16(v, table);  // vpermw reads index bits 0-4: the table repeats
      whi[r] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
      sv[r] = _mm512_permutexvar_ps(pick, _mm512_loadu_ps(sc[r] + 2 * c));  // the chunk's 2 scales, 8 lanes each
    }
    for (int t = 0; t < TB; ++t) {
      __m512 d[R];
      for (int r = 0; r < R; ++r) d[r] = _mm512_setzero_ps();
      for (int s = 0; s < S; ++s) {
        const uint16_t* xc = xt[t] + s * Kp + c * kChunk;
        const __m512bh xlo = (__m512bh)_mm512_loadu_si512(xc), xhi = (__m512bh)_mm512_loadu_si512(xc + 32);
        for (int r = 0; r < R; ++r) {
          d[r] = _mm512_dpbf16_ps(d[r], wlo[r], xlo);
          d[r] = _mm512_dpbf16_ps(d[r], whi[r], xhi);
        }
      }
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(d[r], sv[r], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) sums[r * TB + t] = _mm512_reduce_add_ps(acc[r][t]);
}

// Rows [r0, r1) of one expert (row pointers w + r * row_bytes, scales sc + (r - r0) * sld) for tokens [t0, t1):
// out[(t - t0) * ldo + (r - r0)].
template <int S>
void block_rows(const uint8_t* w, int64_t row_bytes, const float* sc, int64_t sld, int64_t r0, int64_t r1,
                int64_t K, const uint16_t* xp, int64_t Kp, int64_t t0, int64_t t1, __m512i table, float* out,
                int64_t ldo) {
  for (int64_t t = t0; t < t1; t += kTokTile) {
    const int nt = static_cast<int>(std::min<int64_t>(kTokTile, t1 - t));
    const uint16_t* xt[kTokTile];
    for (int i = 0; i < nt; ++i) xt[i] = xp + (t + i) * S * Kp;
    const int R = nt <= 2 ? 4 : 2;
    for (int64_t r = r0; r < r1;) {
      const int nr = r1 - r >= R ? R : 1;
      const uint8_t* wr[4];
      const float* sr[4];
      for (int i = 0; i < nr; ++i) wr[i] = w + (r + i) * row_bytes, sr[i] = sc + (r - r0 + i) * sld;
      float sums[16];
#define TF_ROWS(TB, RR) rows_tile<S, TB, RR>(wr, sr, K, xt, Kp, table, sums)
      if (nr == 1) {
        switch (nt) { case 4: TF_ROWS(4, 1); break; case 3: TF_ROWS(3, 1); break;
                      case 2: TF_ROWS(2, 1); break; default: TF_ROWS(1, 1); }
      } else if (nr == 4) {
        if (nt == 2) TF_ROWS(2, 4); else TF_ROWS(1, 4);
      } else {
        if (nt == 4) TF_ROWS(4, 2); else TF_ROWS(3, 2);
      }
#undef TF_ROWS
      for (int i = 0; i < nr; ++i)
        for (int j = 0; j < nt; ++j) out[(t - t0 + j) * ldo + (r - r0 + i)] = sums[i * nt + j];
      r += nr;
    }
  }
}

// Prefill: rows [j_begin, nr) (nr <= 32) of a row block dequantized into wf [K][32] float32 (row j in column j,
// zero columns past nr), the values the reference computes (code value * scale, exact in float32).
void dequant_block(int64_t fmt, const uint8_t* w, int64_t row_bytes, const float* sc, int64_t sld, int64_t nr,
                   int64_t K, float* wf, int64_t j_begin) {
  float lut[16];
  for (int i = 0; i < 16; ++i) lut[i] = tokenfab_experts::code_value(fmt, i);
  for (int64_t j = j_begin; j < kRowBlock; ++j) {
    if (j >= nr) {
      for (int64_t k = 0; k < K; ++k) wf[k * kRowBlock + j] = 0.f;
      continue;
    }
    const uint8_t* b = w + j * row_bytes;
    const float* s = sc + j * sld;
    for (int64_t k = 0; k < K; k += 2) {
      const uint8_t byte = b[k / 2];
      const float g = s[k / kGroup];
      wf[k * kRowBlock + j] = lut[byte & 15] * g;
      wf[(k + 1) * kRowBlock + j] = lut[byte >> 4] * g;
    }
  }
}

// bf16 x prefill: rows [0, nr) of a row block in brgemm's VNNI layout [K / 2][32][2] (zero rows past nr), each
// float32 value rounded once to bf16 as the dequantized bf16 twin holds it (MXFP4 values, E2M1 times a power of two,
// are bf16 values already; INT4's (q - 8) s keeps 8 of its up to 11 (bf16 s) or 14 (fp16 s) significant bits).
// 16 rows at a time, 64 bytes (128 values, 4 scale groups) of each row loaded and transposed, so dword d of the
// result holds bytes 4 d .. 4 d + 3 of every row: each byte (one value pair) is spread to its two words (low nibble
// in the even one, high nibble in the odd one: vpermw reads index bits 0-4 of a table that repeats) and looked up,
// giving the 16 rows' pair as GroupScale scales it into one layout row [pair][j0 .. j0 + 15] (its float32 form
// takes the two nibbles' values as floats directly). st: scratch of
// 16 (K / 32) floats (the 16 rows' scales, group-major). Rows before j_begin (0 or 16: a tile wrote them) are left
// alone.
void dequant_vnni(int64_t fmt, const uint8_t* w, int64_t row_bytes, const float* sc, int64_t sld, int64_t nr,
                  int64_t K, uint16_t* out, float* st, int64_t j_begin) {
  const __m512i words_table = value_table(fmt);
  alignas(64) float lut[16];
  for (int i = 0; i < 16; ++i) lut[i] = tokenfab_experts::code_value(fmt, i);
  const __m512 lutf = _mm512_load_ps(lut);
  auto* words = reinterpret_cast<int32_t*>(out);
  const int64_t ng = K / kGroup;
  for (int64_t j0 = j_begin; j0 < kRowBlock; j0 += 16) {
    const int64_t nv = std::max<int64_t>(0, std::min<int64_t>(16, nr - j0));
    const __mmask16 valid = nv >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nv) - 1u);
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t i = 0; i < 16; ++i) st[g * 16 + i] = i < nv ? sc[(j0 + i) * sld + g] : 0.f;
    for (int64_t c = 0; c < row_bytes; c += 64) {  // bytes [c, c + 64): pairs c.., scale groups c / 16 ..
      const int64_t nb = std::min<int64_t>(64, row_bytes - c);
      const __mmask64 m = nb == 64 ? ~0ull : (1ull << nb) - 1ull;
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < nv ? _mm512_maskz_loadu_epi8(m, w + (j0 + i) * row_bytes + c) : _mm512_setzero_si512();
      tokenfab_cpu::transpose16x16_epi32(r);
      for (int64_t gg = 0; gg < nb / 16; ++gg) {
        const int64_t g = c / 16 + gg;
        const GroupScale gs(_mm512_loadu_ps(st + g * 16), fmt == kExpertsMxfp4, valid);  // zero rows: zero words
        for (int q = 0; q < 4; ++q) {
          const __m512i wd = r[4 * gg + q];
          int32_t* dst = words + (16 * g + 4 * q) * kRowBlock + j0;
          for (int bb = 0; bb < 4; ++bb) {  // byte bb: pair 16 g + 4 q + bb
            const __m512i t = _mm512_srli_epi32(wd, 8 * bb);
            if (gs.bits) {
              const __m512i idx = _mm512_mask_mov_epi16(t, 0xAAAAAAAAu, _mm512_slli_epi32(t, 12));
              _mm512_storeu_si512(dst + bb * kRowBlock, gs.pairs(_mm512_permutexvar_epi16(idx, words_table)));
            } else {  // the float32 form straight from the nibbles (vpermps reads index bits 0-3)
              _mm512_storeu_si512(dst + bb * kRowBlock,
                                  gs.pairs(_mm512_permutexvar_ps(t, lutf),
                                           _mm512_permutexvar_ps(_mm512_srli_epi32(t, 4), lutf)));
            }
          }
        }
      }
    }
  }
}

// x [N, K] -> [N][S][Kp] bf16 parts, per 64-chunk the even values then the odd ones, zero past K.
template <typename T, int S>
std::vector<uint16_t> rearrange(const T* x, int64_t N, int64_t K, int64_t Kp) {
  std::vector<uint16_t> xp(static_cast<size_t>(N * S * Kp), 0);
  at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t c = k / kChunk, j = k % kChunk;
        const int64_t dst = c * kChunk + (j % 2) * 32 + j / 2;
        if constexpr (S == 1) {
          uint16_t bits;
          std::memcpy(&bits, x + r * K + k, 2);
          xp[r * Kp + dst] = bits;
        } else {
          float rest = static_cast<float>(x[r * K + k]);
          for (int s = 0; s < S; ++s) {
            const uint16_t h = f_to_bf16(rest);
            xp[(r * S + s) * Kp + dst] = h;
            rest -= tokenfab_cpu::bf16_to_f(h);
          }
        }
      }
    }
  });
  return xp;
}

#endif  // __AVX512BF16__

}  // namespace

at::Tensor packed_experts_linear(const at::Tensor& x, int64_t fmt, const at::Tensor& packed, const at::Tensor& scale,
                                 const at::Tensor& experts, const at::Tensor& offsets) {
#if defined(__AVX512BF16__)
  const bool tiled = fmt >= kExpertsTiles;  // whole 16-row tiles in the CPU tile layout (packed_expert_tiles.h)
  if (tiled) fmt -= kExpertsTiles;
  TORCH_CHECK(fmt == kExpertsInt4Group || fmt == kExpertsMxfp4, "packed_experts_linear: unknown format ", fmt);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "packed_experts_linear: x [N, K] bf16 or float32 expected");
  const int scale_kind = check_expert_buffers(fmt, packed, scale, x.size(1), "packed_experts_linear");
  const int64_t N = x.size(0), K = x.size(1), E = packed.size(0), n = packed.size(1);
  const auto seg = tokenfab_cpu::expert_segments(experts, offsets, E, N, "packed_experts_linear");
  const int64_t A = seg.A;
  const int64_t* ep = seg.ep();
  const int64_t* op = seg.op();
  const bool f32 = x.scalar_type() == at::kFloat;
  const auto xc = x.contiguous();
  const int64_t Kp = (K + kChunk - 1) / kChunk * kChunk, ng = K / kGroup;
  const int64_t n16 = tiled ? n / tokenfab_tiles::kTileRows * tokenfab_tiles::kTileRows : 0;  // rows in tiles
#if defined(TOKENFAB_AMX)
  const bool amx = tokenfab_cpu::amx_ready();
#else
  const bool amx = false;
#endif
  const int64_t gemm_min = tiled && !f32 && !amx ? kTileGemmMinTokens : kGemmMinTokens;  // more tokens: brgemm
  bool gemv = false;  // x is rearranged only for segments on the register path (prefill reads x as it is)
  for (int64_t a = 0; a < A; ++a) gemv |= op[a + 1] > op[a] && op[a + 1] - op[a] <= gemm_min;
  const bool row_gemv = gemv && n16 < n, tile_gemv = gemv && n16 > 0;
  const std::vector<uint16_t> xp = !row_gemv ? std::vector<uint16_t>()
                                   : f32 ? rearrange<float, 3>(xc.data_ptr<float>(), N, K, Kp)
                                         : rearrange<c10::BFloat16, 1>(xc.data_ptr<c10::BFloat16>(), N, K, Kp);
  // the tiles' register path reads x in its natural order: bf16 as it is, float32 as three bf16 parts [N][3][K]
  const at::Tensor xn_t = tile_gemv ? tokenfab_cpu::bf16_parts(xc) : at::Tensor();
  const auto* xn = tile_gemv ? reinterpret_cast<const uint16_t*>(xn_t.data_ptr()) : nullptr;
  const int64_t es = scale.element_size();
  auto y = at::empty({N, n}, x.options());
  const auto* wbase = static_cast<const uint8_t*>(packed.data_ptr());
  const auto* sbase = static_cast<const uint8_t*>(scale.data_ptr());
  const int64_t row_bytes = K / 2, srow_bytes = ng * es;
  const int64_t blocks = (n + kRowBlock - 1) / kRowBlock;
  const __m512i table = value_table(fmt);
  float* yf = f32 ? y.data_ptr<float>() : nullptr;
  auto* yb = f32 ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, A * blocks, 1, [&](int64_t b, int64_t e) {
    const int64_t sld = ng + 16;
    std::vector<float> sc(static_cast<size_t>(kRowBlock * sld));
    std::vector<float> tmp, wf, cbuf;
    std::vector<uint16_t> wb;
    std::vector<float> st;
    bool used_brgemm = false;
    for (int64_t it = b; it < e; ++it) {
      const int64_t a = it / blocks, r0 = (it % blocks) * kRowBlock, r1 = std::min(n, r0 + kRowBlock);
      const int64_t t0 = op[a], t1 = op[a + 1];
      if (t1 == t0) continue;
      const int64_t rows = r1 - r0;
      // rows [r0, rt) lie in whole tiles (0, 16 or 32 of them), [rt, r1) in the checkpoint layout
      const int64_t rt = std::max(r0, std::min(r1, n16)), jt = rt - r0;
      for (int64_t r = rt; r < r1; ++r)
        row_scales(fmt, scale_kind, sbase + (ep[a] * n + r) * srow_bytes, ng, sc.data() + (r - r0) * sld);
      const uint8_t* w = wbase + ep[a] * n * row_bytes;
      auto tile_codes = [&](int64_t j) { return w + (r0 + j) * row_bytes; };
      auto tile_scales = [&](int64_t j) { return sbase + (ep[a] * n + r0 + j) * srow_bytes; };
      const bool mx = fmt == kExpertsMxfp4;
      if (t1 - t0 > gemm_min) {  // prefill: this row block dequantized once, brgemm over 64-token tiles
        cbuf.resize(static_cast<size_t>(kGemmTileM * kRowBlock));
        if (f32) {
          wf.resize(static_cast<size_t>(K * kRowBlock));
          for (int64_t j = 0; j < jt; j += tokenfab_tiles::kTileRows)
            tokenfab_tiles::tile_dequant<true>(tile_codes(j), tile_scales(j), mx, scale_kind, es, ng, table, wf.data(), j);
          if (jt < kRowBlock)
            dequant_block(fmt, w + r0 * row_bytes, row_bytes, sc.data(), sld, rows, K, wf.data(), jt);
        } else {
          wb.resize(static_cast<size_t>(K * kRowBlock));
          st.resize(static_cast<size_t>(16 * ng));
          for (int64_t j = 0; j < jt; j += tokenfab_tiles::kTileRows)
            tokenfab_tiles::tile_dequant<false>(tile_codes(j), tile_scales(j), mx, scale_kind, es, ng, table, wb.data(), j);
          if (jt < kRowBlock)
            dequant_vnni(fmt, w + r0 * row_bytes, row_bytes, sc.data(), sld, rows, K, wb.data(), st.data(), jt);
        }
        used_brgemm = true;
        for (int64_t m0 = t0; m0 < t1; m0 += kGemmTileM) {
          const int64_t mt = std::min(kGemmTileM, t1 - m0);
          if (f32) {
            at::native::cpublas::brgemm(mt, kRowBlock, K, K, kRowBlock, kRowBlock, false, xc.data_ptr<float>() + m0 * K,
                                        wf.data(), cbuf.data(), false);
          } else {
            at::native::cpublas::brgemm(mt, kRowBlock, K, K, kRowBlock, kRowBlock, false,
                                        xc.data_ptr<at::BFloat16>() + m0 * K,
                                        reinterpret_cast<const at::BFloat16*>(wb.data()), cbuf.data(), true);
          }
          for (int64_t t = 0; t < mt; ++t) {
            const float* src = cbuf.data() + t * kRowBlock;
            if (f32) std::memcpy(yf + (m0 + t) * n + r0, src, rows * sizeof(float));
            else for (int64_t r = 0; r < rows; ++r) yb[(m0 + t) * n + r0 + r] = f_to_bf16(src[r]);
          }
        }
        continue;
      }
      tmp.resize(static_cast<size_t>((t1 - t0) * rows));
      for (int64_t j = 0; j < jt; j += tokenfab_tiles::kTileRows) {
        if (f32)
          tokenfab_tiles::tile_rows<3>(tile_codes(j), tile_scales(j), mx, scale_kind, es, ng, xn, K, t0, t1, table,
                                       tmp.data() + j, rows);
        else
          tokenfab_tiles::tile_rows<1>(tile_codes(j), tile_scales(j), mx, scale_kind, es, ng, xn, K, t0, t1, table,
                                       tmp.data() + j, rows);
      }
      if (rt < r1) {
        const float* sct = sc.data() + jt * sld;
        if (f32)
          block_rows<3>(w, row_bytes, sct, sld, rt, r1, K, xp.data(), Kp, t0, t1, table, tmp.data() + jt, rows);
        else
          block_rows<1>(w, row_bytes, sct, sld, rt, r1, K, xp.data(), Kp, t0, t1, table, tmp.data() + jt, rows);
      }
      for (int64_t t = t0; t < t1; ++t) {
        const float* src = tmp.data() + (t - t0) * rows;
        if (f32) std::memcpy(yf + t * n + r0, src, rows * sizeof(float));
        else for (int64_t r = 0; r < rows; ++r) yb[t * n + r0 + r] = f_to_bf16(src[r]);
      }
    }
    if (used_brgemm) at::native::cpublas::brgemm_release(!f32);
  });
  return y;
#else
  TORCH_CHECK(false, "packed_experts_linear needs AVX512-BF16 (use the PyTorch path)");
  return x;
#endif
}

void packed_experts_relayout(int64_t fmt, at::Tensor& packed, at::Tensor& scale, bool to_tiles) {
  TORCH_CHECK(fmt == kExpertsInt4Group || fmt == kExpertsMxfp4, "packed_experts_relayout: unknown format ", fmt);
  TORCH_CHECK(packed.dim() == 3 && scale.dim() == 3 && packed.is_contiguous() && scale.is_contiguous() &&
                  packed.device().is_cpu() && scale.size(0) == packed.size(0) && scale.size(1) == packed.size(1),
              "packed_experts_relayout: contiguous CPU packed [E, n, .] and scale [E, n, K / 32] expected");
  const int64_t E = packed.size(0), n = packed.size(1), row_bytes = packed.size(2) * packed.element_size();
  const int64_t ng = scale.size(2), es = scale.element_size();
  TORCH_CHECK(row_bytes == ng * 16, "packed_experts_relayout: packed rows of ", row_bytes, " bytes do not hold ", ng,
              " groups of 32 4-bit codes");
  const int64_t tiles = n / tokenfab_tiles::kTileRows;
  auto* w = static_cast<uint8_t*>(packed.data_ptr());
  auto* s = static_cast<uint8_t*>(scale.data_ptr());
  at::parallel_for(0, E * tiles, 1, [&](int64_t b, int64_t e) {
    std::vector<uint8_t> tmp;
    for (int64_t i = b; i < e; ++i) {
      const int64_t r = (i / tiles) * n + (i % tiles) * tokenfab_tiles::kTileRows;  // first row of the tile
      tokenfab_tiles::relayout_tile(w + r * row_bytes, row_bytes, s + r * ng * es, ng, es, to_tiles, tmp);
    }
  });
}

void register_packed_experts(pybind11::module_& m) {
  m.def("packed_experts_relayout", &packed_experts_relayout,
        "in place: a packed experts stack's whole 16-row tiles into the CPU tile layout, or back", py::arg("fmt"),
        py::arg("packed"), py::arg("scale"), py::arg("to_tiles"));
  m.def("packed_experts_linear", &packed_experts_linear,
        "grouped x W_e^T over routed experts kept packed (int4 group / MXFP4; CPU, AVX512-BF16)", py::arg("x"),
        py::arg("fmt"), py::arg("packed"), py::arg("scale"), py::arg("experts"), py::arg("offsets"));
  m.attr("packed_experts_avx2_built") = packed_experts_avx2_built();
  m.def("packed_experts_avx2", &packed_experts_avx2,
        "grouped x W_e^T over int4 group / MXFP4 experts in the checkpoint layout, float32 x and y (CPU, AVX2 + FMA: "
        "CPUs without AVX512-BF16)", py::arg("x"), py::arg("fmt"), py::arg("packed"), py::arg("scale"),
        py::arg("experts"), py::arg("offsets"));
}
