// What the linear kernels (vnni_linear.cpp, gguf_linear.cpp, fp8_linear.cpp) share at their entry: x [..., K] as a
// matrix of rows, the output's shape, and the bias as float32.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/stack.h>

#include <vector>

namespace tokenfab_cpu {

struct LinearRows {
  at::Tensor x2;  // [M, K], unit stride along K (row stride kept when rows are apart)
  at::Tensor y;   // empty [..., n] of the requested dtype
  int64_t M;
};

// x [..., K] as rows [M, K] (copied only when a row is not contiguous) and y = empty(x.shape[:-1] + [n], ydtype).
inline LinearRows linear_rows(const at::Tensor& x, int64_t K, int64_t n, at::ScalarType ydtype) {
  auto x2 = x.reshape({-1, K});
  if (x2.stride(1) != 1 || (x2.size(0) > 1 && x2.stride(0) < K)) x2 = x2.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return {x2, at::empty(shape, x.options().dtype(ydtype)), x2.size(0)};
}

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) times B [K, N], B's element (k, j) at b[k * bk + j * bn]:
// PyTorch's float32 GEMM (at::mm_out, the BLAS it links) over caller-owned memory, written into y in place. The
// dequantizing prefill paths of the AVX2 kernels multiply their converted panels with it.
inline void mm_into(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, int64_t K, const float* b,
                    int64_t bk, int64_t bn, int64_t N) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor out = at::from_blob(y, {M, N}, {ldy, 1}, f32);
  at::mm_out(out, at::from_blob(const_cast<float*>(x), {M, K}, {ldx, 1}, f32),
             at::from_blob(const_cast<float*>(b), {K, N}, {bk, bn}, f32));
}

// The bias as float32 values (nullptr without one); `keep` holds the converted copy. Raises (naming `who`) unless it
// has n values.
inline const float* float_bias(const c10::optional<at::Tensor>& bias, int64_t n, const char* who, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == n, who, ": bias has ", bias->numel(), " values for ", n, " outputs");
  keep = bias->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// A grouped expert linear's segments: ``experts`` [A] (ids in [0, E)) and ``offsets`` [A + 1] (rows of x, from 0 to
// N, nondecreasing) as int64 tensors, checked (raising with `who`'s name).
struct ExpertSegments {
  at::Tensor experts, offsets;
  int64_t A;
  const int64_t* ep() const { return experts.data_ptr<int64_t>(); }
  const int64_t* op() const { return offsets.data_ptr<int64_t>(); }
};

inline ExpertSegments expert_segments(const at::Tensor& experts, const at::Tensor& offsets, int64_t E, int64_t N,
                                      const char* who) {
  ExpertSegments s{experts.to(at::kLong).contiguous(), offsets.to(at::kLong).contiguous(), experts.numel()};
  TORCH_CHECK(s.offsets.numel() == s.A + 1, who, ": offsets must hold len(experts) + 1 values");
  const int64_t *ep = s.ep(), *op = s.op();
  TORCH_CHECK(s.A == 0 || (op[0] == 0 && op[s.A] == N), who, ": offsets must run from 0 to N");
  for (int64_t a = 0; a < s.A; ++a)
    TORCH_CHECK(ep[a] >= 0 && ep[a] < E && op[a + 1] >= op[a], who, ": bad expert id or offsets");
  return s;
}

// The GEMV's bf16 operand rows: x2 [M, K] float32 split into three bf16 parts per row, [M, 3, K] with h + m + l = x
// to 2^-24 relative (each part multiplied exactly, so float32 x keeps float32 accuracy); bf16 x as it is, [M, K].
inline at::Tensor bf16_parts(const at::Tensor& x2) {
  if (x2.scalar_type() != at::kFloat) return x2.contiguous();
  const auto h = x2.to(at::kBFloat16), r = x2 - h.to(at::kFloat), mid = r.to(at::kBFloat16);
  const auto lo = (r - mid.to(at::kFloat)).to(at::kBFloat16);
  return at::stack({h, mid, lo}, 1).contiguous();
}

}  // namespace tokenfab_cpu
