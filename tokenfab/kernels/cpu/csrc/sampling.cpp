// Sampling without top-k / top-p in one pass per row (tokenfab/engine/sampler.py): row i at temperature t_i draws
// the first index j with cdf_j > u_i * cdf_{V-1} (capped just below the total) over p_j = exp(x_j / t_i - max), the
// cumulative sum in float64, as inverse_cdf_sample does over softmax(x / t) (dividing by the sum does not move the
// draw). Rows with t_i < 1e-5 take the first argmax. -inf logits get probability 0 exactly (never drawn).
#include "cpu_common.h"
#include "cpu_kernels.h"

using namespace tokenfab_cpu;

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
