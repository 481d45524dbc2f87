// tokenfab's fused CPU kernels: paged decode attention, RMSNorm, SiLU-GLU and rotary embedding.
//
// Each kernel replaces a chain of small eager-PyTorch ops on the decode hot path (benchmarks/NOTES.md). They are
// built on first use by tokenfab/kernels/cpu_kernels.py (torch.utils.cpp_extension, -O3 -march=native) and checked
// against the PyTorch paths in tests/test_cpu_kernels.py. Elementwise kernels round intermediates to the activation
// dtype in the same order as the PyTorch code they replace (transformers' reference order), so bf16 results match
// those paths bit for bit up to the order of the RMSNorm sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_kernels.h"
#include "gguf_linear.h"
#include "vnni_linear.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// Run the lambda with scalar_t = float or c10::BFloat16 (the dtypes tokenfab computes in on CPU).
#define DISPATCH_F32_BF16(TYPE, NAME, ...)                                              \
  do {                                                                                  \
    if ((TYPE) == at::kFloat) {                                                         \
      using scalar_t = float;                                                           \
      __VA_ARGS__();                                                                    \
    } else if ((TYPE) == at::kBFloat16) {                                               \
      using scalar_t = c10::BFloat16;                                                   \
      __VA_ARGS__();                                                                    \
    } else {                                                                            \
      TORCH_CHECK(false, NAME ": float32 or bfloat16 tensors expected, got ", (TYPE)); \
    }                                                                                   \
  } while (0)

namespace {

#include <cstdint>
#include <cstring>

// Scalar conversions written on the bit patterns so that loops over them vectorize (c10::BFloat16's own
// conversions do not). bf16 -> float is exact; float -> bf16 rounds to nearest even, NaN stays NaN, as c10 does.
inline float bf16_to_f(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

// Per-dtype access: Raw is the storage type read and written in loops.
template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
  using Raw = float;
  static inline float load(float v) { return v; }
  static inline float store(float v) { return v; }
  static inline float round(float v) { return v; }
};
template <>
struct Cvt<c10::BFloat16> {
  using Raw = uint16_t;
  static inline float load(uint16_t v) { return bf16_to_f(v); }
  static inline uint16_t store(float v) { return f_to_bf16(v); }
  static inline float round(float v) { return bf16_to_f(f_to_bf16(v)); }
};

template <typename T>
inline const typename Cvt<T>::Raw* raw(const at::Tensor& t) {
  return reinterpret_cast<const typename Cvt<T>::Raw*>(t.data_ptr<T>());
}
template <typename T>
inline typename Cvt<T>::Raw* raw_mut(at::Tensor& t) {
  return reinterpret_cast<typename Cvt<T>::Raw*>(t.data_ptr<T>());
}

// Round a float to the activation dtype and back (what a PyTorch op in that dtype stores).
template <typename T>
inline float round_to(float x) { return Cvt<T>::round(x); }

// exp(x) for float, branch-free so that loops over it vectorize: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p the
// degree-6 Taylor polynomial (relative error ~2e-7, below float32's own rounding of the result; the callers round
// to bf16 or compare against 1e-6 tolerances). Inputs are clamped to [-87, 88] (exp underflows to ~1e-38 there).
inline float exp_approx(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  const uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// 16 floats in one value (GCC/Clang vector extension: one AVX-512 register, two AVX2 ones elsewhere).
typedef float vf16 __attribute__((vector_size(64)));

inline vf16 loadv(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storev(float* p, vf16 v) { std::memcpy(p, &v, sizeof(v)); }

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

// Horizontal sum by halving (a lane-by-lane loop costs ~16 extracts per call).
inline float hsum(vf16 v) {
  vf8 lo, hi;
  std::memcpy(&lo, &v, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + 32, 32);
  const vf8 s8 = lo + hi;
  vf4 a, b;
  std::memcpy(&a, &s8, 16);
  std::memcpy(&b, reinterpret_cast<const char*>(&s8) + 16, 16);
  const vf4 s4 = a + b;
  return (s4[0] + s4[1]) + (s4[2] + s4[3]);
}

// Dot product with four independent accumulators (a single chain would wait on the FMA latency every step).
inline float dot(const float* a, const float* b, int64_t n) {
  vf16 s0 = {}, s1 = {}, s2 = {}, s3 = {};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    s0 += loadv(a + i) * loadv(b + i);
    s1 += loadv(a + i + 16) * loadv(b + i + 16);
    s2 += loadv(a + i + 32) * loadv(b + i + 32);
    s3 += loadv(a + i + 48) * loadv(b + i + 48);
  }
  for (; i + 16 <= n; i += 16) s0 += loadv(a + i) * loadv(b + i);
  float r = hsum((s0 + s1) + (s2 + s3));
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

// y[0:n] += p * x[0:n]
inline void axpy(float* y, float p, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) storev(y + i, loadv(y + i) + p * loadv(x + i));
  for (; i < n; ++i) y[i] += p * x[i];
}

typedef uint16_t vu16x16 __attribute__((vector_size(32)));
typedef uint32_t vu32x16 __attribute__((vector_size(64)));

// Load n values of dtype T (float or bf16) into float: bf16 widened 16 lanes at a time (zero-extend, shift).
inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const auto* r = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    vu16x16 h;
    std::memcpy(&h, r + i, sizeof(h));
    const vu32x16 w = __builtin_convertvector(h, vu32x16) << 16;
    std::memcpy(dst + i, &w, sizeof(w));
  }
  for (; i < n; ++i) dst[i] = bf16_to_f(r[i]);
}

// ---------------------------------------------------------------------------------------------------------------
// Paged decode attention: one query token per sequence, keys/values read in place from the paged pool.
//
// q [B, H, D]; k_cache [NB, bs, Hk, D] and v_cache [NB, bs, Hk, Dv] (any strides: MLA passes one latent pool as
// both, values being its first Dv columns); block_tables [B, max_blocks] int64; context_lens [B] int64.
// out [B, H, Dv] = softmax(scale * q k^T) v over each sequence's first context_lens[b] tokens.
// Query head h reads KV head h / (H / Hk).
//
// One pass over the context, block by block, with the online softmax of flash-decoding (running max and sum per
// head, Milakov & Gimelshein 2018; Dao et al. 2023): each block's K (and V, unless it is the same latent rows) is
// widened to float once into a tile, all of the item's heads are scored against it with 2-token x 4-head register
// blocking, and the block's values are accumulated. Float32 throughout. Work items: (sequence, chunk of heads);
// heads are split only when there are fewer sequences than threads. The next block is prefetched while one is
// being computed (blocks are scattered in the pool, so the hardware prefetcher cannot follow them).

