// The instruction sets the fused CPU kernels may use at run time: the build targets this CPU (-march=native), and
// TOKENFAB_CPU_ISA (tokenfab/kernels/cpu/isa.py) may cap it lower, so that any machine runs the path a CPU without
// AMX, or without AVX512-BF16, would take. Python sets the cap once after loading the extension (set_isa_cap).
#pragma once
#include <atomic>

namespace tokenfab_cpu {

// Levels as tokenfab.kernels.cpu.isa.LEVELS: 0 avx2 (no AVX512-BF16 dot products), 1 avx512_bf16, 2 amx.
enum IsaLevel : int { kIsaAvx2 = 0, kIsaAvx512Bf16 = 1, kIsaAmx = 2 };

inline std::atomic<int>& isa_cap() {
  static std::atomic<int> cap{kIsaAmx};
  return cap;
}
inline bool bf16_dot_allowed() { return isa_cap().load(std::memory_order_relaxed) >= kIsaAvx512Bf16; }
inline bool amx_allowed() { return isa_cap().load(std::memory_order_relaxed) >= kIsaAmx; }

}  // namespace tokenfab_cpu
