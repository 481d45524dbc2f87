// Paged decode attention, bf16 on AVX512-BF16: the fast path of paged_decode_attention (paged_attention.cpp).
#include "paged_attention.h"

#include "batch_invariant.h"

#if defined(__AVX512BF16__)
// bf16 paged decode attention on AVX512-BF16 (`vdpbf16ps`: 32 bf16 products accumulated in float32 per
// instruction, twice the float32 FMA rate and no widening pass). Same algorithm and work split as
// decode_attention_impl; K/V rows are read raw from the pool. Scores accumulate in float32; the softmax weights are
// rounded to bf16 for the value products (as the eager path's `softmax(...).to(bf16) @ v` does) and the running sum
// uses the rounded weights. Values are accumulated over token pairs: `unpacklo/hi_epi16` of rows t, t+1 interleave
// them per 128-bit lane, so accumulator lane 4j+i holds column 8j+i ("lo") or 8j+4+i ("hi") of each 32-column
// chunk; the permutation is undone once at the end. Needs D and Dv multiples of 32 (the caller checks).
//
// Blocks of 16 rows (tokenfab's block size) take a vector path: each head's 16 scores of a block form one register
// (narrow rows: 16 dot products reduced together by transpose_sum16; rows of 256+ values, e.g. MLA's 576:
// scores16_heads_bf16, 4-row x 4-head register tiles that load each key row once for 4 heads, their dot products
// reduced 16 rows at a time by transpose_sum16, 4-8% faster than one horizontal reduction each, NOTES.md entry 45),
// and the online-softmax step, the bf16 rounding and the weight pairs are 16-lane operations. 1.3-2.1x faster than
// the per-token scalar softmax it replaces (benchmarks/NOTES.md).

using namespace tokenfab_cpu;

namespace {

// acc[t][g] = the 16-lane partial products of q_g . k_t (D a multiple of 32): each key row loaded once for NG heads.
template <int NT, int NG>
inline void dot_tile_bf16(const uint16_t* q, int64_t D, const uint16_t* const* k, __m512 (&acc)[NT][NG]) {
  for (int t = 0; t < NT; ++t)
    for (int g = 0; g < NG; ++g) acc[t][g] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    __m512bh kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = (__m512bh)_mm512_loadu_si512(k[t] + d);
    for (int g = 0; g < NG; ++g) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + g * D + d);
      for (int t = 0; t < NT; ++t) acc[t][g] = _mm512_dpbf16_ps(acc[t][g], qv, kv[t]);
    }
  }
}

template <int NT, int NG>
inline void score_tile_bf16(const uint16_t* q, int64_t D, const uint16_t* const* k, float scale, float* s,
                            int64_t ls) {
  __m512 acc[NT][NG];
  dot_tile_bf16<NT, NG>(q, D, k, acc);
  for (int t = 0; t < NT; ++t)
    for (int g = 0; g < NG; ++g) s[t * ls + g] = scale * _mm512_reduce_add_ps(acc[t][g]);
}

template <int NT>
inline void score_heads_bf16(const uint16_t* q, int64_t D, const uint16_t* const* k, float scale, int64_t ng,
                             float* s, int64_t ls) {
  int64_t g = 0;
  for (; g + 4 <= ng; g += 4) score_tile_bf16<NT, 4>(q + g * D, D, k, scale, s + g, ls);
  switch (ng - g) {
    case 3: score_tile_bf16<NT, 3>(q + g * D, D, k, scale, s + g, ls); break;
    case 2: score_tile_bf16<NT, 2>(q + g * D, D, k, scale, s + g, ls); break;
    case 1: score_tile_bf16<NT, 1>(q + g * D, D, k, scale, s + g, ls); break;
    default: break;
  }
}