// s[t * ls + g] = q_g . k_t for NT tokens and NG heads sharing one KV row per token (q rows at stride D).
template <int NT, int NG>
inline void score_tile(const float* q, const float* const* k, int64_t D, float* s, int64_t ls) {
  vf16 acc[NT][NG];
  for (int t = 0; t < NT; ++t)
    for (int g = 0; g < NG; ++g) acc[t][g] = vf16{};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    vf16 kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = loadv(k[t] + d);
    for (int g = 0; g < NG; ++g) {
      const vf16 qv = loadv(q + g * D + d);
      for (int t = 0; t < NT; ++t) acc[t][g] += qv * kv[t];
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int g = 0; g < NG; ++g) {
      float r = hsum(acc[t][g]);
      for (int64_t e = d; e < D; ++e) r += q[g * D + e] * k[t][e];
      s[t * ls + g] = r;
    }
}

// acc_g[0:Dv] += sum_t p[t * lp + g] * v_t[0:Dv] for NG heads sharing the value rows v_t (t < n).
template <int NG>
inline void value_tile(const float* p, int64_t lp, const float* v, int64_t vstride, int64_t n, int64_t Dv,
                       float* acc) {
  int64_t d = 0;
  for (; d + 16 <= Dv; d += 16) {
    vf16 a[NG];
    for (int g = 0; g < NG; ++g) a[g] = loadv(acc + g * Dv + d);
    for (int64_t t = 0; t < n; ++t) {
      const vf16 vv = loadv(v + t * vstride + d);
      for (int g = 0; g < NG; ++g) a[g] += p[t * lp + g] * vv;
    }
    for (int g = 0; g < NG; ++g) storev(acc + g * Dv + d, a[g]);
  }
  for (; d < Dv; ++d)
    for (int64_t t = 0; t < n; ++t)
      for (int g = 0; g < NG; ++g) acc[g * Dv + d] += p[t * lp + g] * v[t * vstride + d];
}

template <int NT>
inline void score_heads(const float* q, const float* const* k, int64_t D, int64_t ng, float* s, int64_t ls) {
  int64_t g = 0;
  for (; g + 4 <= ng; g += 4) score_tile<NT, 4>(q + g * D, k, D, s + g, ls);
  switch (ng - g) {
    case 3: score_tile<NT, 3>(q + g * D, k, D, s + g, ls); break;
    case 2: score_tile<NT, 2>(q + g * D, k, D, s + g, ls); break;
    case 1: score_tile<NT, 1>(q + g * D, k, D, s + g, ls); break;
    default: break;
  }
}

inline void value_heads(const float* p, int64_t lp, const float* v, int64_t vstride, int64_t n, int64_t Dv,
                        int64_t ng, float* acc) {
  int64_t g = 0;
  for (; g + 4 <= ng; g += 4) value_tile<4>(p + g, lp, v, vstride, n, Dv, acc + g * Dv);
  switch (ng - g) {
    case 3: value_tile<3>(p + g, lp, v, vstride, n, Dv, acc + g * Dv); break;
    case 2: value_tile<2>(p + g, lp, v, vstride, n, Dv, acc + g * Dv); break;
    case 1: value_tile<1>(p + g, lp, v, vstride, n, Dv, acc + g * Dv); break;
    default: break;
  }
}

template <typename T>
inline void prefetch_rows(const T* base, int64_t rows, int64_t row_stride, int64_t row_elems) {
  const int64_t bytes = row_elems * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < rows; ++j) {
    const char* r = reinterpret_cast<const char*>(base + j * row_stride);
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(r + o, 0, 1);
  }
}

// Shapes, strides and work split shared by both decode kernels. Work items are (sequence, chunk of query heads,
// split of the context). With fewer sequences than threads, the work is split further: by query heads, or, with
// ``split_context`` and one KV head shared by all query heads (MLA's latent pool), by the context instead
// (flash-decoding): heads split over threads would each stream the same latent rows, while a context split reads
// each row once for all heads; the partial softmax states are merged after (merge_splits).
struct DecodeGeometry {
  int64_t B, H, D, bs, Hk, Dv, G, ks0, ks1, ks2, vs0, vs1, vs2, qs0, qs1, max_blocks, chunks, per_chunk, splits;

  DecodeGeometry(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, bool split_context = false)
      : B(q.size(0)), H(q.size(1)), D(q.size(2)), bs(k_cache.size(1)), Hk(k_cache.size(2)), Dv(v_cache.size(3)),
        G(H / Hk), ks0(k_cache.stride(0)), ks1(k_cache.stride(1)), ks2(k_cache.stride(2)),
        vs0(v_cache.stride(0)), vs1(v_cache.stride(1)), vs2(v_cache.stride(2)), qs0(q.stride(0)),
        qs1(q.stride(1)), max_blocks(block_tables.size(1)) {
    const int64_t threads = at::get_num_threads();
    chunks = 1;
    splits = 1;
    if (split_context && Hk == 1 && B < threads) {
      splits = std::min((threads + B - 1) / B, std::max<int64_t>(max_blocks, 1));
    } else {
      while (B * chunks < threads && chunks < H) chunks *= 2;
    }
    chunks = std::min(chunks, H);
    per_chunk = (H + chunks - 1) / chunks;
  }

  int64_t num_items() const { return B * chunks * splits; }

  // Item idx: sequence b, query heads [h0, h1) (ng of them), reading KV heads [kv0, kv0 + nkv), context split
  // ``split`` of ``splits``.
  struct Item {
    int64_t b, h0, h1, ng, kv0, nkv, split;
  };
  Item item(int64_t idx) const {
    Item it;
    it.split = idx % splits;
    idx /= splits;
    it.b = idx / chunks;
    it.h0 = (idx % chunks) * per_chunk;
    it.h1 = std::min(H, it.h0 + per_chunk);
    it.ng = it.h1 - it.h0;
    it.kv0 = it.h0 / G;
    it.nkv = it.ng > 0 ? (it.h1 - 1) / G + 1 - it.kv0 : 0;
    return it;
  }

