// Matmuls on GGUF blocks (Q4_0, Q4_1, Q8_0; Q4_K, Q6_K) for CPUs with AVX512-BF16 and no
// AMX, at every batch size (dot_linear.cpp dispatches here; its notes on pair tiles and batch
// invariance hold for this file too).
//
// Rebuilding each weight's bf16 value from its block costs more than reading the block (a
// table per row and block, then a 16x16 transpose into pair tiles: ~180 cycles per 512
// weights, which made a decode step slower than reading bf16 weights). So this kernel never
// builds the weights: per block of 32 inputs it takes the block's quantized values as bf16
// integers (exact: |q| <= 127) and factors the scales out,
//   y[m, n] = sum over blocks b of ( d[n, b] * sum_k q[n, k] x[m, k] + m[n, b] * sum_k x[m, k] )
// (the m term for Q4_1 and Q4_K only; Q4_0's values are q - 8). One vdpbf16ps adds a pair
// of inputs' products to 16 rows' block sums; after the block's 16 pairs, one fused
// multiply-add scales the block sum into the output's float32 sum (and one more adds m times
// the block's input sum). That is the exact GGUF weights (not rounded to bf16), from 4
// instructions per 32 Q4 weights, in the same operations and order for an output whatever
// the batch, tile or thread: the sums are those of the blocks' float32 products, not of the
// bf16 weights', so they differ from the bf16 weights' in the last bits (closer to float32).
//
// Records (pack_dot_blocks), per 16 output rows and 32-input block, pair-major:
//   Q4_0, Q4_1: q[16 pairs][16 rows] bytes (input 2c in the low nibble, 2c + 1 in the high),
//               d[16] fp16 (, m[16] fp16)                      = 288 (320) bytes
//   Q8_0:       q[16 pairs][16 rows][2] int8, d[16] fp16        = 544 bytes
//   Q4_K, Q6_K, both (Q4_K_M files' types, repacked per 32 with float32 scales; Q6_K's per
//   16 inputs: two block sums of 8 pairs): 384, 640, 704 bytes (at scale_offset below)

#include "quant_linear.h"

#include "dot_tiles.h"
#include "gguf_blocks.h"
#include "simd_math.h"
#include "token_passes.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace conveyor {
namespace {

constexpr int64_t kPass = 64;       // most tokens per pass: their sums stay in L1 between blocks
constexpr int kTokens = 3;          // 3 tokens x 4 records x 2 (block and total sums): 24 sums
constexpr int64_t kStreamed = 3;    // up to this many tokens, records are read in place
constexpr int kOuterTokens = 6;     // beyond: 6 tokens x 4 records of block sums at a time

// Where a record's d (then m) begins, and its size. Q4_K: Q4_1's nibbles, then d * sc and
// -dmin * m as float32 [16] each = 384 bytes; Q6_K: q - 32 as Q8_0's int8 pairs, then d * sc
// of inputs 0-15 and of 16-31 as float32 [16] each = 640; kKMixed (a matmul fused from Q4_K
// and Q6_K parts): Q6_K's record (Q4_K rows: q, d * sc twice), then m float32 [16] = 704.
constexpr int64_t scale_offset(int64_t type) { return byte_values(type) ? 512 : 256; }
int64_t bf16_record_bytes(int64_t type) {
  switch (type) {
    case kQ4_K: return 384;
    case kQ6_K: return 640;
    case kKMixed: return 704;
    default: return block_format(type).record_bytes;
  }
}
int64_t bf16_type_of_record(int64_t bytes) {
  for (int64_t type : {kQ4_K, kQ6_K, kKMixed})
    if (bf16_record_bytes(type) == bytes) return type;
  return type_of_record(bytes, "dot_linear", "pack_dot_blocks");
}

#ifdef CONVEYOR_AVX512BF16

// The 16 values of a nibble as bf16 integers: q - 8 (Q4_0) or q (Q4_1), in words 0-15.
template <int64_t Type>
__m512i nibble_levels() {
  const __m512 levels = Type == kQ4_0
      ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
      : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return (__m512i)_mm512_cvtne2ps_pbh(levels, levels);
}

// Pair c of a record: for its 16 rows, the values of inputs 2c and 2c + 1 as bf16 (one word
// each, the even input low).
template <int64_t Type>
inline __m512bh record_pair(const uint8_t* rec, int64_t c, __m512i levels) {
  if constexpr (byte_values(Type)) {
    const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(rec + c * 32)));
    const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(rec + c * 32 + 16)));
    return _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(hi), _mm512_cvtepi32_ps(lo));
  } else {
    // Row r's byte in dword r; its low nibble to word 2r, its high one (<< 12) to word 2r + 1.
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(rec + c * 16)));
    const __m512i idx = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12),
                                                  _mm512_set1_epi32(0x000F000F), 0xA8);  // (a|b)&c
    return (__m512bh)_mm512_permutexvar_epi16(idx, levels);
  }
}