// acc_g += sum over token pairs of (p_t, p_t+1) . (v_t, v_t+1), 32 columns at a time; pp[pair * lp + g * gs] holds
// the two bf16 weights of head g (low half: token 2 * pair). v has an even number of rows (the caller pads).
template <int NG>
inline void value_tile_bf16(const uint32_t* pp, int64_t lp, int64_t gs, const uint16_t* const* v, int64_t npair,
                            int64_t Dv, float* acc) {
  for (int64_t c = 0; c < Dv; c += 32) {
    __m512 lo[NG], hi[NG];
    for (int g = 0; g < NG; ++g) {
      lo[g] = _mm512_loadu_ps(acc + g * Dv + c);
      hi[g] = _mm512_loadu_ps(acc + g * Dv + c + 16);
    }
    for (int64_t q = 0; q < npair; ++q) {
      const __m512i v0 = _mm512_loadu_si512(v[2 * q] + c);
      const __m512i v1 = _mm512_loadu_si512(v[2 * q + 1] + c);
      const __m512bh il = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
      const __m512bh ih = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
      for (int g = 0; g < NG; ++g) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[q * lp + g * gs]));
        lo[g] = _mm512_dpbf16_ps(lo[g], il, pb);
        hi[g] = _mm512_dpbf16_ps(hi[g], ih, pb);
      }
    }
    for (int g = 0; g < NG; ++g) {
      _mm512_storeu_ps(acc + g * Dv + c, lo[g]);
      _mm512_storeu_ps(acc + g * Dv + c + 16, hi[g]);
    }
  }
}

inline void value_heads_bf16(const uint32_t* pp, int64_t lp, int64_t gs, const uint16_t* const* v, int64_t npair,
                             int64_t Dv, int64_t ng, float* acc) {
  int64_t g = 0;
  for (; g + 4 <= ng; g += 4) value_tile_bf16<4>(pp + g * gs, lp, gs, v, npair, Dv, acc + g * Dv);
  switch (ng - g) {
    case 3: value_tile_bf16<3>(pp + g * gs, lp, gs, v, npair, Dv, acc + g * Dv); break;
    case 2: value_tile_bf16<2>(pp + g * gs, lp, gs, v, npair, Dv, acc + g * Dv); break;
    case 1: value_tile_bf16<1>(pp + g * gs, lp, gs, v, npair, Dv, acc + g * Dv); break;
    default: break;
  }
}

// Sum of each of 16 vectors, as one vector: lane t = sum of a[t]'s 16 lanes. A transposing add tree (45
// instructions for 16 sums, against ~8 per `_mm512_reduce_add_ps`): pairs within 128-bit lanes, then quads, then
// across the four 128-bit lanes.
inline __m512 transpose_sum16(const __m512* a) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = a[2i], b = a[2i+1]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's partial sums of a[4i .. 4i + 3]
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
    y[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // 128-bit lanes [y.L0 + y.L1, y.L2 + y.L3, y'.L0 + y'.L1, y'.L2 + y'.L3], then the same once more: lane block i
  // holds the totals of a[4i .. 4i + 3]
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

// q . k_t for the 16 rows of one block (k rows at stride ks; rows past the context are computed and masked later).
inline __m512 scores16_bf16(const uint16_t* q, int64_t D, const uint16_t* k, int64_t ks) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
    for (int t = 0; t < 16; ++t)
      acc[t] = _mm512_dpbf16_ps(acc[t], qv, (__m512bh)_mm512_loadu_si512(k + t * ks + d));
  }
  return transpose_sum16(acc);
}

// Scores of up to 4 query heads (ng, rows of q at stride D) against the 16 key rows of one block (stride ks), times
// scale: s[g * 16 + t]. Key rows are loaded once for all heads (4-row x NG-head register tiles, NOTES.md entry 49) and
// the 16 x NG dot products reduced by transpose_sum16 per head, instead of one horizontal reduction each.
template <int NG>
inline void scores16_heads_tile(const uint16_t* q, int64_t D, const uint16_t* k, int64_t ks, float scale,
                                float* s) {
  __m512 acc[16][NG];
  for (int t = 0; t < 16; t += 4) {  // 4 rows x NG heads: 4 key and 1 query load per 16 dot-product steps
    const uint16_t* rows[4] = {k + t * ks, k + (t + 1) * ks, k + (t + 2) * ks, k + (t + 3) * ks};
    __m512 a[4][NG];
    dot_tile_bf16<4, NG>(q, D, rows, a);
    for (int r = 0; r < 4; ++r)
      for (int g = 0; g < NG; ++g) acc[t + r][g] = a[r][g];
  }
  for (int g = 0; g < NG; ++g) {
    __m512 col[16];
    for (int t = 0; t < 16; ++t) col[t] = acc[t][g];
    _mm512_storeu_ps(s + g * 16, _mm512_mul_ps(transpose_sum16(col), _mm512_set1_ps(scale)));
  }
}

