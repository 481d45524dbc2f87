// The whole decoder stack of a decode-only CPU step in one call (tokenfab/engine/cpu_decode_stack.py builds it).
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
//
// A linear is either tokenfab's VNNI-blocked bf16 weight (vnni_linear) or a GGUF block-quantized weight kept packed
// (gguf_linear over its tiles, tokenfab/quant/gguf_blocks.py): grouped-query layers, dense SiLU-GLUs and the LM head
// take either, the embedding may be a packed GGUF weight too (gguf_embedding), so a GGUF file served packed runs
// the same one-call step (tests/test_decode_stack_packed.py).
//
// On CPUs without AVX512-BF16 (the avx2 ISA level) a GGUF file served packed runs in float32: its Lins are the AVX2
// GEMV on the same tiles (gguf_gemv_avx2, float32 x and outputs, as GGUFWeight.linear calls it there), the embedding
// rows are dequantized to float32, and norms, RoPE, the cache writes and paged attention take float32 tensors, as
// the module path does (tests/test_decode_stack_avx2.py).

#include <ATen/ATen.h>

#include "batch_invariant.h"
#include "registrations.h"
#include "cpu_kernels.h"
#include "fp8_linear.h"
#include "gguf_linear.h"
#include "packed_experts.h"
#include "vnni_linear.h"

#include <string>
#include <vector>

namespace {

// qtype of an FP8 block-scaled Lin (DeepSeek-V3's float8_e4m3fn bytes + float32 scale_inv per 128 x 128 block).
constexpr int64_t kFp8LinQtype = 256;
// qtype of an FP8 Lin whose whole 16-row tiles are in the CPU tile layout (fp8_block_linear's tiled).
constexpr int64_t kFp8LinTiledQtype = 257;
// qtype of a GGUF Lin on the AVX2 GEMV: this + its ggml type (engine/cpu_decode_stack.py's GGUF_AVX2_QTYPE).
constexpr int64_t kGgufAvx2Qtype = 512;

// One linear y = x W^T (+ b): VNNI blocks (qtype -1, vnni_linear), packed GGUF tiles (qtype the ggml type id,
// gguf_linear; kGgufAvx2Qtype + the id: gguf_gemv_avx2, in float32, the result in x's dtype) or FP8 block-scaled
// bytes (qtype kFp8LinQtype, or kFp8LinTiledQtype for tiles: fp8_block_linear with ``scale``); ``rows`` = output
// features.
struct Lin {
  at::Tensor w;
  int64_t qtype = -1;
  int64_t rows = 0;
  c10::optional<at::Tensor> bias;
  c10::optional<at::Tensor> scale;  // FP8: scale_inv [ceil(rows / 128), ceil(K / 128)]

  bool defined() const { return w.defined(); }
  bool vnni() const { return qtype < 0; }
  bool avx2() const { return qtype >= kGgufAvx2Qtype; }
  bool fp8() const { return qtype == kFp8LinQtype || qtype == kFp8LinTiledQtype; }
  at::Tensor operator()(const at::Tensor& x) const {
    if (fp8()) return fp8_block_linear(x, w, *scale, bias, qtype == kFp8LinTiledQtype);
    if (avx2()) return f32(x).to(x.scalar_type());  // GGUFWeight.linear at the avx2 level: .to(x.dtype)
    return qtype < 0 ? vnni_linear(x, w, rows, bias) : gguf_linear(x, w, qtype, rows, bias);
  }
  // float32 outputs straight from the accumulator (the LM head's logits, as CausalLM.compute_logits gives them)
  at::Tensor f32(const at::Tensor& x) const {
    if (fp8()) return fp8_block_linear(x.to(at::kFloat), w, *scale, bias, qtype == kFp8LinTiledQtype);
    if (avx2()) return gguf_gemv_avx2(x.to(at::kFloat), w, qtype - kGgufAvx2Qtype, rows, bias);
    return qtype < 0 ? vnni_linear(x, w, rows, bias, true) : gguf_linear(x, w, qtype, rows, bias, true);
  }
};

// (weight, qtype, rows, bias[, scale]) from Python (engine/cpu_decode_stack.py's _lin_spec; the scale for FP8 only).
using LinSpec = pybind11::tuple;
Lin make_lin(const LinSpec& s) {
  TORCH_CHECK(s.size() == 4 || s.size() == 5, "DecodeStack: a Lin is (weight, qtype, rows, bias[, scale])");
  Lin l{s[0].cast<at::Tensor>(), s[1].cast<int64_t>(), s[2].cast<int64_t>(),
        s[3].cast<c10::optional<at::Tensor>>(), std::nullopt};
  if (s.size() == 5) l.scale = s[4].cast<c10::optional<at::Tensor>>();
  TORCH_CHECK(!l.fp8() || l.scale.has_value(), "DecodeStack: an FP8 Lin needs its scale_inv");
  return l;
}

// One SiLU-GLU block: down(silu(gate_up(x))), gate_up rows [gate | up]; or, where gate and up could not be joined
// (GGUF weights of two block types), down(silu(gate(x)) * up(x)) as GatedMLP.forward computes it.
struct GatedMlp {
  Lin gate_up, gate, up, down;