inline __m512 record_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

// Weights read in place from a task's records (absent ones: a zero record).
template <int64_t Type>
struct Records {
  const uint8_t* first[kTaskGroups];  // block 0's record of each group
  int64_t stride;                 // bytes from a group's block to its next
  __m512i levels;
  __m512bh pair(int64_t j, int64_t b, int64_t c) const {
    return record_pair<Type>(first[j] + b * stride, c, levels);
  }
  // The record's 16 scales from byte `at` on (float32, or fp16 values).
  __m512 scales_at(int64_t j, int64_t b, int64_t at) const {
    const uint8_t* p = first[j] + b * stride + scale_offset(Type) + at;
    if constexpr (float_scales(Type)) return _mm512_loadu_ps(p);
    else return record_halves(p);
  }
  // d (of inputs 0-15 where the halves have their own), that of inputs 16-31, then m.
  __m512 scale(int64_t j, int64_t b) const { return scales_at(j, b, 0); }
  __m512 scale_b(int64_t j, int64_t b) const { return scales_at(j, b, 64); }
  __m512 min(int64_t j, int64_t b) const {
    return scales_at(j, b, float_scales(Type) ? (half_scales(Type) ? 128 : 64) : 32);
  }
};

struct Call {
  const uint32_t* x;  // [m, pairs] words
  const float* sx;    // [m, blocks]: each block's input sum (types with an m)
  int64_t pairs, blocks, n;
  const float* bias;  // [n] or null
  uint16_t* y;        // [m, n] bf16
};

// Input pairs [c0, c1) of block b into tokens [m0, m0 + MR)'s block sums (per token and
// record, 16 outputs), from zero.
template <int MR, class Weights>
inline void block_pairs(const Call& p, const Weights& w, int64_t b, int64_t m0, int64_t c0,
                        int64_t c1, __m512 (&blk)[MR][kTaskGroups]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kTaskGroups; ++j) blk[i][j] = _mm512_setzero_ps();
  const uint32_t* xr = p.x + m0 * p.pairs + b * 16;
  for (int64_t c = c0; c < c1; ++c) {
    __m512bh wv[kTaskGroups];
    for (int j = 0; j < kTaskGroups; ++j) wv[j] = w.pair(j, b, c);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[i * p.pairs + c]));
      for (int j = 0; j < kTaskGroups; ++j) blk[i][j] = _mm512_dpbf16_ps(blk[i][j], wv[j], xb);
    }
  }
}

// Tokens [m0, m0 + MR) take block b into their sums: its 16 input pairs into block sums,
// then sum += d * block sum (with a scale per half block: d * the first 8 pairs' + db * the
// last 8's), + m * the block's input sum for types with an m. Both ways of walking the blocks
// below run exactly this, so an output's operations do not depend on the number of tokens.
template <int64_t Type, int MR, class Weights>
inline void add_block(const Call& p, const Weights& w, int64_t b, int64_t m0,
                      __m512 (&sums)[MR][kTaskGroups]) {
  __m512 blk[MR][kTaskGroups];
  block_pairs<MR>(p, w, b, m0, 0, half_scales(Type) ? 8 : 16, blk);
  for (int j = 0; j < kTaskGroups; ++j) {
    const __m512 d = w.scale(j, b);
    for (int i = 0; i < MR; ++i) sums[i][j] = _mm512_fmadd_ps(blk[i][j], d, sums[i][j]);
  }
  if constexpr (half_scales(Type)) {
    block_pairs<MR>(p, w, b, m0, 8, 16, blk);
    for (int j = 0; j < kTaskGroups; ++j) {
      const __m512 d = w.scale_b(j, b);
      for (int i = 0; i < MR; ++i) sums[i][j] = _mm512_fmadd_ps(blk[i][j], d, sums[i][j]);
    }
  }
  if constexpr (has_min(Type)) {
    for (int j = 0; j < kTaskGroups; ++j) {
      const __m512 mv = w.min(j, b);
      for (int i = 0; i < MR; ++i)
        sums[i][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(p.sx[(m0 + i) * p.blocks + b]), sums[i][j]);
    }
  }
}

