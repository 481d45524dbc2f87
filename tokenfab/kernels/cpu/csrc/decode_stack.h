// The DecodeStack class (decode_stack.cpp), added to the extension module by bindings.cpp.
#pragma once
#include <torch/extension.h>

// Adds the DecodeStack class to the extension module.
void register_decode_stack(pybind11::module_& m);
