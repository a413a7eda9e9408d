// float32 matmuls with AVX2 and FMA, for CPUs without bf16 matrix units (AMD Zen 2 and 3,
// Intel before Cooper Lake: Skylake, Cascade Lake, Ice Lake), where the engine runs float32:
// one kernel family for every row count, so a row's result never depends on how many rows
// share the call (torch's float32 matmul switches kernels by row count, and its single-row
// results differ in the last bits). With AVX-512 the same kernels run on 16-lane registers.
//
// y[m, n] = b[n] + sum_k x[m, k] w[n, k]. Lane tiles: per 8 output rows, [K][8] floats, so one
// vfmadd231ps with input k of a token broadcast adds its products to 8 outputs' sums (with
// AVX-512, two tiles joined in a register: 16). Each output is one lane, summed over k in order
// with fused multiply-adds, then the bias added: the register width, the register tile (up to
// 3 tokens x 32 outputs, with AVX-512 6 x 64) and the thread only choose which register holds
// an output, never its operations, so AVX2 and AVX-512 give the same bits.
//
// GGUF blocks (pack_f32_blocks) are read in place: per block of 32 inputs the quantized values
// are exact as floats, so the block's sum is taken over them and the scales factored out, as
// the AVX512-BF16 kernel does (dot_blocks.cpp),
//   y[m, n] = sum over blocks b of ( d[n, b] * sum_k q[n, k] x[m, k] + m[n, b] * sum_k x[m, k] )
// (the m term for Q4_1 and Q4_K, also in K-mixed records, only; Q4_0's values are q - 8;
// Q6_K's q - 32, with one d per half block: two sums of 16): the exact GGUF weights. A few
// tokens convert each block's values in registers; more tokens convert a block once into L1
// and sweep it: both run `add_block`, the same operations in the same order.
//
// Records, per 8 output rows and 32-input block, input-major:
//   Q4_0, Q4_1: q[16 pairs][8 rows] bytes (input 2c in the low nibble, 2c + 1 in the high),
//               d[8] fp16 (, m[8] fp16)                        = 144 (160) bytes
//   Q8_0:       q[32 inputs][8 rows] int8, d[8] fp16             = 272 bytes
//   Q4_K:       Q4_1's nibbles, d * sc[8] and -dmin * m[8] float32 (exact)      = 192 bytes
//   Q6_K:       q - 32 as Q8_0's int8, d * sc of inputs 0-15 [8] and of 16-31 [8] float32
//                                                                = 320 bytes
//   both (a matmul fused from Q4_K and Q6_K parts, kKMixed): Q6_K's record (Q4_K rows: q and
//               d * sc twice), then m[8] float32 (Q6_K rows: 0)  = 352 bytes

#include "quant_linear.h"

#include "gguf_blocks.h"
#include "simd_math.h"
#include "token_passes.h"

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cstdint>
#include <vector>

