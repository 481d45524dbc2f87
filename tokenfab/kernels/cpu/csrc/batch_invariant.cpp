// Batch-invariant mode: the switch and the one kernel it needs beyond the existing ones.
//
// In the default mode a row's result can depend on its batch: linears of up to 4 rows run the GEMV and larger ones
// oneDNN's brgemm tiles (two summation orders), decode attention splits a context across threads when there are
// fewer sequences than threads (flash-decoding, merged by log-sum-exp), and the routers' GEMMs go to MKL / oneDNN,
// whose kernels are chosen by shape. With the switch on (tokenfab/kernels/cpu/ops/batch_invariant.py),
// vnni_linear runs brgemm tiles for every number of rows (vnni_linear.cpp: their order per output does not depend
// on M or the row's tile), decode attention never splits a context (paged_attention_bf16.cpp) and the routers run
// rowwise_linear_f32 below (decode_stack.cpp). The idea follows vLLM's batch-invariant mode and Thinking Machines'
// "Defeating Nondeterminism in LLM Inference" (2025): fix each reduction's order per row, whatever the batch.
#include "batch_invariant.h"

#include "cpu_common.h"

namespace {
thread_local bool g_batch_invariant = false;
}  // namespace

namespace tokenfab_cpu {
bool batch_invariant() { return g_batch_invariant; }
}  // namespace tokenfab_cpu

bool set_batch_invariant(bool on) {
  const bool was = g_batch_invariant;
  g_batch_invariant = on;
  return was;
}

at::Tensor rowwise_linear_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
              x.size(1) == w.size(1), "rowwise_linear_f32: float32 x [T, K] and w [E, K] expected, got ", x.sizes(),
              " ", x.scalar_type(), " and ", w.sizes(), " ", w.scalar_type());
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  const int64_t T = xc.size(0), K = xc.size(1), E = wc.size(0);
  auto y = at::empty({T, E}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // any split of the outputs over threads gives the same bits: each output is one dot() on one thread
  at::parallel_for(0, T * E, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) yp[i] = tokenfab_cpu::dot(xp + (i / E) * K, wp + (i % E) * K, K);
  });
  return y;
}
