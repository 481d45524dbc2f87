// The paged cache write of the decode blocks below (what write_cache's index_copy_ does): slot_mapping as int64,
// every slot checked against the pool, then per token its values copied to cache row slot, columns col.. on.
#include "cpu_common.h"
#include "cpu_kernels.h"

at::Tensor checked_slots(const at::Tensor& slot_mapping, const at::Tensor& cache, const char* who) {
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t nslots = cache.size(0) * cache.size(1);
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, who, ": slot ", sp[t], " outside the cache");
  return slots;
}

// cache [blocks, block_size, ...] contiguous (bf16, or float32 / bf16 / fp16 at the avx2 level); rows [T, ...] of
// the cache's dtype, or float32 rows into a bf16 / fp16 cache (rounded to nearest-even first: the values
// write_cache's rows.to(cache.dtype) stores); any strides; W values per token, written from column ``col`` of each
// slot's row.
void write_slots(at::Tensor& cache, const at::Tensor& slots, int64_t col, const at::Tensor& rows) {
  const bool narrowed = rows.scalar_type() == at::kFloat &&
                        (cache.scalar_type() == at::kBFloat16 || cache.scalar_type() == at::kHalf);
  TORCH_CHECK(rows.scalar_type() == cache.scalar_type() || narrowed, "write_slots: rows of the cache's dtype (",
              cache.scalar_type(), ") or float32 rows into a bf16 / fp16 cache expected, got ", rows.scalar_type());
  const int64_t T = slots.numel(), row = cache.numel() / (cache.size(0) * cache.size(1));
  const auto r = (narrowed ? rows.to(cache.scalar_type()) : rows).reshape({T, -1}).contiguous();
  const int64_t W = r.size(1), es = cache.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  auto* cp = static_cast<char*>(cache.data_ptr());
  const auto* rp = static_cast<const char*>(r.data_ptr());
  for (int64_t t = 0; t < T; ++t) std::memcpy(cp + (sp[t] * row + col) * es, rp + t * W * es, W * es);
}
