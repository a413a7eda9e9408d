// Causal attention of a prefill chunk (bf16, head_dim a multiple of 32): with AMX tiles, or
// with AVX512-BF16's vdpbf16ps where the CPU has no AMX.
//
// torch's CPU flash-attention kernel splits a prompt of a few hundred tokens into many small
// GEMM calls whose fixed cost dominates: ~0.4 ms per prompt and layer for 186 tokens here,
// 22 % of a 2048-token prefill step. This kernel does, for each head and 16 queries, two
// passes over the visible keys with tile products and no calls between them:
//   S = Q K^T (16 x 16 per tile, float32), an exact softmax per row over its visible keys
//   (scaled, max-subtracted, exp in float32, rounded to bf16 as P), then O = P V
//   (accumulated in float32 tiles) divided by the row's sum and rounded to bf16.
// Key j is visible to query i when j <= offset + i (offset: the cached prefix before the
// chunk, whose keys come first in k and v). K and V are packed once per KV head into the tile
// layouts (pairs of bf16 per 32-bit word along the product's inner dimension).
// Without AMX the same passes run on those layouts with vdpbf16ps: a score sums its query's
// dim pairs in order in one float32 lane (16 keys a vector), an output its key pairs in order
// (16 dims a vector). Either way every value of a row is computed by the same operations in
// the same order whatever chunk or 16-row group the row is in (keys a row does not see add
// exact zeros), so a prompt's outputs do not depend on how it was chunked.
//
// Decode attention over a KV cache in the tile layout (decode_attention_tiles, at the end)
// shares the softmax, and without AMX the scores (scores_dp_all): there the cache itself holds
// K^T and V as the products read them, and a decode row gets the bits the same query gets in
// a prefill chunk.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "parallel_tasks.h"
#include "prefill_attention.h"
#include "simd_math.h"

namespace conveyor {

namespace {

#ifdef CONVEYOR_AVX512BF16

// v [keys, d] -> per 32 keys and 16 dims, [16 key pairs][16 dims] words (the low half the
// even key): the second operand of O = P V. Keys past the end are zero.
void pack_values(uint32_t* out, const at::BFloat16* v, int64_t keys, int64_t stride, int64_t d,
                 int64_t pair_blocks) {
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t pb = 0; pb < pair_blocks; ++pb)
    for (int64_t pr = 0; pr < 16; ++pr) {
      const int64_t key = pb * 32 + 2 * pr;
      for (int64_t dt = 0; dt < d / 16; ++dt) {
        const __m256i even = key < keys
            ? _mm256_loadu_si256((const __m256i*)(v + key * stride + dt * 16)) : zero;
        const __m256i odd = key + 1 < keys
            ? _mm256_loadu_si256((const __m256i*)(v + (key + 1) * stride + dt * 16)) : zero;
        _mm512_storeu_si512(out + ((pb * (d / 16) + dt) * 16 + pr) * 16,
                            _mm512_or_si512(_mm512_cvtepu16_epi32(even),
                                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(odd), 16)));
      }
    }
}

