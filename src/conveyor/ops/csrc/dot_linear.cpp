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
// The pair tiles come packed once at load (pack_dot_weight) from bf16 weights. GGUF blocks
// (pack_dot_blocks) go to dot_blocks.cpp, which reads them in the same pair order; their int8
// records (pack_vnni_blocks) to vnni_blocks.cpp, float32 x to f32_linear.cpp.

#include "quant_linear.h"

#include "dot_tiles.h"
#include "simd_math.h"
#include "token_passes.h"

#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace conveyor {
namespace {

constexpr int64_t kTokenPass = 256;     // most tokens per pass over a task's rows: x stays in L2

#ifdef CONVEYOR_AVX512BF16

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
constexpr DotTokens kDotTokens[kMaxTokens + 1] = {nullptr, dot_tokens<1>, dot_tokens<2>,
                                                  dot_tokens<3>, dot_tokens<4>, dot_tokens<5>,
                                                  dot_tokens<6>};

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
  if (w.scalar_type() == at::kFloat) return pack_f32_weight(w);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) % kGroupRows == 0 &&
                  w.size(1) % 2 == 0,
              "pack_dot_weight: w must be bf16 [out, in], out a multiple of 16 and in even, got ",
              w.sizes(), " ", w.scalar_type());
  // [out/16, 16, in/2] words -> [out/16, in/2, 16]: each group's rows become lanes.
  return w.contiguous().view(at::kInt).view({w.size(0) / kGroupRows, kGroupRows, w.size(1) / 2})
      .transpose(1, 2).contiguous();
}

at::Tensor pack_dot_blocks(const at::Tensor& raw, int64_t type, at::ScalarType dtype,
                           bool k_mixed) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "pack_dot_blocks: dtype must be bfloat16 or float32, got ", dtype);
  return dtype == at::kFloat ? pack_f32_blocks(raw, type, k_mixed)
                             : pack_bf16_blocks(raw, type, k_mixed);
}

at::Tensor dot_linear(const at::Tensor& x, const at::Tensor& w,
                      const std::optional<at::Tensor>& bias) {
  if (x.scalar_type() == at::kFloat) return f32_linear(x, w, bias);
  TORCH_CHECK(dot_linear_available(), "dot_linear: bf16 needs a CPU with AVX512-BF16");
  const bool vnni = w.scalar_type() == at::kChar, blocks = vnni || w.scalar_type() == at::kByte;
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() &&
                  (blocks || (w.scalar_type() == at::kInt && w.size(2) == kGroupRows)),
              "dot_linear: w must come from pack_dot_weight, pack_dot_blocks or pack_vnni_blocks");
  const int64_t groups = w.size(0), n = groups * kGroupRows;
  const int64_t k = blocks ? w.size(1) * 32 : w.size(1) * 2;
  [[maybe_unused]] const int64_t pairs = k / 2;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == k,
              "dot_linear: x must be bf16 or float32 [rows, ", k, "], got ", x.sizes(), " ",
              x.scalar_type());
  const at::Tensor bias_f = float_bias(bias, n);
  const float* bd = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const at::Tensor xc = x.contiguous();
  if (vnni) return vnni_blocks_linear(xc, w, bd);
  if (blocks) return dot_blocks_linear(xc, w, bd);
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
#ifdef CONVEYOR_AVX512BF16
  const auto* xw = reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>());
  auto* yd = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const auto* wd = reinterpret_cast<const uint32_t*>(w.data_ptr<int32_t>());
  const TokenPasses passes(m, kTokenPass);
  const int64_t group_words = pairs * kGroupRows;
  for_each_group_task<uint32_t, kTaskGroups>(
      wd, group_words, groups, kTaskGroups, passes, m,
      [&](const GroupTask<uint32_t, kTaskGroups>& t, int64_t) {
        for (int64_t m0 = t.m0; m0 < t.m1; m0 += kMaxTokens) {
          const int64_t rows = std::min<int64_t>(kMaxTokens, t.m1 - m0);
          kDotTokens[rows](xw, pairs, t.group, t.here, bd, yd, n, t.first * kGroupRows, m0);
        }
      });
#endif
  return y;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("dot_linear_available() -> bool", &conveyor::dot_linear_available);
  m.def("f32_linear_available() -> bool", &conveyor::f32_linear_available);
  m.def("f32_vector_lanes(int lanes=0) -> int", &conveyor::f32_vector_lanes);
  m.def("pack_dot_blocks(Tensor raw, int type, ScalarType dtype, bool k_mixed=False) -> Tensor",
        &conveyor::pack_dot_blocks);
  m.def("pack_dot_weight(Tensor w) -> Tensor", &conveyor::pack_dot_weight);
  m.def("vnni_blocks_available() -> bool", &conveyor::vnni_blocks_available);
  m.def("pack_vnni_blocks(Tensor raw, int type, bool k_mixed=False) -> Tensor",
        &conveyor::pack_vnni_blocks);
  m.def("dot_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor", &conveyor::dot_linear);
}
