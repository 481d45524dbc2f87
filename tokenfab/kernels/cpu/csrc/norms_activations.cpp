// RMSNorm (optionally fused with the residual add) and SiLU-GLU, in the activation dtype's rounding order.
#include "cpu_common.h"
#include "cpu_kernels.h"

using namespace tokenfab_cpu;

namespace {

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