  bool defined() const { return gate_up.defined() || gate.defined(); }
  bool has_bias() const {
    return gate_up.bias.has_value() || gate.bias.has_value() || up.bias.has_value() || down.bias.has_value();
  }
  at::Tensor operator()(const at::Tensor& x) const {
    if (gate_up.defined()) return down(silu_and_mul(gate_up(x)));
    return down(at::silu(gate(x)) * up(x));
  }
};

struct Layer {
  bool mla = false;
  std::vector<Lin> mla_lins;  // MLA on Lin projections: {q_a|kv_a} or {q_a, kv_a}, then q_b, o_proj
  std::vector<Lin> qkv;  // grouped-query layers on Lin projections: {q|k|v} or {q, k, v}; then o
  Lin o;
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
  // routed experts kept packed (set_moe_packed): a PackedExperts format id (packed_experts.h; 2 = FP8 block-scaled,
  // fp8_experts_linear), gate|up and down stacks with their scales and row parts, local experts, all experts
  int64_t packed_fmt = -1, part13 = 0, part2 = 0, num_local = 0, num_experts = 0;
  at::Tensor q13, s13, q2, s2;
};

constexpr int64_t kExpertsFp8Block = 2;  // tokenfab/quant/fp8_block_experts.py's kernel_format

// One grouped linear over a packed expert stack (PackedExperts.kernel_linear; fmt: its kernel_id, the format plus
// kExpertsTiles while the stack is in its CPU tile layout).
at::Tensor packed_grouped(int64_t fmt, const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, int64_t part,
                          const at::Tensor& experts, const at::Tensor& offsets) {
  if (fmt % kExpertsTiles == kExpertsFp8Block)
    return fp8_experts_linear(x, q, s, experts, offsets, part, fmt >= kExpertsTiles);
  return packed_experts_linear(x, fmt, q, s, experts, offsets);
}

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

