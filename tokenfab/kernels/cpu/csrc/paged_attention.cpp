// Paged decode attention: one query token per sequence, keys/values read in place from the paged pool.
//
// q [B, H, D]; k_cache [NB, bs, Hk, D] and v_cache [NB, bs, Hk, Dv] (any strides: MLA passes one latent pool as
// both, values being its first Dv columns); block_tables [B, max_blocks] int64; context_lens [B] int64.
// out [B, H, Dv] = softmax(scale * q k^T) v over each sequence's first context_lens[b] tokens.
// Query head h reads KV head h / (H / Hk).
//
// One pass over the context, block by block, with the online softmax of flash-decoding (running max and sum per
// head, Milakov & Gimelshein 2018; Dao et al. 2023): each block's K and V rows are read in the pool itself (bf16 /
// fp16 rows widened in registers as they are loaded), all of the item's heads are scored against it with 2-token x
// 4-head register blocking in the native vector width (8 or 16 floats), each head's block scores go through the
// softmax as whole vectors (exponential included), and the block's values are accumulated. Float32 arithmetic
// throughout; q and out float32 or bf16, the pool float32, bf16 or fp16 (float32 q over a narrower pool: a bf16 /
// fp16 KV cache beside float32 activations). Work items: (sequence, chunk of heads);
// heads are split only when there are fewer sequences than threads. The next block is prefetched while one is
// being computed (blocks are scattered in the pool, so the hardware prefetcher cannot follow them).
#include "cpu_isa.h"
#include "cpu_kernels.h"
#include "paged_attention.h"

using namespace tokenfab_cpu;