// Softmax of one row of scores s[0, n) (scaled), written as bf16 p[0, width) with zeros past
// n; returns the sum of the unrounded exponentials.
float softmax_row(const float* s, uint16_t* p, int64_t n, int64_t width, float scale) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
  if (j < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1);
    mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + j));
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale);
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j < width; j += 16) {
    const int64_t valid = std::clamp<int64_t>(n - j, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    __m512 e = exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(mask, s + j), sc, shift));
    e = _mm512_maskz_mov_ps(mask, e);
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256((__m256i*)(p + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return _mm512_reduce_add_ps(sum);
}

// Query rows and the keys they read: up to 16 rows (qbuf, d bf16 apart; zeros past `rows`);
// kt[g]: where keys 16g ... 16g + 15's K^T starts ([16 dim pairs][16 keys] words per 32 dims,
// `part` words apart); vt[g]: where the cache holds their values, or null (elsewhere).
struct QueryRows {
  const uint16_t* qbuf;
  int64_t rows;
  const uint32_t* const* kt;
  const at::BFloat16* const* vt;
  int64_t d, part;
};

#ifdef CONVEYOR_AMX
// Scores of the 16 rows against key group kb with tiles (Q in tile 0, K^T in 1, the sums in
// tile acc: 2 in prefill_core's configuration, 4 in decode's): s[i * width + kb * 16 + j].
// GCC's tile intrinsics are macros that paste the tile number into the instruction, so the
// accumulator is a literal (a template argument does not assemble): one function per tile.
#define CONVEYOR_SCORES_TILES(name, acc)                                        \
  void name(const QueryRows& t, int64_t kb, float* s, int64_t width) {          \
    _tile_zero(acc);                                                            \
    for (int64_t c = 0; c < t.d / 32; ++c) {                                    \
      _tile_loadd(0, t.qbuf + c * 32, t.d * 2);                                 \
      _tile_loadd(1, t.kt[kb] + c * t.part, 64);                                \
      _tile_dpbf16ps(acc, 0, 1);                                                \
    }                                                                           \
    _tile_stored(acc, s + kb * 16, width * 4);                                  \
  }
CONVEYOR_SCORES_TILES(scores_tiles_prefill, 2)
CONVEYOR_SCORES_TILES(scores_tiles_decode, 4)
#undef CONVEYOR_SCORES_TILES
#endif

// Without AMX: scores of rows [r0, r0 + R) against key groups [kb, kb + NG), s[i * width +
// 16 * group + j], each lane its query's dim pairs in order from zero, whatever the rows or
// groups beside it. With Fetch (decode, t.vt set: the groups lie anywhere in the cache) the
// next NG groups' K^T lines and these groups' values (for the pass after) are fetched into L2,
// a line each per line read (into L1 instead, the K^T ran 0.95x at 13-48 decodes x 300-400
// positions, Zen 4); a prefill's packed K^T is in L2 already. The 16 dim pairs of a 32-dim
// part run unrolled from hoisted pointers (the loop's address and fetch arithmetic took issue
// slots from the products: prefill attention 1.02-1.05x at 512-2,048 tokens, Zen 4).
template <int R, int NG, bool Fetch>
void scores_dp(const QueryRows& t, int64_t r0, int64_t kb, int64_t groups, float* s,
               int64_t width) {
  const int64_t half = t.d / 2;
  const auto* q = reinterpret_cast<const uint32_t*>(t.qbuf + r0 * t.d);
  __m512 acc[R][NG];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t c = 0; c < half / 16; ++c) {  // dim pairs 16c ... 16c + 15: part c
    const uint32_t* keys_at[NG];
    [[maybe_unused]] const char* next[NG];
    [[maybe_unused]] const char* values[NG];
    for (int g = 0; g < NG; ++g) {
      keys_at[g] = t.kt[kb + g] + c * t.part;
      if constexpr (Fetch) {
        next[g] = kb + NG + g < groups ? (const char*)(t.kt[kb + NG + g] + c * t.part) : nullptr;
        values[g] = (const char*)(t.vt[kb + g] + 2 * (c * 16 * 16));
      }
    }
    const uint32_t* qc = q + c * 16;
#pragma GCC unroll 16
    for (int w = 0; w < 16; ++w) {
      __m512bh keys[NG];
      for (int g = 0; g < NG; ++g) {
        keys[g] = (__m512bh)_mm512_loadu_si512(keys_at[g] + w * 16);
        if constexpr (Fetch) {
          if (next[g]) _mm_prefetch(next[g] + w * 64, _MM_HINT_T1);
          _mm_prefetch(values[g] + w * 64, _MM_HINT_T1);
        }
      }
      for (int i = 0; i < R; ++i) {
        const __m512bh qw = (__m512bh)_mm512_set1_epi32(static_cast<int>(qc[i * half + w]));
        for (int g = 0; g < NG; ++g) acc[i][g] = _mm512_dpbf16_ps(acc[i][g], keys[g], qw);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int g = 0; g < NG; ++g) _mm512_storeu_ps(s + (r0 + i) * width + (kb + g) * 16, acc[i][g]);
}

// scores_dp for rows [r0, r0 + R) against groups [0, groups), 4 groups at a time.
template <int R, bool Fetch>
void scores_rows(const QueryRows& t, int64_t r0, int64_t groups, float* s, int64_t width) {
  int64_t kb = 0;
  for (; kb + 4 <= groups; kb += 4) scores_dp<R, 4, Fetch>(t, r0, kb, groups, s, width);
  for (; kb < groups; ++kb) scores_dp<R, 1, Fetch>(t, r0, kb, groups, s, width);
}

// f(R, r0) for rows [r0, r0 + R) of [0, rows), R (a std::integral_constant) 4 but at the end.
template <typename F>
void by_four_rows(int64_t rows, F&& f) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    switch (std::min<int64_t>(4, rows - r0)) {
      case 1: f(std::integral_constant<int, 1>{}, r0); break;
      case 2: f(std::integral_constant<int, 2>{}, r0); break;
      case 3: f(std::integral_constant<int, 3>{}, r0); break;
      default: f(std::integral_constant<int, 4>{}, r0); break;
    }
  }
}

