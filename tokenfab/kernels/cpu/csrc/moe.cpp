// Mixture-of-experts on CPU: the DeepSeek-V3 sigmoid group-limited router and the routed (+ shared) experts over
// packed weights.
#include "cpu_common.h"
#include "cpu_kernels.h"
#include "vnni_linear.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <string_view>

using namespace tokenfab_cpu;

// ---------------------------------------------------------------------------------------------------------------
// DeepSeek-V3 / Kimi-K2 router (noaux_tc) after its float32 logits, one row per token: scores = sigmoid(logits);
// choice = scores + bias; groups ranked by the sum of their top-2 choice scores and the best topk_group kept; the
// top_k experts of the kept groups by choice score; weights = the unbiased scores of those experts, divided by
// their sum (+1e-20) when norm, times scale. Replaces ~13 small ops of SigmoidGroupRouter.forward (transformers'
// DeepseekV3TopkRouter order); ties go to the lower index.
std::vector<at::Tensor> sigmoid_group_topk(const at::Tensor& logits, const at::Tensor& bias, int64_t n_group,
                                           int64_t topk_group, int64_t top_k, bool norm, double scale) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat &&
              bias.numel() == logits.size(1), "sigmoid_group_topk: logits [T, E] and bias [E] float32 expected");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group && top_k >= 1 &&
              top_k <= (E / n_group) * (n_group > 1 ? topk_group : 1), "sigmoid_group_topk: bad group / top-k sizes");
  const auto lc = logits.contiguous();
  const auto bc = bias.contiguous();
  auto w = at::empty({T, top_k}, lc.options());
  auto ids = at::empty({T, top_k}, lc.options().dtype(at::kLong));
  const float* lp = lc.data_ptr<float>();
  const float* bp = bc.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t gs = E / n_group;
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> sc(E), ch(E), gscore(n_group);
    std::vector<char> allowed(E);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        sc[e] = 1.0f / (1.0f + std::exp(-lp[t * E + e]));
        ch[e] = sc[e] + bp[e];
      }
      std::fill(allowed.begin(), allowed.end(), static_cast<char>(n_group == 1));
      if (n_group > 1) {
        for (int64_t g = 0; g < n_group; ++g) {  // sum of the group's two largest choice scores
          float a = -std::numeric_limits<float>::infinity(), b = a;
          for (int64_t e = g * gs; e < (g + 1) * gs; ++e) {
            if (ch[e] > a) { b = a; a = ch[e]; } else if (ch[e] > b) { b = ch[e]; }
          }
          gscore[g] = gs >= 2 ? a + b : a;
        }
        for (int64_t r = 0; r < topk_group; ++r) {
          int64_t best = -1;
          for (int64_t g = 0; g < n_group; ++g)
            if (!allowed[g * gs] && (best < 0 || gscore[g] > gscore[best])) best = g;  // not yet kept
          for (int64_t e = best * gs; e < (best + 1) * gs; ++e) allowed[e] = 1;
        }
      }
      float sum = 0.f;
      for (int64_t j = 0; j < top_k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
          if (allowed[e] == 1 && (best < 0 || ch[e] > ch[best])) best = e;
        allowed[best] = 2;  // taken
        ip[t * top_k + j] = best;
        wp[t * top_k + j] = sc[best];
        sum += sc[best];
      }
      const float denom = sum + 1e-20f;
      for (int64_t j = 0; j < top_k; ++j)
        wp[t * top_k + j] = (norm ? wp[t * top_k + j] / denom : wp[t * top_k + j]) * static_cast<float>(scale);
    }
  });
  return {w, ids};
}