namespace conveyor {
// Named, not anonymous: kernels.cpp compiles this file in one unit with dot_blocks.cpp, whose
// internals (Call, Records, run, block_sums, ...) have the same names where AVX512-BF16 is on.
namespace f32 {

constexpr int64_t kLanes = 8;      // output rows of a lane tile (and of a record)
constexpr int64_t kF32Pass = 64;   // tokens per pass over a task's weights

struct RecordFormat {
  int64_t q_bytes;  // where the scales begin (d; then m, for Q4_1)
  int64_t bytes;
};

RecordFormat record_format(int64_t type) {
  switch (type) {
    case kQ4_0: return {128, 144};
    case kQ4_1: return {128, 160};
    case kQ8_0: return {256, 272};
    case kQ4_K: return {128, 192};
    case kQ6_K: return {256, 320};
    case kKMixed: return {256, 352};
    default: TORCH_CHECK(false, "f32 blocks: GGML type ", type,
                         " is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), Q6_K (14)");
  }
}

int64_t type_of_f32_record(int64_t bytes) {
  for (int64_t type : {kQ4_0, kQ4_1, kQ8_0, kQ4_K, kQ6_K, kKMixed})
    if (record_format(type).bytes == bytes) return type;
  TORCH_CHECK(false, "dot_linear: w is not from pack_dot_blocks (", bytes, "-byte records)");
}

#ifdef CONVEYOR_AVX2

// ------------------------------------------------------------------ vector widths
// A register holds V::kTiles lane tiles side by side: V8 one (AVX2: 8 outputs), V16 two
// (AVX-512: 16 outputs, the two tiles' 8 floats or record bytes joined on load). Every output
// is one lane either way, with the same operations in the same order: V16 gives V8's bits in
// half the arithmetic instructions. The packed layouts (8-row tiles and records) are the same.
struct V8 {
  using T = __m256;
  using I = __m256i;
  static constexpr int64_t kTiles = 1;
  static constexpr int kRegs = 4;  // registers per token in a task: 32 outputs
  static constexpr int kTokens = 3;  // tokens x registers: 12 sums in registers
  static constexpr int kInPlace = 3;  // up to this many tokens, records convert in registers
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float v) { return _mm256_set1_ps(v); }
  static T bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T load(const float* p) { return _mm256_load_ps(p); }
  static T loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_store_ps(p, v); }
  static void storeu(float* p, T v) { _mm256_storeu_ps(p, v); }
  // The first `tiles` tiles' floats at p (here always the one)
  static T load_tiles(const float* p, int64_t /*tiles*/) { return _mm256_loadu_ps(p); }
  static void store_tiles(float* p, T v, int64_t /*tiles*/) { _mm256_storeu_ps(p, v); }
  // 8 floats of tile a (b: the register's second tile, V16 only)
  static T tiles(const float* a, const float* /*b*/) { return _mm256_loadu_ps(a); }
  // 8 bytes of tile a, zero- or sign-extended to 32-bit integers
  static I bytes_u(const uint8_t* a, const uint8_t* /*b*/) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)a));
  }
  static I bytes_s(const uint8_t* a, const uint8_t* /*b*/) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)a));
  }
  static T low_nibbles(I v) { return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF))); }
  static T high_nibbles(I v) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)); }
  static T floats(I v) { return _mm256_cvtepi32_ps(v); }
  // 8 fp16 values of tile a as floats
  static T halves(const uint8_t* a, const uint8_t* /*b*/) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)a));
  }
};

#ifdef __AVX512F__
struct V16 {
  using T = __m512;
  using I = __m512i;
  static constexpr int64_t kTiles = 2;
  static constexpr int kRegs = 4;  // 64 outputs
  static constexpr int kTokens = 6;  // 24 sums in registers (of 32)
  static constexpr int kInPlace = 3;  // (more: blk and sums no longer fit)
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float v) { return _mm512_set1_ps(v); }
  static T bcast(const float* p) { return _mm512_set1_ps(*p); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T load(const float* p) { return _mm512_load_ps(p); }
  static T loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_store_ps(p, v); }
  static void storeu(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T load_tiles(const float* p, int64_t tiles) {
    return tiles == 2 ? _mm512_loadu_ps(p) : _mm512_castps256_ps512(_mm256_loadu_ps(p));
  }
  static void store_tiles(float* p, T v, int64_t tiles) {
    if (tiles == 2) _mm512_storeu_ps(p, v);
    else _mm256_storeu_ps(p, _mm512_castps512_ps256(v));
  }
  static T join(__m256 a, __m256 b) {  // AVX512F has no insertf32x8 (DQ): as doubles
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)),
                                               _mm256_castps_pd(b), 1));
  }
  static T tiles(const float* a, const float* b) {
    return join(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
  }
  static __m128i two_words(const uint8_t* a, const uint8_t* b) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)a), _mm_loadl_epi64((const __m128i*)b));
  }
  static I bytes_u(const uint8_t* a, const uint8_t* b) { return _mm512_cvtepu8_epi32(two_words(a, b)); }
  static I bytes_s(const uint8_t* a, const uint8_t* b) { return _mm512_cvtepi8_epi32(two_words(a, b)); }
  static T low_nibbles(I v) { return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF))); }
  static T high_nibbles(I v) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)); }
  static T floats(I v) { return _mm512_cvtepi32_ps(v); }
  static T halves(const uint8_t* a, const uint8_t* b) {
    const __m256i h = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)), _mm_loadu_si128((const __m128i*)b), 1);
    return _mm512_cvtph_ps(h);
  }
};
#endif

