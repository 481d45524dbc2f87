// Causal softmax of prefill attention scores, in place: s [B, Hx, R, L] (contiguous) holds q k^T for R query rows
// per (sequence, head group); row r is query r % q_len of sequence b, at absolute position query_pos[b, r % q_len]
// (-1 for padding). Key j is visible when j <= that position (padding rows see key 0 only, as causal_mask does).
// Each row becomes softmax(scale * s) over its visible keys (zeros elsewhere) in float32, stored in s's dtype:
// the float conversion, scale, mask add, softmax and cast of the eager path in one pass.
#include "cpu_common.h"
#include "cpu_kernels.h"

using namespace tokenfab_cpu;

namespace {

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

}  // namespace

// Declared in cpu_kernels.h.
void causal_softmax_(at::Tensor& s, const at::Tensor& query_pos, int64_t q_len, double scale) {
  TORCH_CHECK(s.dim() == 4 && s.is_contiguous(), "causal_softmax_: s must be a contiguous [B, Hx, R, L] tensor");
  TORCH_CHECK(query_pos.dim() == 2 && query_pos.size(0) == s.size(0) && q_len >= 1 && q_len <= query_pos.size(1)
              && s.size(2) % q_len == 0, "causal_softmax_: query_pos must be [B, >= q_len] and R a multiple of q_len");
  auto qp = query_pos.to(at::kLong).contiguous();
  DISPATCH_F32_BF16(s.scalar_type(), "causal_softmax_", [&] { causal_softmax_impl<scalar_t>(s, qp, q_len, scale); });
}