  // A layer with MLA attention whose projections are Lins (FP8 weights kept packed): a = {q_a|kv_a} or {q_a, kv_a},
  // then q_b and o; w = {q_a_layernorm, kv_a_layernorm, W_UK, W_UV^T (pack_head_weights)}; dims as mla_decode's.
  // Runs mla_decode's steps with the Lins in place of its VNNI linears (MLAttention.forward's module path).
  void add_mla_layer_lin(at::Tensor in_norm, double in_eps, at::Tensor post_norm, double post_eps,
                         std::vector<LinSpec> a, LinSpec q_b, LinSpec o, std::vector<at::Tensor> w,
                         std::vector<int64_t> dims, double eps_q, double eps_kv, double scale) {
    TORCH_CHECK((a.size() == 1 || a.size() == 2) && w.size() == 4 && dims.size() == 7,
                "DecodeStack.add_mla_layer_lin: {q_a|kv_a} or {q_a, kv_a}, 4 weights and 7 dims expected");
    Layer l;
    l.mla = true;
    l.in_norm = std::move(in_norm), l.in_eps = in_eps, l.post_norm = std::move(post_norm), l.post_eps = post_eps;
    for (const auto& s : a) l.mla_lins.push_back(make_lin(s));
    l.mla_lins.push_back(make_lin(q_b));
    l.mla_lins.push_back(make_lin(o));
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

  // A grouped-query layer whose projections are Lins (GGUF tiles or VNNI blocks): qkv = {q|k|v} or {q, k, v},
  // o = o_proj, qk_norms = {q_norm, k_norm} (Qwen3) or {}; dims = {H, Hk, D}. Runs gqa_attend between them.
  void add_gqa_layer_lin(at::Tensor in_norm, double in_eps, at::Tensor post_norm, double post_eps,
                         std::vector<LinSpec> qkv, LinSpec o, std::vector<at::Tensor> qk_norms,
                         std::vector<int64_t> dims, double eps, double scale) {
    TORCH_CHECK((qkv.size() == 1 || qkv.size() == 3) && dims.size() == 3 && (qk_norms.empty() || qk_norms.size() == 2),
                "DecodeStack.add_gqa_layer_lin: {q|k|v} or {q, k, v}, 3 dims and 0 or 2 q/k norms expected");
    Layer l;
    l.in_norm = std::move(in_norm), l.in_eps = in_eps, l.post_norm = std::move(post_norm), l.post_eps = post_eps;
    for (const auto& s : qkv) l.qkv.push_back(make_lin(s));
    l.o = make_lin(o);
    l.attn_w = std::move(qk_norms), l.attn_dims = std::move(dims), l.eps_a = eps, l.scale = scale;
    layers_.push_back(std::move(l));
  }

  // The last added layer's dense SiLU-GLU (or, after set_moe, its shared expert) over VNNI blocks.
  void set_gated_mlp(at::Tensor gate_up, c10::optional<at::Tensor> gate_up_bias, int64_t gate_up_rows,
                     at::Tensor down, c10::optional<at::Tensor> down_bias, int64_t down_rows) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack.set_gated_mlp: add a layer first");
    GatedMlp g;
    g.gate_up = Lin{std::move(gate_up), -1, gate_up_rows, std::move(gate_up_bias)};
    g.down = Lin{std::move(down), -1, down_rows, std::move(down_bias)};
    layers_.back().mlp = std::move(g);
  }

  // The last added layer's dense SiLU-GLU over Lins: gate_up = {gate|up} or {gate, up}, then down.
  void set_gated_mlp_lin(std::vector<LinSpec> gate_up, LinSpec down) {
    TORCH_CHECK(!layers_.empty() && (gate_up.size() == 1 || gate_up.size() == 2),
                "DecodeStack.set_gated_mlp_lin: add a layer first; {gate|up} or {gate, up} expected");
    GatedMlp g;
    if (gate_up.size() == 1) {
      g.gate_up = make_lin(gate_up[0]);
    } else {
      g.gate = make_lin(gate_up[0]), g.up = make_lin(gate_up[1]);
    }
    g.down = make_lin(down);
    layers_.back().mlp = std::move(g);
  }