  // The item's query heads that read KV head kv0 + kh, as offsets [ga, gb) within the item.
  void heads_of(const Item& it, int64_t kh, int64_t& ga, int64_t& gb) const {
    ga = std::max(it.h0, (it.kv0 + kh) * G) - it.h0;
    gb = std::min(it.h1, (it.kv0 + kh + 1) * G) - it.h0;
  }
};

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

  at::parallel_for(0, geo.num_items(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(per_chunk * D), ktile(bs * Hk * D), vtile(shared_kv ? 0 : bs * Hk * Dv),
        s(bs * per_chunk), acc(per_chunk * Dv), m(per_chunk), l(per_chunk);
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
        for (int64_t j = 0; j < n; ++j)  // widen the block's rows to float once
          for (int64_t kh = 0; kh < nkv; ++kh) {
            load_row(kb + j * geo.ks1 + (it.kv0 + kh) * geo.ks2, ktile.data() + (j * nkv + kh) * D, D);
            if (!shared_kv)
              load_row(vb + j * geo.vs1 + (it.kv0 + kh) * geo.vs2, vtile.data() + (j * nkv + kh) * Dv, Dv);
          }
        for (int64_t kh = 0; kh < nkv; ++kh) {  // scores s[j * ng + g], heads grouped by their KV head
          int64_t ga, gb;
          geo.heads_of(it, kh, ga, gb);
          int64_t j = 0;
          for (; j + 2 <= n; j += 2) {
            krows[0] = ktile.data() + (j * nkv + kh) * D;
            krows[1] = ktile.data() + ((j + 1) * nkv + kh) * D;
            score_heads<2>(qf.data() + ga * D, krows.data(), D, gb - ga, s.data() + j * ng + ga, ng);
          }
          if (j < n) {
            krows[0] = ktile.data() + (j * nkv + kh) * D;
            score_heads<1>(qf.data() + ga * D, krows.data(), D, gb - ga, s.data() + j * ng + ga, ng);
          }
        }
        // online softmax (flash-decoding): rescale the running sums to the new maximum, scores become weights
        for (int64_t g = 0; g < ng; ++g) {
          float mb = m[g];
          for (int64_t j = 0; j < n; ++j) mb = std::max(mb, s[j * ng + g]);
          const float corr = exp_approx(m[g] - mb);  // 0 on the first block (m = -inf, clamped)
          float sum = 0.f;
          for (int64_t j = 0; j < n; ++j) {
            const float e = exp_approx(s[j * ng + g] - mb);
            s[j * ng + g] = e;
            sum += e;
          }
          if (corr != 1.f) {
            float* a = acc.data() + g * Dv;
            for (int64_t d = 0; d < Dv; ++d) a[d] *= corr;
          }
          l[g] = l[g] * corr + sum;
          m[g] = mb;
        }
        const float* vt = shared_kv ? ktile.data() : vtile.data();
        const int64_t vw = shared_kv ? D : Dv;
        for (int64_t kh = 0; kh < nkv; ++kh) {
          int64_t ga, gb;
          geo.heads_of(it, kh, ga, gb);
          value_heads(s.data() + ga, ng, vt + kh * vw, nkv * vw, n, Dv, gb - ga, acc.data() + ga * Dv);
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

void decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                           at::Tensor& out) {
  const DecodeGeometry geo(q, k_cache, v_cache, block_tables, /*split_context=*/true);
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
        if (t0 + bs < t_end) {
          const int64_t nn = std::min(bs, L - t0 - bs);
          prefetch_rows(kp + bt[t0 / bs + 1] * geo.ks0 + it.kv0 * geo.ks2, nn, geo.ks1, (it.nkv - 1) * geo.ks2 + D);
          if (vp != kp) prefetch_rows(vp + bt[t0 / bs + 1] * geo.vs0 + it.kv0 * geo.vs2, nn, geo.vs1, (it.nkv - 1) * geo.vs2 + Dv);
        }
        if (bs == 16) {  // one vector per head and block: scores, online softmax and bf16 weights in 16 lanes
          const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
          for (int64_t kh = 0; kh < it.nkv; ++kh) {
            int64_t ga, gb;
            geo.heads_of(it, kh, ga, gb);
            const uint16_t* kk = kb + (it.kv0 + kh) * geo.ks2;
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
#endif  // __AVX512BF16__

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
  if (q.scalar_type() == at::kBFloat16 && q.size(2) % 32 == 0 && v_cache.size(3) % 32 == 0) {
    decode_attention_bf16(q, k_cache, v_cache, bt, cl, scale, out);
    return out;
  }
#endif
  DISPATCH_F32_BF16(q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(q, k_cache, v_cache, bt, cl, scale, out);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// RMSNorm in transformers' order: y = w * T(x * rsqrt(mean(x^2) + eps)), statistics in float32.
// x [N, hidden] (rows may be strided, last dim contiguous), weight [hidden] in x's dtype -> [N, hidden].
// With ``residual`` (same shape): r = T(x + residual) is returned as well and normalised instead of x.
template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& w, double eps,
                   at::Tensor& out, at::Tensor* res_out) {
  using C = Cvt<T>;
  const int64_t N = x.size(0), Hd = x.size(1);
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  const auto* xp = raw<T>(x);
  const auto* rp = residual ? raw<T>(*residual) : nullptr;
  const auto* wp = raw<T>(w);
  auto* op = raw_mut<T>(out);
  auto* rop = res_out ? raw_mut<T>(*res_out) : nullptr;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(Hd, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> h(Hd), wf(Hd);
    for (int64_t i = 0; i < Hd; ++i) wf[i] = C::load(wp[i]);
    for (int64_t n = begin; n < end; ++n) {
      const auto* xr = xp + n * xs;
      if (rp) {
        const auto* rr = rp + n * rs;
        auto* ro = rop + n * Hd;
#pragma omp simd
        for (int64_t i = 0; i < Hd; ++i) {
          ro[i] = C::store(C::load(xr[i]) + C::load(rr[i]));
          h[i] = C::load(ro[i]);
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < Hd; ++i) h[i] = C::load(xr[i]);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < Hd; ++i) ss += h[i] * h[i];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(Hd) + static_cast<float>(eps));
      auto* o = op + n * Hd;
#pragma omp simd
      for (int64_t i = 0; i < Hd; ++i) o[i] = C::store(wf[i] * C::round(h[i] * r));
    }
  });
}

}  // namespace

// Declared in cpu_kernels.h (decode_stack.cpp calls it).
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                 const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [N, hidden] with a contiguous last dim");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: weight must be a contiguous [hidden] tensor in x's dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  at::Tensor res_out;
  const at::Tensor* rptr = nullptr;
  at::Tensor r;
  if (residual.has_value()) {
    r = *residual;
    TORCH_CHECK(r.sizes() == x.sizes() && r.stride(1) == 1 && r.scalar_type() == x.scalar_type(),
                "rms_norm: residual must match x");
    rptr = &r;
    res_out = at::empty({x.size(0), x.size(1)}, x.options());
  }
  DISPATCH_F32_BF16(x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x, rptr, weight, eps, out, rptr ? &res_out : nullptr);
  });
  if (rptr) return {out, res_out};
  return {out};
}

