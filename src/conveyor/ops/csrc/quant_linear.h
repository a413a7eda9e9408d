// Matmuls on GGUF block-quantized weights (quant_linear.cpp: AMX; dot_linear.cpp: AVX512-BF16),
// for cpu_ops.cpp's decode loop.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace conveyor {

// The most rows (tokens) quantized_linear takes in one call.
constexpr int64_t kQuantizedMaxRows = 64;

// y = x W^T + b for x [M <= kQuantizedMaxRows, K] bf16 and W packed by pack_block_weights:
// bit-identical to oneDNN's bf16 matmul on the dequantized weights (what the loader makes of
// the same blocks), while reading 0.56-1.06 bytes per weight instead of 2.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias);

// Whether the kernels were built with AVX512-BF16 (dot_linear can run).
bool dot_linear_available();

// w bf16 [N, K] (N a multiple of 16, K even) -> the pair tiles dot_linear reads.
at::Tensor pack_dot_weight(const at::Tensor& w);

// raw GGUF blocks uint8 [N, K/32, block bytes] -> the pair-major records dot_linear reads.
at::Tensor pack_dot_blocks(const at::Tensor& raw, int64_t type);

// y = x W^T + b for x [M, K] bf16 and W from pack_dot_weight (bf16) or pack_dot_blocks (the
// exact GGUF weights): the same bits for a row whatever M is (dot_linear.cpp, dot_blocks.cpp).
at::Tensor dot_linear(const at::Tensor& x, const at::Tensor& w,
                      const std::optional<at::Tensor>& bias);

// dot_linear's block path: x contiguous, w from pack_dot_blocks, bias float32 [N] or null.
at::Tensor dot_blocks_linear(const at::Tensor& x, const at::Tensor& w, const float* bias);

}  // namespace conveyor
