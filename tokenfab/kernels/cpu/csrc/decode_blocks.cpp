// Attention blocks of a decode-only CPU bf16 batch in one call each: MLA (absorbed) and grouped-query attention,
// from x to the o_proj output, on the other kernels of this extension in the Python path's order.
#include "cpu_common.h"
#include "cpu_kernels.h"
#include "vnni_linear.h"

// ---------------------------------------------------------------------------------------------------------------
// MLA attention for a decode-only batch in one call: the ~25 Python-level ops of MLAttention.forward's absorbed
// decode (tokenfab/layers/mla.py) between x and o_proj, on the same kernels in the same order, so the output and the
// cache rows written are bit-identical to that path. Python dispatch was ~180 us of the ~410 us a layer took at
// batch 1 on the 2-core VM (benchmarks/NOTES.md entry 33).
//   a = x Wqkv_a^T -> [q_a | c_kv | k_rope]; q = rms(q_a) Wq_b^T -> [T, H, nope + R]; c_kv = rms(c_kv);
//   q_rope, k_rope = rope(.); cache[slot] = [c_kv | k_rope]; q_lat = [q_nope W_UK | q_rope];
//   o_lat = paged attention over the latent cache (values = its first C columns); o = (o_lat W_UV) Wo^T.
// Weights: qkv_a, q_b, o_proj from pack_linear_weight; w_uk, w_uv_t from pack_head_weights; norm weights [q_lora],
// [C] bf16. dims = {q_lora, C, R, H, nope, v, hidden}.
at::Tensor mla_decode(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping,
                      at::Tensor& cache, const at::Tensor& block_tables, const at::Tensor& context_lens,
                      const std::vector<at::Tensor>& w, const std::vector<int64_t>& dims, const at::Tensor& cos,
                      const at::Tensor& sin, bool interleave, double eps_q, double eps_kv, double scale) {
  TORCH_CHECK(w.size() == 7 && dims.size() == 7, "mla_decode: 7 weights and 7 dims expected");
  const int64_t q_lora = dims[0], C = dims[1], R = dims[2], H = dims[3], nope = dims[4], vd = dims[5],
                hidden = dims[6], T = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && cache.scalar_type() == at::kBFloat16 &&
              cache.dim() == 3 && cache.size(2) == C + R && cache.is_contiguous(),
              "mla_decode: bf16 x [T, hidden] and a contiguous bf16 latent cache [blocks, block_size, C + R]");
  TORCH_CHECK(slot_mapping.numel() == T && positions.numel() == T && block_tables.size(0) == T,
              "mla_decode: one decode token per sequence expected");
  const auto a = vnni_linear(x, w[0], q_lora + C + R, std::nullopt);  // [T, q_lora + C + R]
  const auto q_a = a.slice(1, 0, q_lora);
  const auto q = vnni_linear(rms_norm(q_a, std::nullopt, w[1], eps_q)[0], w[3], H * (nope + R), std::nullopt)
                     .view({T, H, nope + R});
  const auto c_kv = rms_norm(a.slice(1, q_lora, q_lora + C), std::nullopt, w[2], eps_kv)[0];  // [T, C]
  const auto q_rope = rope(q.slice(2, nope, nope + R), positions, cos, sin, interleave);     // [T, H, R]
  const auto k_rope = rope(a.slice(1, q_lora + C, q_lora + C + R).unsqueeze(1), positions, cos, sin, interleave);
  const auto slots = checked_slots(slot_mapping, cache, "mla_decode");
  write_slots(cache, slots, 0, c_kv);  // the cache row is [c_kv | k_rope]
  write_slots(cache, slots, C, k_rope);
  auto q_lat = at::empty({T, H, C + R}, x.options());
  auto q_lat_c = q_lat.slice(2, 0, C);
  head_gemm_(q.slice(2, 0, nope), w[4], q_lat_c);
  q_lat.slice(2, C, C + R).copy_(q_rope);
  const auto lat = cache.unsqueeze(2);  // [blocks, block_size, 1, C + R]: one latent "head", values = first C
  const auto o_lat = paged_decode_attention(q_lat, lat, lat.slice(3, 0, C), block_tables, context_lens, scale);
  auto o = at::empty({T, H, vd}, x.options());
  head_gemm_(o_lat, w[5], o);
  return vnni_linear(o.view({T, H * vd}), w[6], hidden, std::nullopt);
}

