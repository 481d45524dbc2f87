// Batch-invariant kernel mode (batch_invariant.cpp): a per-thread switch that makes every kernel of this extension
// reduce in an order that depends on neither the number of rows, a row's place among them, nor the thread count.
#pragma once
#include <ATen/core/Tensor.h>

namespace tokenfab_cpu {

// True while the calling thread runs in batch-invariant mode. Kernels read it on the calling thread, before their
// parallel regions (OpenMP workers never read it).
bool batch_invariant();

}  // namespace tokenfab_cpu

// Sets the calling thread's batch-invariant mode; returns the previous value.
bool set_batch_invariant(bool on);

// y[t, e] = x[t] . w[e] for x [T, K] and w [E, K] float32 -> [T, E] float32, every output one dot product in a fixed
// order (16-lane partial sums in four chains, then one fixed reduction): the same bits for a row whatever T is.
at::Tensor rowwise_linear_f32(const at::Tensor& x, const at::Tensor& w);
