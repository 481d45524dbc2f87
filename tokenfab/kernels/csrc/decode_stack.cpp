// The whole decoder stack of a decode-only CPU bf16 step in one call (tokenfab/models/decode_stack.py builds it).
//
// A batch-1 decode step of the default DeepSeek model runs ~50 kernel calls that together take ~2.2-2.5 ms; the
// Python between them (module calls, the router's float cast, adds, argument lists) took another ~0.8 ms
// (benchmarks/NOTES.md entry 38). DecodeStack keeps every layer's weights and sizes on the C++ side and chains the
// same kernels in the same order as the Python modules do:
//
//   h = embedding(ids)
//   per layer:  a = rms(h);  o = attention(a)  [mla_decode or gqa_decode, which write the KV cache]
//               x, h = rms(o + h), o + h        [one fused pass, as DecoderLayer does]
//               h = h + mlp(x)                  [dense SiLU-GLU, or DeepSeek-V3 MoE: router GEMM in float32,
//                                                sigmoid group-limited top-k, routed experts, + shared expert;
//                                                or Qwen3-MoE: softmax top-k router, routed experts]
//   return rms(h)                               [forward_sample: then the LM head and sample_plain]
//
// so its output and the cache rows it writes are bit-identical to the Python path (tests/test_decode_stack.py).
#include <torch/extension.h>

#include "batch_invariant.h"
#include "cpu_kernels.h"
#include "decode_stack.h"
#include "vnni_linear.h"

#include <string>
#include <vector>

namespace {

// One SiLU-GLU block over VNNI-packed weights: down(silu(gate_up(x))), gate_up rows [gate | up].
struct GatedMlp {
  at::Tensor gate_up, down;
  c10::optional<at::Tensor> gate_up_bias, down_bias;
  int64_t gate_up_rows = 0, down_rows = 0;

  bool defined() const { return gate_up.defined(); }
  at::Tensor operator()(const at::Tensor& x) const {
    return vnni_linear(silu_and_mul(vnni_linear(x, gate_up, gate_up_rows, gate_up_bias)), down, down_rows,
                       down_bias);
  }
};

struct Layer {
  bool mla = false;
  std::vector<at::Tensor> attn_w;
  std::vector<c10::optional<at::Tensor>> attn_b;
  std::vector<int64_t> attn_dims;
  double eps_a = 0, eps_b = 0, scale = 0;  // MLA: q_a / kv_a norm eps; GQA: q/k norm eps (eps_a)
  at::Tensor in_norm, post_norm;
  double in_eps = 0, post_eps = 0;
  GatedMlp mlp;  // dense layers; the shared expert of MoE layers
  bool moe = false;
  bool softmax_router = false;       // Qwen3-MoE: softmax top-k over bf16 logits; else DeepSeek-V3's sigmoid router
  at::Tensor router_w, router_bias;  // float32 [E, hidden], [E] (softmax router: bf16 [E, hidden], no bias)
  int64_t n_group = 1, topk_group = 1, top_k = 1, expert_start = 0;
  bool norm_topk = false;
  double routed_scale = 1.0;
  std::vector<at::Tensor> p13, p2;
};

// slot_mapping of one decode token per sequence, as ModelRunner._slots computes it: block_tables[t, pos / bs] * bs +
// pos % bs (positions [T], block_tables [T, nblk] int64).
at::Tensor decode_slots(const at::Tensor& positions, const at::Tensor& block_tables, int64_t bs) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && block_tables.scalar_type() == at::kLong &&
              block_tables.dim() == 2 && block_tables.size(0) == positions.numel(),
              "DecodeStack: int64 positions [T] and block_tables [T, blocks] expected");
  const auto pos = positions.contiguous();
  const auto bt = block_tables.contiguous();
  const int64_t T = pos.numel(), nb = bt.size(1);
  auto out = at::empty_like(pos);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* bp = bt.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] / bs < nb, "DecodeStack: position ", pp[t], " is past its block table");
    op[t] = bp[t * nb + pp[t] / bs] * bs + pp[t] % bs;
  }
  return out;
}

class DecodeStack {
 public:
  DecodeStack(at::Tensor embed, at::Tensor final_norm, double final_eps, at::Tensor cos, at::Tensor sin,
              bool interleave)
      : embed_(std::move(embed)), final_norm_(std::move(final_norm)), final_eps_(final_eps), cos_(std::move(cos)),
        sin_(std::move(sin)), interleave_(interleave) {}

  // A layer with MLA attention: the arguments of mla_decode that do not change between steps.
  void add_mla_layer(at::Tensor in_norm, double in_eps, at::Tensor post_norm, double post_eps,
                     std::vector<at::Tensor> w, std::vector<int64_t> dims, double eps_q, double eps_kv,
                     double scale) {
    Layer l;
    l.mla = true;
    l.in_norm = std::move(in_norm), l.in_eps = in_eps, l.post_norm = std::move(post_norm), l.post_eps = post_eps;
    l.attn_w = std::move(w), l.attn_dims = std::move(dims), l.eps_a = eps_q, l.eps_b = eps_kv, l.scale = scale;
    layers_.push_back(std::move(l));
  }