// ---------------------------------------------------------------------------------------------------------------
// Grouped-query attention for a decode-only batch in one call (Llama / Qwen3 LlamaAttention.forward, layers in
// tokenfab/models/llama.py): fused q|k|v GEMM, optional per-head q/k RMSNorm (Qwen3), RoPE, k/v cache writes,
// paged decode attention, o_proj; the same kernels in the same order as the Python path (bit-identical).
// w = {qkv (pack_linear_weight), o_proj, [q_norm, k_norm]}; biases = {qkv bias or undefined, o_proj bias or
// undefined}; dims = {H, Hk, D, hidden}.
at::Tensor gqa_decode(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, const std::vector<at::Tensor>& w,
                      const std::vector<c10::optional<at::Tensor>>& biases, const std::vector<int64_t>& dims,
                      const at::Tensor& cos, const at::Tensor& sin, bool interleave, double eps, double scale) {
  TORCH_CHECK((w.size() == 2 || w.size() == 4) && biases.size() == 2 && dims.size() == 4,
              "gqa_decode: weights {qkv, o_proj[, q_norm, k_norm]}, 2 biases and 4 dims expected");
  const int64_t H = dims[0], Hk = dims[1], D = dims[2], hidden = dims[3], T = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.dim() == 4 && k_cache.size(2) == Hk && k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes(),
              "gqa_decode: bf16 x [T, hidden] and contiguous bf16 caches [blocks, block_size, Hk, D] expected");
  TORCH_CHECK(slot_mapping.numel() == T && positions.numel() == T && block_tables.size(0) == T,
              "gqa_decode: one decode token per sequence expected");
  const auto qkv = vnni_linear(x, w[0], (H + 2 * Hk) * D, biases[0]);  // [T, (H + 2 Hk) D]
  const auto q = qkv.slice(1, 0, H * D).view({T, H, D});
  const auto k = qkv.slice(1, H * D, (H + Hk) * D).view({T, Hk, D});
  const auto v = qkv.slice(1, (H + Hk) * D, (H + 2 * Hk) * D).view({T, Hk, D});
  const std::vector<at::Tensor> qk_norms(w.begin() + 2, w.end());
  const auto o = gqa_attend(q, k, v, positions, slot_mapping, k_cache, v_cache, block_tables, context_lens, qk_norms,
                            cos, sin, interleave, eps, scale);
  return vnni_linear(o.view({T, H * D}), w[1], hidden, biases[1]);
}

// The part of gqa_decode between the q|k|v projection and o_proj, shared with DecodeStack's layers whose linears
// are not VNNI blocks (GGUF tiles): q [T, H, D], k / v [T, Hk, D] (views of the projection output) -> [T, H, D].
at::Tensor gqa_attend(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v, const at::Tensor& positions,
                      const at::Tensor& slot_mapping, at::Tensor& k_cache, at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens,
                      const std::vector<at::Tensor>& qk_norms, const at::Tensor& cos, const at::Tensor& sin,
                      bool interleave, double eps, double scale) {
  const int64_t T = q_in.size(0), H = q_in.size(1), Hk = k_in.size(1), D = q_in.size(2);
  auto q = q_in, k = k_in;
  if (qk_norms.size() == 2) {  // Qwen3: RMSNorm over each head's D values
    q = rms_norm(q.reshape({-1, D}), std::nullopt, qk_norms[0], eps)[0].view({T, H, D});
    k = rms_norm(k.reshape({-1, D}), std::nullopt, qk_norms[1], eps)[0].view({T, Hk, D});
  }
  const auto q_rot = rope(q, positions, cos, sin, interleave);
  const auto k_rot = rope(k, positions, cos, sin, interleave);
  const auto slots = checked_slots(slot_mapping, k_cache, "gqa_decode");
  write_slots(k_cache, slots, 0, k_rot);
  write_slots(v_cache, slots, 0, v);
  return paged_decode_attention(q_rot, k_cache, v_cache, block_tables, context_lens, scale);  // [T, H, D]
}
