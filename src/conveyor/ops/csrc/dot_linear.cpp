// Matmuls for CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and 5, Intel Cooper Lake): one
// kernel family for every row count, so a row's result never depends on how many rows share
// the call, whether they are a decode batch or a 2048-token prefill chunk.
//
// y[m, n] = b[n] + sum_k x[m, k] w[n, k] (bf16 in, float32 sums, bf16 out). The weights are
// laid out in pair tiles: per 16 output rows, [K/2][16] 32-bit words (word c of row r: its
// inputs 2c and 2c + 1), so one vdpbf16ps with a token's pair c broadcast adds that pair's
// products to 16 outputs' float32 sums. Each output is one lane, summed over the pairs in
// order, then the bias added and the sum rounded to bf16: the register tile (up to 6 tokens
// x 64 outputs) and the thread only choose which register holds an output, never its
// operations.
//
// The pair tiles come packed once at load (pack_dot_weight) from bf16 weights, or from GGUF
// blocks (gguf_blocks.h) that a task dequantizes per 64 output rows into exactly the bf16
// values the loader made and transposes into pair tiles: the same bits from 0.56-1.06 bytes
// per weight instead of 2.

#include "quant_linear.h"

#include "gguf_blocks.h"
#include "simd_math.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace conveyor {
namespace {

constexpr int64_t kGroupRows = 16;      // output rows of a pair tile (and of a GGUF record)
constexpr int64_t kTaskGroups = 4;      // pair tiles per task: 64 outputs, 4 sums per token
constexpr int64_t kTokenPass = 256;     // tokens per pass over a task's rows: x stays in L2

#ifdef CONVEYOR_AVX512BF16

// y rows [m0, m0 + MR), outputs [n0, n0 + 16 * groups) = the sums plus the bias, in bf16.
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

// Records stream in order; asking for them 8 ahead keeps more in flight.
inline void prefetch_ahead(const uint8_t* rec, int64_t record) {
  const char* ahead = reinterpret_cast<const char*>(rec + 8 * record);
  for (int64_t line = 0; line < record; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}

// y rows [m0, m0 + MR), outputs [n0, n0 + 16 * groups): the tokens' pairs broadcast against
// the groups' pair tiles (g: [pairs][16] words each; absent groups point at zeros).
template <int MR>
void dot_tokens(const uint32_t* x, int64_t pairs, const uint32_t* const g[kTaskGroups],
                int64_t groups, const float* bias, uint16_t* y, int64_t n, int64_t n0,
                int64_t m0) {
  __m512 acc[MR][kTaskGroups];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kTaskGroups; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint32_t* xr = x + m0 * pairs;
  for (int64_t c = 0; c < pairs; ++c) {
    __m512bh w[kTaskGroups];
    for (int j = 0; j < kTaskGroups; ++j) w[j] = (__m512bh)_mm512_loadu_si512(g[j] + c * 16);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[i * pairs + c]));
      for (int j = 0; j < kTaskGroups; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], w[j], xb);
    }
  }
  store_sums<MR>(acc, groups, bias, y, n, n0, m0);
}

using DotTokens = void (*)(const uint32_t*, int64_t, const uint32_t* const*, int64_t,
                           const float*, uint16_t*, int64_t, int64_t, int64_t);
constexpr int kMaxTokens = 6;  // 6 tokens x 4 groups = 24 accumulator registers
// Up to this many tokens, a task dequantizes a block's records and uses them at once (in L1)
// rather than a whole pair tile first (through L2): measured faster at 1 token, slower at 4.
constexpr int64_t kStreamingTokens = 2;
constexpr DotTokens kDotTokens[kMaxTokens + 1] = {nullptr, dot_tokens<1>, dot_tokens<2>,
                                                  dot_tokens<3>, dot_tokens<4>, dot_tokens<5>,
                                                  dot_tokens<6>};

// 16 rows of 32 bf16 (row r at rows + r * stride) -> their pair tile's 16 words [16][16].
inline void to_pair_tile(const uint16_t* rows, int64_t stride, uint32_t* out) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(rows + i * stride));
  transpose16x16(r);
  for (int c = 0; c < 16; ++c) _mm512_storeu_ps(reinterpret_cast<float*>(out + c * 16), r[c]);
}