// Scores of every row against key groups [0, groups) without AMX (s[i * width + 16 kb + j] =
// q_i . k_j), 4 rows at a time: each broadcast query pair and loaded key vector serves 4
// products (the 16 rows against one key vector, a broadcast per product: 0.91-0.99x of this
// on a prefill's attention, Zen 4).
void scores_dp_all(const QueryRows& t, int64_t groups, float* s, int64_t width) {
  by_four_rows(t.rows, [&](auto r, int64_t r0) {
    if (t.vt)
      scores_rows<r(), true>(t, r0, groups, s, width);
    else
      scores_rows<r(), false>(t, r0, groups, s, width);
  });
}

#ifdef CONVEYOR_AMX
// Zeroes the output accumulators (tiles 4-7) of a P V product.
inline void zero_outputs() {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
}
#endif

// Where positions g * 16 ... of KV head kh start in a plane of the tile layout (ops/reference.py), in
// elements; `table` holds the blocks of positions 0, 1, ...
inline int64_t group_offset(const int64_t* table, int64_t g, int64_t kh, int64_t kvh,
                            int64_t bs, int64_t d) {
  return (table[g * 16 / bs] * kvh + kh) * bs * d + (g * 16 % bs) * d;
}

// A query row into a tile's row (zeros for nullptr: a row past the last).
inline void load_query(uint16_t* row, const at::BFloat16* q, int64_t d) {
  if (q) std::memcpy(row, q, d * 2);
  else std::memset(row, 0, d * 2);
}

// Row i of o ([rows][d] float32 sums) divided by sums[i], rounded to bf16 into dst(i).
template <typename Dst>
void store_outputs(const float* o, const float* sums, int64_t rows, int64_t d, const Dst& dst) {
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 inv = _mm512_set1_ps(1.f / sums[i]);
    at::BFloat16* out = dst(i);
    for (int64_t c = 0; c < d; c += 16)
      _mm256_storeu_si256((__m256i*)(out + c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(
                                                   _mm512_loadu_ps(o + i * d + c), inv)));
  }
}

#ifdef CONVEYOR_AMX
// o[16][d] = P V over the first `pairs` pair blocks of keys, with tiles.
void values_tiles(const uint16_t* p, int64_t width, const uint32_t* vh, int64_t d,
                  int64_t pairs, float* o) {
  for (int64_t d0 = 0; d0 < d; d0 += 64) {  // 64 dims (4 tiles) at a time
    const int64_t tiles = std::min<int64_t>(4, (d - d0) / 16);
    zero_outputs();
    for (int64_t pb = 0; pb < pairs; ++pb) {
      _tile_loadd(0, p + pb * 32, width * 2);
      const uint32_t* vb = vh + (pb * (d / 16) + d0 / 16) * 256;
      _tile_loadd(1, vb, 64);
      _tile_dpbf16ps(4, 0, 1);
      if (tiles > 1) {
        _tile_loadd(1, vb + 256, 64);
        _tile_dpbf16ps(5, 0, 1);
      }
      if (tiles > 2) {
        _tile_loadd(1, vb + 512, 64);
        _tile_dpbf16ps(6, 0, 1);
      }
      if (tiles > 3) {
        _tile_loadd(1, vb + 768, 64);
        _tile_dpbf16ps(7, 0, 1);
      }
    }
    _tile_stored(4, o + d0, d * 4);
    if (tiles > 1) _tile_stored(5, o + d0 + 16, d * 4);
    if (tiles > 2) _tile_stored(6, o + d0 + 32, d * 4);
    if (tiles > 3) _tile_stored(7, o + d0 + 48, d * 4);
  }
}
#endif

// Rows [r0, r0 + 4) x dims [d0, d0 + 16 Tiles) of P V (values_dp), each sum adding its key
// pairs in order; the 16 pairs of a pair block unrolled from hoisted pointers.
template <int Tiles>
void values_dp_block(const uint16_t* p, int64_t width, const uint32_t* vh, int64_t d,
                     int64_t pairs, float* o, int64_t r0, int64_t d0) {
  __m512 acc[4][Tiles];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  const uint32_t* pw[4];
  for (int r = 0; r < 4; ++r) pw[r] = reinterpret_cast<const uint32_t*>(p + (r0 + r) * width);
  for (int64_t pb = 0; pb < pairs; ++pb) {
    const uint32_t* vb = vh + (pb * (d / 16) + d0 / 16) * 256;
#pragma GCC unroll 16
    for (int pr = 0; pr < 16; ++pr) {
      __m512bh v[Tiles];
      for (int t = 0; t < Tiles; ++t) v[t] = (__m512bh)_mm512_loadu_si512(vb + (t * 16 + pr) * 16);
      for (int r = 0; r < 4; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[r][pb * 16 + pr]));
        for (int t = 0; t < Tiles; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], v[t], w);
      }
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < Tiles; ++t) _mm512_storeu_ps(o + (r0 + r) * d + d0 + t * 16, acc[r][t]);
}