// f(std::integral_constant<int, r>) for r = min(rows, Max): a kernel's token count as a
// template argument.
template <int Max, class F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (Max > 1) {
    if (rows < Max) return with_rows<Max - 1>(rows, f);
  }
  f(std::integral_constant<int, Max>{});
}

// Lane tiles a task covers: kRegs registers per token.
template <class V>
constexpr int64_t kTaskTiles = V::kRegs * V::kTiles;

// Output tiles [n0, n0 + 8 * here) of rows [m0, m0 + MR) = the sums plus the bias.
template <class V, int MR>
inline void store_sums(const typename V::T (&acc)[MR][V::kRegs], int64_t here, const float* bias,
                       float* y, int64_t n, int64_t n0, int64_t m0) {
  for (int64_t j = 0; j < V::kRegs && j * V::kTiles < here; ++j) {
    const int64_t tiles = std::min(V::kTiles, here - j * V::kTiles);
    const int64_t col = n0 + j * V::kTiles * kLanes;
    const typename V::T b = bias ? V::load_tiles(bias + col, tiles) : V::zero();
    for (int i = 0; i < MR; ++i) V::store_tiles(y + (m0 + i) * n + col, V::add(acc[i][j], b), tiles);
  }
}

// ------------------------------------------------------------------ lane tiles (float32 weights)
template <class V, int MR>
void dense_tokens(const float* x, int64_t k, const float* const* g, int64_t here,
                  const float* bias, float* y, int64_t n, int64_t n0, int64_t m0) {
  typename V::T acc[MR][V::kRegs];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < V::kRegs; ++j) acc[i][j] = V::zero();
  const float* xr = x + m0 * k;
  for (int64_t c = 0; c < k; ++c) {
    typename V::T w[V::kRegs];
    for (int j = 0; j < V::kRegs; ++j)
      w[j] = V::tiles(g[j * V::kTiles] + c * kLanes, g[j * V::kTiles + V::kTiles - 1] + c * kLanes);
    for (int i = 0; i < MR; ++i) {
      const typename V::T xb = V::bcast(xr + i * k + c);
      for (int j = 0; j < V::kRegs; ++j) acc[i][j] = V::fma(xb, w[j], acc[i][j]);
    }
  }
  store_sums<V, MR>(acc, here, bias, y, n, n0, m0);
}

// Calls f(tiles, first, here, m0, m1) for every task (for_each_group_task): token rows [m0,
// m1) (a pass of at most kF32Pass, all passes alike: TokenPasses) against lane tiles [first,
// first + here) (at most kTaskTiles, each `tile` elements from w; absent ones point at
// zeros).
template <class V, class T, class F>
void for_each_task(const T* w, int64_t tile, int64_t tiles, int64_t m, F&& f) {
  constexpr int64_t per = kTaskTiles<V>;
  for_each_group_task<T, per>(w, tile, tiles, per, TokenPasses(m, kF32Pass), m,
                              [&](const GroupTask<T, per>& t, int64_t) {
                                f(t.group, t.first, t.here, t.m0, t.m1);
                              });
}

