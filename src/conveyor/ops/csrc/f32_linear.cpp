// float32 matmuls with AVX2 and FMA, for CPUs without bf16 matrix units (AMD Zen 2 and 3,
// Intel before Cooper Lake), where the engine runs float32: one kernel family for every row
// count, so a row's result never depends on how many rows share the call (torch's float32
// matmul switches kernels by row count, and its single-row results differ in the last bits).
//
// y[m, n] = b[n] + sum_k x[m, k] w[n, k]. Lane tiles: per 8 output rows, [K][8] floats, so one
// vfmadd231ps with input k of a token broadcast adds its products to 8 outputs' sums. Each
// output is one lane, summed over k in order with fused multiply-adds, then the bias added:
// the register tile (up to 3 tokens x 32 outputs) and the thread only choose which register
// holds an output, never its operations.
//
// GGUF blocks (pack_f32_blocks) are read in place: per block of 32 inputs the quantized values
// are exact as floats, so the block's sum is taken over them and the scales factored out, as
// the AVX512-BF16 kernel does (dot_blocks.cpp),
//   y[m, n] = sum over blocks b of ( d[n, b] * sum_k q[n, k] x[m, k] + m[n, b] * sum_k x[m, k] )
// (the m term for Q4_1 only; Q4_0's values are q - 8): the exact GGUF weights. A few tokens
// convert each block's values in registers; more tokens convert a block once into L1 and sweep
// it: both run `add_block`, the same operations in the same order.
//
// Records, per 8 output rows and 32-input block, input-major:
//   Q4_0, Q4_1: q[16 pairs][8 rows] bytes (input 2c in the low nibble, 2c + 1 in the high),
//               d[8] fp16 (, m[8] fp16)                        = 144 (160) bytes
//   Q8_0:       q[32 inputs][8 rows] int8, d[8] fp16             = 272 bytes

#include "quant_linear.h"

#include "gguf_blocks.h"
#include "simd_math.h"
#include "token_passes.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace conveyor {
// Named, not anonymous: kernels.cpp compiles this file in one unit with dot_blocks.cpp, whose
// internals (Call, Records, run, block_sums, ...) have the same names where AVX512-BF16 is on.
namespace f32 {

constexpr int64_t kLanes = 8;      // output rows of a lane tile (and of a record)
constexpr int64_t kGroups = 4;     // lane tiles per task: 32 outputs
constexpr int kF32Tokens = 3;      // 3 tokens x 4 tiles: 12 sums in registers
constexpr int64_t kF32Pass = 64;   // tokens per pass over a task's weights
constexpr int64_t kInPlace = 3;    // up to this many tokens, records are converted in registers

struct RecordFormat {
  int64_t q_bytes;  // where d begins (then m, for Q4_1)
  int64_t bytes;
};

RecordFormat record_format(int64_t type) {
  switch (type) {
    case kQ4_0: return {128, 144};
    case kQ4_1: return {128, 160};
    case kQ8_0: return {256, 272};
    default: TORCH_CHECK(false, "f32 blocks: GGML type ", type,
                         " is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8)");
  }
}

int64_t type_of_f32_record(int64_t bytes) {
  for (int64_t type : {kQ4_0, kQ4_1, kQ8_0})
    if (record_format(type).bytes == bytes) return type;
  TORCH_CHECK(false, "dot_linear: w is not from pack_dot_blocks (", bytes, "-byte records)");
}

#ifdef CONVEYOR_AVX2

// Output tiles [n0, n0 + 8 * groups) of rows [m0, m0 + MR) = the sums plus the bias.
template <int MR>
inline void store_sums(const __m256 (&acc)[MR][kGroups], int64_t groups, const float* bias,
                       float* y, int64_t n, int64_t n0, int64_t m0) {
  for (int64_t j = 0; j < groups; ++j) {
    const int64_t col = n0 + j * kLanes;
    const __m256 b = bias ? _mm256_loadu_ps(bias + col) : _mm256_setzero_ps();
    for (int i = 0; i < MR; ++i) _mm256_storeu_ps(y + (m0 + i) * n + col, _mm256_add_ps(acc[i][j], b));
  }
}

// ------------------------------------------------------------------ lane tiles (float32 weights)
template <int MR>
void dense_tokens(const float* x, int64_t k, const float* const g[kGroups], int64_t groups,
                  const float* bias, float* y, int64_t n, int64_t n0, int64_t m0) {
  __m256 acc[MR][kGroups];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kGroups; ++j) acc[i][j] = _mm256_setzero_ps();
  const float* xr = x + m0 * k;
  for (int64_t c = 0; c < k; ++c) {
    for (int i = 0; i < MR; ++i) {
      const __m256 xb = _mm256_broadcast_ss(xr + i * k + c);
      for (int j = 0; j < kGroups; ++j)
        acc[i][j] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(g[j] + c * kLanes), acc[i][j]);
    }
  }
  store_sums<MR>(acc, groups, bias, y, n, n0, m0);
}