// o rows [0, rows) of P V over the first `pairs` pair blocks of keys, with vdpbf16ps: 4 rows
// x 64 dims of sums at a time. (The dims' count was a run-time bound inside the loop, whose
// branches and spilled registers made this 1.11-1.20x slower at 192-2,048 tokens, Zen 4.)
void values_dp(const uint16_t* p, int64_t width, const uint32_t* vh, int64_t d, int64_t pairs,
               float* o, int64_t rows) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4)
    for (int64_t d0 = 0; d0 < d; d0 += 64) {
      if (d - d0 >= 64)  // d is a multiple of 32: 64 dims, or the last 32
        values_dp_block<4>(p, width, vh, d, pairs, o, r0, d0);
      else
        values_dp_block<2>(p, width, vh, d, pairs, o, r0, d0);
    }
}

#endif  // CONVEYOR_AVX512BF16

}  // namespace

#ifdef CONVEYOR_AVX512BF16
namespace {

// The attention of a prefill chunk q [L, H, D] at positions offset ... over `keys` = offset
// + L keys of kv_heads KV heads: kgroup(h, kb) is KV head h's K^T for keys kb * 16 ... (its
// 32-dim parts c_stride words apart), vt + h * packed_v its values as pack_values lays them.
template <typename KGroup>
void prefill_core(const at::Tensor& q, at::Tensor& out, int64_t offset, int64_t keys,
                  int64_t kv_heads, double scale, const KGroup& kgroup, int64_t c_stride,
                  const uint32_t* vt, int64_t packed_v) {
  const int64_t len = q.size(0), heads = q.size(1), d = q.size(2);
  [[maybe_unused]] const bool tiles = amx_available();  // read where AMX is built in
  const int64_t width = (keys + 31) / 32 * 32;  // scores and weights per row, padded
  const int64_t group = heads / kv_heads, q_blocks = (len + 15) / 16;
  const auto* qd = q.data_ptr<at::BFloat16>();
  auto* od = out.data_ptr<at::BFloat16>();
  parallel_tasks(heads * q_blocks, [&](int64_t w0, int64_t w1) {
    const FlushDenormals flush;
#ifdef CONVEYOR_AMX
    if (tiles) load_tile_config();  // 0: Q or P; 1: K or V; 2: S; 4-7: O
#endif
    std::vector<float> s(static_cast<size_t>(16 * width));
    std::vector<uint16_t> p(static_cast<size_t>(16 * width));
    std::vector<const uint32_t*> kt;
    alignas(64) uint16_t qbuf[16 * 256];
    alignas(64) float o[16 * 256];
    float sums[16];
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t h = w / q_blocks, q0 = (w % q_blocks) * 16;
      const int64_t rows = std::min<int64_t>(16, len - q0);
      const uint32_t* vh = vt + (h / group) * packed_v;
      for (int64_t i = 0; i < 16; ++i)
        load_query(qbuf + i * d, i < rows ? qd + (q0 + i) * q.stride(0) + h * q.stride(1) : nullptr,
                   d);
      const int64_t visible = offset + q0 + rows;  // keys the last row sees
      const int64_t groups = (visible + 15) / 16;
      kt.resize(groups);
      for (int64_t kb = 0; kb < groups; ++kb) kt[kb] = kgroup(h / group, kb);
      const QueryRows r{qbuf, rows, kt.data(), nullptr, d, c_stride};
#ifdef CONVEYOR_AMX
      if (tiles)
        for (int64_t kb = 0; kb < groups; ++kb) scores_tiles_prefill(r, kb, s.data(), width);
      else
#endif
        scores_dp_all(r, groups, s.data(), width);  // S = Q K^T
      const int64_t used = (visible + 31) / 32 * 32;  // weights P V reads per row
      for (int64_t i = 0; i < 16; ++i) {
        if (i < rows)
          sums[i] = softmax_row(s.data() + i * width, p.data() + i * width, offset + q0 + i + 1,
                                used, static_cast<float>(scale));
        else
          std::memset(p.data() + i * width, 0, used * 2);
      }
#ifdef CONVEYOR_AMX
      if (tiles)
        values_tiles(p.data(), width, vh, d, used / 32, o);
      else
#endif
        values_dp(p.data(), width, vh, d, used / 32, o, rows);
      store_outputs(o, sums, rows, d, [&](int64_t i) { return od + ((q0 + i) * heads + h) * d; });
    }
#ifdef CONVEYOR_AMX
    if (tiles) _tile_release();
#endif
  });
}

}  // namespace
#endif  // CONVEYOR_AVX512BF16