// y rows [m0, m0 + MR), the task's outputs from n0 (`groups` records): every block in
// turn, the sums in registers.
template <int64_t Type, int MR, class Weights>
void block_tokens(const Call& p, const Weights& w, int64_t groups, int64_t n0, int64_t m0) {
  __m512 sums[MR][kTaskGroups];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kTaskGroups; ++j) sums[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) add_block<Type, MR>(p, w, b, m0, sums);
  store_sums<MR>(sums, groups, p.bias, p.y, p.n, n0, m0);
}

template <int64_t Type, class Weights>
void tokens(const Call& p, const Weights& w, int64_t groups, int64_t n0, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; m += kTokens) {
    switch (std::min<int64_t>(kTokens, m1 - m)) {
      case 1: block_tokens<Type, 1>(p, w, groups, n0, m); break;
      case 2: block_tokens<Type, 2>(p, w, groups, n0, m); break;
      default: block_tokens<Type, 3>(p, w, groups, n0, m); break;
    }
  }
}

// One block's weights for a task, unpacked from its records: pairs as bf16 words, scales.
struct BlockWeights {
  alignas(64) uint32_t pairs[kTaskGroups][16][16];
  __m512 scales[kTaskGroups], scales_b[kTaskGroups], mins[kTaskGroups];
  __m512bh pair(int64_t j, int64_t /*b*/, int64_t c) const {
    return (__m512bh)_mm512_load_si512(pairs[j][c]);
  }
  __m512 scale(int64_t j, int64_t /*b*/) const { return scales[j]; }
  __m512 scale_b(int64_t j, int64_t /*b*/) const { return scales_b[j]; }
  __m512 min(int64_t j, int64_t /*b*/) const { return mins[j]; }
};

// Tokens [m0, m0 + MR) (their sums at acc, [token][group][16] floats) take block b.
template <int64_t Type, int MR>
void block_step(const Call& p, const BlockWeights& w, int64_t b, int64_t m0, float* acc) {
  __m512 sums[MR][kTaskGroups];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kTaskGroups; ++j)
      sums[i][j] = _mm512_loadu_ps(acc + (i * kTaskGroups + j) * 16);
  add_block<Type, MR>(p, w, b, m0, sums);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kTaskGroups; ++j)
      _mm512_storeu_ps(acc + (i * kTaskGroups + j) * 16, sums[i][j]);
}

// Tokens [m0, m1) against a task's records, a block at a time: the block's records unpacked
// once into L1, every token's sums kept in `acc` between blocks.
template <int64_t Type>
void blocks_outer(const Call& p, const Records<Type>& r, int64_t groups, int64_t n0, int64_t m0,
                  int64_t m1, std::vector<float>& acc) {
  acc.assign(static_cast<size_t>((m1 - m0) * kTaskGroups * 16), 0.f);
  BlockWeights w;
  for (int64_t b = 0; b < p.blocks; ++b) {
    for (int64_t j = 0; j < kTaskGroups; ++j) {
      for (int64_t c = 0; c < 16; ++c) _mm512_store_si512(w.pairs[j][c], (__m512i)r.pair(j, b, c));
      w.scales[j] = r.scale(j, b);
      if constexpr (half_scales(Type)) w.scales_b[j] = r.scale_b(j, b);
      if constexpr (has_min(Type)) w.mins[j] = r.min(j, b);
    }
    for (int64_t m = m0; m < m1; m += kOuterTokens) {
      float* a = acc.data() + (m - m0) * kTaskGroups * 16;
      switch (std::min<int64_t>(kOuterTokens, m1 - m)) {
        case 1: block_step<Type, 1>(p, w, b, m, a); break;
        case 2: block_step<Type, 2>(p, w, b, m, a); break;
        case 3: block_step<Type, 3>(p, w, b, m, a); break;
        case 4: block_step<Type, 4>(p, w, b, m, a); break;
        case 5: block_step<Type, 5>(p, w, b, m, a); break;
        default: block_step<Type, 6>(p, w, b, m, a); break;
      }
    }
  }
  for (int64_t m = m0; m < m1; ++m) {
    __m512 sums[1][kTaskGroups];
    for (int j = 0; j < kTaskGroups; ++j)
      sums[0][j] = _mm512_loadu_ps(acc.data() + ((m - m0) * kTaskGroups + j) * 16);
    store_sums<1>(sums, groups, p.bias, p.y, p.n, n0, m);
  }
}

