// AMX tile registers, shared by the kernels that use them (quant_linear.cpp,
// prefill_attention.cpp): whether they can run, and the one tile configuration they load.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define CONVEYOR_AMX 1
#include <immintrin.h>
#endif

namespace conveyor {

// Built with AMX-BF16, and the kernel granted this process the tile registers.
bool amx_available();

#ifdef CONVEYOR_AMX
// All 8 tiles at their largest: 16 rows x 64 bytes (16 x 32 bf16, or 16 x 16 float32 / bf16
// pairs), as the kernels use them (decode attention over the tile layout narrows two, in a
// config derived from this one). Load per task with _tile_loadconfig; oneDNN loads its own.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      rows[t] = 16;
      colsb[t] = 64;
    }
  }
};

inline void load_tile_config() {
  static thread_local const TileConfig config;
  _tile_loadconfig(&config);
}
#endif

}  // namespace conveyor
