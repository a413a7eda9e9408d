// Pair tiles, shared by the AVX512-BF16 matmul kernels (dot_linear.cpp on bf16 weights,
// dot_blocks.cpp on GGUF blocks): 16 output rows are the 16 lanes of one float32 sum vector,
// and a task takes 4 such groups side by side (64 outputs).
#pragma once

#include <cstdint>

#include "simd_math.h"

namespace conveyor {

constexpr int64_t kGroupRows = 16;  // output rows of a pair tile (and of a GGUF record)
constexpr int64_t kTaskGroups = 4;  // pair tiles per task: 64 outputs, 4 sums per token

#ifdef CONVEYOR_AVX512BF16
// y rows [m0, m0 + MR) (row stride n), outputs [n0, n0 + 16 * groups) = the sums plus the
// bias (float32 [n] or null), rounded to bf16.
template <int MR>
inline void store_sums(const __m512 (&acc)[MR][kTaskGroups], int64_t groups, const float* bias,
                       uint16_t* y, int64_t n, int64_t n0, int64_t m0) {
  for (int64_t j = 0; j < groups; ++j) {
    const int64_t col = n0 + j * kGroupRows;
    const __m512 b = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i)
      _mm256_storeu_si256((__m256i*)(y + (m0 + i) * n + col),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b)));
  }
}
#endif

}  // namespace conveyor