  // The embedding as a packed GGUF weight (tiles [ceil(vocab / 16), hidden / 32, bytes], ggml type, vocab rows):
  // its rows are dequantized by gguf_embedding instead of read from a table, to bf16 (``bf16``) or float32.
  void set_gguf_embedding(at::Tensor tiles, int64_t qtype, int64_t rows, bool bf16) {
    embed_ = std::move(tiles), embed_qtype_ = qtype, embed_rows_ = rows, embed_bf16_ = bf16;
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

  // The last added layer's DeepSeek-V3 MoE with its routed experts kept packed (RoutedExperts.q13 / q2, format
  // ``fmt``, PackedExperts.kernel_format): the router as set_moe, then RoutedExperts.packed_forward's ops in its order.
  void set_moe_packed(at::Tensor router_w, at::Tensor router_bias, int64_t n_group, int64_t topk_group, int64_t top_k,
                      bool norm_topk, double routed_scale, int64_t fmt, at::Tensor q13, at::Tensor s13, int64_t part13,
                      at::Tensor q2, at::Tensor s2, int64_t part2, int64_t start, int64_t num_experts) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack.set_moe_packed: add a layer first");
    TORCH_CHECK(router_w.scalar_type() == at::kFloat && q13.dim() == 3 && q2.dim() == 3 && q13.size(0) == q2.size(0),
                "DecodeStack.set_moe_packed: float32 router weight and gate_up / down stacks of one expert count");
    Layer& l = layers_.back();
    l.moe = true;
    l.router_w = std::move(router_w), l.router_bias = std::move(router_bias);
    l.n_group = n_group, l.topk_group = topk_group, l.top_k = top_k, l.norm_topk = norm_topk;
    l.routed_scale = routed_scale, l.expert_start = start, l.num_local = q13.size(0), l.num_experts = num_experts;
    l.packed_fmt = fmt, l.q13 = std::move(q13), l.s13 = std::move(s13), l.part13 = part13;
    l.q2 = std::move(q2), l.s2 = std::move(s2), l.part2 = part2;
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
  void set_lm_head(at::Tensor packed, int64_t rows) { lm_head_ = Lin{std::move(packed), -1, rows, std::nullopt}; }

  // The LM head as any Lin (a packed GGUF weight, e.g. the tied Q8_0 token embedding of a GGUF file).
  void set_lm_head_lin(LinSpec lin) { lm_head_ = make_lin(lin); }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // forward, then the LM head's float32 logits (CausalLM.compute_logits) and one token per sequence drawn by
  // sample_plain at temperatures ``temps`` [T] float32 with uniforms ``u`` [T]: the Sampler's plain path in the same
  // call, so no Python runs between the forward and the draw. Returns int64 [T].
  at::Tensor forward_sample(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                            std::vector<at::Tensor> caches, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, const at::Tensor& temps, const at::Tensor& u) const {
    TORCH_CHECK(lm_head_.defined(), "DecodeStack.forward_sample: set_lm_head first");
    const auto h = forward(input_ids, positions, slot_mapping, std::move(caches), block_tables, context_lens);
    return sample_plain(lm_head_.f32(h), temps, u);
  }

  // input_ids, positions, slot_mapping [T] int64 (or an empty slot_mapping: computed here from positions and
  // block_tables); caches: per layer its latent pool (MLA) or k and v pools (GQA), flattened in layer order;
  // block_tables [T, max_blocks], context_lens [T]. Returns the final-normed hidden states [T, hidden] in the
  // activations' dtype (bf16; float32 at the avx2 level).
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping_in,
                     std::vector<at::Tensor> caches, const at::Tensor& block_tables,
                     const at::Tensor& context_lens) const {
    TORCH_CHECK(!caches.empty(), "DecodeStack.forward: no KV caches");
    const at::Tensor slot_mapping = slot_mapping_in.numel() == 0 && input_ids.numel() > 0
                                        ? decode_slots(positions, block_tables, caches[0].size(1))
                                        : slot_mapping_in;
    size_t c = 0;
    auto h = embed_qtype_ < 0 ? at::embedding(embed_, input_ids)
                              : gguf_embedding(embed_, embed_qtype_, embed_rows_, input_ids, embed_bf16_);
    for (const Layer& l : layers_) {
      const auto a = rms_norm(h, std::nullopt, l.in_norm, l.in_eps)[0];
      at::Tensor o;
      if (!l.qkv.empty()) {  // LlamaAttention.forward's module path, its linears Lins
        TORCH_CHECK(c + 1 < caches.size(), "DecodeStack.forward: fewer KV caches than layers");
        const int64_t T = a.size(0), H = l.attn_dims[0], Hk = l.attn_dims[1], D = l.attn_dims[2];
        at::Tensor q, k, v;
        if (l.qkv.size() == 1) {
          const auto qkv = l.qkv[0](a);
          q = qkv.slice(1, 0, H * D).view({T, H, D});
          k = qkv.slice(1, H * D, (H + Hk) * D).view({T, Hk, D});
          v = qkv.slice(1, (H + Hk) * D, (H + 2 * Hk) * D).view({T, Hk, D});
        } else {
          q = l.qkv[0](a).view({T, H, D}), k = l.qkv[1](a).view({T, Hk, D}), v = l.qkv[2](a).view({T, Hk, D});
        }
        const auto att = gqa_attend(q, k, v, positions, slot_mapping, caches[c], caches[c + 1], block_tables,
                                    context_lens, l.attn_w, cos_, sin_, interleave_, l.eps_a, l.scale);
        o = l.o(att.view({T, H * D}));
        c += 2;
      } else if (l.mla && !l.mla_lins.empty()) {
        TORCH_CHECK(c < caches.size(), "DecodeStack.forward: fewer KV caches than layers");
        o = mla_lin(l, a, positions, slot_mapping, caches[c], block_tables, context_lens);
        c += 1;
      } else if (l.mla) {
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
        if (l.packed_fmt >= 0) {  // routed experts kept packed, then the shared expert as DeepseekV3MoE adds it
          m = packed_moe(l, x, route[0], route[1]);
          if (l.mlp.defined()) m = m + l.mlp(x);
        } else {
          const bool fused = l.mlp.gate_up.defined() && l.mlp.gate_up.vnni() && l.mlp.down.vnni() && !l.mlp.has_bias();
          m = moe_experts_packed(x, route[0], route[1], l.p13, l.p2, l.expert_start,
                                 fused ? c10::optional<at::Tensor>(l.mlp.gate_up.w) : std::nullopt,
                                 fused ? c10::optional<at::Tensor>(l.mlp.down.w) : std::nullopt);
          if (l.mlp.defined() && !fused) m = m + l.mlp(x);
        }
      } else {
        m = l.mlp(x);
      }
      h = xh[1] + m;
    }
    TORCH_CHECK(c == caches.size(), "DecodeStack.forward: ", caches.size(), " KV caches for ", c, " expected");
    return rms_norm(h, std::nullopt, final_norm_, final_eps_)[0];
  }