template <class V>
void dense_linear(const float* x, const float* w, const float* bias, float* y, int64_t m,
                  int64_t n, int64_t k) {
  for_each_task<V>(w, k * kLanes, n / kLanes, m,
                   [&](const float* const* g, int64_t first, int64_t here, int64_t m0, int64_t m1) {
    for (; m0 < m1; m0 += V::kTokens)
      with_rows<V::kTokens>(m1 - m0, [&](auto rows) {
        dense_tokens<V, decltype(rows)::value>(x, k, g, here, bias, y, n, first * kLanes, m0);
      });
  });
}

// ------------------------------------------------------------------ GGUF blocks
// A task's weights, converted in registers from its records (absent ones: a zero record).
// Register j holds tiles j * kTiles .. (j + 1) * kTiles - 1.
template <class V, int64_t Type>
struct Records {
  using T = typename V::T;
  const uint8_t* first[kTaskTiles<V>];  // block 0's record of each tile
  int64_t stride;                       // bytes from a tile's block to its next
  const uint8_t* tile(int64_t j, int64_t b, int64_t which) const {
    return first[j * V::kTiles + which] + b * stride;
  }
  // Inputs 2c and 2c + 1 of the register's rows, as floats (exact).
  void pair(int64_t j, int64_t b, int64_t c, T& even, T& odd) const {
    const uint8_t *a = tile(j, b, 0), *z = tile(j, b, V::kTiles - 1);
    if constexpr (byte_values(Type)) {
      even = V::floats(V::bytes_s(a + c * 16, z + c * 16));
      odd = V::floats(V::bytes_s(a + c * 16 + 8, z + c * 16 + 8));
    } else {
      const typename V::I v = V::bytes_u(a + c * 8, z + c * 8);
      even = V::low_nibbles(v);
      odd = V::high_nibbles(v);
      if constexpr (Type == kQ4_0) {
        even = V::sub(even, V::set1(8.f));
        odd = V::sub(odd, V::set1(8.f));
      }
    }
  }
  // The record's scales from byte `at` on: 8 floats (or fp16 values) per tile.
  T scales_at(int64_t j, int64_t b, int64_t at) const {
    const uint8_t *a = tile(j, b, 0) + at, *z = tile(j, b, V::kTiles - 1) + at;
    if constexpr (float_scales(Type))
      return V::tiles(reinterpret_cast<const float*>(a), reinterpret_cast<const float*>(z));
    else
      return V::halves(a, z);
  }
  // d (of inputs 0-15 where the halves have their own), that of inputs 16-31, then m.
  T scale(int64_t j, int64_t b) const { return scales_at(j, b, record_format(Type).q_bytes); }
  T scale_b(int64_t j, int64_t b) const {
    return scales_at(j, b, record_format(Type).q_bytes + 32);
  }
  T min(int64_t j, int64_t b) const {
    const int64_t width = float_scales(Type) ? 32 : 16;  // bytes of a tile's 8 scales
    return scales_at(j, b, record_format(Type).q_bytes + width * (half_scales(Type) ? 2 : 1));
  }
};

// One block of a task's weights, converted once into L1.
template <class V>
struct BlockWeights {
  using T = typename V::T;
  static constexpr int64_t kWidth = V::kTiles * kLanes;
  alignas(64) float q[V::kRegs][32][kWidth];
  T scales[V::kRegs], scales_b[V::kRegs], mins[V::kRegs];
  void pair(int64_t j, int64_t /*b*/, int64_t c, T& even, T& odd) const {
    even = V::load(q[j][2 * c]);
    odd = V::load(q[j][2 * c + 1]);
  }
  T scale(int64_t j, int64_t /*b*/) const { return scales[j]; }
  T scale_b(int64_t j, int64_t /*b*/) const { return scales_b[j]; }
  T min(int64_t j, int64_t /*b*/) const { return mins[j]; }
};

struct Call {
  const float* x;   // [m, k]
  const float* sx;  // [m, blocks]: each block's input sum (types with an m)
  int64_t k, blocks, n;
  const float* bias;  // [n] or null
  float* y;           // [m, n]
};