namespace {

// The native float vector: one AVX-512 register, or one AVX2 register (a 64-byte GCC vector on AVX2 is two
// registers that the compiler spills through the stack in these tiles: the kernel ran at ~5 GB/s that way).
#if defined(__AVX512F__)
constexpr int64_t W = 16;
#else
constexpr int64_t W = 8;
#endif
typedef float vfw __attribute__((vector_size(W * 4)));
typedef int32_t viw __attribute__((vector_size(W * 4)));

inline vfw ldw(const float* p) {
  vfw v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void stw(float* p, vfw v) { std::memcpy(p, &v, sizeof(v)); }
inline vfw splat(float x) { return vfw{} + x; }

// W pool values at p widened to float: float32 as is; bf16 zero-extended and shifted into the high half; fp16 by
// F16C / AVX-512's conversion (exact in every case).
inline vfw ldk(const float* p) { return ldw(p); }
inline vfw ldk(const c10::BFloat16* p) {
  typedef uint16_t vu16w __attribute__((vector_size(W * 2)));
  typedef uint32_t vu32w __attribute__((vector_size(W * 4)));
  vu16w h;
  std::memcpy(&h, p, sizeof(h));
  const vu32w w = __builtin_convertvector(h, vu32w) << 16;
  vfw v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
inline vfw ldk(const c10::Half* p) {
  vfw v;
#if defined(__AVX512F__)
  const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float x[W];
  for (int64_t i = 0; i < W; ++i) x[i] = static_cast<float>(p[i]);
#endif
  std::memcpy(&v, &x, sizeof(v));
  return v;
}
template <typename TK>
inline float tof(TK x) { return static_cast<float>(x); }

inline float hsumw(vfw v) {
#if defined(__AVX512F__)
  vf16 u;
  std::memcpy(&u, &v, sizeof(v));
  return hsum(u);
#else
  __m256 u;
  std::memcpy(&u, &v, sizeof(v));
  return hsum(u);
#endif
}

inline float hmaxw(vfw v) {
  float m = v[0];
  for (int64_t i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}

// exp_approx (cpu_common.h) on W lanes: the same clamp, range reduction and polynomial; n = round-to-nearest-even
// of x log2(e) by adding and subtracting 1.5 * 2^23 (exact for |x log2(e)| < 2^22, which the clamp ensures).
inline vfw exp_w(vfw x) {
  const vfw lo = splat(-87.0f), hi = splat(88.0f), magic = splat(12582912.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vfw n = (x * 1.44269504088896341f + magic) - magic;
  const vfw r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  const vfw p = exp_taylor6(r, splat(1.0f / 720.0f));
  const viw e = (__builtin_convertvector(n, viw) + 127) << 23;
  vfw scale;
  std::memcpy(&scale, &e, sizeof(e));
  return p * scale;
}

// s[g * ls + t] = q_g . k_t for NT tokens and NG heads sharing one KV row per token (q rows at stride D).
template <int NT, int NG, typename TK>
inline void score_tile(const float* q, const TK* const* k, int64_t D, float* s, int64_t ls) {
  vfw acc[NT][NG];
  for (int t = 0; t < NT; ++t)
    for (int g = 0; g < NG; ++g) acc[t][g] = vfw{};
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    vfw kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = ldk(k[t] + d);
    for (int g = 0; g < NG; ++g) {
      const vfw qv = ldw(q + g * D + d);
      for (int t = 0; t < NT; ++t) acc[t][g] += qv * kv[t];
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int g = 0; g < NG; ++g) {
      float r = hsumw(acc[t][g]);
      for (int64_t e = d; e < D; ++e) r += q[g * D + e] * tof(k[t][e]);
      s[g * ls + t] = r;
    }
}

// acc_g[0:Dv] += sum_t p[g * lp + t] * v_t[0:Dv] for NG heads sharing the value rows v_t (t < n): two vectors of
// the row at a time, so each weight broadcast feeds two FMAs.
template <int NG, typename TK>
inline void value_tile(const float* p, int64_t lp, const TK* v, int64_t vstride, int64_t n, int64_t Dv,
                       float* acc) {
  int64_t d = 0;
  for (; d + 2 * W <= Dv; d += 2 * W) {
    vfw a[NG][2];
    for (int g = 0; g < NG; ++g) {
      a[g][0] = ldw(acc + g * Dv + d);
      a[g][1] = ldw(acc + g * Dv + d + W);
    }
    for (int64_t t = 0; t < n; ++t) {
      const vfw v0 = ldk(v + t * vstride + d), v1 = ldk(v + t * vstride + d + W);
      for (int g = 0; g < NG; ++g) {
        const vfw pw = splat(p[g * lp + t]);
        a[g][0] += pw * v0;
        a[g][1] += pw * v1;
      }
    }
    for (int g = 0; g < NG; ++g) {
      stw(acc + g * Dv + d, a[g][0]);
      stw(acc + g * Dv + d + W, a[g][1]);
    }
  }
  for (; d + W <= Dv; d += W) {
    vfw a[NG];
    for (int g = 0; g < NG; ++g) a[g] = ldw(acc + g * Dv + d);
    for (int64_t t = 0; t < n; ++t) {
      const vfw vv = ldk(v + t * vstride + d);
      for (int g = 0; g < NG; ++g) a[g] += splat(p[g * lp + t]) * vv;
    }
    for (int g = 0; g < NG; ++g) stw(acc + g * Dv + d, a[g]);
  }
  for (; d < Dv; ++d)
    for (int64_t t = 0; t < n; ++t)
      for (int g = 0; g < NG; ++g) acc[g * Dv + d] += p[g * lp + t] * tof(v[t * vstride + d]);
}

template <int NT, typename TK>
inline void score_heads(const float* q, const TK* const* k, int64_t D, int64_t ng, float* s, int64_t ls) {
  int64_t g = 0;
  for (; g + 4 <= ng; g += 4) score_tile<NT, 4, TK>(q + g * D, k, D, s + g * ls, ls);
  switch (ng - g) {
    case 3: score_tile<NT, 3, TK>(q + g * D, k, D, s + g * ls, ls); break;
    case 2: score_tile<NT, 2, TK>(q + g * D, k, D, s + g * ls, ls); break;
    case 1: score_tile<NT, 1, TK>(q + g * D, k, D, s + g * ls, ls); break;
    default: break;
  }
}

template <typename TK>
inline void value_heads(const float* p, int64_t lp, const TK* v, int64_t vstride, int64_t n, int64_t Dv,
                        int64_t ng, float* acc) {
  int64_t g = 0;
  for (; g + 4 <= ng; g += 4) value_tile<4>(p + g * lp, lp, v, vstride, n, Dv, acc + g * Dv);
  switch (ng - g) {
    case 3: value_tile<3>(p + g * lp, lp, v, vstride, n, Dv, acc + g * Dv); break;
    case 2: value_tile<2>(p + g * lp, lp, v, vstride, n, Dv, acc + g * Dv); break;
    case 1: value_tile<1>(p + g * lp, lp, v, vstride, n, Dv, acc + g * Dv); break;
    default: break;
  }
}

// Online softmax of one head's block scores s[0:n] (flash-decoding: Milakov & Gimelshein 2018; Dao et al. 2023):
// the running max m and sum l move to the block's max, s becomes the block's weights exp(s - m), and the factor
// that rescales the head's accumulator is returned (0 on the first block: m = -inf, clamped in exp). s has room
// for n rounded up to W; the lanes past n are set to -inf for the max and to 0 among the weights.
inline float softmax_block(float* s, int64_t n, float& m, float& l) {
  const int64_t nw = (n + W - 1) / W * W;
  for (int64_t j = n; j < nw; ++j) s[j] = -std::numeric_limits<float>::infinity();
  vfw mv = splat(m);
  for (int64_t j = 0; j < nw; j += W) {
    const vfw x = ldw(s + j);
    mv = x > mv ? x : mv;
  }
  const float mb = hmaxw(mv);
  const float corr = exp_approx(m - mb);
  const vfw mbv = splat(mb);
  for (int64_t j = 0; j < nw; j += W) stw(s + j, exp_w(ldw(s + j) - mbv));
  // lanes past n: exp of the clamped -87 is ~1.6e-38, not 0; zero them so they add nothing anywhere
  for (int64_t j = n; j < nw; ++j) s[j] = 0.f;
  vfw sum = vfw{};
  for (int64_t j = 0; j < nw; j += W) sum += ldw(s + j);
  const float total = hsumw(sum);
  l = l * corr + total;
  m = mb;
  return corr;
}

// T: q's and out's dtype; TK: the pool's (float32 q over a bf16 / fp16 pool widens the pool's rows as they are read).
template <typename T, typename TK>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                           at::Tensor& out) {
  const DecodeGeometry geo(q, k_cache, v_cache, block_tables);
  const int64_t H = geo.H, D = geo.D, bs = geo.bs, Hk = geo.Hk, Dv = geo.Dv, per_chunk = geo.per_chunk;
  const T* qp = q.data_ptr<T>();
  const TK* kp = k_cache.data_ptr<TK>();
  const TK* vp = v_cache.data_ptr<TK>();
  // MLA: values are the first Dv columns of the key rows (one stream of rows for both).
  const bool shared_kv = vp == kp && geo.vs0 == geo.ks0 && geo.vs1 == geo.ks1 && geo.vs2 == geo.ks2 && Dv <= D;
  const int64_t* btp = block_tables.data_ptr<int64_t>();
  const int64_t* clp = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const int64_t ls = (bs + W - 1) / W * W;  // a head's row of block scores, padded to whole vectors

  at::parallel_for(0, geo.num_items(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(per_chunk * D), s(ls * per_chunk), acc(per_chunk * Dv), m(per_chunk), l(per_chunk);
    std::vector<const TK*> krows(2);
    for (int64_t idx = begin; idx < end; ++idx) {
      const auto it = geo.item(idx);
      const int64_t ng = it.ng, nkv = it.nkv;
      if (ng <= 0) continue;
      const int64_t L = clp[it.b];
      const int64_t* bt = btp + it.b * geo.max_blocks;
      for (int64_t g = 0; g < ng; ++g) {
        load_row(qp + it.b * geo.qs0 + (it.h0 + g) * geo.qs1, qf.data() + g * D, D);
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= fscale;
      }
      std::fill(acc.begin(), acc.begin() + ng * Dv, 0.f);
      std::fill(m.begin(), m.begin() + ng, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + ng, 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += bs) {
        const int64_t n = std::min(bs, L - t0);
        const TK* kb = kp + bt[t0 / bs] * geo.ks0;
        const TK* vb = vp + bt[t0 / bs] * geo.vs0;
        // the next block is somewhere else in the pool: its rows are prefetched per KV head, K as that head's
        // scores start and V as its value products start (as the bf16 kernel, NOTES.md entry 94)
        const bool pf = t0 + bs < L;
        const int64_t nn = pf ? std::min(bs, L - t0 - bs) : 0;
        const TK* kn = pf ? kp + bt[t0 / bs + 1] * geo.ks0 : nullptr;
        const TK* vn = pf ? vp + bt[t0 / bs + 1] * geo.vs0 : nullptr;
        // key row j of KV head kh, read in the pool itself (widened to float in registers)
        const auto krow = [&](int64_t j, int64_t kh) -> const TK* {
          return kb + j * geo.ks1 + (it.kv0 + kh) * geo.ks2;
        };
        for (int64_t kh = 0; kh < nkv; ++kh) {  // scores s[g * ls + j], heads grouped by their KV head
          int64_t ga, gb;
          geo.heads_of(it, kh, ga, gb);
          if (pf) prefetch_rows(kn + (it.kv0 + kh) * geo.ks2, nn, geo.ks1, D);
          int64_t j = 0;
          for (; j + 2 <= n; j += 2) {
            krows[0] = krow(j, kh);
            krows[1] = krow(j + 1, kh);
            score_heads<2>(qf.data() + ga * D, krows.data(), D, gb - ga, s.data() + ga * ls + j, ls);
          }
          if (j < n) {
            krows[0] = krow(j, kh);
            score_heads<1>(qf.data() + ga * D, krows.data(), D, gb - ga, s.data() + ga * ls + j, ls);
          }
        }
        for (int64_t g = 0; g < ng; ++g) {  // scores become weights; the accumulator moves to the new max
          const float corr = softmax_block(s.data() + g * ls, n, m[g], l[g]);
          if (corr != 1.f) {
            float* a = acc.data() + g * Dv;
            for (int64_t d = 0; d < Dv; ++d) a[d] *= corr;
          }
        }
        for (int64_t kh = 0; kh < nkv; ++kh) {
          int64_t ga, gb;
          geo.heads_of(it, kh, ga, gb);
          // value row 0 of KV head kh, rows vstride apart (MLA: a key row's first Dv values)
          const TK* vrows = shared_kv ? kb + (it.kv0 + kh) * geo.ks2 : vb + (it.kv0 + kh) * geo.vs2;
          const int64_t vstride = shared_kv ? geo.ks1 : geo.vs1;
          if (pf && !shared_kv) prefetch_rows(vn + (it.kv0 + kh) * geo.vs2, nn, geo.vs1, Dv);
          value_heads(s.data() + ga * ls, ls, vrows, vstride, n, Dv, gb - ga, acc.data() + ga * Dv);
        }
      }
      for (int64_t g = 0; g < ng; ++g) {
        T* o = op + (it.b * H + it.h0 + g) * Dv;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<T>(acc[g * Dv + d] * inv);
      }
    }
  });
}

}  // namespace

// Declared in cpu_kernels.h: checks the shapes, then the AVX512-BF16 path (bf16, D and Dv multiples of 32) or the
// float32-tile path above (also float32 q over a bf16 / fp16 pool).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_decode_attention: q [B, H, D], "
              "k_cache [NB, bs, Hk, D], v_cache [NB, bs, Hk, Dv] expected");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_decode_attention: the last dimension of q, k_cache and v_cache must be contiguous");
  const auto qt = q.scalar_type(), kt = k_cache.scalar_type();
  TORCH_CHECK(kt == v_cache.scalar_type() &&
                  (qt == kt || (qt == at::kFloat && (kt == at::kBFloat16 || kt == at::kHalf))),
              "paged_decode_attention: q, k_cache and v_cache must share a dtype, or float32 q over a bf16 / fp16 "
              "pool (k_cache and v_cache alike); got q ", qt, ", k_cache ", kt, ", v_cache ", v_cache.scalar_type());
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged_decode_attention: heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "paged_decode_attention: q and k_cache head dims differ");
  auto bt = block_tables.to(at::kLong).contiguous();
  auto cl = context_lens.to(at::kLong).contiguous();
  auto out = at::empty({q.size(0), q.size(1), v_cache.size(3)}, q.options());
#if defined(__AVX512BF16__)
  if (tokenfab_cpu::bf16_dot_allowed() && q.scalar_type() == at::kBFloat16 && q.size(2) % 32 == 0 &&
      v_cache.size(3) % 32 == 0) {
    decode_attention_bf16(q, k_cache, v_cache, bt, cl, scale, out);
    return out;
  }
#endif
  if (qt == at::kBFloat16) {
    decode_attention_impl<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, bt, cl, scale, out);
  } else if (kt == at::kBFloat16) {
    decode_attention_impl<float, c10::BFloat16>(q, k_cache, v_cache, bt, cl, scale, out);
  } else if (kt == at::kHalf) {
    decode_attention_impl<float, c10::Half>(q, k_cache, v_cache, bt, cl, scale, out);
  } else {
    TORCH_CHECK(qt == at::kFloat, "paged_decode_attention: float32 or bfloat16 q expected, got ", qt);
    decode_attention_impl<float, float>(q, k_cache, v_cache, bt, cl, scale, out);
  }
  return out;
}