// ---------------------------------------------------------------------------------------------------------------
// Routed experts with packed weights (tokenfab's VNNI blocks, vnni_linear.cpp, or oneDNN's): the whole token ->
// expert dispatch in one call (the Python version spent ~230 us per MoE layer at batch 1 on ~25 small ops around its
// 4 GEMMs, benchmarks/NOTES.md). Same arithmetic and order as RoutedExperts.forward's packed path: (token, slot)
// pairs grouped by expert in increasing expert id (stable within an expert), per expert one packed GEMM [n, H] ->
// [n, 2I], SiLU-GLU, one packed GEMM -> [n, H]; each row scaled by its float32 routing weight and rounded to bf16,
// then summed per token in that order in float32 and rounded once
// (what `out.index_add_(0, token_of, (h * w).to(bf16))` does on CPU).
// With VNNI weights the experts' GEMMs go through vnni_linear_group: all experts' gate_up GEMVs in one parallel
// region, then all down GEMVs in one (decode: T * k pairs over few experts), with a shared expert (shared_gate_up,
// shared_down: packed [2I_s, H] and [H, I_s], no bias) in the same two regions; the result is then
// `routed + shared` rounded as a bf16 tensor add rounds (DeepseekV3MoE.forward's order).
at::Tensor moe_experts_packed(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                              const std::vector<at::Tensor>& p13, const std::vector<at::Tensor>& p2, int64_t start,
                              const c10::optional<at::Tensor>& shared_gate_up,
                              const c10::optional<at::Tensor>& shared_down) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && ids.dim() == 2 && weights.sizes() == ids.sizes() &&
              ids.size(0) == x.size(0) && p13.size() == p2.size(), "moe_experts_packed: x [T, H] bf16, weights / ids "
              "[T, k], one packed gate_up and down weight per local expert expected");
  const bool shared = shared_gate_up.has_value() && shared_gate_up->defined();
  TORCH_CHECK(shared == (shared_down.has_value() && shared_down->defined()) &&
              (!shared || (shared_gate_up->dim() == 4 && shared_down->dim() == 4)),
              "moe_experts_packed: a shared expert needs both its gate_up and down weights, VNNI-packed");
  static const auto linear = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  const auto xc = x.contiguous();
  const auto idc = ids.to(at::kLong).contiguous();
  const auto wc = weights.to(at::kFloat).contiguous();
  const int64_t T = xc.size(0), H = xc.size(1), k = idc.size(1), E = static_cast<int64_t>(p13.size());
  const int64_t* idp = idc.data_ptr<int64_t>();
  const float* wp = wc.data_ptr<float>();
  std::vector<std::vector<int64_t>> pairs(E);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t e = idp[p] - start;
    if (e >= 0 && e < E) pairs[e].push_back(p);
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  std::vector<int64_t> active;  // local experts with pairs, in increasing id
  std::vector<at::Tensor> xs;   // their gathered rows
  for (int64_t e = 0; e < E; ++e) {
    const auto& pe = pairs[e];
    const int64_t n = static_cast<int64_t>(pe.size());
    if (n == 0) continue;
    auto xe = at::empty({n, H}, xc.options());
    auto* xsp = reinterpret_cast<uint16_t*>(xe.data_ptr());
    for (int64_t i = 0; i < n; ++i) std::memcpy(xsp + i * H, xp + (pe[i] / k) * H, H * sizeof(uint16_t));
    active.push_back(e);
    xs.push_back(xe);
  }
  const bool vnni = std::all_of(active.begin(), active.end(), [&](int64_t e) { return p13[e].dim() == 4; });
  std::vector<at::Tensor> hs;  // per active expert [n, H], then (with a shared expert) the shared output [T, H]
  if (vnni) {  // gate_up GEMVs of every expert (and the shared one) in one region, then every down GEMV in one
    std::vector<at::Tensor> w13, w2;
    std::vector<int64_t> n13, n2;
    for (int64_t e : active) {
      w13.push_back(p13[e]), w2.push_back(p2[e]);
      n13.push_back(p2[e].size(1) * 4), n2.push_back(H);  // gate_up [2I, H]: 2I = 2 * (down's K = 2 * K/2)
    }
    if (shared) {
      xs.push_back(xc);
      w13.push_back(*shared_gate_up), w2.push_back(*shared_down);
      n13.push_back(shared_down->size(1) * 4), n2.push_back(H);
    }
    auto h13 = vnni_linear_group(xs, w13, n13);
    for (auto& h : h13) h = silu_and_mul(h);
    hs = vnni_linear_group(h13, w2, n2);
  } else {
    TORCH_CHECK(!shared, "moe_experts_packed: a shared expert needs VNNI-packed routed experts");
    const c10::List<std::optional<at::Scalar>> no_scalars;
    for (size_t i = 0; i < active.size(); ++i) {
      const int64_t e = active[i];
      const auto h13 = linear.call(xs[i], p13[e], std::nullopt, "none", no_scalars, std::string_view(""));
      hs.push_back(
          linear.call(silu_and_mul(h13), p2[e], std::nullopt, "none", no_scalars, std::string_view("")).contiguous());
    }
  }
  std::vector<float> acc(T * H, 0.f);  // index_add_ on bf16 sums in float32 and rounds once
  for (size_t i = 0; i < active.size(); ++i) {
    const auto& pe = pairs[active[i]];
    const auto* hp = reinterpret_cast<const uint16_t*>(hs[i].data_ptr());
    for (size_t r = 0; r < pe.size(); ++r) {
      float* a = acc.data() + (pe[r] / k) * H;
      const uint16_t* hr = hp + r * H;
      const float w = wp[pe[r]];
      for (int64_t c = 0; c < H; ++c) a[c] += bf16_to_f(f_to_bf16(bf16_to_f(hr[c]) * w));
    }
  }
  auto out = at::empty_like(xc);
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (shared) {  // bf16 routed sum + bf16 shared output, rounded once more (a bf16 tensor add)
    const auto* sp = reinterpret_cast<const uint16_t*>(hs.back().data_ptr());
    for (int64_t i = 0; i < T * H; ++i) op[i] = f_to_bf16(bf16_to_f(f_to_bf16(acc[i])) + bf16_to_f(sp[i]));
    return out;
  }
  for (int64_t i = 0; i < T * H; ++i) op[i] = f_to_bf16(acc[i]);
  return out;
}
