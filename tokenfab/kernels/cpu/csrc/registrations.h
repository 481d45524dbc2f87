// The functions that add each kernel family's functions and classes to the extension module (bindings.cpp calls
// them). Only the files defining them and bindings.cpp include pybind11 (torch's type casters for at::Tensor); the
// kernel headers include ATen alone, which keeps the build short (torch/extension.h would pull in the whole C++
// frontend into every file: about 4x the parse time).
#pragma once
#include <torch/csrc/utils/pybind.h>

// The DecodeStack class (decode_stack.cpp).
void register_decode_stack(pybind11::module_& m);
// fp8_block_linear (its AVX2 form from fp8_linear_avx2.cpp) and the FP8 expert kernels (fp8_linear.cpp).
void register_fp8_linear(pybind11::module_& m);
// gguf_linear, gguf_gemv_avx2, gguf_embedding and their settings (gguf_linear.cpp).
void register_gguf_linear(pybind11::module_& m);
// The packed routed-expert kernels (packed_experts.cpp; the AVX2 one from packed_experts_avx2.cpp).
void register_packed_experts(pybind11::module_& m);