// Pairs [c0, c1) of block b (inputs 2 * c0 .. 2 * c1 - 1) into tokens [m0, m0 + MR)'s block
// sums, from zero.
template <class V, int MR, class Weights>
inline void block_pairs(const Call& p, const Weights& w, int64_t b, int64_t m0, int64_t c0,
                        int64_t c1, typename V::T (&blk)[MR][V::kRegs]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < V::kRegs; ++j) blk[i][j] = V::zero();
  const float* xr = p.x + m0 * p.k + b * 32;
  for (int64_t c = c0; c < c1; ++c) {
    typename V::T even[V::kRegs], odd[V::kRegs];
    for (int j = 0; j < V::kRegs; ++j) w.pair(j, b, c, even[j], odd[j]);
    for (int i = 0; i < MR; ++i) {
      const typename V::T x0 = V::bcast(xr + i * p.k + 2 * c);
      for (int j = 0; j < V::kRegs; ++j) blk[i][j] = V::fma(x0, even[j], blk[i][j]);
      const typename V::T x1 = V::bcast(xr + i * p.k + 2 * c + 1);
      for (int j = 0; j < V::kRegs; ++j) blk[i][j] = V::fma(x1, odd[j], blk[i][j]);
    }
  }
}

// Tokens [m0, m0 + MR) take block b into their sums: its 32 inputs into block sums, then
// sum += d * block sum (per half block with two scales: d * the first 16's + db * the last
// 16's), + m * the block's input sum for types with an m. Both ways of walking the blocks run
// exactly this, so an output's operations do not depend on the number of tokens.
template <class V, int64_t Type, int MR, class Weights>
inline void add_block(const Call& p, const Weights& w, int64_t b, int64_t m0,
                      typename V::T (&sums)[MR][V::kRegs]) {
  typename V::T blk[MR][V::kRegs];
  block_pairs<V, MR>(p, w, b, m0, 0, half_scales(Type) ? 8 : 16, blk);
  for (int j = 0; j < V::kRegs; ++j) {
    const typename V::T d = w.scale(j, b);
    for (int i = 0; i < MR; ++i) sums[i][j] = V::fma(blk[i][j], d, sums[i][j]);
  }
  if constexpr (half_scales(Type)) {
    block_pairs<V, MR>(p, w, b, m0, 8, 16, blk);
    for (int j = 0; j < V::kRegs; ++j) {
      const typename V::T d = w.scale_b(j, b);
      for (int i = 0; i < MR; ++i) sums[i][j] = V::fma(blk[i][j], d, sums[i][j]);
    }
  }
  if constexpr (has_min(Type)) {
    for (int j = 0; j < V::kRegs; ++j) {
      const typename V::T mv = w.min(j, b);
      for (int i = 0; i < MR; ++i)
        sums[i][j] = V::fma(mv, V::set1(p.sx[(m0 + i) * p.blocks + b]), sums[i][j]);
    }
  }
}

// Rows [m0, m1) (at most kInPlace), every block in turn, the sums in registers.
template <class V, int64_t Type, int MR>
void block_tokens(const Call& p, const Records<V, Type>& r, int64_t here, int64_t n0, int64_t m0) {
  typename V::T sums[MR][V::kRegs];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < V::kRegs; ++j) sums[i][j] = V::zero();
  for (int64_t b = 0; b < p.blocks; ++b) add_block<V, Type, MR>(p, r, b, m0, sums);
  store_sums<V, MR>(sums, here, p.bias, p.y, p.n, n0, m0);
}

// Tokens [m0, m0 + MR) (their sums at acc, [token][register][width] floats) take block b.
template <class V, int64_t Type, int MR>
void block_step(const Call& p, const BlockWeights<V>& w, int64_t b, int64_t m0, float* acc) {
  constexpr int64_t width = BlockWeights<V>::kWidth;
  typename V::T sums[MR][V::kRegs];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < V::kRegs; ++j) sums[i][j] = V::loadu(acc + (i * V::kRegs + j) * width);
  add_block<V, Type, MR>(p, w, b, m0, sums);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < V::kRegs; ++j) V::storeu(acc + (i * V::kRegs + j) * width, sums[i][j]);
}