// q [L, H, D], k and v [offset + L, KVH, D] (the prefix's keys first), each with unit stride
// in D; returns [L, H, D].
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             int64_t offset, double scale) {
  TORCH_CHECK(prefill_attention_available(),
              "prefill_attention: needs a CPU with AVX512-BF16 (and kernels built for it)");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: 3-d tensors");
  const int64_t len = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t keys = k.size(0), kv_heads = k.size(1);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "prefill_attention: bf16 only");
  TORCH_CHECK(d % 32 == 0 && d <= 256 && k.size(2) == d && v.sizes() == k.sizes(),
              "prefill_attention: head_dim must be a multiple of 32 (at most 256), k and v alike");
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0, "prefill_attention: heads % kv_heads");
  TORCH_CHECK(offset >= 0 && keys == offset + len, "prefill_attention: k must hold offset + ",
              len, " keys, got ", keys);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "prefill_attention: head_dim must be contiguous");
  // Keys are read as pairs of bf16 (32-bit words).
  TORCH_CHECK(k.stride(0) % 2 == 0 && k.stride(1) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(k.data_ptr()) % 4 == 0,
              "prefill_attention: k's rows must start on 4-byte boundaries");
  at::Tensor out = at::empty({len, heads, d}, q.options());
#ifdef CONVEYOR_AVX512BF16
  const int64_t key_blocks = (keys + 15) / 16, pair_blocks = (keys + 31) / 32;
  const int64_t packed_k = key_blocks * (d / 2) * 16, packed_v = pair_blocks * (d / 16) * 256;
  std::vector<uint32_t> kt(static_cast<size_t>(kv_heads * packed_k));
  std::vector<uint32_t> vt(static_cast<size_t>(kv_heads * packed_v));
  const auto* kd = k.data_ptr<at::BFloat16>();
  const auto* vd = v.data_ptr<at::BFloat16>();
  at::parallel_for(0, kv_heads, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      // K^T for S = Q K^T: per 16 dim pairs and 16 keys, [16 pairs][16 keys] words.
      transpose_pairs(kt.data() + h * packed_k,
                      reinterpret_cast<const uint32_t*>(kd + h * k.stride(1)), keys,
                      k.stride(0) / 2, d / 32, key_blocks);
      pack_values(vt.data() + h * packed_v, vd + h * v.stride(1), keys, v.stride(0), d,
                  pair_blocks);
    }
  });
  prefill_core(q, out, offset, keys, kv_heads, scale,
               [&](int64_t h, int64_t kb) { return kt.data() + h * packed_k + kb * 256; },
               key_blocks * 256, vt.data(), packed_v);
#endif
  return out;
}

// prefill_attention over a tile-layout cache [2, blocks, KVH, bs * D] holding the chunk's
// keys and its prefix (written first) at positions 0 ... offset + L - 1 of `block_table`
// [n]: K^T read where the cache holds it, the values copied into prefill_core's layout (64
// bytes at a time, no shuffles). The same outputs as prefill_attention over those keys.
at::Tensor prefill_attention_tiles(const at::Tensor& q, const at::Tensor& kv_cache,
                                   const at::Tensor& block_table, int64_t offset, double scale) {
  const int64_t len = q.size(0), heads = q.size(1), d = q.size(2), keys = offset + len;
  TORCH_CHECK(prefill_attention_available() && q.dim() == 3 && q.stride(2) == 1 &&
                  q.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16 &&
                  kv_cache.dim() == 4 && kv_cache.is_contiguous() && d % 32 == 0 && d <= 256 &&
                  kv_cache.size(3) % (16 * d) == 0 && heads % kv_cache.size(2) == 0,
              "prefill_attention_tiles: bf16 q [L, H, D] and a tile-layout kv_cache");
  [[maybe_unused]] const int64_t kvh = kv_cache.size(2);  // read where AVX512-BF16 is built in
  const int64_t bs = kv_cache.size(3) / d, blocks = kv_cache.size(1);
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() &&
                  block_table.dim() == 1 && block_table.numel() * bs >= keys && offset >= 0,
              "prefill_attention_tiles: a block table [n] long enough for offset + L keys");
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t i = 0; i < (keys + bs - 1) / bs; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < blocks, "prefill_attention_tiles: block ", table[i],
                " outside the cache");
  at::Tensor out = at::empty({len, heads, d}, q.options());