  // A layer with grouped-query attention (gqa_decode's arguments).
  void add_gqa_layer(at::Tensor in_norm, double in_eps, at::Tensor post_norm, double post_eps,
                     std::vector<at::Tensor> w, std::vector<c10::optional<at::Tensor>> biases,
                     std::vector<int64_t> dims, double eps, double scale) {
    Layer l;
    l.in_norm = std::move(in_norm), l.in_eps = in_eps, l.post_norm = std::move(post_norm), l.post_eps = post_eps;
    l.attn_w = std::move(w), l.attn_b = std::move(biases), l.attn_dims = std::move(dims), l.eps_a = eps,
    l.scale = scale;
    layers_.push_back(std::move(l));
  }

  // The last added layer's dense SiLU-GLU (or, after set_moe, its shared expert).
  void set_gated_mlp(at::Tensor gate_up, c10::optional<at::Tensor> gate_up_bias, int64_t gate_up_rows,
                     at::Tensor down, c10::optional<at::Tensor> down_bias, int64_t down_rows) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack.set_gated_mlp: add a layer first");
    layers_.back().mlp = GatedMlp{std::move(gate_up), std::move(down), std::move(gate_up_bias),
                                  std::move(down_bias), gate_up_rows, down_rows};
  }

  // The last added layer's DeepSeek-V3 MoE: router (float32 weight and score-correction bias), group-limited top-k
  // and one packed gate_up / down weight per local expert (experts start..start + len(p13) - 1).
  void set_moe(at::Tensor router_w, at::Tensor router_bias, int64_t n_group, int64_t topk_group, int64_t top_k,
               bool norm_topk, double routed_scale, std::vector<at::Tensor> p13, std::vector<at::Tensor> p2,
               int64_t start) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack.set_moe: add a layer first");
    TORCH_CHECK(router_w.scalar_type() == at::kFloat && p13.size() == p2.size() && !p13.empty(),
                "DecodeStack.set_moe: float32 router weight and one gate_up / down pair per expert expected");
    Layer& l = layers_.back();
    l.moe = true;
    l.router_w = std::move(router_w), l.router_bias = std::move(router_bias);
    l.n_group = n_group, l.topk_group = topk_group, l.top_k = top_k, l.norm_topk = norm_topk;
    l.routed_scale = routed_scale, l.p13 = std::move(p13), l.p2 = std::move(p2), l.expert_start = start;
  }

  // The last added layer's Qwen3-MoE block: router weight [E, hidden] (the activations' dtype), top_k, whether the
  // chosen probabilities are renormalized, and one packed gate_up / down weight per local expert.
  void set_moe_softmax(at::Tensor router_w, int64_t top_k, bool norm_topk, std::vector<at::Tensor> p13,
                       std::vector<at::Tensor> p2, int64_t start) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack.set_moe_softmax: add a layer first");
    TORCH_CHECK(p13.size() == p2.size() && !p13.empty() && top_k >= 1 && top_k <= router_w.size(0),
                "DecodeStack.set_moe_softmax: one gate_up / down pair per expert and 1 <= top_k <= experts expected");
    Layer& l = layers_.back();
    l.moe = true, l.softmax_router = true;
    l.router_w = std::move(router_w), l.top_k = top_k, l.norm_topk = norm_topk;
    l.p13 = std::move(p13), l.p2 = std::move(p2), l.expert_start = start;
  }

  // The LM head (VNNI-packed [vocab, hidden], ``rows`` = vocab) for forward_sample.
  void set_lm_head(at::Tensor packed, int64_t rows) {
    lm_head_ = std::move(packed);
    lm_rows_ = rows;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // forward, then the LM head's float32 logits (CausalLM.compute_logits) and one token per sequence drawn by
  // sample_plain at temperatures ``temps`` [T] float32 with uniforms ``u`` [T]: the Sampler's plain path in the same
  // call, so no Python runs between the forward and the draw. Returns int64 [T].
  at::Tensor forward_sample(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                            std::vector<at::Tensor> caches, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, const at::Tensor& temps, const at::Tensor& u) const {
    TORCH_CHECK(lm_head_.defined(), "DecodeStack.forward_sample: set_lm_head first");
    const auto h = forward(input_ids, positions, slot_mapping, std::move(caches), block_tables, context_lens);
    return sample_plain(vnni_linear(h, lm_head_, lm_rows_, std::nullopt).to(at::kFloat), temps, u);
  }

  // input_ids, positions, slot_mapping [T] int64 (or an empty slot_mapping: computed here from positions and
  // block_tables); caches: per layer its latent pool (MLA) or k and v pools (GQA), flattened in layer order;
  // block_tables [T, max_blocks], context_lens [T]. Returns the final-normed hidden states [T, hidden] bf16.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping_in,
                     std::vector<at::Tensor> caches, const at::Tensor& block_tables,
                     const at::Tensor& context_lens) const {
    TORCH_CHECK(!caches.empty(), "DecodeStack.forward: no KV caches");
    const at::Tensor slot_mapping = slot_mapping_in.numel() == 0 && input_ids.numel() > 0
                                        ? decode_slots(positions, block_tables, caches[0].size(1))
                                        : slot_mapping_in;
    size_t c = 0;
    auto h = at::embedding(embed_, input_ids);
    for (const Layer& l : layers_) {
      const auto a = rms_norm(h, std::nullopt, l.in_norm, l.in_eps)[0];
      at::Tensor o;
      if (l.mla) {
        TORCH_CHECK(c < caches.size(), "DecodeStack.forward: fewer KV caches than layers");
        o = mla_decode(a, positions, slot_mapping, caches[c], block_tables, context_lens, l.attn_w, l.attn_dims,
                       cos_, sin_, interleave_, l.eps_a, l.eps_b, l.scale);
        c += 1;
      } else {
        TORCH_CHECK(c + 1 < caches.size(), "DecodeStack.forward: fewer KV caches than layers");
        o = gqa_decode(a, positions, slot_mapping, caches[c], caches[c + 1], block_tables, context_lens, l.attn_w,
                       l.attn_b, l.attn_dims, cos_, sin_, interleave_, l.eps_a, l.scale);
        c += 2;
      }
      const auto xh = rms_norm(o, h, l.post_norm, l.post_eps);  // {norm(o + h), o + h}
      const auto& x = xh[0];
      at::Tensor m;
      if (l.moe && l.softmax_router) {  // SoftmaxTopKRouter.forward's ops, in its order (the same ATen kernels)
        const auto logits = tokenfab_cpu::batch_invariant()  // as SoftmaxTopKRouter.forward in that mode
            ? rowwise_linear_f32(x.to(at::kFloat), l.router_w.to(at::kFloat)).to(at::result_type(x, l.router_w))
            : at::linear(x, l.router_w);
        auto [w, ids] = at::topk(at::softmax(logits, -1, at::kFloat), l.top_k, -1);
        if (l.norm_topk) w = w / w.sum(-1, true);
        m = moe_experts_packed(x, w.to(logits.scalar_type()), ids, l.p13, l.p2, l.expert_start, std::nullopt,
                               std::nullopt);
      } else if (l.moe) {
        const auto xf = x.to(at::kFloat);
        const auto route = sigmoid_group_topk(tokenfab_cpu::batch_invariant() ? rowwise_linear_f32(xf, l.router_w)
                                                                               : at::linear(xf, l.router_w),
                                              l.router_bias, l.n_group,
                                              l.topk_group, l.top_k, l.norm_topk, l.routed_scale);
        // a bias-free shared expert runs inside the routed experts' two parallel regions (routed + shared rounded
        // as before); one with biases runs after them
        const bool fused = l.mlp.defined() && !l.mlp.gate_up_bias.has_value() && !l.mlp.down_bias.has_value();
        m = moe_experts_packed(x, route[0], route[1], l.p13, l.p2, l.expert_start,
                               fused ? c10::optional<at::Tensor>(l.mlp.gate_up) : std::nullopt,
                               fused ? c10::optional<at::Tensor>(l.mlp.down) : std::nullopt);
        if (l.mlp.defined() && !fused) m = m + l.mlp(x);
      } else {
        m = l.mlp(x);
      }
      h = xh[1] + m;
    }
    TORCH_CHECK(c == caches.size(), "DecodeStack.forward: ", caches.size(), " KV caches for ", c, " expected");
    return rms_norm(h, std::nullopt, final_norm_, final_eps_)[0];
  }

 private:
  at::Tensor embed_, final_norm_;
  double final_eps_;
  at::Tensor cos_, sin_;
  bool interleave_;
  std::vector<Layer> layers_;
  at::Tensor lm_head_;
  int64_t lm_rows_ = 0;
};

}  // namespace

void register_decode_stack(pybind11::module_& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack", "the decoder stack of a decode-only CPU bf16 step in one call")
      .def(pybind11::init<at::Tensor, at::Tensor, double, at::Tensor, at::Tensor, bool>())
      .def("add_mla_layer", &DecodeStack::add_mla_layer)
      .def("add_gqa_layer", &DecodeStack::add_gqa_layer)
      .def("set_gated_mlp", &DecodeStack::set_gated_mlp)
      .def("set_moe", &DecodeStack::set_moe)
      .def("set_moe_softmax", &DecodeStack::set_moe_softmax)
      .def("set_lm_head", &DecodeStack::set_lm_head)
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_sample", &DecodeStack::forward_sample, pybind11::call_guard<pybind11::gil_scoped_release>());
}