// Tokens [m0, m1) against a task's records, a block at a time: the block converted once into
// L1, every token's sums kept in `acc` between blocks.
template <class V, int64_t Type>
void blocks_outer(const Call& p, const Records<V, Type>& r, int64_t here, int64_t n0, int64_t m0,
                  int64_t m1, std::vector<float>& acc) {
  constexpr int64_t width = BlockWeights<V>::kWidth;
  acc.assign(static_cast<size_t>((m1 - m0) * V::kRegs * width), 0.f);
  BlockWeights<V> w;
  for (int64_t b = 0; b < p.blocks; ++b) {
    for (int64_t j = 0; j < V::kRegs; ++j) {
      for (int64_t c = 0; c < 16; ++c) {
        typename V::T even, odd;
        r.pair(j, b, c, even, odd);
        V::store(w.q[j][2 * c], even);
        V::store(w.q[j][2 * c + 1], odd);
      }
      w.scales[j] = r.scale(j, b);
      if constexpr (half_scales(Type)) w.scales_b[j] = r.scale_b(j, b);
      if constexpr (has_min(Type)) w.mins[j] = r.min(j, b);
    }
    for (int64_t m = m0; m < m1; m += V::kTokens) {
      float* a = acc.data() + (m - m0) * V::kRegs * width;
      with_rows<V::kTokens>(m1 - m, [&](auto rows) {
        block_step<V, Type, decltype(rows)::value>(p, w, b, m, a);
      });
    }
  }
  for (int64_t m = m0; m < m1; ++m) {
    typename V::T sums[1][V::kRegs];
    for (int j = 0; j < V::kRegs; ++j)
      sums[0][j] = V::loadu(acc.data() + ((m - m0) * V::kRegs + j) * width);
    store_sums<V, 1>(sums, here, p.bias, p.y, p.n, n0, m);
  }
}