#ifdef CONVEYOR_AVX512BF16
  const auto* kc = reinterpret_cast<const uint32_t*>(kv_cache.data_ptr<at::BFloat16>());
  const uint32_t* vc = kc + kv_cache[0].numel() / 2;
  auto group_of = [&](const uint32_t* plane, int64_t h, int64_t kb) {  // 16 keys' words
    return plane + group_offset(table, kb, h, kvh, bs, d) / 2;
  };
  const int64_t pair_blocks = (keys + 31) / 32, packed_v = pair_blocks * (d / 16) * 256;
  std::vector<uint32_t> vt(static_cast<size_t>(kvh * packed_v));
  at::parallel_for(0, kvh * pair_blocks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {  // [16 key pairs][16 dims] per 32 keys and 16 dims
      const int64_t h = t / pair_blocks, pb = t % pair_blocks;
      for (int64_t pr = 0; pr < 16; ++pr) {
        const int64_t key = pb * 32 + 2 * pr;
        const uint32_t* src = key < keys ? group_of(vc, h, key / 16) + (pr % 8) * d : nullptr;
        for (int64_t dt = 0; dt < d / 16; ++dt) {
          uint32_t* dst = vt.data() + h * packed_v + ((pb * (d / 16) + dt) * 16 + pr) * 16;
          if (src) std::memcpy(dst, src + dt * 16, 64);
          else std::memset(dst, 0, 64);
        }
      }
    }
  });
  prefill_core(q, out, offset, keys, kvh, scale,
               [&](int64_t h, int64_t kb) { return group_of(kc, h, kb); }, 256, vt.data(),
               packed_v);
#endif
  return out;
}

#ifdef CONVEYOR_AVX512BF16
namespace {

#ifdef CONVEYOR_AMX
// The tiles of decode_attention_tiles: 0 Q (16 rows x 32 dims), 1 K^T (16 dim pairs x 16
// positions), 2 P (16 rows x 16 positions), 3 V (8 position pairs x 16 dims), 4-7 S or O.
struct DecodeTileConfig : TileConfig {
  DecodeTileConfig() {
    colsb[2] = 32;
    rows[3] = 8;
  }
};
#endif

// Runs of consecutive rows whose blocks are the same as far as the longest of them reads (a
// verify: a request's last token and its drafts): [starts[i], starts[i + 1]).
std::vector<int64_t> runs_of(const int64_t* tables, int64_t width, const int64_t* lens,
                             int64_t batch, int64_t bs) {
  std::vector<int64_t> starts{0};
  int64_t longest = lens[0];
  for (int64_t b = 1; b < batch; ++b) {
    const int64_t first = starts.back(), most = std::max(longest, lens[b]);
    const int64_t blocks = (most + bs - 1) / bs;
    if (std::equal(tables + b * width, tables + b * width + blocks, tables + first * width)) {
      longest = most;
    } else {
      starts.push_back(b);
      longest = lens[b];
    }
  }
  starts.push_back(batch);
  return starts;
}

// A task of decode_attention_tiles: a run, a KV head, and 16 of the run's query rows (row of
// the run, query head), from `first`; a prefill chunk's rows (one run) spread over threads.
struct DecodeTask {
  int64_t run, kh, first;
};

std::vector<DecodeTask> decode_tasks(const std::vector<int64_t>& starts, int64_t kvh,
                                     int64_t group) {
  std::vector<DecodeTask> tasks;
  for (int64_t run = 0; run + 1 < static_cast<int64_t>(starts.size()); ++run)
    for (int64_t kh = 0; kh < kvh; ++kh)
      for (int64_t first = 0; first < (starts[run + 1] - starts[run]) * group; first += 16)
        tasks.push_back({run, kh, first});
  return tasks;
}

#ifdef CONVEYOR_AMX
// The rows' S = Q K^T per 16 positions, an exact softmax per row (softmax_row), O = P V per
// 16 positions in tiles of 64 dims, divided by the row's sum and rounded to bf16 into dst[i].
// Each row's values come from its own query and positions only, in one fixed order: a row's
// output does not depend on the other rows.
void attend_tiles(const QueryRows& t, const int64_t* visible, float scale, float* s,
                  uint16_t* p, float* o, at::BFloat16* const* dst) {
  const auto& [qbuf, rows, kt, vt, d, part] = t;
  const int64_t most = *std::max_element(visible, visible + rows);
  const int64_t groups = (most + 15) / 16, width = groups * 16;
  for (int64_t kb = 0; kb < groups; ++kb) {
    if (kb + 1 < groups)  // the next groups lie anywhere: fetch them while this one computes
      for (int64_t byte = 0; byte < 32 * d; byte += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(kt[kb + 1]) + byte, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vt[kb + 1]) + byte, _MM_HINT_T1);
      }
    scores_tiles_decode(t, kb, s, width);
  }
  float sums[16];
  for (int64_t i = 0; i < rows; ++i)  // rows past `rows` keep finite scratch; nobody reads them
    sums[i] = softmax_row(s + i * width, p + i * width, visible[i], width, scale);
  for (int64_t d0 = 0; d0 < d; d0 += 64) {
    const int64_t tiles = std::min<int64_t>(4, (d - d0) / 16);
    zero_outputs();
    for (int64_t kb = 0; kb < groups; ++kb) {
      _tile_loadd(2, p + kb * 16, width * 2);
      const at::BFloat16* v = vt[kb] + d0 * 2;  // [8 position pairs][d dims][2]
      _tile_loadd(3, v, d * 4);
      _tile_dpbf16ps(4, 2, 3);
      if (tiles > 1) {
        _tile_loadd(3, v + 32, d * 4);
        _tile_dpbf16ps(5, 2, 3);
      }
      if (tiles > 2) {
        _tile_loadd(3, v + 64, d * 4);
        _tile_dpbf16ps(6, 2, 3);
      }
      if (tiles > 3) {
        _tile_loadd(3, v + 96, d * 4);
        _tile_dpbf16ps(7, 2, 3);
      }
    }
    _tile_stored(4, o + d0, d * 4);
    if (tiles > 1) _tile_stored(5, o + d0 + 16, d * 4);
    if (tiles > 2) _tile_stored(6, o + d0 + 32, d * 4);
    if (tiles > 3) _tile_stored(7, o + d0 + 48, d * 4);
  }
  store_outputs(o, sums, rows, d, [&](int64_t i) { return dst[i]; });
}
#endif