// Calls f(tiles, first, here, m0, m1) for every task: token rows [m0, m1) (a pass of at most
// kF32Pass, all passes alike: TokenPasses) against lane tiles [first, first + here) (at most
// kGroups, each `tile` elements from w; absent ones point at `zeros`). Tasks run pass-major, so
// a thread's run of tasks shares x's rows.
template <class T, class F>
void for_each_task(const T* w, int64_t tile, int64_t groups, int64_t m, const T* zeros, F&& f) {
  const int64_t tasks = (groups + kGroups - 1) / kGroups;
  const TokenPasses passes(m, kF32Pass);
  at::parallel_for(0, passes.count * tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t pass = task / tasks, first = (task % tasks) * kGroups;
      const int64_t here = std::min(kGroups, groups - first);
      const T* g[kGroups];
      for (int64_t j = 0; j < kGroups; ++j) g[j] = j < here ? w + (first + j) * tile : zeros;
      f(g, first, here, passes.begin(pass), passes.end(pass, m));
    }
  });
}

void dense_linear(const float* x, const float* w, const float* bias, float* y, int64_t m,
                  int64_t n, int64_t k) {
  const std::vector<float> zeros(static_cast<size_t>(k * kLanes), 0.f);
  for_each_task(w, k * kLanes, n / kLanes, m, zeros.data(),
                [&](const float* const* g, int64_t first, int64_t here, int64_t m0, int64_t m1) {
    for (; m0 < m1; m0 += kF32Tokens) {
      switch (std::min<int64_t>(kF32Tokens, m1 - m0)) {
        case 1: dense_tokens<1>(x, k, g, here, bias, y, n, first * kLanes, m0); break;
        case 2: dense_tokens<2>(x, k, g, here, bias, y, n, first * kLanes, m0); break;
        default: dense_tokens<3>(x, k, g, here, bias, y, n, first * kLanes, m0); break;
      }
    }
  });
}

// ------------------------------------------------------------------ GGUF blocks
// Inputs 2c and 2c + 1 of a record's 8 rows, as floats (exact).
template <int64_t Type>
inline void record_pair(const uint8_t* rec, int64_t c, __m256& even, __m256& odd) {
  if constexpr (Type == kQ8_0) {
    even = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(rec + c * 16))));
    odd = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(rec + c * 16 + 8))));
  } else {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(rec + c * 8)));
    const __m256i nib = _mm256_set1_epi32(0xF);
    even = _mm256_cvtepi32_ps(_mm256_and_si256(v, nib));
    odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    if constexpr (Type == kQ4_0) {
      even = _mm256_sub_ps(even, _mm256_set1_ps(8.f));
      odd = _mm256_sub_ps(odd, _mm256_set1_ps(8.f));
    }
  }
}

inline __m256 record_halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}