template <class V, int64_t Type>
void run(const Call& p, const uint8_t* w, int64_t tiles, int64_t m) {
  const int64_t record = record_format(Type).bytes;
  for_each_task<V>(w, p.blocks * record, tiles, m,
                   [&](const uint8_t* const* g, int64_t first, int64_t here, int64_t m0, int64_t m1) {
    Records<V, Type> r{{}, record};
    std::copy(g, g + kTaskTiles<V>, r.first);
    if (m1 - m0 <= V::kInPlace) {
      with_rows<V::kInPlace>(m1 - m0, [&](auto rows) {
        block_tokens<V, Type, decltype(rows)::value>(p, r, here, first * kLanes, m0);
      });
    } else {
      std::vector<float> acc;
      blocks_outer<V, Type>(p, r, here, first * kLanes, m0, m1, acc);
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

// The matmul on V's registers: lane tiles (float32 weights) or GGUF records.
template <class V>
void linear(const float* x, const at::Tensor& w, bool blocks, const float* bias, float* y,
            int64_t m, int64_t n, int64_t k) {
  if (!blocks) {
    dense_linear<V>(x, w.data_ptr<float>(), bias, y, m, n, k);
    return;
  }
  const int64_t type = type_of_f32_record(w.size(2)), nb = w.size(1), tiles = w.size(0);
  const std::vector<float> sx = has_min(type) ? block_sums(x, m, nb) : std::vector<float>();
  const Call p{x, sx.data(), k, nb, n, bias, y};
  const uint8_t* wd = w.data_ptr<uint8_t>();
  switch (type) {
    case kQ4_0: run<V, kQ4_0>(p, wd, tiles, m); break;
    case kQ4_1: run<V, kQ4_1>(p, wd, tiles, m); break;
    case kQ4_K: run<V, kQ4_K>(p, wd, tiles, m); break;
    case kQ6_K: run<V, kQ6_K>(p, wd, tiles, m); break;
    case kKMixed: run<V, kKMixed>(p, wd, tiles, m); break;
    default: run<V, kQ8_0>(p, wd, tiles, m); break;
  }
}

#endif  // CONVEYOR_AVX2

#ifdef __AVX512F__
constexpr int64_t kWidestLanes = 16;
#else
constexpr int64_t kWidestLanes = 8;
#endif
// Outputs per register the kernels use: the widest this build has (tests set 8 to compare).
std::atomic<int64_t> vector_lanes{kWidestLanes};

}  // namespace f32

int64_t f32_vector_lanes(int64_t lanes) {
  const int64_t before = f32::vector_lanes.load();
  if (lanes > 0) {
    TORCH_CHECK(lanes == 8 || lanes == f32::kWidestLanes, "f32_vector_lanes: 8 or ",
                f32::kWidestLanes, " on this CPU, got ", lanes);
    f32::vector_lanes.store(lanes);
  }
  return before;
}

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

namespace f32 {

// Q4_K or Q6_K super-blocks -> per-32 records of their own, or with `mixed` kKMixed's.
at::Tensor pack_k_quant(const at::Tensor& raw, int64_t type, bool mixed) {
  const int64_t kind = mixed ? kKMixed : type;
  const RecordFormat rf = record_format(kind);
  return repack_k_blocks(raw, type, "pack_dot_blocks", kLanes, rf.bytes, at::kByte,
                         [&](uint8_t* rec, int64_t i, const KBlock& k) {
    for (int64_t l = 0; l < 32; ++l) {
      if (kind == kQ4_K)  // Q4_1's nibbles: input 2c low, 2c + 1 high
        rec[(l / 2) * kLanes + i] |= static_cast<uint8_t>(k.q[l] << (4 * (l & 1)));
      else  // Q6_K's q - 32 (a Q4_K row of mixed records: q), as int8
        rec[l * kLanes + i] = static_cast<uint8_t>(type == kQ6_K ? k.q[l] - 32 : k.q[l]);
    }
    put_k_scales(rec, rf.q_bytes, kLanes, i, kind, k);
  });
}

}  // namespace f32

at::Tensor pack_f32_blocks(const at::Tensor& raw, int64_t type, bool k_mixed) {
  using f32::kLanes;
  check_k_mixed(k_mixed, type, "pack_dot_blocks");
  if (type == kQ4_K || type == kQ6_K) return f32::pack_k_quant(raw, type, k_mixed);
  check_raw_blocks(raw, type, "pack_dot_blocks");  // the type first: its message names it
  const f32::RecordFormat rf = f32::record_format(type);
  return repack_blocks(raw, type, "pack_dot_blocks", kLanes, rf.bytes, rf.q_bytes, at::kByte,
                       [type](uint8_t* rec, int64_t i, const uint8_t* qs) {
    for (int64_t c = 0; c < 16; ++c) {
      if (type == kQ8_0) {
        rec[(2 * c) * kLanes + i] = qs[2 * c];
        rec[(2 * c + 1) * kLanes + i] = qs[2 * c + 1];
      } else {
        rec[c * kLanes + i] =
            static_cast<uint8_t>(gguf_nibble(qs, 2 * c) | (gguf_nibble(qs, 2 * c + 1) << 4));
      }
    }
  });
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
#ifdef __AVX512F__
  if (f32::vector_lanes.load() == 16) {
    f32::linear<f32::V16>(xc.data_ptr<float>(), w, blocks, bias, y.data_ptr<float>(), m, n, k);
    return y;
  }
#endif
  f32::linear<f32::V8>(xc.data_ptr<float>(), w, blocks, bias, y.data_ptr<float>(), m, n, k);
#endif
  return y;
}

}  // namespace conveyor