 private:
  // mla_decode (decode_blocks.cpp) with the layer's Lins as its three projections, step for step: MLAttention.forward's
  // module path on packed linears (a separate q_a / kv_a pair where their rows could not be joined).
  at::Tensor mla_lin(const Layer& l, const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     at::Tensor& cache, const at::Tensor& block_tables, const at::Tensor& context_lens) const {
    const auto& d = l.attn_dims;
    const int64_t q_lora = d[0], C = d[1], R = d[2], H = d[3], nope = d[4], vd = d[5], T = x.size(0);
    const auto& lins = l.mla_lins;
    at::Tensor q_a, ckv, kr;
    if (lins.size() == 3) {
      const auto a = lins[0](x);  // [T, q_lora + C + R]
      q_a = a.slice(1, 0, q_lora), ckv = a.slice(1, q_lora, q_lora + C), kr = a.slice(1, q_lora + C, q_lora + C + R);
    } else {
      q_a = lins[0](x);
      const auto kv = lins[1](x);  // [T, C + R]
      ckv = kv.slice(1, 0, C), kr = kv.slice(1, C, C + R);
    }
    const auto q = lins[lins.size() - 2](rms_norm(q_a, std::nullopt, l.attn_w[0], l.eps_a)[0]).view({T, H, nope + R});
    const auto c_kv = rms_norm(ckv, std::nullopt, l.attn_w[1], l.eps_b)[0];  // [T, C]
    const auto q_rope = rope(q.slice(2, nope, nope + R), positions, cos_, sin_, interleave_);  // [T, H, R]
    const auto k_rope = rope(kr.unsqueeze(1), positions, cos_, sin_, interleave_);
    const auto slots = checked_slots(slot_mapping, cache, "DecodeStack (MLA)");
    write_slots(cache, slots, 0, c_kv);  // the cache row is [c_kv | k_rope]
    write_slots(cache, slots, C, k_rope);
    auto q_lat = at::empty({T, H, C + R}, x.options());
    auto q_lat_c = q_lat.slice(2, 0, C);
    head_gemm_(q.slice(2, 0, nope), l.attn_w[2], q_lat_c);
    q_lat.slice(2, C, C + R).copy_(q_rope);
    const auto lat = cache.unsqueeze(2);  // [blocks, block_size, 1, C + R]: one latent "head", values = first C
    const auto o_lat = paged_decode_attention(q_lat, lat, lat.slice(3, 0, C), block_tables, context_lens, l.scale);
    auto o = at::empty({T, H, vd}, x.options());
    head_gemm_(o_lat, l.attn_w[3], o);
    return lins.back()(o.view({T, H * vd}));
  }

