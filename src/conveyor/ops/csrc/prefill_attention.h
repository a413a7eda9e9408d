// What cpu_ops.cpp calls of prefill_attention.cpp.
#pragma once

#include <ATen/ATen.h>

namespace conveyor {

// Built with AVX512-BF16 (AMX tiles are used too where the CPU grants them).
bool prefill_attention_available();

// decode_attention over a tile-layout bf16 cache [2, blocks, KVH, bs * D] (ops/reference.py)
// with AMX tiles, or vdpbf16ps where the CPU has no AMX; the arguments already checked as
// decode_attention's. Rows with the same blocks (a verify's) share each read of them.
at::Tensor decode_attention_tiles(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale);

}  // namespace conveyor
