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

// y = x W^T + b for x [M, K] bf16 and W from pack_dot_weight or pack_block_weights: the
// same bits for a row whatever M is, and from the blocks as from the bf16 weight
// (dot_linear.cpp).
at::Tensor dot_linear(const at::Tensor& x, const at::Tensor& w,
                      const std::optional<at::Tensor>& bias);

}  // namespace conveyor
