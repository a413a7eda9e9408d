// Matmuls that read GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) in place, for decode steps
// and steps of up to kQuantizedMaxRows tokens.
//
// A decode step is bound by reading the weights: bf16 copies cost 2 bytes per weight, the
// GGUF blocks 0.56-1.06. The loader still dequantizes every weight to the engine's dtype (the
// model is defined by those values, and steps of more tokens run oneDNN on them); these kernels
// rebuild exactly the same bf16 values from the blocks, 16 output rows x 32 inputs at a time,
// in registers, and multiply them with AMX tiles in the same order oneDNN's AMX kernel does,
// so the results are bit-identical to it (checked at load on every weight, and in the tests).
//
// Dequantization and the packed layout: gguf_blocks.h.
//
// The product is computed transposed, C^T = W x^T: the weight tile is AMX's first operand
// (16 rows x 32 inputs, as dequantized), x^T its second (pairs of inputs x 16 tokens, packed
// once per call), and 4 accumulator tiles hold 64 tokens; more tokens go in groups of 64
// (linear_tiles).

#include "quant_linear.h"

#include "amx.h"
#include "gguf_blocks.h"
#include "simd_math.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#ifdef CONVEYOR_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace conveyor {
namespace {

// raw: uint8 [N, K/32, block bytes], GGUF blocks in row order -> uint8 [N/16, K/32, record]:
// per 16 rows, Q8_0's 32 bytes a row, or weight j of rows 2p and 2p + 1 in the low and high
// nibble of byte j of row pair p; then the rows' d (and m), as repack_blocks places them.
at::Tensor pack_block_weights(const at::Tensor& raw, int64_t type) {
  const int64_t q_bytes = type == kQ8_0 ? 32 : 16;  // per row and block
  return repack_blocks(raw, type, "pack_block_weights", 16, block_format(type).record_bytes,
                       16 * q_bytes, at::kByte, [type](uint8_t* rec, int64_t i, const uint8_t* qs) {
    if (type == kQ8_0) {
      std::memcpy(rec + i * 32, qs, 32);
      return;
    }
    uint8_t* pair = rec + (i / 2) * 32;  // zeros before row 2p's nibbles
    for (int64_t j = 0; j < 32; ++j)
      pair[j] = static_cast<uint8_t>(pair[j] | gguf_nibble(qs, j) << (i % 2 ? 4 : 0));
  });
}

#ifdef CONVEYOR_AMX

bool request_tile_registers() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// x [M, K] bf16 -> x^T tiles: for each 32-input block and 16-token tile, [16 pairs][16 tokens]
// of 32-bit (two bf16) words; tokens past M are zero.
void pack_tokens(uint32_t* out, const at::Tensor& x, int64_t token_tiles) {
  const int64_t pairs = x.size(1) / 2;
  transpose_pairs(out, reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>()), x.size(0),
                  pairs, pairs / 16, token_tiles);
}

// GCC's tile intrinsics are macros that paste the tile number into the instruction: literals
// only. The two x^T tiles alternate so a load need not wait for the previous product.
#define CONVEYOR_ACCUMULATE(acc, src, xt)  \
  do {                                     \
    _tile_loadd(src, xt, 64);              \
    _tile_dpbf16ps(acc, 0, src);           \
  } while (0)

// Accumulators 2.. 2 + TT - 1 = one row tile (16 outputs) x TT token tiles (starting at token
// tile `first`) over all input blocks; weight_tile(b) returns block b's dequantized tile.
template <int TT, typename WeightTile>
inline void row_tile_products(WeightTile&& weight_tile, const uint32_t* xt, int64_t token_tiles,
                              int64_t first, int64_t blocks) {
  _tile_zero(2);
  if constexpr (TT > 1) _tile_zero(3);
  if constexpr (TT > 2) _tile_zero(4);
  if constexpr (TT > 3) _tile_zero(5);
  for (int64_t b = 0; b < blocks; ++b) {
    _tile_loadd(0, weight_tile(b), 64);
    const uint32_t* xb = xt + (b * token_tiles + first) * 256;
    CONVEYOR_ACCUMULATE(2, 1, xb);
    if constexpr (TT > 1) CONVEYOR_ACCUMULATE(3, 6, xb + 256);
    if constexpr (TT > 2) CONVEYOR_ACCUMULATE(4, 1, xb + 512);
    if constexpr (TT > 3) CONVEYOR_ACCUMULATE(5, 6, xb + 768);
  }
}