namespace {

// ---------------------------------------------------------------------------------------------------------------
// SiLU-GLU: x [N, 2I] laid out [gate | up] -> T(T(silu(gate)) * up) [N, I] (PyTorch's rounding order).
template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  using C = Cvt<T>;
  const int64_t N = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  const auto* xp = raw<T>(x);
  auto* op = raw_mut<T>(out);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const auto* g = xp + n * xs;
      const auto* u = g + I;
      auto* o = op + n * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float gv = C::load(g[i]);
        const float s = C::round(gv / (1.f + exp_approx(-gv)));
        o[i] = C::store(s * C::load(u[i]));
      }
    }
  });
}

}  // namespace

// Declared in cpu_kernels.h.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [N, 2I] with a contiguous last dim");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  DISPATCH_F32_BF16(x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(x, out);
  });
  return out;
}

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Rotary embedding of x [T, H, dim] (last dim contiguous, any other strides) at positions [T] with float32
// cos/sin tables [P, dim/2] -> new contiguous [T, H, dim]. cos/sin are rounded to x's dtype first and every product
// and sum rounded in x's dtype, as transformers' apply_rotary_pos_emb does. interleave: pairs (2i, 2i+1) as in
// DeepSeek-V3's interleaved layout, output [even rotated | odd rotated] (halves); else pairs (i, i + dim/2).
template <typename T>
void rope_impl(const at::Tensor& x, const at::Tensor& pos, const at::Tensor& cos, const at::Tensor& sin,
               bool interleave, at::Tensor& out) {
  using C = Cvt<T>;
  const int64_t Tn = x.size(0), H = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  const auto* xp = raw<T>(x);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  auto* op = raw_mut<T>(out);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(H * dim, 1));
  at::parallel_for(0, Tn, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> cr(half), sr(half), x1(half), x2(half);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pp[t] * half;
      const float* s = sp + pp[t] * half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        cr[i] = C::round(c[i]);
        sr[i] = C::round(s[i]);
      }
      for (int64_t h = 0; h < H; ++h) {
        const auto* xr = xp + t * xs0 + h * xs1;
        auto* o = op + (t * H + h) * dim;
        if (interleave) {
          for (int64_t i = 0; i < half; ++i) {
            x1[i] = C::load(xr[2 * i]);
            x2[i] = C::load(xr[2 * i + 1]);
          }
        } else {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            x1[i] = C::load(xr[i]);
            x2[i] = C::load(xr[i + half]);
          }
        }
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          o[i] = C::store(C::round(x1[i] * cr[i]) - C::round(x2[i] * sr[i]));
          o[i + half] = C::store(C::round(x2[i] * cr[i]) + C::round(x1[i] * sr[i]));
        }
      }
    }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                bool interleave) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rope: x must be [T, H, dim] with a contiguous last dim and an even dim");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(1) == x.size(2) / 2, "rope: cos/sin must be contiguous float32 [P, dim/2]");
  auto pos = positions.to(at::kLong).contiguous();
  auto out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  DISPATCH_F32_BF16(x.scalar_type(), "rope", [&] {
    rope_impl<scalar_t>(x, pos, cos, sin, interleave, out);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Causal softmax of prefill attention scores, in place: s [B, Hx, R, L] (contiguous) holds q k^T for R query rows
// per (sequence, head group); row r is query r % q_len of sequence b, at absolute position query_pos[b, r % q_len]
// (-1 for padding). Key j is visible when j <= that position (padding rows see key 0 only, as causal_mask does).
// Each row becomes softmax(scale * s) over its visible keys (zeros elsewhere) in float32, stored in s's dtype:
// the float conversion, scale, mask add, softmax and cast of the eager path in one pass.
template <typename T>
void causal_softmax_impl(at::Tensor& s, const at::Tensor& qpos, int64_t q_len, double scale) {
  using C = Cvt<T>;
  const int64_t B = s.size(0), Hx = s.size(1), R = s.size(2), L = s.size(3);
  auto* sp = raw_mut<T>(s);
  const int64_t* pp = qpos.data_ptr<int64_t>();
  const int64_t qs = qpos.size(1);
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, B * Hx * R, std::max<int64_t>(1, 8192 / std::max<int64_t>(L, 1)), [&](int64_t begin,
                                                                                             int64_t end) {
    std::vector<float> row(L);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / (Hx * R), r = idx % R;
      const int64_t n = std::min(L, std::max<int64_t>(pp[b * qs + r % q_len], 0) + 1);  // visible keys
      auto* x = sp + idx * L;
      float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < n; ++j) {
        row[j] = C::load(x[j]) * fscale;
        m = std::max(m, row[j]);
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        row[j] = exp_approx(row[j] - m);
        sum += row[j];
      }
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) x[j] = C::store(row[j] * inv);
      const auto zero = C::store(0.f);
      for (int64_t j = n; j < L; ++j) x[j] = zero;
    }
  });
}

void causal_softmax_(at::Tensor& s, const at::Tensor& query_pos, int64_t q_len, double scale) {
  TORCH_CHECK(s.dim() == 4 && s.is_contiguous(), "causal_softmax_: s must be a contiguous [B, Hx, R, L] tensor");
  TORCH_CHECK(query_pos.dim() == 2 && query_pos.size(0) == s.size(0) && q_len >= 1 && q_len <= query_pos.size(1)
              && s.size(2) % q_len == 0, "causal_softmax_: query_pos must be [B, >= q_len] and R a multiple of q_len");
  auto qp = query_pos.to(at::kLong).contiguous();
  DISPATCH_F32_BF16(s.scalar_type(), "causal_softmax_", [&] { causal_softmax_impl<scalar_t>(s, qp, q_len, scale); });
}

}  // namespace