  // RoutedExperts.packed_forward, op for op (the same ATen kernels on the same tensors, so bit-identical): pairs
  // sorted by expert (stable), one grouped linear per projection over the active local experts, silu_and_mul in
  // between, each row times its float32 routing weight rounded to x's dtype and summed with index_add.
  at::Tensor packed_moe(const Layer& l, const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids) const {
    const int64_t k = ids.size(1), start = l.expert_start;
    const auto flat = ids.reshape({-1});
    auto order = at::argsort(flat, true, 0, false);
    const auto counts = at::bincount(flat, {}, l.num_experts).slice(0, start, start + l.num_local).contiguous();
    const int64_t lo = start ? (flat < start).sum().item<int64_t>() : 0;
    auto out = at::zeros_like(x);
    const int64_t* cp = counts.data_ptr<int64_t>();
    std::vector<int64_t> ex, offs{0};
    for (int64_t e = 0; e < l.num_local; ++e)
      if (cp[e]) ex.push_back(e), offs.push_back(offs.back() + cp[e]);
    if (ex.empty()) return out;
    order = order.slice(0, lo, lo + offs.back());
    const auto token_of = at::floor_divide(order, k);
    const auto w_sorted = weights.reshape({-1}).index({order});
    const auto et = at::tensor(ex, at::kLong), ot = at::tensor(offs, at::kLong);
    const auto h13 = packed_grouped(l.packed_fmt, x.index({token_of}), l.q13, l.s13, l.part13, et, ot);
    const auto h = packed_grouped(l.packed_fmt, silu_and_mul(h13), l.q2, l.s2, l.part2, et, ot);
    out.index_add_(0, token_of, (h.to(w_sorted.scalar_type()) * w_sorted.unsqueeze(1)).to(out.scalar_type()));
    return out;
  }

  at::Tensor embed_, final_norm_;
  int64_t embed_qtype_ = -1, embed_rows_ = 0;  // a packed GGUF embedding: its ggml type and rows
  bool embed_bf16_ = true;                      // ... and the dtype its rows are dequantized to
  double final_eps_;
  at::Tensor cos_, sin_;
  bool interleave_;
  std::vector<Layer> layers_;
  Lin lm_head_;
};

}  // namespace

void register_decode_stack(pybind11::module_& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack", "the decoder stack of a decode-only CPU step in one call")
      .def(pybind11::init<at::Tensor, at::Tensor, double, at::Tensor, at::Tensor, bool>())
      .def("add_mla_layer", &DecodeStack::add_mla_layer)
      .def("add_gqa_layer", &DecodeStack::add_gqa_layer)
      .def("add_mla_layer_lin", &DecodeStack::add_mla_layer_lin)
      .def("add_gqa_layer_lin", &DecodeStack::add_gqa_layer_lin)
      .def("set_gated_mlp", &DecodeStack::set_gated_mlp)
      .def("set_gated_mlp_lin", &DecodeStack::set_gated_mlp_lin)
      .def("set_gguf_embedding", &DecodeStack::set_gguf_embedding)
      .def("set_lm_head_lin", &DecodeStack::set_lm_head_lin)
      .def("set_moe", &DecodeStack::set_moe)
      .def("set_moe_softmax", &DecodeStack::set_moe_softmax)
      .def("set_moe_packed", &DecodeStack::set_moe_packed)
      .def("set_lm_head", &DecodeStack::set_lm_head)
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_sample", &DecodeStack::forward_sample, pybind11::call_guard<pybind11::gil_scoped_release>());
}
