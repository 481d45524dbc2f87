// Prefill attention in flash form for bf16 on CPU: per tile of query rows, key blocks of kKeyBlock keys are scored by
// one brgemm (the rows of the grouped query heads of a KV head stacked, so K is read once for all of them), the
// causal mask is applied to the scores of the blocks on the diagonal only (never materialized), an online softmax
// in float32 keeps each row's running max m and sum l (FlashAttention's recurrence: o <- o e^(m - m') + p v,
// l <- l e^(m - m') + sum p), and the bf16 probabilities meet V in a second brgemm accumulating into float32 o.
// Key blocks past a tile's last visible key are skipped. Scores and probabilities live in thread-local buffers of
// kRows x kKeyBlock; K and V are laid out once per call, block by block, in brgemm's VNNI pair layout (a copy of the
// context the size of the gathered one), shared by all tiles of their KV head.
//
// q [B, H, Q, D], k [B, Hk, L, D], v [B, Hk, L, Dv] bf16 (any strides but a unit last one), H a multiple of Hk,
// D and kKeyBlock even; query_pos [B, Q] int64: query i of sequence b is at position query_pos[b, i] and sees keys
// j <= that position (-1, a padding row, sees key 0 only). Output [B, H, Q, Dv] bf16.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <limits>
#include <vector>

using namespace tokenfab_cpu;

namespace {

constexpr int64_t kRows = 64;       // query rows (heads x queries) per tile: one brgemm M
constexpr int64_t kKeyBlock = 128;  // keys per block: one brgemm N (scores) and K (values)

struct Tile {
  int64_t b, hk, g0, g1, i0, i1;  // sequence, KV head, query heads [g0, g1) of its group, queries [i0, i1)
};

// Key block kb of one KV head into VNNI pairs: kt [D / 2][kKeyBlock] (word (d / 2, j) = (k[j][d], k[j][d + 1])) and
// vt [kKeyBlock / 2][Dv] (word (j / 2, d) = (v[j][d], v[j + 1][d])); keys past L are zero.
void pack_block(const uint16_t* k, int64_t ksl, const uint16_t* v, int64_t vsl, int64_t j0, int64_t L, int64_t D,
                int64_t Dv, uint32_t* kt, uint32_t* vt) {
  const int64_t nk = std::min(kKeyBlock, L - j0);
  for (int64_t j = 0; j < kKeyBlock; ++j) {
    if (j < nk) {
      const auto* kr = reinterpret_cast<const uint32_t*>(k + (j0 + j) * ksl);
      for (int64_t dp = 0; dp < D / 2; ++dp) kt[dp * kKeyBlock + j] = kr[dp];
    } else {
      for (int64_t dp = 0; dp < D / 2; ++dp) kt[dp * kKeyBlock + j] = 0;
    }
  }
  for (int64_t jp = 0; jp < kKeyBlock / 2; ++jp) {
    const int64_t j = 2 * jp;
    const uint16_t* v0 = j < nk ? v + (j0 + j) * vsl : nullptr;
    const uint16_t* v1 = j + 1 < nk ? v + (j0 + j + 1) * vsl : nullptr;
    uint32_t* dst = vt + jp * Dv;
    if (v0 != nullptr && v1 != nullptr) {
#pragma omp simd
      for (int64_t d = 0; d < Dv; ++d) dst[d] = v0[d] | (static_cast<uint32_t>(v1[d]) << 16);
    } else {
      for (int64_t d = 0; d < Dv; ++d) dst[d] = v0 != nullptr ? v0[d] : 0u;
    }
  }
}

void flash_tile(const Tile& t, const uint16_t* q, const int64_t qs[4], const uint32_t* kpack, const uint32_t* vpack,
                const int64_t* qpos, int64_t Q, int64_t L, int64_t D, int64_t Dv, int64_t G, float scale,
                uint16_t* out, const int64_t os[4], std::vector<uint16_t>& a, std::vector<float>& s,
                std::vector<uint16_t>& p, std::vector<float>& o, std::vector<float>& m, std::vector<float>& l,
                std::vector<int64_t>& pos) {
  const int64_t nq = t.i1 - t.i0, M = (t.g1 - t.g0) * nq;
  // rows r = (g - g0) * nq + (i - i0): head g = hk * G + g's query i
  int64_t kmax = 0, kmin = std::numeric_limits<int64_t>::max();
  for (int64_t r = 0; r < M; ++r) {
    const int64_t g = t.g0 + r / nq, i = t.i0 + r % nq;
    pos[r] = std::max<int64_t>(qpos[t.b * Q + i], 0);
    kmax = std::max(kmax, pos[r]);
    kmin = std::min(kmin, pos[r]);
    const uint16_t* src = q + t.b * qs[0] + (t.hk * G + g) * qs[1] + i * qs[2];
    std::copy(src, src + D, a.data() + r * D);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  std::fill(o.begin(), o.begin() + M * Dv, 0.f);
  const int64_t kend = std::min(L, kmax + 1);
  for (int64_t j0 = 0; j0 < kend; j0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, kend - j0);
    const uint32_t* kt = kpack + (j0 / kKeyBlock) * (D / 2) * kKeyBlock;
    const uint32_t* vt = vpack + (j0 / kKeyBlock) * (kKeyBlock / 2) * Dv;
    at::native::cpublas::brgemm(M, kKeyBlock, D, D, kKeyBlock, kKeyBlock, false,
                                reinterpret_cast<const at::BFloat16*>(a.data()),
                                reinterpret_cast<const at::BFloat16*>(kt), s.data(), true);
    const bool diagonal = j0 + nk - 1 > kmin;  // some row sees only part of this block
    for (int64_t r = 0; r < M; ++r) {
      float* sr = s.data() + r * kKeyBlock;
      const int64_t vis = diagonal ? std::min(nk, std::max<int64_t>(pos[r] - j0 + 1, 0)) : nk;
      float mb = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mb)
      for (int64_t j = 0; j < vis; ++j) {
        sr[j] *= scale;
        mb = std::max(mb, sr[j]);
      }
      const float mnew = std::max(m[r], mb);
      uint16_t* pr = p.data() + r * kKeyBlock;
      if (mnew == -std::numeric_limits<float>::infinity()) {  // no visible key yet (a later block has them)
        std::fill(pr, pr + kKeyBlock, uint16_t{0});
        continue;
      }
      const float alpha = exp_approx(m[r] - mnew);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < vis; ++j) {
        const float e = exp_approx(sr[j] - mnew);
        sum += e;
        pr[j] = f_to_bf16(e);
      }
      for (int64_t j = vis; j < kKeyBlock; ++j) pr[j] = 0;
      l[r] = l[r] * alpha + sum;
      m[r] = mnew;
      if (alpha != 1.f) {
        float* orow = o.data() + r * Dv;
#pragma omp simd
        for (int64_t d = 0; d < Dv; ++d) orow[d] *= alpha;
      }
    }
    at::native::cpublas::brgemm(M, Dv, kKeyBlock, kKeyBlock, Dv, Dv, true,
                                reinterpret_cast<const at::BFloat16*>(p.data()),
                                reinterpret_cast<const at::BFloat16*>(vt), o.data(), true);
  }
  for (int64_t r = 0; r < M; ++r) {
    const int64_t g = t.g0 + r / nq, i = t.i0 + r % nq;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    uint16_t* dst = out + t.b * os[0] + (t.hk * G + g) * os[1] + i * os[2];
    const float* orow = o.data() + r * Dv;
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) dst[d] = f_to_bf16(orow[d] * inv);
  }
}

}  // namespace