// ---------------------------------------------------------------------------------------------------------------
// Per-head GEMM for MLA's absorbed decode: y[b, g, :] = x[b, g, :] W_g for every head g, i.e. the two small
// batched matmuls q_nope W_UK (K = qk_nope_head_dim, N = kv_lora_rank) and o_lat W_UV (K = kv_lora_rank,
// N = v_head_dim). W is packed once per layer in the VNNI pair layout wp[g, k / 2, n, 2] (the two k values of a
// pair side by side), so one `vdpbf16ps` of a broadcast (x[2k'], x[2k' + 1]) pair against 32 packed values adds two
// products to 16 outputs: no horizontal reductions. Register tile: up to 4 rows x 64 outputs (16 accumulators).
// Float32 accumulation, one rounding to bf16 per output (what a bf16 `bmm` stores). y may be a strided view (e.g.
// the first N columns of the concatenated [q_lat | q_rope] buffer).
#if defined(__AVX512BF16__)
template <int BB, int NV>
inline void head_gemm_tile(const uint16_t* x, int64_t xs0, const uint16_t* w, int64_t N, int64_t K2, uint16_t* y,
                           int64_t ys0, int64_t nvalid) {
  __m512 acc[BB][NV];
  for (int i = 0; i < BB; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512bh wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + (kp * N + 16 * v) * 2);
    for (int i = 0; i < BB; ++i) {
      uint32_t pair;
      std::memcpy(&pair, x + i * xs0 + 2 * kp, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xb, wv[v]);
    }
  }
  // outputs past nvalid (the zero padding of N to a multiple of 16) are not stored
  const int64_t rem = nvalid - 16 * (NV - 1);
  const __mmask16 last = rem >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rem) - 1u);
  for (int i = 0; i < BB; ++i)
    for (int v = 0; v < NV; ++v) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(acc[i][v]);
      if (v + 1 < NV) _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * ys0 + 16 * v), h);
      else _mm256_mask_storeu_epi16(y + i * ys0 + 16 * v, last, h);
    }
}

template <int BB>
inline void head_gemm_rows(const uint16_t* x, int64_t xs0, const uint16_t* w, int64_t N, int64_t K2, uint16_t* y,
                           int64_t ys0, int64_t nv, int64_t nvalid) {
  switch (nv) {
    case 4: head_gemm_tile<BB, 4>(x, xs0, w, N, K2, y, ys0, nvalid); break;
    case 3: head_gemm_tile<BB, 3>(x, xs0, w, N, K2, y, ys0, nvalid); break;
    case 2: head_gemm_tile<BB, 2>(x, xs0, w, N, K2, y, ys0, nvalid); break;
    default: head_gemm_tile<BB, 1>(x, xs0, w, N, K2, y, ys0, nvalid); break;
  }
}
#endif

void head_gemm_(const at::Tensor& x, const at::Tensor& wp, at::Tensor& y) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 3 && wp.dim() == 4 && y.dim() == 3 && wp.size(3) == 2, "head_gemm_: x [B, G, K], "
              "wp [G, K/2, Np, 2] (Np = N rounded up to 16), y [B, G, N] expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16 &&
              y.scalar_type() == at::kBFloat16, "head_gemm_: bfloat16 tensors expected");
  const int64_t B = x.size(0), G = x.size(1), K = x.size(2), N = wp.size(2), K2 = wp.size(1), Ny = y.size(2);
  TORCH_CHECK(wp.size(0) == G && 2 * K2 == K && y.size(0) == B && y.size(1) == G && N % 16 == 0 &&
              N == (Ny + 15) / 16 * 16, "head_gemm_: shapes do not match (K even, packed N = y's N rounded up to 16)");
  TORCH_CHECK(x.stride(2) == 1 && y.stride(2) == 1 && wp.is_contiguous(), "head_gemm_: last dims must be contiguous");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wpp = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), ys0 = y.stride(0), ys1 = y.stride(1);
  const int64_t tiles = (N + 63) / 64;
  at::parallel_for(0, G * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t g = it / tiles, n0 = (it % tiles) * 64, nv = std::min<int64_t>(64, N - n0) / 16;
      const int64_t nvalid = std::min<int64_t>(64, Ny - n0);
      const uint16_t* w = wpp + (g * K2 * N + n0) * 2;
      for (int64_t b0 = 0; b0 < B; b0 += 4) {
        const uint16_t* xr = xp + b0 * xs0 + g * xs1;
        uint16_t* yr = yp + b0 * ys0 + g * ys1 + n0;
        switch (std::min<int64_t>(4, B - b0)) {
          case 4: head_gemm_rows<4>(xr, xs0, w, N, K2, yr, ys0, nv, nvalid); break;
          case 3: head_gemm_rows<3>(xr, xs0, w, N, K2, yr, ys0, nv, nvalid); break;
          case 2: head_gemm_rows<2>(xr, xs0, w, N, K2, yr, ys0, nv, nvalid); break;
          default: head_gemm_rows<1>(xr, xs0, w, N, K2, yr, ys0, nv, nvalid); break;
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "head_gemm_ needs AVX512-BF16 (has_bf16_dot is False)");
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// The paged cache write of the decode blocks below (what write_cache's index_copy_ does): slot_mapping as int64,
// every slot checked against the pool, then per token its bf16 values copied to cache row slot, columns col.. on.
at::Tensor checked_slots(const at::Tensor& slot_mapping, const at::Tensor& cache, const char* who) {
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t nslots = cache.size(0) * cache.size(1);
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, who, ": slot ", sp[t], " outside the cache");
  return slots;
}

// cache [blocks, block_size, ...] contiguous bf16; rows [T, ...] bf16 (any strides), W values per token.
void write_slots(at::Tensor& cache, const at::Tensor& slots, int64_t col, const at::Tensor& rows) {
  const int64_t T = slots.numel(), row = cache.numel() / (cache.size(0) * cache.size(1));
  const auto r = rows.reshape({T, -1}).contiguous();
  const int64_t W = r.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  auto* cp = reinterpret_cast<uint16_t*>(cache.data_ptr());
  const auto* rp = reinterpret_cast<const uint16_t*>(r.data_ptr());
  for (int64_t t = 0; t < T; ++t) std::memcpy(cp + sp[t] * row + col, rp + t * W, W * 2);
}

// ---------------------------------------------------------------------------------------------------------------
// MLA attention for a decode-only batch in one call: the ~25 Python-level ops of MLAttention.forward's absorbed
// decode (tokenfab/layers/mla.py) between x and o_proj, on the same kernels in the same order, so the output and the
// cache rows written are bit-identical to that path. Python dispatch was ~180 us of the ~410 us a layer took at
// batch 1 on the 2-core VM (benchmarks/NOTES.md entry 33).
//   a = x Wqkv_a^T -> [q_a | c_kv | k_rope]; q = rms(q_a) Wq_b^T -> [T, H, nope + R]; c_kv = rms(c_kv);
//   q_rope, k_rope = rope(.); cache[slot] = [c_kv | k_rope]; q_lat = [q_nope W_UK | q_rope];
//   o_lat = paged attention over the latent cache (values = its first C columns); o = (o_lat W_UV) Wo^T.
// Weights: qkv_a, q_b, o_proj from pack_linear_weight; w_uk, w_uv_t from pack_head_weights; norm weights [q_lora],
// [C] bf16. dims = {q_lora, C, R, H, nope, v, hidden}.
at::Tensor mla_decode(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping,
                      at::Tensor& cache, const at::Tensor& block_tables, const at::Tensor& context_lens,
                      const std::vector<at::Tensor>& w, const std::vector<int64_t>& dims, const at::Tensor& cos,
                      const at::Tensor& sin, bool interleave, double eps_q, double eps_kv, double scale) {
  TORCH_CHECK(w.size() == 7 && dims.size() == 7, "mla_decode: 7 weights and 7 dims expected");
  const int64_t q_lora = dims[0], C = dims[1], R = dims[2], H = dims[3], nope = dims[4], vd = dims[5],
                hidden = dims[6], T = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && cache.scalar_type() == at::kBFloat16 &&
              cache.dim() == 3 && cache.size(2) == C + R && cache.is_contiguous(),
              "mla_decode: bf16 x [T, hidden] and a contiguous bf16 latent cache [blocks, block_size, C + R]");
  TORCH_CHECK(slot_mapping.numel() == T && positions.numel() == T && block_tables.size(0) == T,
              "mla_decode: one decode token per sequence expected");
  const auto a = vnni_linear(x, w[0], q_lora + C + R, std::nullopt);  // [T, q_lora + C + R]
  const auto q_a = a.slice(1, 0, q_lora);
  const auto q = vnni_linear(rms_norm(q_a, std::nullopt, w[1], eps_q)[0], w[3], H * (nope + R), std::nullopt)
                     .view({T, H, nope + R});
  const auto c_kv = rms_norm(a.slice(1, q_lora, q_lora + C), std::nullopt, w[2], eps_kv)[0];  // [T, C]
  const auto q_rope = rope(q.slice(2, nope, nope + R), positions, cos, sin, interleave);     // [T, H, R]
  const auto k_rope = rope(a.slice(1, q_lora + C, q_lora + C + R).unsqueeze(1), positions, cos, sin, interleave);
  const auto slots = checked_slots(slot_mapping, cache, "mla_decode");
  write_slots(cache, slots, 0, c_kv);  // the cache row is [c_kv | k_rope]
  write_slots(cache, slots, C, k_rope);
  auto q_lat = at::empty({T, H, C + R}, x.options());
  auto q_lat_c = q_lat.slice(2, 0, C);
  head_gemm_(q.slice(2, 0, nope), w[4], q_lat_c);
  q_lat.slice(2, C, C + R).copy_(q_rope);
  const auto lat = cache.unsqueeze(2);  // [blocks, block_size, 1, C + R]: one latent "head", values = first C
  const auto o_lat = paged_decode_attention(q_lat, lat, lat.slice(3, 0, C), block_tables, context_lens, scale);
  auto o = at::empty({T, H, vd}, x.options());
  head_gemm_(o_lat, w[5], o);
  return vnni_linear(o.view({T, H * vd}), w[6], hidden, std::nullopt);
}