// A task's weights, converted in registers from its records (absent ones: a zero record).
template <int64_t Type>
struct Records {
  const uint8_t* first[kGroups];  // block 0's record of each tile
  int64_t stride;                 // bytes from a tile's block to its next
  void pair(int64_t j, int64_t b, int64_t c, __m256& even, __m256& odd) const {
    record_pair<Type>(first[j] + b * stride, c, even, odd);
  }
  __m256 scale(int64_t j, int64_t b) const {
    return record_halves(first[j] + b * stride + record_format(Type).q_bytes);
  }
  __m256 min(int64_t j, int64_t b) const {  // after the 8 scales (Q4_1)
    return record_halves(first[j] + b * stride + record_format(Type).q_bytes + 16);
  }
};

// One block of a task's weights, converted once into L1.
struct BlockWeights {
  alignas(32) float q[kGroups][32][kLanes];
  __m256 scales[kGroups], mins[kGroups];
  void pair(int64_t j, int64_t /*b*/, int64_t c, __m256& even, __m256& odd) const {
    even = _mm256_load_ps(q[j][2 * c]);
    odd = _mm256_load_ps(q[j][2 * c + 1]);
  }
  __m256 scale(int64_t j, int64_t /*b*/) const { return scales[j]; }
  __m256 min(int64_t j, int64_t /*b*/) const { return mins[j]; }
};

struct Call {
  const float* x;   // [m, k]
  const float* sx;  // [m, blocks]: each block's input sum (Q4_1)
  int64_t k, blocks, n;
  const float* bias;  // [n] or null
  float* y;           // [m, n]
};

// Tokens [m0, m0 + MR) take block b into their sums: its 32 inputs into block sums, then
// sum += d * block sum (+ m * the block's input sum). Both ways of walking the blocks run
// exactly this, so an output's operations do not depend on the number of tokens.
template <int64_t Type, int MR, class Weights>
inline void add_block(const Call& p, const Weights& w, int64_t b, int64_t m0,
                      __m256 (&sums)[MR][kGroups]) {
  __m256 blk[MR][kGroups];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kGroups; ++j) blk[i][j] = _mm256_setzero_ps();
  const float* xr = p.x + m0 * p.k + b * 32;
  for (int64_t c = 0; c < 16; ++c) {
    __m256 even[kGroups], odd[kGroups];
    for (int j = 0; j < kGroups; ++j) w.pair(j, b, c, even[j], odd[j]);
    for (int i = 0; i < MR; ++i) {
      const __m256 x0 = _mm256_broadcast_ss(xr + i * p.k + 2 * c);
      for (int j = 0; j < kGroups; ++j) blk[i][j] = _mm256_fmadd_ps(x0, even[j], blk[i][j]);
      const __m256 x1 = _mm256_broadcast_ss(xr + i * p.k + 2 * c + 1);
      for (int j = 0; j < kGroups; ++j) blk[i][j] = _mm256_fmadd_ps(x1, odd[j], blk[i][j]);
    }
  }
  for (int j = 0; j < kGroups; ++j) {
    const __m256 d = w.scale(j, b);
    for (int i = 0; i < MR; ++i) sums[i][j] = _mm256_fmadd_ps(blk[i][j], d, sums[i][j]);
    if constexpr (Type == kQ4_1) {
      const __m256 mv = w.min(j, b);
      for (int i = 0; i < MR; ++i)
        sums[i][j] = _mm256_fmadd_ps(mv, _mm256_set1_ps(p.sx[(m0 + i) * p.blocks + b]), sums[i][j]);
    }
  }
}

// Rows [m0, m1) (at most kInPlace), every block in turn, the sums in registers.
template <int64_t Type, int MR>
void block_tokens(const Call& p, const Records<Type>& r, int64_t groups, int64_t n0, int64_t m0) {
  __m256 sums[MR][kGroups];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kGroups; ++j) sums[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) add_block<Type, MR>(p, r, b, m0, sums);
  store_sums<MR>(sums, groups, p.bias, p.y, p.n, n0, m0);
}

// Tokens [m0, m0 + MR) (their sums at acc, [token][tile][8] floats) take block b.
template <int64_t Type, int MR>
void block_step(const Call& p, const BlockWeights& w, int64_t b, int64_t m0, float* acc) {
  __m256 sums[MR][kGroups];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kGroups; ++j) sums[i][j] = _mm256_loadu_ps(acc + (i * kGroups + j) * kLanes);
  add_block<Type, MR>(p, w, b, m0, sums);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kGroups; ++j) _mm256_storeu_ps(acc + (i * kGroups + j) * kLanes, sums[i][j]);
}

