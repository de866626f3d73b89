// What every AMX user here needs before its first tile instruction (kernels/cpu/amx_bf16.h, the
// GEMM; kernels/cpu/fma_peak.cpp, the roof): the process's permission to use the tile state, and a
// palette with all 8 tiles at their full 16 rows x 64 bytes. Empty where the build has no AMX.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

// The kernel hands a process the 8 KiB tile state only on request (Linux >= 5.16).
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// A kernel's exported switch for its tile path: `on` = 1 or 0 sets `flag` (the tests compare the
// paths), -1 only asks; 1 when the tiles will be used.
inline int amx_switch(bool& flag, int on) {
  if (on >= 0) flag = on != 0;
  return flag && amx_permitted() ? 1 : 0;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes. The configuration is per-thread state: each thread that uses tiles
// loads it (and releases the tiles when done).
inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace
#endif