// ---------------------------------------------------------------------------------------------------------------
// Grouped-query attention for a decode-only batch in one call (Llama / Qwen3 LlamaAttention.forward, layers in
// tokenfab/models/llama.py): fused q|k|v GEMM, optional per-head q/k RMSNorm (Qwen3), RoPE, k/v cache writes,
// paged decode attention, o_proj; the same kernels in the same order as the Python path (bit-identical).
// w = {qkv (pack_linear_weight), o_proj, [q_norm, k_norm]}; biases = {qkv bias or undefined, o_proj bias or
// undefined}; dims = {H, Hk, D, hidden}.
at::Tensor gqa_decode(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, const std::vector<at::Tensor>& w,
                      const std::vector<c10::optional<at::Tensor>>& biases, const std::vector<int64_t>& dims,
                      const at::Tensor& cos, const at::Tensor& sin, bool interleave, double eps, double scale) {
  TORCH_CHECK((w.size() == 2 || w.size() == 4) && biases.size() == 2 && dims.size() == 4,
              "gqa_decode: weights {qkv, o_proj[, q_norm, k_norm]}, 2 biases and 4 dims expected");
  const int64_t H = dims[0], Hk = dims[1], D = dims[2], hidden = dims[3], T = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.dim() == 4 && k_cache.size(2) == Hk && k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes(),
              "gqa_decode: bf16 x [T, hidden] and contiguous bf16 caches [blocks, block_size, Hk, D] expected");
  TORCH_CHECK(slot_mapping.numel() == T && positions.numel() == T && block_tables.size(0) == T,
              "gqa_decode: one decode token per sequence expected");
  const auto qkv = vnni_linear(x, w[0], (H + 2 * Hk) * D, biases[0]);  // [T, (H + 2 Hk) D]
  auto q = qkv.slice(1, 0, H * D).view({T, H, D});
  auto k = qkv.slice(1, H * D, (H + Hk) * D).view({T, Hk, D});
  const auto v = qkv.slice(1, (H + Hk) * D, (H + 2 * Hk) * D).view({T, Hk, D});
  if (w.size() == 4) {  // Qwen3: RMSNorm over each head's D values
    q = rms_norm(q.reshape({-1, D}), std::nullopt, w[2], eps)[0].view({T, H, D});
    k = rms_norm(k.reshape({-1, D}), std::nullopt, w[3], eps)[0].view({T, Hk, D});
  }
  const auto q_rot = rope(q, positions, cos, sin, interleave);
  const auto k_rot = rope(k, positions, cos, sin, interleave);
  const auto slots = checked_slots(slot_mapping, k_cache, "gqa_decode");
  write_slots(k_cache, slots, 0, k_rot);
  write_slots(v_cache, slots, 0, v);
  const auto o = paged_decode_attention(q_rot, k_cache, v_cache, block_tables, context_lens, scale);  // [T, H, D]
  return vnni_linear(o.view({T, H * D}), w[1], hidden, biases[1]);
}