// Tokens [m0, m1) against a task's records, a block at a time: the block converted once into
// L1, every token's sums kept in `acc` between blocks.
template <int64_t Type>
void blocks_outer(const Call& p, const Records<Type>& r, int64_t groups, int64_t n0, int64_t m0,
                  int64_t m1, std::vector<float>& acc) {
  acc.assign(static_cast<size_t>((m1 - m0) * kGroups * kLanes), 0.f);
  BlockWeights w;
  for (int64_t b = 0; b < p.blocks; ++b) {
    for (int64_t j = 0; j < kGroups; ++j) {
      for (int64_t c = 0; c < 16; ++c) {
        __m256 even, odd;
        r.pair(j, b, c, even, odd);
        _mm256_store_ps(w.q[j][2 * c], even);
        _mm256_store_ps(w.q[j][2 * c + 1], odd);
      }
      w.scales[j] = r.scale(j, b);
      if constexpr (Type == kQ4_1) w.mins[j] = r.min(j, b);
    }
    for (int64_t m = m0; m < m1; m += kF32Tokens) {
      float* a = acc.data() + (m - m0) * kGroups * kLanes;
      switch (std::min<int64_t>(kF32Tokens, m1 - m)) {
        case 1: block_step<Type, 1>(p, w, b, m, a); break;
        case 2: block_step<Type, 2>(p, w, b, m, a); break;
        default: block_step<Type, 3>(p, w, b, m, a); break;
      }
    }
  }
  for (int64_t m = m0; m < m1; ++m) {
    __m256 sums[1][kGroups];
    for (int j = 0; j < kGroups; ++j)
      sums[0][j] = _mm256_loadu_ps(acc.data() + ((m - m0) * kGroups + j) * kLanes);
    store_sums<1>(sums, groups, p.bias, p.y, p.n, n0, m);
  }
}

template <int64_t Type>
void in_place(const Call& p, const Records<Type>& r, int64_t groups, int64_t n0, int64_t m0,
              int64_t m1) {
  switch (m1 - m0) {
    case 1: block_tokens<Type, 1>(p, r, groups, n0, m0); break;
    case 2: block_tokens<Type, 2>(p, r, groups, n0, m0); break;
    default: block_tokens<Type, 3>(p, r, groups, n0, m0); break;
  }
}

template <int64_t Type>
void run(const Call& p, const uint8_t* w, int64_t groups, int64_t m) {
  const int64_t record = record_format(Type).bytes;
  const std::vector<uint8_t> zeros(static_cast<size_t>(record * p.blocks), 0);
  for_each_task(w, p.blocks * record, groups, m, zeros.data(),
                [&](const uint8_t* const* g, int64_t first, int64_t here, int64_t m0, int64_t m1) {
    Records<Type> r{{}, record};
    std::copy(g, g + kGroups, r.first);
    if (m1 - m0 <= kInPlace) {
      in_place<Type>(p, r, here, first * kLanes, m0, m1);
    } else {
      std::vector<float> acc;
      blocks_outer<Type>(p, r, here, first * kLanes, m0, m1, acc);
    }
  });
}

// Each token's sum of each block of 32 inputs, in one fixed order: [m, blocks].
std::vector<float> block_sums(const float* x, int64_t m, int64_t blocks) {
  std::vector<float> sx(static_cast<size_t>(m * blocks));
  for (int64_t i = 0; i < m * blocks; ++i) {
    const float* v = x + i * 32;
    const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8)),
                                   _mm256_add_ps(_mm256_loadu_ps(v + 16), _mm256_loadu_ps(v + 24)));
    sx[static_cast<size_t>(i)] = hsum8(s);
  }
  return sx;
}

#endif  // CONVEYOR_AVX2

}  // namespace f32

bool f32_linear_available() {
#ifdef CONVEYOR_AVX2
  return true;
#else
  return false;
#endif
}