// Record row tile `group`'s blocks -> its pair tile [blocks * 16][16] words in out.
template <int64_t Type>
void dequantize_group(const uint8_t* w, int64_t group, int64_t blocks, uint32_t* out) {
  const int64_t record = block_format(Type).record_bytes;
  const uint8_t* rec = w + group * blocks * record;
  alignas(64) uint16_t tile[16 * 32];
  for (int64_t b = 0; b < blocks; ++b, rec += record) {
    prefetch_ahead(rec, record);
    dequantize_record<Type>(rec, tile, 32);
    to_pair_tile(tile, 32, out + b * 256);
  }
}

// Tokens [m0, m0 + MR) against a task's `here` record row tiles (first, first + here), a
// block at a time: each block's records dequantized into pair tiles in L1 and used at once.
// The sums are the same operations in the same order as dot_tokens' over whole pair tiles.
template <int64_t Type, int MR>
void dot_tokens_streaming(const uint32_t* x, int64_t pairs, const uint8_t* w, int64_t first,
                          int64_t here, const float* bias, uint16_t* y, int64_t n, int64_t m0) {
  const int64_t record = block_format(Type).record_bytes, blocks = pairs / 16;
  alignas(64) uint16_t tile[16 * 32];
  alignas(64) uint32_t g[kTaskGroups][256] = {};
  __m512 acc[MR][kTaskGroups];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kTaskGroups; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint32_t* xr = x + m0 * pairs;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t j = 0; j < here; ++j) {
      const uint8_t* rec = w + ((first + j) * blocks + b) * record;
      prefetch_ahead(rec, record);
      dequantize_record<Type>(rec, tile, 32);
      to_pair_tile(tile, 32, g[j]);
    }
    for (int64_t c = 0; c < 16; ++c) {
      __m512bh wv[kTaskGroups];
      for (int j = 0; j < kTaskGroups; ++j) wv[j] = (__m512bh)_mm512_load_si512(g[j] + c * 16);
      for (int i = 0; i < MR; ++i) {
        const __m512bh xb =
            (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[i * pairs + b * 16 + c]));
        for (int j = 0; j < kTaskGroups; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xb);
      }
    }
  }
  store_sums<MR>(acc, here, bias, y, n, first * kGroupRows, m0);
}

template <int64_t Type>
void stream_task(int64_t rows, const uint32_t* x, int64_t pairs, const uint8_t* w, int64_t first,
                 int64_t here, const float* bias, uint16_t* y, int64_t n) {
  switch (rows) {
    case 1: return dot_tokens_streaming<Type, 1>(x, pairs, w, first, here, bias, y, n, 0);
    case 2: return dot_tokens_streaming<Type, 2>(x, pairs, w, first, here, bias, y, n, 0);
    case 3: return dot_tokens_streaming<Type, 3>(x, pairs, w, first, here, bias, y, n, 0);
    case 4: return dot_tokens_streaming<Type, 4>(x, pairs, w, first, here, bias, y, n, 0);
    case 5: return dot_tokens_streaming<Type, 5>(x, pairs, w, first, here, bias, y, n, 0);
    default: return dot_tokens_streaming<Type, 6>(x, pairs, w, first, here, bias, y, n, 0);
  }
}

// All `rows` (at most kStreamingTokens) tokens against a task's records, a block at a time.
void stream_task(int64_t type, int64_t rows, const uint32_t* x, int64_t pairs, const uint8_t* w,
                 int64_t first, int64_t here, const float* bias, uint16_t* y, int64_t n) {
  switch (type) {
    case kQ4_0: return stream_task<kQ4_0>(rows, x, pairs, w, first, here, bias, y, n);
    case kQ4_1: return stream_task<kQ4_1>(rows, x, pairs, w, first, here, bias, y, n);
    default: return stream_task<kQ8_0>(rows, x, pairs, w, first, here, bias, y, n);
  }
}

