// What the AMX kernels (gguf_linear.cpp, fp8_linear.cpp) share: whether this thread may use AMX tiles, and loading
// a three-tile configuration. Compiled only where the build targets AMX-BF16 (TOKENFAB_AMX); the run-time answer
// also needs TOKENFAB_CPU_ISA at amx (cpu_isa.h) and the Linux kernel's permission.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TOKENFAB_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "cpu_isa.h"

namespace tokenfab_cpu {

// True when AMX tiles may be used here: the ISA setting allows it and the Linux kernel granted the tile data state
// (arch_prctl ARCH_REQ_XCOMP_PERM, asked once per process).
inline bool amx_ready() {
  if (!amx_allowed()) return false;  // TOKENFAB_CPU_ISA below amx
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads tiles 0..2 of 64 bytes a row with rows0 / rows1 / rows2 rows (the kernels' C, A and B tiles). Inline
// assembly with fixed tile registers: GCC's AMX intrinsics let its tile-register pass insert a ldtilecfg of its own
// (a partly uninitialized one: #GP) into the calling function.
inline void amx_load_config(int rows0, int rows1, int rows2) {
  TileConfig c;
  c.colsb[0] = c.colsb[1] = c.colsb[2] = 64;
  c.rows[0] = static_cast<uint8_t>(rows0);
  c.rows[1] = static_cast<uint8_t>(rows1);
  c.rows[2] = static_cast<uint8_t>(rows2);
  asm volatile("ldtilecfg %0" ::"m"(c));
}

}  // namespace tokenfab_cpu
#endif
