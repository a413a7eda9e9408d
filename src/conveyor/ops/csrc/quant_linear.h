// The matmul kernels' entry points, for cpu_ops.cpp: on GGUF blocks with AMX (quant_linear.cpp);
// with AVX512-BF16 on pair tiles (dot_linear.cpp) and GGUF blocks (dot_blocks.cpp; with
// AVX512-VNNI, int8 inputs: vnni_blocks.cpp); in float32 (f32_linear.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace conveyor {

// The most rows (tokens) the matmuls send to quantized_linear in one call (it takes any
// number). Up to here it costs about what oneDNN's call does (a 2-core AMX Xeon, SmolLM2's
// shapes) and never pays oneDNN's first call at a new row count; above, oneDNN's blocking is
// faster (1.7x at 512 rows).
constexpr int64_t kQuantizedMaxRows = 256;

// The most rows of a call for which oneDNN's bf16 matmul gives every row the bits it gives
// that row alone (on the 2-core AMX Xeon; checked per row count above it, cpu_ops.cpp's
// large_linear). quantized_linear matches oneDNN's bits up to here.
constexpr int64_t kOneDnnSmallRows = 64;

// y = x W^T + b for x [M, K] bf16 and W packed by pack_block_weights:
// bit-identical to oneDNN's bf16 matmul on the dequantized weights (what the loader makes of
// the same blocks), while reading 0.56-1.06 bytes per weight instead of 2.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias);

// Whether the kernels were built with AVX512-BF16 (dot_linear can run).
bool dot_linear_available();

// w bf16 [N, K] (N a multiple of 16, K even) -> the pair tiles dot_linear reads.
at::Tensor pack_dot_weight(const at::Tensor& w);

// raw GGUF blocks uint8 [N, K/32, block bytes] (Q4_K, Q6_K: [N, K/256, ...]) -> the records
// dot_linear reads for x of this dtype (bf16: pair-major, dot_blocks.cpp; float32:
// input-major, f32_linear.cpp); k_mixed (Q4_K, Q6_K): records of the kind both types' parts
// of one fused weight share.
at::Tensor pack_dot_blocks(const at::Tensor& raw, int64_t type, at::ScalarType dtype,
                           bool k_mixed);
at::Tensor pack_bf16_blocks(const at::Tensor& raw, int64_t type, bool k_mixed);

// y = x W^T + b for x [M, K] bf16 or float32 and W from pack_dot_weight (of a weight of x's
// dtype) or pack_dot_blocks (the exact GGUF weights): the same bits for a row whatever M is
// (dot_linear.cpp, dot_blocks.cpp; f32_linear.cpp).
at::Tensor dot_linear(const at::Tensor& x, const at::Tensor& w,
                      const std::optional<at::Tensor>& bias);

// dot_linear's bf16 block path: x contiguous, w from pack_bf16_blocks, bias float32 [N] or null.
at::Tensor dot_blocks_linear(const at::Tensor& x, const at::Tensor& w, const float* bias);

// GGUF blocks with int8 activations (vnni_blocks.cpp, CPUs with AVX512-VNNI): whether it was
// built; raw blocks -> int8 records for dot_linear; dot_linear's path for them (x contiguous
// bf16, bias float32 [N] or null).
bool vnni_blocks_available();
at::Tensor pack_vnni_blocks(const at::Tensor& raw, int64_t type, bool k_mixed);
at::Tensor vnni_blocks_linear(const at::Tensor& x, const at::Tensor& w, const float* bias);

// The float32 family (f32_linear.cpp): whether it was built (AVX2 and FMA); lane tiles of a
// float32 weight [N, K] (N a multiple of 8); GGUF records; y = x W^T + b for x float32.
bool f32_linear_available();
at::Tensor pack_f32_weight(const at::Tensor& w);
at::Tensor pack_f32_blocks(const at::Tensor& raw, int64_t type, bool k_mixed);
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w,
                      const std::optional<at::Tensor>& bias);
// Outputs per register the float32 kernels use (16 with AVX-512, else 8; the same bits
// either way): returns the value before the call; lanes > 0 sets it (8, or this CPU's
// widest).
int64_t f32_vector_lanes(int64_t lanes);

// dot_linear's bias [n] as contiguous float32 (undefined for none).
inline at::Tensor float_bias(const std::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return {};
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "dot_linear: bias must be [", n, "]");
  return bias->to(at::kFloat).contiguous();
}

}  // namespace conveyor