void dequantize_group(int64_t type, const uint8_t* w, int64_t group, int64_t blocks,
                      uint32_t* out) {
  switch (type) {
    case kQ4_0: return dequantize_group<kQ4_0>(w, group, blocks, out);
    case kQ4_1: return dequantize_group<kQ4_1>(w, group, blocks, out);
    default: return dequantize_group<kQ8_0>(w, group, blocks, out);
  }
}

#endif  // CONVEYOR_AVX512BF16

}  // namespace

bool dot_linear_available() {
#ifdef CONVEYOR_AVX512BF16
  return true;
#else
  return false;
#endif
}

at::Tensor pack_dot_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) % kGroupRows == 0 &&
                  w.size(1) % 2 == 0,
              "pack_dot_weight: w must be bf16 [out, in], out a multiple of 16 and in even, got ",
              w.sizes(), " ", w.scalar_type());
  // [out/16, 16, in/2] words -> [out/16, in/2, 16]: each group's rows become lanes.
  return w.contiguous().view(at::kInt).view({w.size(0) / kGroupRows, kGroupRows, w.size(1) / 2})
      .transpose(1, 2).contiguous();
}

at::Tensor dot_linear(const at::Tensor& x, const at::Tensor& w,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(dot_linear_available(), "dot_linear: needs a CPU with AVX512-BF16");
  const bool blocks = w.scalar_type() == at::kByte;
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() &&
                  (blocks || (w.scalar_type() == at::kInt && w.size(2) == kGroupRows)),
              "dot_linear: w must come from pack_dot_weight or pack_block_weights");
  const int64_t groups = w.size(0), n = groups * kGroupRows;
  const int64_t k = blocks ? w.size(1) * 32 : w.size(1) * 2, pairs = k / 2;
  const int64_t type = blocks ? type_of_record(w.size(2), "dot_linear") : 0;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == k,
              "dot_linear: x must be bf16 [rows, ", k, "], got ", x.sizes(), " ", x.scalar_type());
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "dot_linear: bias must be [", n, "]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
#ifdef CONVEYOR_AVX512BF16
  const at::Tensor xc = x.contiguous();
  const auto* xw = reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>());
  auto* yd = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* bd = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t tasks = (groups + kTaskGroups - 1) / kTaskGroups;
  const int64_t passes = (m + kTokenPass - 1) / kTokenPass;
  const int64_t group_words = pairs * kGroupRows;
  // Tasks: (token pass, 64 outputs), pass-major, so a thread's run of tasks shares x's rows.
  at::parallel_for(0, passes * tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint32_t> buf(static_cast<size_t>((blocks ? kTaskGroups : 0) * group_words));
    std::vector<uint32_t> zeros;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t pass = task / tasks, first = (task % tasks) * kTaskGroups;
      const int64_t here = std::min(kTaskGroups, groups - first);
      if (blocks && m <= kStreamingTokens) {  // each block's records used at once, in L1
        stream_task(type, m, xw, pairs, w.data_ptr<uint8_t>(), first, here, bd, yd, n);
        continue;
      }
      const uint32_t* g[kTaskGroups];
      for (int64_t j = 0; j < kTaskGroups; ++j) {
        if (j >= here) {
          zeros.resize(static_cast<size_t>(group_words), 0);
          g[j] = zeros.data();
        } else if (blocks) {
          dequantize_group(type, w.data_ptr<uint8_t>(), first + j, pairs / 16,
                           buf.data() + j * group_words);
          g[j] = buf.data() + j * group_words;
        } else {
          g[j] = reinterpret_cast<const uint32_t*>(w.data_ptr<int32_t>()) + (first + j) * group_words;
        }
      }
      const int64_t end = std::min(m, (pass + 1) * kTokenPass);
      for (int64_t m0 = pass * kTokenPass; m0 < end; m0 += kMaxTokens) {
        const int64_t rows = std::min<int64_t>(kMaxTokens, end - m0);
        kDotTokens[rows](xw, pairs, g, here, bd, yd, n, first * kGroupRows, m0);
      }
    }
  });
#endif
  return y;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("dot_linear_available() -> bool", &conveyor::dot_linear_available);
  m.def("pack_dot_weight(Tensor w) -> Tensor", &conveyor::pack_dot_weight);
  m.def("dot_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor", &conveyor::dot_linear);
}
