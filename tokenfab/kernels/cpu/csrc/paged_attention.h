// Paged decode attention internals shared by the float32 / bf16 path (paged_attention.cpp) and the AVX512-BF16
// path (paged_attention_bf16.cpp): the work split and the prefetch of the next scattered block.
#pragma once
#include "cpu_common.h"

namespace tokenfab_cpu {

// Touch rows [0, rows) of row_elems values each (stride row_stride) so they are in cache when the block is read.
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

#if defined(__AVX512BF16__)
// bf16 paged decode attention on AVX512-BF16 into out [B, H, Dv] (paged_attention_bf16.cpp); D and Dv multiples of
// 32, block_tables / context_lens int64 contiguous.
void decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                           at::Tensor& out);
#endif

}  // namespace tokenfab_cpu