// Declared in cpu_kernels.h.
at::Tensor flash_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& query_pos, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kBFloat16 &&
              k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "flash_prefill_attention: q [B, H, Q, D], k [B, Hk, L, D], v [B, Hk, L, Dv], all bf16");
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), L = k.size(2), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hk && v.size(2) == L && k.size(3) == D && Hk > 0 &&
              H % Hk == 0 && D % 2 == 0, "flash_prefill_attention: shapes ", q.sizes(), " ", k.sizes(), " ",
              v.sizes(), " do not fit (H a multiple of Hk, D even)");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "flash_prefill_attention: the last dimension must be contiguous");
  TORCH_CHECK(query_pos.dim() == 2 && query_pos.size(0) == B && query_pos.size(1) == Q,
              "flash_prefill_attention: query_pos must be [B, Q]");
  const auto qp = query_pos.to(at::kLong).contiguous();
  auto out = at::empty({B, H, Q, Dv}, q.options());
  if (B == 0 || Q == 0) return out;
  const int64_t G = H / Hk;
  // tiles: all G heads x kRows / G queries, or (G > kRows) kRows heads x 1 query
  const int64_t gh = std::min(G, kRows), nqt = std::max<int64_t>(1, kRows / gh);
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hk = 0; hk < Hk; ++hk)
      for (int64_t g0 = 0; g0 < G; g0 += gh)
        for (int64_t i0 = 0; i0 < Q; i0 += nqt)
          tiles.push_back({b, hk, g0, std::min(G, g0 + gh), i0, std::min(Q, i0 + nqt)});
  const int64_t qs[4] = {q.stride(0), q.stride(1), q.stride(2), 1}, ks[4] = {k.stride(0), k.stride(1), k.stride(2), 1};
  const int64_t vs[4] = {v.stride(0), v.stride(1), v.stride(2), 1};
  const int64_t os[4] = {out.stride(0), out.stride(1), out.stride(2), 1};
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kd = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vd = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t* pp = qp.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  // K and V of every (sequence, KV head) in VNNI pair blocks, once: [B * Hk][NKB][block words]
  const int64_t NKB = (L + kKeyBlock - 1) / kKeyBlock, kw = (D / 2) * kKeyBlock, vw = (kKeyBlock / 2) * Dv;
  std::vector<uint32_t> kpack(static_cast<size_t>(B * Hk * NKB * kw)), vpack(static_cast<size_t>(B * Hk * NKB * vw));
  at::parallel_for(0, B * Hk * NKB, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bh = i / NKB, kb = i % NKB, b = bh / Hk, hk = bh % Hk;
      pack_block(kd + b * ks[0] + hk * ks[1], ks[2], vd + b * vs[0] + hk * vs[1], vs[2], kb * kKeyBlock, L, D, Dv,
                 kpack.data() + i * kw, vpack.data() + i * vw);
    }
  });
  // later tiles of a sequence see more keys: hand them out first-come (grain 1) so threads stay balanced
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint16_t> a(kRows * D), p(kRows * kKeyBlock);
    std::vector<float> s(kRows * kKeyBlock), o(kRows * Dv), m(kRows), l(kRows);
    std::vector<int64_t> pos(kRows);
    for (int64_t ti = t0; ti < t1; ++ti) {
      const Tile& t = tiles[ti];
      const int64_t bh = t.b * Hk + t.hk;
      flash_tile(t, qd, qs, kpack.data() + bh * NKB * kw, vpack.data() + bh * NKB * vw, pp, Q, L, D, Dv, G,
                 fscale, od, os, a, s, p, o, m, l, pos);
    }
    at::native::cpublas::brgemm_release(true);
  });
  return out;
}