// Without AMX: o rows [r0, r0 + R), dims [d0, d0 + 16 * TL) = P V over the groups, each lane
// its position pairs in order (as values_dp does for a prefill chunk).
template <int R, int TL>
void values_dp_rows(const QueryRows& t, int64_t r0, int64_t d0, int64_t groups,
                    const uint16_t* p, int64_t width, float* o) {
  __m512 acc[R][TL];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < groups; ++kb) {
    const at::BFloat16* v = t.vt[kb] + d0 * 2;  // [8 position pairs][d dims][2]
    for (int64_t pr = 0; pr < 8; ++pr) {
      __m512i vv[TL];
      for (int c = 0; c < TL; ++c) vv[c] = _mm512_loadu_si512(v + pr * t.d * 2 + c * 32);
      for (int i = 0; i < R; ++i) {
        const auto* pw = reinterpret_cast<const uint32_t*>(p + (r0 + i) * width) + kb * 8 + pr;
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(*pw));
        for (int c = 0; c < TL; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)vv[c], pv);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < TL; ++c) _mm512_storeu_ps(o + (r0 + i) * t.d + d0 + 16 * c, acc[i][c]);
}

// values_dp_rows over every 16 dims of rows [r0, r0 + R).
template <int R>
void values_dp_all(const QueryRows& t, int64_t r0, int64_t groups, const uint16_t* p,
                   int64_t width, float* o) {
  int64_t d0 = 0;
  for (; d0 + 64 <= t.d; d0 += 64) values_dp_rows<R, 4>(t, r0, d0, groups, p, width, o);
  switch ((t.d - d0) / 16) {
    case 1: values_dp_rows<R, 1>(t, r0, d0, groups, p, width, o); break;
    case 2: values_dp_rows<R, 2>(t, r0, d0, groups, p, width, o); break;
    case 3: values_dp_rows<R, 3>(t, r0, d0, groups, p, width, o); break;
  }
}

// attend_tiles without AMX, on vdpbf16ps: the same outputs as prefill_core gives those rows
// (the same products in the same order per lane), 4 rows at a time.
void attend_dp(const QueryRows& t, const int64_t* visible, float scale, float* s, uint16_t* p,
               float* o, at::BFloat16* const* dst) {
  const int64_t most = *std::max_element(visible, visible + t.rows);
  const int64_t groups = (most + 15) / 16, width = groups * 16;
  scores_dp_all(t, groups, s, width);
  float sums[16];
  for (int64_t i = 0; i < t.rows; ++i)
    sums[i] = softmax_row(s + i * width, p + i * width, visible[i], width, scale);
  by_four_rows(t.rows, [&](auto r, int64_t r0) { values_dp_all<r()>(t, r0, groups, p, width, o); });
  store_outputs(o, sums, t.rows, t.d, [&](int64_t i) { return dst[i]; });
}

}  // namespace
#endif  // CONVEYOR_AVX512BF16

