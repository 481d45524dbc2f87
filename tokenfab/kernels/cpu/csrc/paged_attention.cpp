// Paged decode attention: one query token per sequence, keys/values read in place from the paged pool.
//
// q [B, H, D]; k_cache [NB, bs, Hk, D] and v_cache [NB, bs, Hk, Dv] (any strides: MLA passes one latent pool as
// both, values being its first Dv columns); block_tables [B, max_blocks] int64; context_lens [B] int64.
// out [B, H, Dv] = softmax(scale * q k^T) v over each sequence's first context_lens[b] tokens.
// Query head h reads KV head h / (H / Hk).
//
// One pass over the context, block by block, with the online softmax of flash-decoding (running max and sum per
// head, Milakov & Gimelshein 2018; Dao et al. 2023): each block's K (and V, unless it is the same latent rows) is
// widened to float once into a tile (bf16 pools; float32 pools are read in place), all of the item's heads are
// scored against it with 2-token x 4-head register blocking in the native vector width (8 or 16 floats), each
// head's block scores go through the softmax as whole vectors (exponential included), and the block's values are
// accumulated. Float32 throughout. Work items: (sequence, chunk of heads);
// heads are split only when there are fewer sequences than threads. The next block is prefetched while one is
// being computed (blocks are scattered in the pool, so the hardware prefetcher cannot follow them).
#include "cpu_isa.h"
#include "cpu_kernels.h"
#include "paged_attention.h"

#include <type_traits>

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
  vfw p = splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const viw e = (__builtin_convertvector(n, viw) + 127) << 23;
  vfw scale;
  std::memcpy(&scale, &e, sizeof(e));
  return p * scale;
}

// s[g * ls + t] = q_g . k_t for NT tokens and NG heads sharing one KV row per token (q rows at stride D).
template <int NT, int NG>
inline void score_tile(const float* q, const float* const* k, int64_t D, float* s, int64_t ls) {
  vfw acc[NT][NG];
  for (int t = 0; t < NT; ++t)
    for (int g = 0; g < NG; ++g) acc[t][g] = vfw{};
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    vfw kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = ldw(k[t] + d);
    for (int g = 0; g < NG; ++g) {
      const vfw qv = ldw(q + g * D + d);
      for (int t = 0; t < NT; ++t) acc[t][g] += qv * kv[t];
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int g = 0; g < NG; ++g) {
      float r = hsumw(acc[t][g]);
      for (int64_t e = d; e < D; ++e) r += q[g * D + e] * k[t][e];
      s[g * ls + t] = r;
    }
}

// acc_g[0:Dv] += sum_t p[g * lp + t] * v_t[0:Dv] for NG heads sharing the value rows v_t (t < n): two vectors of
// the row at a time, so each weight broadcast feeds two FMAs.
template <int NG>
inline void value_tile(const float* p, int64_t lp, const float* v, int64_t vstride, int64_t n, int64_t Dv,
                       float* acc) {
  int64_t d = 0;
  for (; d + 2 * W <= Dv; d += 2 * W) {
    vfw a[NG][2];
    for (int g = 0; g < NG; ++g) {
      a[g][0] = ldw(acc + g * Dv + d);
      a[g][1] = ldw(acc + g * Dv + d + W);
    }
    for (int64_t t = 0; t < n; ++t) {
      const vfw v0 = ldw(v + t * vstride + d), v1 = ldw(v + t * vstride + d + W);
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
      const vfw vv = ldw(v + t * vstride + d);
      for (int g = 0; g < NG; ++g) a[g] += splat(p[g * lp + t]) * vv;
    }
    for (int g = 0; g < NG; ++g) stw(acc + g * Dv + d, a[g]);
  }
  for (; d < Dv; ++d)
    for (int64_t t = 0; t < n; ++t)
      for (int g = 0; g < NG; ++g) acc[g * Dv + d] += p[g * lp + t] * v[t * vstride + d];
}

template <int NT>
inline void score_heads(const float* q, const float* const* k, int64_t D, int64_t ng, float* s, int64_t ls) {
  int64_t g = 0;
  for (; g + 4 <= ng; g += 4) score_tile<NT, 4>(q + g * D, k, D, s + g * ls, ls);
  switch (ng - g) {
    case 3: score_tile<NT, 3>(q + g * D, k, D, s + g * ls, ls); break;
    case 2: score_tile<NT, 2>(q + g * D, k, D, s + g * ls, ls); break;
    case 1: score_tile<NT, 1>(q + g * D, k, D, s + g * ls, ls); break;
    default: break;
  }
}

