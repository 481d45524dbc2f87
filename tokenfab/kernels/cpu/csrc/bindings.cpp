// The Python module of tokenfab's fused CPU kernels (tokenfab/kernels/cpu/ops/ wraps it): every binding in
// one place, each kernel defined in the file cpu_kernels.h / vnni_linear.h names.
#include "batch_invariant.h"
#include "cpu_isa.h"
#include "cpu_kernels.h"
#include "fp8_linear.h"
#include "gguf_linear.h"
#include "packed_experts.h"
#include "registrations.h"
#include "vnni_linear.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
#if defined(__AVX512BF16__)
  m.attr("has_bf16_dot") = true;
#else
  m.attr("has_bf16_dot") = false;
#endif
  m.def("set_isa_cap", [](int level) { tokenfab_cpu::isa_cap().store(level); },
        "cap the instruction sets the kernels use: 0 avx2, 1 avx512_bf16, 2 amx (TOKENFAB_CPU_ISA)");
  m.def("isa_cap", [] { return tokenfab_cpu::isa_cap().load(); }, "the kernels' instruction-set cap");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally fused with a residual add (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "SiLU-GLU (CPU)");
  m.def("rope", &rope, "rotary embedding (CPU)");
  m.def("causal_softmax_", &causal_softmax_, "in-place causal softmax of prefill scores (CPU)");
  m.def("flash_prefill_attention", &flash_prefill_attention,
        "causal prefill attention, online softmax over key blocks, two brgemms per block (CPU, bf16)");
  m.def("sigmoid_group_topk", &sigmoid_group_topk, "DeepSeek-V3 sigmoid group-limited top-k routing (CPU)");
  m.def("moe_experts_packed", &moe_experts_packed, "routed experts over packed weights (CPU, bf16)", py::arg("x"),
        py::arg("weights"), py::arg("ids"), py::arg("p13"), py::arg("p2"), py::arg("start"),
        py::arg("shared_gate_up") = py::none(), py::arg("shared_down") = py::none());
  m.def("pack_linear_weight", &pack_linear_weight, "bf16 weight [N, K] -> VNNI blocks [N/32, K/2, 32, 2] (CPU)");
  m.def("vnni_linear", &vnni_linear, "x W^T (+ b) over VNNI-blocked weights (CPU, bf16; float32 out with out_f32)",
        py::arg("x"), py::arg("wp"), py::arg("n"), py::arg("bias") = py::none(), py::arg("out_f32") = false);
  m.def("vnni_linear_group", &vnni_linear_group, "several bias-free vnni_linear calls, GEMVs in one parallel region");
  m.def("sample_plain", &sample_plain, "temperature sampling by inverse CDF, no top-k / top-p (CPU)");
  m.def("gqa_decode", &gqa_decode, "grouped-query attention decode block, x -> o_proj output (CPU, bf16)");
  m.def("mla_decode", &mla_decode, "MLA absorbed decode attention block, x -> o_proj output (CPU, bf16)");
  m.def("head_gemm_", &head_gemm_, "per-head GEMM with VNNI-packed weights into y (CPU, AVX512-BF16)");
  m.def("set_batch_invariant", &set_batch_invariant, "set this thread's batch-invariant kernel mode; returns the old");
  m.def("batch_invariant", &tokenfab_cpu::batch_invariant, "this thread's batch-invariant kernel mode");
  m.def("rowwise_linear_f32", &rowwise_linear_f32, "float32 x w^T with one fixed-order dot per output (CPU)");
  register_decode_stack(m);
  register_gguf_linear(m);
  register_fp8_linear(m);
  register_packed_experts(m);
}
