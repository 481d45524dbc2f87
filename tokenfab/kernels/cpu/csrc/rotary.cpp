// Rotary embedding of x [T, H, dim] (last dim contiguous, any other strides) at positions [T] with float32
// cos/sin tables [P, dim/2] -> new contiguous [T, H, dim]. cos/sin are rounded to x's dtype first and every product
// and sum rounded in x's dtype, as transformers' apply_rotary_pos_emb does. interleave: pairs (2i, 2i+1) as in
// DeepSeek-V3's interleaved layout, output [even rotated | odd rotated] (halves); else pairs (i, i + dim/2).
#include "cpu_common.h"
#include "cpu_kernels.h"

using namespace tokenfab_cpu;

namespace {

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

}  // namespace

// Declared in cpu_kernels.h.
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