template <int64_t Type>
void run(const Call& p, const uint8_t* w, int64_t groups, int64_t m) {
  const int64_t record = bf16_record_bytes(Type);
  for_each_group_task<uint8_t, kTaskGroups>(
      w, p.blocks * record, groups, kTaskGroups, TokenPasses(m, kPass), m,
      [&](const GroupTask<uint8_t, kTaskGroups>& t, int64_t) {
        static thread_local std::vector<float> acc;  // kept between calls: no fresh pages
        Records<Type> r{{}, record, nibble_levels<Type>()};
        std::copy(t.group, t.group + kTaskGroups, r.first);
        if (t.m1 - t.m0 <= kStreamed)
          tokens<Type>(p, r, t.here, t.first * kGroupRows, t.m0, t.m1);
        else
          blocks_outer<Type>(p, r, t.here, t.first * kGroupRows, t.m0, t.m1, acc);
      });
}

// Each token's sum of each block of 32 inputs, in one fixed order: [m, blocks].
std::vector<float> block_sums(const uint16_t* x, int64_t m, int64_t blocks) {
  std::vector<float> sx(static_cast<size_t>(m * blocks));
  for (int64_t i = 0; i < m * blocks; ++i) {
    const __m512i words = _mm512_loadu_si512(x + i * 32);
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(-65536)));
    sx[static_cast<size_t>(i)] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  }
  return sx;
}

#endif  // CONVEYOR_AVX512BF16

}  // namespace

at::Tensor pack_bf16_blocks(const at::Tensor& raw, int64_t type, bool k_mixed) {
  check_k_mixed(k_mixed, type, "pack_dot_blocks");
  if (type == kQ4_K || type == kQ6_K) {
    const int64_t kind = k_mixed ? kKMixed : type;
    return repack_k_blocks(raw, type, "pack_dot_blocks", kGroupRows, bf16_record_bytes(kind),
                           at::kByte, [&](uint8_t* rec, int64_t i, const KBlock& k) {
      for (int64_t l = 0; l < 32; ++l) {
        if (kind == kQ4_K)  // Q4_1's nibbles: pair c's inputs 2c low, 2c + 1 high
          rec[(l / 2) * kGroupRows + i] |= static_cast<uint8_t>(k.q[l] << (4 * (l & 1)));
        else  // Q6_K's q - 32 (a Q4_K row of mixed records: q), as Q8_0's int8 pairs
          rec[((l / 2) * kGroupRows + i) * 2 + (l & 1)] =
              static_cast<uint8_t>(type == kQ6_K ? k.q[l] - 32 : k.q[l]);
      }
      put_k_scales(rec, scale_offset(kind), kGroupRows, i, kind, k);
    });
  }
  return repack_blocks(raw, type, "pack_dot_blocks", kGroupRows,
                       block_format(type, "pack_dot_blocks").record_bytes,
                       scale_offset(type), at::kByte,
                       [type](uint8_t* rec, int64_t i, const uint8_t* qs) {
    for (int64_t c = 0; c < 16; ++c) {  // pair c of row i
      if (type == kQ8_0) {
        rec[(c * kGroupRows + i) * 2] = qs[2 * c];
        rec[(c * kGroupRows + i) * 2 + 1] = qs[2 * c + 1];
      } else {
        rec[c * kGroupRows + i] =
            static_cast<uint8_t>(gguf_nibble(qs, 2 * c) | (gguf_nibble(qs, 2 * c + 1) << 4));
      }
    }
  });
}

at::Tensor dot_blocks_linear(const at::Tensor& x, const at::Tensor& w, const float* bias) {
  [[maybe_unused]] const int64_t type = bf16_type_of_record(w.size(2));
  const int64_t groups = w.size(0), n = groups * kGroupRows, m = x.size(0);
  [[maybe_unused]] const int64_t blocks = w.size(1);
  at::Tensor y = at::empty({m, n}, x.options());
#ifdef CONVEYOR_AVX512BF16
  const at::Tensor xc = x.contiguous();
  const auto* xd = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const std::vector<float> sx = has_min(type) ? block_sums(xd, m, blocks) : std::vector<float>();
  const Call p{reinterpret_cast<const uint32_t*>(xd), sx.data(), blocks * 16, blocks, n, bias,
               reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>())};
  const uint8_t* wd = w.data_ptr<uint8_t>();
  switch (type) {
    case kQ4_0: run<kQ4_0>(p, wd, groups, m); break;
    case kQ4_1: run<kQ4_1>(p, wd, groups, m); break;
    case kQ4_K: run<kQ4_K>(p, wd, groups, m); break;
    case kQ6_K: run<kQ6_K>(p, wd, groups, m); break;
    case kKMixed: run<kKMixed>(p, wd, groups, m); break;
    default: run<kQ8_0>(p, wd, groups, m); break;
  }
#endif
  return y;
}

}  // namespace conveyor