// ---------------------------------------------------------------------------------------------------------------
// Routed experts with packed weights (tokenfab's VNNI blocks, vnni_linear.cpp, or oneDNN's): the whole token ->
// expert dispatch in one call (the Python version spent ~230 us per MoE layer at batch 1 on ~25 small ops around its
// 4 GEMMs, benchmarks/NOTES.md). Same arithmetic and order as RoutedExperts.forward's packed path: (token, slot)
// pairs grouped by expert in increasing expert id (stable within an expert), per expert one packed GEMM [n, H] ->
// [n, 2I], SiLU-GLU, one packed GEMM -> [n, H]; each row scaled by its float32 routing weight and rounded to bf16,
// then summed per token in that order in float32 and rounded once
// (what `out.index_add_(0, token_of, (h * w).to(bf16))` does on CPU).
// With VNNI weights the experts' GEMMs go through vnni_linear_group: all experts' gate_up GEMVs in one parallel
// region, then all down GEMVs in one (decode: T * k pairs over few experts), with a shared expert (shared_gate_up,
// shared_down: packed [2I_s, H] and [H, I_s], no bias) in the same two regions; the result is then
// `routed + shared` rounded as a bf16 tensor add rounds (DeepseekV3MoE.forward's order).
at::Tensor moe_experts_packed(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                              const std::vector<at::Tensor>& p13, const std::vector<at::Tensor>& p2, int64_t start,
                              const c10::optional<at::Tensor>& shared_gate_up,
                              const c10::optional<at::Tensor>& shared_down) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && ids.dim() == 2 && weights.sizes() == ids.sizes() &&
              ids.size(0) == x.size(0) && p13.size() == p2.size(), "moe_experts_packed: x [T, H] bf16, weights / ids "
              "[T, k], one packed gate_up and down weight per local expert expected");
  const bool shared = shared_gate_up.has_value() && shared_gate_up->defined();
  TORCH_CHECK(shared == (shared_down.has_value() && shared_down->defined()) &&
              (!shared || (shared_gate_up->dim() == 4 && shared_down->dim() == 4)),
              "moe_experts_packed: a shared expert needs both its gate_up and down weights, VNNI-packed");
  static const auto linear = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  const auto xc = x.contiguous();
  const auto idc = ids.to(at::kLong).contiguous();
  const auto wc = weights.to(at::kFloat).contiguous();
  const int64_t T = xc.size(0), H = xc.size(1), k = idc.size(1), E = static_cast<int64_t>(p13.size());
  const int64_t* idp = idc.data_ptr<int64_t>();
  const float* wp = wc.data_ptr<float>();
  std::vector<std::vector<int64_t>> pairs(E);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t e = idp[p] - start;
    if (e >= 0 && e < E) pairs[e].push_back(p);
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  std::vector<int64_t> active;  // local experts with pairs, in increasing id
  std::vector<at::Tensor> xs;   // their gathered rows
  for (int64_t e = 0; e < E; ++e) {
    const auto& pe = pairs[e];
    const int64_t n = static_cast<int64_t>(pe.size());
    if (n == 0) continue;
    auto xe = at::empty({n, H}, xc.options());
    auto* xsp = reinterpret_cast<uint16_t*>(xe.data_ptr());
    for (int64_t i = 0; i < n; ++i) std::memcpy(xsp + i * H, xp + (pe[i] / k) * H, H * sizeof(uint16_t));
    active.push_back(e);
    xs.push_back(xe);
  }
  const bool vnni = std::all_of(active.begin(), active.end(), [&](int64_t e) { return p13[e].dim() == 4; });
  std::vector<at::Tensor> hs;  // per active expert [n, H], then (with a shared expert) the shared output [T, H]
  if (vnni) {  // gate_up GEMVs of every expert (and the shared one) in one region, then every down GEMV in one
    std::vector<at::Tensor> w13, w2;
    std::vector<int64_t> n13, n2;
    for (int64_t e : active) {
      w13.push_back(p13[e]), w2.push_back(p2[e]);
      n13.push_back(p2[e].size(1) * 4), n2.push_back(H);  // gate_up [2I, H]: 2I = 2 * (down's K = 2 * K/2)
    }
    if (shared) {
      xs.push_back(xc);
      w13.push_back(*shared_gate_up), w2.push_back(*shared_down);
      n13.push_back(shared_down->size(1) * 4), n2.push_back(H);
    }
    auto h13 = vnni_linear_group(xs, w13, n13);
    for (auto& h : h13) h = silu_and_mul(h);
    hs = vnni_linear_group(h13, w2, n2);
  } else {
    TORCH_CHECK(!shared, "moe_experts_packed: a shared expert needs VNNI-packed routed experts");
    const c10::List<std::optional<at::Scalar>> no_scalars;
    for (size_t i = 0; i < active.size(); ++i) {
      const int64_t e = active[i];
      const auto h13 = linear.call(xs[i], p13[e], std::nullopt, "none", no_scalars, std::string_view(""));
      hs.push_back(
          linear.call(silu_and_mul(h13), p2[e], std::nullopt, "none", no_scalars, std::string_view("")).contiguous());
    }
  }
  std::vector<float> acc(T * H, 0.f);  // index_add_ on bf16 sums in float32 and rounds once
  for (size_t i = 0; i < active.size(); ++i) {
    const auto& pe = pairs[active[i]];
    const auto* hp = reinterpret_cast<const uint16_t*>(hs[i].data_ptr());
    for (size_t r = 0; r < pe.size(); ++r) {
      float* a = acc.data() + (pe[r] / k) * H;
      const uint16_t* hr = hp + r * H;
      const float w = wp[pe[r]];
      for (int64_t c = 0; c < H; ++c) a[c] += bf16_to_f(f_to_bf16(bf16_to_f(hr[c]) * w));
    }
  }
  auto out = at::empty_like(xc);
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (shared) {  // bf16 routed sum + bf16 shared output, rounded once more (a bf16 tensor add)
    const auto* sp = reinterpret_cast<const uint16_t*>(hs.back().data_ptr());
    for (int64_t i = 0; i < T * H; ++i) op[i] = f_to_bf16(bf16_to_f(f_to_bf16(acc[i])) + bf16_to_f(sp[i]));
    return out;
  }
  for (int64_t i = 0; i < T * H; ++i) op[i] = f_to_bf16(acc[i]);
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Sampling without top-k / top-p in one pass per row (tokenfab/engine/sampler.py): row i at temperature t_i draws
// the first index j with cdf_j > u_i * cdf_{V-1} (capped just below the total) over p_j = exp(x_j / t_i - max), the
// cumulative sum in float64, as inverse_cdf_sample does over softmax(x / t) (dividing by the sum does not move the
// draw). Rows with t_i < 1e-5 take the first argmax. -inf logits get probability 0 exactly (never drawn).
at::Tensor sample_plain(const at::Tensor& logits, const at::Tensor& temps, const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && temps.scalar_type() == at::kFloat &&
              temps.numel() == logits.size(0) && u.numel() == logits.size(0),
              "sample_plain: logits [N, V] float32, temps [N] float32 and u [N] expected");
  const auto lc = logits.contiguous();
  const auto tc = temps.contiguous();
  const auto uc = u.to(at::kDouble).contiguous();
  const int64_t N = lc.size(0), V = lc.size(1);
  auto out = at::empty({N}, lc.options().dtype(at::kLong));
  const float* lp = lc.data_ptr<float>();
  const float* tp = tc.data_ptr<float>();
  const double* up = uc.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(V);
    for (int64_t i = begin; i < end; ++i) {
      const float* x = lp + i * V;
      int64_t best = 0;
      for (int64_t j = 1; j < V; ++j)
        if (x[j] > x[best]) best = j;
      const float t = tp[i];
      if (t < 1e-5f) {
        op[i] = best;
        continue;
      }
      const float inv = 1.0f / t, m = x[best] * inv;
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) p[j] = exp_approx(x[j] * inv - m);
      for (int64_t j = 0; j < V; ++j)
        if (x[j] == -std::numeric_limits<float>::infinity()) p[j] = 0.f;
      double total = 0.0;
      for (int64_t j = 0; j < V; ++j) total += p[j];
      const double target = std::min(up[i] * total, std::nextafter(total, 0.0));
      double c = 0.0;
      int64_t pick = best;
      for (int64_t j = 0; j < V; ++j) {
        c += p[j];
        if (c > target) {
          pick = j;
          break;
        }
      }
      op[i] = pick;
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// DeepSeek-V3 / Kimi-K2 router (noaux_tc) after its float32 logits, one row per token: scores = sigmoid(logits);
// choice = scores + bias; groups ranked by the sum of their top-2 choice scores and the best topk_group kept; the
// top_k experts of the kept groups by choice score; weights = the unbiased scores of those experts, divided by
// their sum (+1e-20) when norm, times scale. Replaces ~13 small ops of SigmoidGroupRouter.forward (transformers'
// DeepseekV3TopkRouter order); ties go to the lower index.
std::vector<at::Tensor> sigmoid_group_topk(const at::Tensor& logits, const at::Tensor& bias, int64_t n_group,
                                           int64_t topk_group, int64_t top_k, bool norm, double scale) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat &&
              bias.numel() == logits.size(1), "sigmoid_group_topk: logits [T, E] and bias [E] float32 expected");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group && top_k >= 1 &&
              top_k <= (E / n_group) * (n_group > 1 ? topk_group : 1), "sigmoid_group_topk: bad group / top-k sizes");
  const auto lc = logits.contiguous();
  const auto bc = bias.contiguous();
  auto w = at::empty({T, top_k}, lc.options());
  auto ids = at::empty({T, top_k}, lc.options().dtype(at::kLong));
  const float* lp = lc.data_ptr<float>();
  const float* bp = bc.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t gs = E / n_group;
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> sc(E), ch(E), gscore(n_group);
    std::vector<char> allowed(E);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        sc[e] = 1.0f / (1.0f + std::exp(-lp[t * E + e]));
        ch[e] = sc[e] + bp[e];
      }
      std::fill(allowed.begin(), allowed.end(), static_cast<char>(n_group == 1));
      if (n_group > 1) {
        for (int64_t g = 0; g < n_group; ++g) {  // sum of the group's two largest choice scores
          float a = -std::numeric_limits<float>::infinity(), b = a;
          for (int64_t e = g * gs; e < (g + 1) * gs; ++e) {
            if (ch[e] > a) { b = a; a = ch[e]; } else if (ch[e] > b) { b = ch[e]; }
          }
          gscore[g] = gs >= 2 ? a + b : a;
        }
        for (int64_t r = 0; r < topk_group; ++r) {
          int64_t best = -1;
          for (int64_t g = 0; g < n_group; ++g)
            if (!allowed[g * gs] && (best < 0 || gscore[g] > gscore[best])) best = g;  // not yet kept
          for (int64_t e = best * gs; e < (best + 1) * gs; ++e) allowed[e] = 1;
        }
      }
      float sum = 0.f;
      for (int64_t j = 0; j < top_k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
          if (allowed[e] == 1 && (best < 0 || ch[e] > ch[best])) best = e;
        allowed[best] = 2;  // taken
        ip[t * top_k + j] = best;
        wp[t * top_k + j] = sc[best];
        sum += sc[best];
      }
      const float denom = sum + 1e-20f;
      for (int64_t j = 0; j < top_k; ++j)
        wp[t * top_k + j] = (norm ? wp[t * top_k + j] / denom : wp[t * top_k + j]) * static_cast<float>(scale);
    }
  });
  return {w, ids};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