inline void scores16_heads_bf16(const uint16_t* q, int64_t D, const uint16_t* k, int64_t ks, int64_t ng, float scale,
                                float* s) {
  switch (ng) {
    case 4: scores16_heads_tile<4>(q, D, k, ks, scale, s); break;
    case 3: scores16_heads_tile<3>(q, D, k, ks, scale, s); break;
    case 2: scores16_heads_tile<2>(q, D, k, ks, scale, s); break;
    default: scores16_heads_tile<1>(q, D, k, ks, scale, s); break;
  }
}

// exp_approx on 16 lanes (same clamp, reduction and polynomial).
inline __m512 exp_approx16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// One output row of the bf16 decode kernel: the float32 accumulator (in value_heads_bf16's lane order) / l, rounded
// to bf16 in column order.
inline void store_decode_row(const float* a, float l, int64_t Dv, uint16_t* o) {
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int64_t c0 = 0; c0 < Dv; c0 += 32)  // undo the unpack lane permutation
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 4; ++i) {
        o[c0 + 8 * j + i] = f_to_bf16(a[c0 + 4 * j + i] * inv);
        o[c0 + 8 * j + 4 + i] = f_to_bf16(a[c0 + 16 + 4 * j + i] * inv);
      }
}

}  // namespace

namespace tokenfab_cpu {

// Declared in paged_attention.h.
void decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                           at::Tensor& out) {
  // batch-invariant mode: never split a context (a split's partial sums depend on how many sequences share the step)
  const DecodeGeometry geo(q, k_cache, v_cache, block_tables, /*split_context=*/!batch_invariant());
  const int64_t H = geo.H, D = geo.D, bs = geo.bs, Dv = geo.Dv, per_chunk = geo.per_chunk, S = geo.splits;
  // context splits: per (sequence, split, head) the running max, sum and permuted accumulator, merged below
  std::vector<float> part_m(S > 1 ? geo.B * S * H : 0), part_l(part_m.size()), part_acc(part_m.size() * Dv);
  const auto* qp = raw<c10::BFloat16>(q);
  const auto* kp = raw<c10::BFloat16>(k_cache);
  const auto* vp = raw<c10::BFloat16>(v_cache);
  const int64_t* btp = block_tables.data_ptr<int64_t>();
  const int64_t* clp = context_lens.data_ptr<int64_t>();
  auto* op = raw_mut<c10::BFloat16>(out);
  const float fscale = static_cast<float>(scale);
  const int64_t npair_max = (bs + 1) / 2;

  at::parallel_for(0, geo.num_items(), 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> qr(per_chunk * D);
    std::vector<float> s(bs * per_chunk), acc(per_chunk * Dv), m(per_chunk), l(per_chunk);
    std::vector<uint32_t> pp(npair_max * per_chunk);
    std::vector<const uint16_t*> krows(2), vrows(2 * npair_max);
    for (int64_t idx = begin; idx < end; ++idx) {
      const auto it = geo.item(idx);
      const int64_t ng = it.ng;
      if (ng <= 0) continue;
      const int64_t L = clp[it.b];
      const int64_t* bt = btp + it.b * geo.max_blocks;
      for (int64_t g = 0; g < ng; ++g)
        std::memcpy(qr.data() + g * D, qp + it.b * geo.qs0 + (it.h0 + g) * geo.qs1, D * 2);
      std::fill(acc.begin(), acc.begin() + ng * Dv, 0.f);
      std::fill(m.begin(), m.begin() + ng, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + ng, 0.f);
      const int64_t nblk = (L + bs - 1) / bs, per_split = (nblk + S - 1) / S;
      const int64_t t_begin = std::min(nblk, it.split * per_split) * bs;
      const int64_t t_end = std::min(L, (it.split + 1) * per_split * bs);
      for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
        const int64_t n = std::min(bs, L - t0), npair = (n + 1) / 2;
        const uint16_t* kb = kp + bt[t0 / bs] * geo.ks0;
        const uint16_t* vb = vp + bt[t0 / bs] * geo.vs0;
        // the next block's K/V rows, prefetched: per KV head as each head's turn comes on the 16-row path (a
        // burst of all heads' rows at once stalled the loads of the current block: 8-9.6 against 10-12.6 GB/s from
        // a shuffled 490 MB pool on one thread, 14-16 against 17-23 on two, NOTES.md entry 94), else at once
        const bool pf = t0 + bs < t_end;
        const int64_t nn = pf ? std::min(bs, L - t0 - bs) : 0;
        const uint16_t* kn = pf ? kp + bt[t0 / bs + 1] * geo.ks0 : nullptr;
        const uint16_t* vn = pf ? vp + bt[t0 / bs + 1] * geo.vs0 : nullptr;
        if (pf && bs != 16) {
          prefetch_rows(kn + it.kv0 * geo.ks2, nn, geo.ks1, (it.nkv - 1) * geo.ks2 + D);
          if (vp != kp) prefetch_rows(vn + it.kv0 * geo.vs2, nn, geo.vs1, (it.nkv - 1) * geo.vs2 + Dv);
        }
        if (bs == 16) {  // one vector per head and block: scores, online softmax and bf16 weights in 16 lanes
          const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
          for (int64_t kh = 0; kh < it.nkv; ++kh) {
            int64_t ga, gb;
            geo.heads_of(it, kh, ga, gb);
            const uint16_t* kk = kb + (it.kv0 + kh) * geo.ks2;
            if (pf) {
              prefetch_rows(kn + (it.kv0 + kh) * geo.ks2, nn, geo.ks1, D);
              if (vp != kp) prefetch_rows(vn + (it.kv0 + kh) * geo.vs2, nn, geo.vs1, Dv);
            }
            if (D >= 256) {  // wide rows (MLA's 576): key rows loaded once per 4 heads, one transposing reduction
              for (int64_t g0 = ga; g0 < gb; g0 += 4)
                scores16_heads_bf16(qr.data() + g0 * D, D, kk, geo.ks1, std::min<int64_t>(4, gb - g0), fscale,
                                    s.data() + g0 * 16);
            } else {  // narrow rows: 16 tokens per head in one transposing reduction
              for (int64_t g = ga; g < gb; ++g)
                _mm512_storeu_ps(s.data() + g * 16, _mm512_mul_ps(scores16_bf16(qr.data() + g * D, D, kk, geo.ks1),
                                                                  _mm512_set1_ps(fscale)));
            }
            for (int64_t g = ga; g < gb; ++g) {
              const __m512 sv = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                                     _mm512_loadu_ps(s.data() + g * 16));
              const float mb = std::max(m[g], _mm512_reduce_max_ps(sv));
              const float corr = exp_approx(m[g] - mb);
              const __m512 pv = _mm512_maskz_mov_ps(valid, exp_approx16(_mm512_sub_ps(sv, _mm512_set1_ps(mb))));
              const __m256bh pb = _mm512_cvtneps_pbh(pv);  // round to nearest even; word i = tokens 2i, 2i + 1
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp.data() + g * 8), (__m256i)pb);
              const __m512 pr = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)pb), 16));
              if (corr != 1.f) {
                float* a = acc.data() + g * Dv;
                for (int64_t d = 0; d < Dv; ++d) a[d] *= corr;
              }
              l[g] = l[g] * corr + _mm512_reduce_add_ps(pr);
              m[g] = mb;
            }
            for (int64_t j = 0; j < 2 * npair; ++j)  // rows past the context get weight 0 and a valid row
              vrows[j] = vb + std::min(j, n - 1) * geo.vs1 + (it.kv0 + kh) * geo.vs2;
            value_heads_bf16(pp.data() + ga * 8, 1, 8, vrows.data(), npair, Dv, gb - ga, acc.data() + ga * Dv);
          }
          continue;
        }
        for (int64_t kh = 0; kh < it.nkv; ++kh) {  // scores s[j * ng + g], heads grouped by their KV head
          int64_t ga, gb;
          geo.heads_of(it, kh, ga, gb);
          const uint16_t* kk = kb + (it.kv0 + kh) * geo.ks2;
          int64_t j = 0;
          for (; j + 2 <= n; j += 2) {
            krows[0] = kk + j * geo.ks1;
            krows[1] = kk + (j + 1) * geo.ks1;
            score_heads_bf16<2>(qr.data() + ga * D, D, krows.data(), fscale, gb - ga, s.data() + j * ng + ga, ng);
          }
          if (j < n) {
            krows[0] = kk + j * geo.ks1;
            score_heads_bf16<1>(qr.data() + ga * D, D, krows.data(), fscale, gb - ga, s.data() + j * ng + ga, ng);
          }
        }
        // the online softmax step of decode_attention_impl, writing bf16 weight pairs (token 2i low, 2i+1 high;
        // an odd last token pairs with 0) as it goes: ~25% faster at long contexts than the float step followed
        // by a separate packing pass (measured, GQA B 16 x 2048)
        for (int64_t g = 0; g < ng; ++g) {
          float mb = m[g];
          for (int64_t j = 0; j < n; ++j) mb = std::max(mb, s[j * ng + g]);
          const float corr = exp_approx(m[g] - mb);
          float sum = 0.f;
          for (int64_t j = 0; j < 2 * npair; ++j) {
            uint16_t bits = 0;
            if (j < n) {
              bits = f_to_bf16(exp_approx(s[j * ng + g] - mb));
              sum += bf16_to_f(bits);
            }
            uint32_t& word = pp[(j / 2) * ng + g];
            word = (j % 2 == 0) ? bits : (word | (static_cast<uint32_t>(bits) << 16));
          }
          if (corr != 1.f) {
            float* a = acc.data() + g * Dv;
            for (int64_t d = 0; d < Dv; ++d) a[d] *= corr;
          }
          l[g] = l[g] * corr + sum;
          m[g] = mb;
        }
        for (int64_t kh = 0; kh < it.nkv; ++kh) {
          int64_t ga, gb;
          geo.heads_of(it, kh, ga, gb);
          for (int64_t j = 0; j < 2 * npair; ++j)  // an odd last row pairs with itself at weight 0
            vrows[j] = vb + std::min(j, n - 1) * geo.vs1 + (it.kv0 + kh) * geo.vs2;
          value_heads_bf16(pp.data() + ga, ng, 1, vrows.data(), npair, Dv, gb - ga, acc.data() + ga * Dv);
        }
      }
      for (int64_t g = 0; g < ng; ++g) {
        if (S > 1) {  // this split's state, merged below
          const int64_t slot = (it.b * S + it.split) * H + it.h0 + g;
          part_m[slot] = m[g];
          part_l[slot] = l[g];
          std::memcpy(part_acc.data() + slot * Dv, acc.data() + g * Dv, Dv * sizeof(float));
          continue;
        }
        store_decode_row(acc.data() + g * Dv, l[g], Dv, op + (it.b * H + it.h0 + g) * Dv);
      }
    }
  });
  if (S == 1) return;
  // merge the context splits: softmax over the union = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s
  at::parallel_for(0, geo.B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(Dv);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t sp = 0; sp < S; ++sp) M = std::max(M, part_m[(b * S + sp) * H + h]);
      std::fill(acc.begin(), acc.end(), 0.f);
      float lsum = 0.f;
      for (int64_t sp = 0; sp < S; ++sp) {
        const int64_t slot = (b * S + sp) * H + h;
        if (part_l[slot] == 0.f) continue;  // an empty split (context shorter than the others' share)
        const float w = exp_approx(part_m[slot] - M);
        lsum += part_l[slot] * w;
        axpy(acc.data(), w, part_acc.data() + slot * Dv, Dv);
      }
      store_decode_row(acc.data(), lsum, Dv, op + bh * Dv);
    }
  });
}

}  // namespace tokenfab_cpu
#endif  // __AVX512BF16__