at::Tensor pack_f32_weight(const at::Tensor& w) {
  using f32::kLanes;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.size(0) % kLanes == 0,
              "pack_dot_weight: float32 w must be [out, in], out a multiple of 8, got ", w.sizes());
  // [out/8, 8, in] -> [out/8, in, 8]: each tile's rows become lanes.
  return w.contiguous().view({w.size(0) / kLanes, kLanes, w.size(1)}).transpose(1, 2).contiguous();
}

at::Tensor pack_f32_blocks(const at::Tensor& raw, int64_t type) {
  using f32::kLanes;
  const BlockFormat f = check_raw_blocks(raw, type, "pack_dot_blocks");
  const f32::RecordFormat rf = f32::record_format(type);
  const int64_t n = raw.size(0), kb = raw.size(1);
  const at::Tensor src = raw.contiguous();
  at::Tensor out = at::zeros({n / kLanes, kb, rf.bytes}, raw.options());
  const uint8_t* r = src.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t q_offset = type == kQ4_1 ? 4 : 2;  // after d (and m) in a GGUF block
  at::parallel_for(0, n / kLanes, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < kb; ++b) {
        uint8_t* rec = o + (t * kb + b) * rf.bytes;
        for (int64_t i = 0; i < kLanes; ++i) {
          const uint8_t* blk = r + ((t * kLanes + i) * kb + b) * f.block_bytes;
          std::memcpy(rec + rf.q_bytes + i * 2, blk, 2);                             // d
          if (type == kQ4_1) std::memcpy(rec + rf.q_bytes + 16 + i * 2, blk + 2, 2);  // m
          const uint8_t* qs = blk + q_offset;
          // GGUF: weight j < 16 in the low nibble of qs[j], weight j + 16 in its high one.
          auto nibble = [&](int64_t j) { return j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4; };
          for (int64_t c = 0; c < 16; ++c) {
            if (type == kQ8_0) {
              rec[(2 * c) * kLanes + i] = qs[2 * c];
              rec[(2 * c + 1) * kLanes + i] = qs[2 * c + 1];
            } else {
              rec[c * kLanes + i] = static_cast<uint8_t>(nibble(2 * c) | (nibble(2 * c + 1) << 4));
            }
          }
        }
      }
  });
  return out;
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w,
                      const std::optional<at::Tensor>& bias_) {
  using f32::kLanes;
  TORCH_CHECK(f32_linear_available(), "dot_linear: float32 needs a CPU with AVX2 and FMA");
  const bool blocks = w.scalar_type() == at::kByte;
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() &&
                  (blocks || (w.scalar_type() == at::kFloat && w.size(2) == kLanes)),
              "dot_linear: float32 w must come from pack_dot_weight or pack_dot_blocks");
  const int64_t groups = w.size(0), n = groups * kLanes;
  const int64_t k = blocks ? w.size(1) * 32 : w.size(1), m = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "dot_linear: x must be [rows, ", k, "], got ",
              x.sizes());
  const at::Tensor xc = x.contiguous(), bias_f = float_bias(bias_, n);
  const float* bias = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({m, n}, x.options());
#ifdef CONVEYOR_AVX2
  const float* xd = xc.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  if (!blocks) {
    f32::dense_linear(xd, w.data_ptr<float>(), bias, yd, m, n, k);
    return y;
  }
  const int64_t type = f32::type_of_f32_record(w.size(2)), nb = w.size(1);
  const std::vector<float> sx = type == kQ4_1 ? f32::block_sums(xd, m, nb) : std::vector<float>();
  const f32::Call p{xd, sx.data(), k, nb, n, bias, yd};
  const uint8_t* wd = w.data_ptr<uint8_t>();
  switch (type) {
    case kQ4_0: f32::run<kQ4_0>(p, wd, groups, m); break;
    case kQ4_1: f32::run<kQ4_1>(p, wd, groups, m); break;
    default: f32::run<kQ8_0>(p, wd, groups, m); break;
  }
#endif
  return y;
}

}  // namespace conveyor