// Accumulator tile 2 + tt (of row tile t, token tile first + tt) -> y as bf16, plus the bias.
inline void store_token_tile(at::BFloat16* y, const float* bias, int64_t t, int64_t token0,
                             int tt, int64_t m, int64_t n) {
  alignas(64) float c[16 * 16];
  switch (tt) {
    case 0: _tile_stored(2, c, 64); break;
    case 1: _tile_stored(3, c, 64); break;
    case 2: _tile_stored(4, c, 64); break;
    default: _tile_stored(5, c, 64); break;
  }
  // c is [16 rows][16 tokens]; transposed, r[j] holds token j's 16 outputs.
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(c + i * 16);
  transpose16x16(r);
  const __m512 b16 = bias ? _mm512_loadu_ps(bias + t * 16) : _mm512_setzero_ps();
  for (int64_t j = 0; j < 16 && token0 + j < m; ++j) {
    const __m512 v = bias ? _mm512_add_ps(r[j], b16) : r[j];
    _mm256_storeu_si256((__m256i*)(y + (token0 + j) * n + t * 16), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// One group of TT token tiles of row tile t: products, then the stores.
template <int TT, typename WeightTile>
inline void token_group(WeightTile&& weight_tile, at::BFloat16* y, const uint32_t* xt,
                        const float* bias, int64_t t, int64_t first, int64_t token_tiles,
                        int64_t m, int64_t n, int64_t blocks) {
  row_tile_products<TT>(weight_tile, xt, token_tiles, first, blocks);
  for (int tt = 0; tt < TT; ++tt) store_token_tile(y, bias, t, (first + tt) * 16, tt, m, n);
}

template <typename WeightTile>
void token_group_of(int64_t tiles, WeightTile&& weight_tile, at::BFloat16* y, const uint32_t* xt,
                    const float* bias, int64_t t, int64_t first, int64_t token_tiles, int64_t m,
                    int64_t n, int64_t blocks) {
  switch (tiles) {
    case 1: return token_group<1>(weight_tile, y, xt, bias, t, first, token_tiles, m, n, blocks);
    case 2: return token_group<2>(weight_tile, y, xt, bias, t, first, token_tiles, m, n, blocks);
    case 3: return token_group<3>(weight_tile, y, xt, bias, t, first, token_tiles, m, n, blocks);
    default: return token_group<4>(weight_tile, y, xt, bias, t, first, token_tiles, m, n, blocks);
  }
}

// Every row tile of W x every token, in groups of up to 64 tokens (4 accumulator tiles): the
// first group dequantizes each record as it streams it; with more tokens it keeps the row
// tile's dequantized records in a buffer (blocks x 1 KB, in L1/L2) that the later groups
// sweep. Either way each output is the same sum of the same tile products in the same order,
// so a token's result never depends on how many tokens share the call.
template <int64_t Type>
void linear_tiles(at::BFloat16* y, const uint32_t* xt, const uint8_t* w, const float* bias,
                  int64_t m, int64_t n, int64_t blocks, int64_t token_tiles) {
  const int64_t record = block_format(Type).record_bytes, row_tiles = n / 16;
  const int64_t groups = (token_tiles + 3) / 4;
  // Row tiles split over the threads, at least 8 per task (a small matmul stays on one).
  at::parallel_for(0, row_tiles, 8, [&](int64_t t0, int64_t t1) {
    // Tile 0: the weight tile (16 rows x 32 bf16); 1 and 6: x^T tiles (16 input pairs x 16
    // tokens); 2-5: accumulators (16 rows x 16 tokens, float32).
    load_tile_config();
    // One group (decodes): two tiles on the stack. More: the row tile's records, on the heap
    // (not zeroed: every tile is written before it is read).
    alignas(64) uint16_t pair[2 * 512];
    std::unique_ptr<uint16_t[]> heap(groups > 1 ? new uint16_t[blocks * 512 + 32] : nullptr);
    uint16_t* tiles = heap ? reinterpret_cast<uint16_t*>(
                                 (reinterpret_cast<uintptr_t>(heap.get()) + 63) & ~uintptr_t{63})
                           : pair;
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* rec = w + t * blocks * record;
      // The first group streams the records, dequantizing each into the buffer; later groups
      // read the buffer.
      auto streamed = [&](int64_t b) {
        // The task streams its records in order; asking for them 8 records (2.3-4.3 KB)
        // ahead keeps more of them in flight than the hardware prefetcher does: ~1.3x.
        const uint8_t* r = rec + b * record;
        prefetch_bytes<_MM_HINT_T0>(r + 8 * record, record);
        // One group: two tile buffers in turn, so the next record's stores need not wait for
        // this tile's load.
        uint16_t* tile = tiles + (groups > 1 ? b : b % 2) * 512;
        dequantize_record<Type>(r, tile, 32);
        return tile;
      };
      auto buffered = [&](int64_t b) { return tiles + b * 512; };
      token_group_of(std::min<int64_t>(4, token_tiles), streamed, y, xt, bias, t, 0, token_tiles,
                     m, n, blocks);
      for (int64_t g = 1; g < groups; ++g)
        token_group_of(std::min<int64_t>(4, token_tiles - 4 * g), buffered, y, xt, bias, t, 4 * g,
                       token_tiles, m, n, blocks);
    }
    _tile_release();
  });
}

#endif  // CONVEYOR_AMX

}  // namespace

bool amx_available() {
#ifdef CONVEYOR_AMX
  static const bool granted = request_tile_registers();
  return granted;
#else
  return false;
#endif
}


at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_available(),
              "quantized_linear: needs a CPU with AMX-BF16 (and kernels built for it)");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quantized_linear: w must come from pack_block_weights");
  [[maybe_unused]] const int64_t type = type_of_record(w.size(2), "quantized_linear");
  const int64_t n = w.size(0) * 16, blocks = w.size(1), k = blocks * 32;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == k,
              "quantized_linear: x must be bf16 [rows, ", k, "], got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t m = x.size(0);
  TORCH_CHECK(m >= 1, "quantized_linear: at least one row, got ", m);
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "quantized_linear: bias must be [", n, "]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({m, n}, x.options());
#ifdef CONVEYOR_AMX
  const at::Tensor xc = x.contiguous();
  const int64_t token_tiles = (m + 15) / 16;
  at::Tensor xt_buffer = at::empty({blocks * token_tiles * 256}, x.options().dtype(at::kInt));
  auto* xt = reinterpret_cast<uint32_t*>(xt_buffer.data_ptr<int32_t>());
  pack_tokens(xt, xc, token_tiles);
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* out = y.data_ptr<at::BFloat16>();
  const auto* wd = w.data_ptr<uint8_t>();
  switch (type) {
    case kQ4_0: linear_tiles<kQ4_0>(out, xt, wd, b, m, n, blocks, token_tiles); break;
    case kQ4_1: linear_tiles<kQ4_1>(out, xt, wd, b, m, n, blocks, token_tiles); break;
    default: linear_tiles<kQ8_0>(out, xt, wd, b, m, n, blocks, token_tiles); break;
  }
#endif
  return y;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("amx_available() -> bool", &conveyor::amx_available);
  m.def("quantized_linear_max_rows() -> int", [] { return conveyor::kQuantizedMaxRows; });
  m.def("onednn_small_rows() -> int", [] { return conveyor::kOneDnnSmallRows; });
  m.def("pack_block_weights(Tensor raw, int type) -> Tensor", &conveyor::pack_block_weights);
  m.def("quantized_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor",
        &conveyor::quantized_linear);
}