at::Tensor decode_attention_tiles(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(prefill_attention_available() && q.scalar_type() == at::kBFloat16 &&
                  kv_cache.scalar_type() == at::kBFloat16 && d <= 256,
              "decode_attention: a tile-layout kv_cache needs AVX512-BF16, bf16 and "
              "head_dim <= 256");
  at::Tensor out = at::empty({batch, heads, d}, q.options());
  if (batch == 0) return out;
#ifdef CONVEYOR_AVX512BF16
  const int64_t kvh = kv_cache.size(2), bs = kv_cache.size(3) / d, group = heads / kvh;
  const int64_t width = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const std::vector<int64_t> starts = runs_of(tables, width, lens, batch, bs);
  const auto* kc = kv_cache.data_ptr<at::BFloat16>();
  const at::BFloat16* vc = kc + kv_cache[0].numel();
  const auto* qd = q.data_ptr<at::BFloat16>();
  auto* od = out.data_ptr<at::BFloat16>();
  const std::vector<DecodeTask> tasks = decode_tasks(starts, kvh, group);
  [[maybe_unused]] const bool amx = amx_available();  // read only where AMX is compiled in
  // Handed out in shrinking runs: the requests' lengths differ (parallel_tasks.h).
  parallel_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t t0, int64_t t1) {
    const FlushDenormals flush;
#ifdef CONVEYOR_AMX
    static thread_local const DecodeTileConfig config;
    if (amx) _tile_loadconfig(&config);
#endif
    static thread_local std::vector<float> s;  // kept between calls: no allocation per step
    static thread_local std::vector<uint16_t> p;
    static thread_local std::vector<const uint32_t*> kt;
    static thread_local std::vector<const at::BFloat16*> vt;
    alignas(64) uint16_t qbuf[16 * 256];
    alignas(64) float o[16 * 256];
    for (int64_t t = t0; t < t1; ++t) {
      const DecodeTask& task = tasks[t];
      const int64_t b0 = starts[task.run];
      const int64_t rows = std::min<int64_t>(16, (starts[task.run + 1] - b0) * group - task.first);
      at::BFloat16* dst[16];
      int64_t visible[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t r = task.first + i, b = b0 + r / group, h = task.kh * group + r % group;
        load_query(qbuf + i * d, i < rows ? qd + b * q.stride(0) + h * q.stride(1) : nullptr, d);
        dst[i] = i < rows ? od + (b * heads + h) * d : nullptr;
        visible[i] = i < rows ? lens[b] : 0;
      }
      const int64_t groups = (*std::max_element(visible, visible + rows) + 15) / 16;
      if (static_cast<int64_t>(s.size()) < 256 * groups) {
        s.resize(256 * groups);
        p.resize(256 * groups);
      }
      kt.resize(groups);
      vt.resize(groups);
      for (int64_t g = 0; g < groups; ++g) {  // each 16 positions' head-block groups
        const int64_t at = group_offset(tables + b0 * width, g, task.kh, kvh, bs, d);
        kt[g] = reinterpret_cast<const uint32_t*>(kc + at);
        vt[g] = vc + at;
      }
      const QueryRows r{qbuf, rows, kt.data(), vt.data(), d, 256};  // 32 dims: 16 x 16 words
#ifdef CONVEYOR_AMX
      if (amx) {
        attend_tiles(r, visible, static_cast<float>(scale), s.data(), p.data(), o, dst);
        continue;
      }
#endif
      attend_dp(r, visible, static_cast<float>(scale), s.data(), p.data(), o, dst);
    }
#ifdef CONVEYOR_AMX
    if (amx) _tile_release();
#endif
  });
#endif
  return out;
}

bool prefill_attention_available() {
#ifdef CONVEYOR_AVX512BF16
  return true;
#else
  return false;
#endif
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("prefill_attention_available() -> bool", &conveyor::prefill_attention_available);
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, int offset, float scale) -> Tensor",
        &conveyor::prefill_attention);
  m.def("prefill_attention_tiles(Tensor q, Tensor kv_cache, Tensor block_table, int offset, "
        "float scale) -> Tensor",
        &conveyor::prefill_attention_tiles);
}