inline void value_heads(const float* p, int64_t lp, const float* v, int64_t vstride, int64_t n, int64_t Dv,
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

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                           at::Tensor& out) {
  const DecodeGeometry geo(q, k_cache, v_cache, block_tables);
  const int64_t H = geo.H, D = geo.D, bs = geo.bs, Hk = geo.Hk, Dv = geo.Dv, per_chunk = geo.per_chunk;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  // MLA: values are the first Dv columns of the key rows; reuse the widened key tile.
  const bool shared_kv = vp == kp && geo.vs0 == geo.ks0 && geo.vs1 == geo.ks1 && geo.vs2 == geo.ks2 && Dv <= D;
  const int64_t* btp = block_tables.data_ptr<int64_t>();
  const int64_t* clp = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  // float32 pools are read in place (the same values the widened tile held: the same results, without its copy)
  constexpr bool kInPlace = std::is_same_v<T, float>;
  const int64_t ls = (bs + W - 1) / W * W;  // a head's row of block scores, padded to whole vectors

  at::parallel_for(0, geo.num_items(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(per_chunk * D), ktile(kInPlace ? 0 : bs * Hk * D),
        vtile(shared_kv || kInPlace ? 0 : bs * Hk * Dv),
        s(ls * per_chunk), acc(per_chunk * Dv), m(per_chunk), l(per_chunk);
    std::vector<const float*> krows(2);
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
        const T* kb = kp + bt[t0 / bs] * geo.ks0;
        const T* vb = vp + bt[t0 / bs] * geo.vs0;
        if (t0 + bs < L) {  // the next block is somewhere else in the pool
          const int64_t nn = std::min(bs, L - t0 - bs);
          prefetch_rows(kp + bt[t0 / bs + 1] * geo.ks0 + it.kv0 * geo.ks2, nn, geo.ks1, (nkv - 1) * geo.ks2 + D);
          if (!shared_kv)
            prefetch_rows(vp + bt[t0 / bs + 1] * geo.vs0 + it.kv0 * geo.vs2, nn, geo.vs1, (nkv - 1) * geo.vs2 + Dv);
        }
        if constexpr (!kInPlace) {
          for (int64_t j = 0; j < n; ++j)  // widen the block's rows to float once
            for (int64_t kh = 0; kh < nkv; ++kh) {
              load_row(kb + j * geo.ks1 + (it.kv0 + kh) * geo.ks2, ktile.data() + (j * nkv + kh) * D, D);
              if (!shared_kv)
                load_row(vb + j * geo.vs1 + (it.kv0 + kh) * geo.vs2, vtile.data() + (j * nkv + kh) * Dv, Dv);
            }
        }
        // key row j of KV head kh: in the pool itself (float32) or in the widened tile
        const auto krow = [&](int64_t j, int64_t kh) -> const float* {
          if constexpr (kInPlace) return kb + j * geo.ks1 + (it.kv0 + kh) * geo.ks2;
          else return ktile.data() + (j * nkv + kh) * D;
        };
        for (int64_t kh = 0; kh < nkv; ++kh) {  // scores s[g * ls + j], heads grouped by their KV head
          int64_t ga, gb;
          geo.heads_of(it, kh, ga, gb);
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
          const float* vrows;  // value row 0 of KV head kh, rows vstride apart (MLA: a key row's first Dv values)
          int64_t vstride;
          if constexpr (kInPlace) {
            vrows = shared_kv ? kb + (it.kv0 + kh) * geo.ks2 : vb + (it.kv0 + kh) * geo.vs2;
            vstride = shared_kv ? geo.ks1 : geo.vs1;
          } else {
            const int64_t vw = shared_kv ? D : Dv;
            vrows = (shared_kv ? ktile.data() : vtile.data()) + kh * vw;
            vstride = nkv * vw;
          }
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
// float32-tile path above.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_decode_attention: q [B, H, D], "
              "k_cache [NB, bs, Hk, D], v_cache [NB, bs, Hk, Dv] expected");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_decode_attention: the last dimension of q, k_cache and v_cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q, k_cache and v_cache must share a dtype");
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
  DISPATCH_F32_BF16(q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(q, k_cache, v_cache, bt, cl, scale, out);
  });
  return out;
}