#if defined(__AVX512BF16__)
  m.attr("has_bf16_dot") = true;
#else
  m.attr("has_bf16_dot") = false;
#endif
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally fused with a residual add (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "SiLU-GLU (CPU)");
  m.def("rope", &rope, "rotary embedding (CPU)");
  m.def("causal_softmax_", &causal_softmax_, "in-place causal softmax of prefill scores (CPU)");
  m.def("sigmoid_group_topk", &sigmoid_group_topk, "DeepSeek-V3 sigmoid group-limited top-k routing (CPU)");
  m.def("moe_experts_packed", &moe_experts_packed, "routed experts over packed weights (CPU, bf16)", py::arg("x"),
        py::arg("weights"), py::arg("ids"), py::arg("p13"), py::arg("p2"), py::arg("start"),
        py::arg("shared_gate_up") = py::none(), py::arg("shared_down") = py::none());
  m.def("pack_linear_weight", &pack_linear_weight, "bf16 weight [N, K] -> VNNI blocks [N/32, K/2, 32, 2] (CPU)");
  m.def("vnni_linear", &vnni_linear, "x W^T (+ b) over VNNI-blocked weights (CPU, bf16)");
  m.def("vnni_linear_group", &vnni_linear_group, "several bias-free vnni_linear calls, GEMVs in one parallel region");
  m.def("sample_plain", &sample_plain, "temperature sampling by inverse CDF, no top-k / top-p (CPU)");
  m.def("gqa_decode", &gqa_decode, "grouped-query attention decode block, x -> o_proj output (CPU, bf16)");
  m.def("mla_decode", &mla_decode, "MLA absorbed decode attention block, x -> o_proj output (CPU, bf16)");
  m.def("head_gemm_", &head_gemm_, "per-head GEMM with VNNI-packed weights into y (CPU, AVX512-BF16)");
  register_decode_stack(m);
  register_gguf_linear(m);
}
