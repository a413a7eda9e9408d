// GGUF block formats (Q4_0, Q4_1, Q8_0; Q4_K and Q6_K decoded per 32) as the matmul kernels
// keep them, their repacking (repack_blocks, repack_k_blocks: the bf16, float32 and int8-input
// records) and their dequantization to bf16 in registers: shared by the AMX kernel
// (quant_linear.cpp), the AVX512-BF16 dot kernels on blocks (dot_blocks.cpp, vnni_blocks.cpp)
// and the float32 ones (f32_linear.cpp).
//
// Layout (pack_block_weights): for each 16 output rows and each 32-input block, one record:
//   Q4_0: q[8 row pairs][32 bytes] (nibbles of two rows), d[16] fp16      = 288 bytes
//   Q4_1: q[8][32], d[16] fp16, m[16] fp16                                = 320 bytes
//   Q8_0: q[16 rows][32] int8, d[16] fp16                                 = 544 bytes
// records ordered by row tile, then block: a task streams one contiguous run.
//
// Dequantization reproduces gguf-py's numpy (float32, no fused multiply-add): Q4_0 d*(q-8),
// Q4_1 d*q+m, Q8_0 d*q, then float32 -> bf16 rounded to nearest even as torch's copy does
// (vcvtne2ps2bf16 also flushes float32 denormals, which torch keeps: the load-time check
// would catch a weight where that mattered). For the 4-bit types each row's 16 possible
// values are computed once per block and its 32 weights looked up with one vpermw.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "simd_math.h"

namespace conveyor {

// GGML type ids of the formats we read.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

struct BlockFormat {
  int64_t block_bytes;   // one GGUF block of 32 weights
  int64_t record_bytes;  // 16 rows x one block, packed
};

inline BlockFormat block_format(int64_t type, const char* op = "pack_block_weights") {
  switch (type) {
    case kQ4_0: return {18, 288};
    case kQ4_1: return {20, 320};
    case kQ8_0: return {34, 544};
    default: TORCH_CHECK(false, op, ": GGML type ", type,
                         " is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8)");
  }
}

// Checks raw GGUF blocks, uint8 [rows (a multiple of 16), blocks, block bytes], for `op`.
inline BlockFormat check_raw_blocks(const at::Tensor& raw, int64_t type, const char* op) {
  const BlockFormat f = block_format(type, op);
  TORCH_CHECK(raw.dim() == 3 && raw.scalar_type() == at::kByte && raw.size(2) == f.block_bytes,
              op, ": expected uint8 [rows, blocks, ", f.block_bytes, "], got ", raw.sizes(), " ",
              raw.scalar_type());
  TORCH_CHECK(raw.size(0) % 16 == 0, op, ": rows must be a multiple of 16, got ", raw.size(0));
  return f;
}

// Raw GGUF blocks (checked as check_raw_blocks does, for `op`) repacked per `rows` output rows
// and block into one record of `record_bytes`: an [N / rows, K / 32, record_bytes] tensor of
// `dtype` (uint8 or int8). Row i's d (and Q4_1's m) go as fp16 to rec + scales + 2i (and
// rec + scales + 2 * rows + 2i); put(rec, i, qs) places its quantized bytes (qs: the 16, or
// for Q8_0 32, bytes after the block's scales). Each kernel family's packing is one `put`.
template <class Put>
at::Tensor repack_blocks(const at::Tensor& raw, int64_t type, const char* op, int64_t rows,
                         int64_t record_bytes, int64_t scales, at::ScalarType dtype, Put&& put) {
  const BlockFormat f = check_raw_blocks(raw, type, op);
  const int64_t n = raw.size(0), kb = raw.size(1);
  const at::Tensor src = raw.contiguous();
  at::Tensor out = at::zeros({n / rows, kb, record_bytes}, raw.options().dtype(dtype));
  const uint8_t* r = src.data_ptr<uint8_t>();
  auto* o = static_cast<uint8_t*>(out.data_ptr());
  const int64_t q_offset = type == kQ4_1 ? 4 : 2;  // after d (and m) in a GGUF block
  at::parallel_for(0, n / rows, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < kb; ++b) {
        uint8_t* rec = o + (t * kb + b) * record_bytes;
        for (int64_t i = 0; i < rows; ++i) {
          const uint8_t* blk = r + ((t * rows + i) * kb + b) * f.block_bytes;
          std::memcpy(rec + scales + i * 2, blk, 2);                                    // d
          if (type == kQ4_1) std::memcpy(rec + scales + 2 * rows + i * 2, blk + 2, 2);  // m
          put(rec, i, blk + q_offset);
        }
      }
  });
  return out;
}

// GGML's K-quants (llama.cpp's Q4_K_M files hold both): 256 weights per super-block. The
// kernels that read them repack each per 32 inputs, the other types' block size.
//   Q4_K (144 bytes): d, dmin fp16; 12 bytes of 6-bit scales and mins, one of each per 32;
//                     128 bytes of nibbles. A weight is d * sc * q - dmin * m.
//   Q6_K (210 bytes): 6-bit values q, an int8 scale per 16, one fp16 d: d * sc * (q - 32).
constexpr int64_t kQ4_K = 12, kQ6_K = 14;
// A matmul fused from Q4_K and Q6_K parts (q, k and v of a Q4_K_M file's layer), read as one
// record kind. Not a GGML type: an id of ours.
constexpr int64_t kKMixed = 1000;

// What a type's records hold where a kernel reads K-quants: an m (the blocks' input sums
// count), a scale per half block (Q6_K's per 16 inputs: two block sums), float32 scales (the
// K-quants' exact d * sc; fp16 otherwise), values as int8 (else as nibbles: Q4_0, Q4_1, Q4_K).
constexpr bool has_min(int64_t type) { return type == kQ4_1 || type == kQ4_K || type == kKMixed; }
constexpr bool half_scales(int64_t type) { return type == kQ6_K || type == kKMixed; }
constexpr bool float_scales(int64_t type) { return type == kQ4_K || half_scales(type); }
constexpr bool byte_values(int64_t type) { return type == kQ8_0 || half_scales(type); }

// Sub-block j's (0-7) 6-bit scale and min from a Q4_K super-block's 12 scale bytes (GGML's
// get_scale_min_k4).
inline void q4k_scale_min(const uint8_t* s, int64_t j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One 32-weight block of a K-quant super-block, for a record row: its values, its halves'
// scales (inputs 0-15 and 16-31) and its m (a weight is d * q + m; Q6_K: q - 32, m = 0).
struct KBlock {
  uint8_t q[32];
  float da, db, m;
};

// Block j (0-7) of a Q4_K super-block (d, dmin fp16; 12 bytes of 6-bit scales and mins; 128
// bytes of nibbles: blocks 2c and 2c + 1 are the low and high nibbles of bytes 32c..32c+31).
inline void q4k_block(const uint8_t* blk, int64_t j, KBlock& k) {
  uint16_t bits[2];
  std::memcpy(bits, blk, 4);
  const float d = static_cast<float>(c10::Half(bits[0], c10::Half::from_bits()));
  const float dmin = static_cast<float>(c10::Half(bits[1], c10::Half::from_bits()));
  int sc = 0, mn = 0;
  q4k_scale_min(blk + 4, j, sc, mn);
  k.da = k.db = d * static_cast<float>(sc);
  k.m = -(dmin * static_cast<float>(mn));
  const uint8_t* qs = blk + 16 + 32 * (j / 2);
  for (int64_t l = 0; l < 32; ++l) k.q[l] = static_cast<uint8_t>((qs[l] >> (4 * (j & 1))) & 0xF);
}

// Block j (0-7) of a Q6_K super-block (ql[128], qh[64], int8 scales[16], d fp16; GGML's
// dequantize_row_q6_K: per 128 weights, 64 bytes of low nibbles, weights 64-127 in the high
// ones, and 32 bytes of high bits, weights 32s..32s+31 in bits 2s, 2s + 1): d * (q - 32).
inline void q6k_block(const uint8_t* blk, int64_t j, KBlock& k) {
  uint16_t bits;
  std::memcpy(&bits, blk + 208, 2);
  const float d = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
  k.da = d * static_cast<float>(sc[2 * j]);
  k.db = d * static_cast<float>(sc[2 * j + 1]);
  k.m = 0.f;
  const int64_t half = j / 4, quarter = j % 4;
  for (int64_t l = 0; l < 32; ++l) {
    const uint8_t low = blk[half * 64 + (quarter & 1) * 32 + l] >> (4 * (quarter >> 1)) & 0xF;
    const uint8_t high = blk[128 + half * 32 + l] >> (2 * quarter) & 3;
    k.q[l] = static_cast<uint8_t>(low | high << 4);
  }
}

// Raw K-quant super-blocks (uint8 [rows, in / 256, 144 (Q4_K) or 210 (Q6_K)]) repacked per
// `rows` output rows and 32-input block into one record of `record_bytes`: an
// [N / rows, K / 32, record_bytes] tensor of `dtype`, zeroed, then put(rec, i, k) for each
// row i's block k.
template <class Put>
at::Tensor repack_k_blocks(const at::Tensor& raw, int64_t type, const char* op, int64_t rows,
                           int64_t record_bytes, at::ScalarType dtype, Put&& put) {
  const bool q6k = type == kQ6_K;
  const int64_t bytes = q6k ? 210 : 144;
  TORCH_CHECK(raw.dim() == 3 && raw.scalar_type() == at::kByte && raw.size(2) == bytes &&
                  raw.size(0) % rows == 0,
              op, ": ", q6k ? "Q6_K" : "Q4_K", " blocks must be uint8 [rows (a multiple of ",
              rows, "), in / 256, ", bytes, "], got ", raw.sizes(), " ", raw.scalar_type());
  const int64_t n = raw.size(0), supers = raw.size(1), blocks = supers * 8;
  const at::Tensor src = raw.contiguous();
  at::Tensor out = at::zeros({n / rows, blocks, record_bytes}, raw.options().dtype(dtype));
  const uint8_t* r = src.data_ptr<uint8_t>();
  auto* o = static_cast<uint8_t*>(out.data_ptr());
  at::parallel_for(0, n / rows, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t b = 0; b < blocks; ++b) {
          KBlock k;
          (q6k ? q6k_block : q4k_block)(r + ((t * rows + i) * supers + b / 8) * bytes, b % 8, k);
          put(o + (t * blocks + b) * record_bytes, i, k);
        }
  });
  return out;
}

// Row i's float32 scales of a K-quant block in records of `rows` rows, from byte `at` on:
// d (that of inputs 0-15 for a type with half scales), then db or m, then (kKMixed) m.
inline void put_k_scales(uint8_t* rec, int64_t at, int64_t rows, int64_t i, int64_t kind,
                         const KBlock& k) {
  const float scales[3] = {k.da, half_scales(kind) ? k.db : k.m, k.m};
  for (int64_t s = 0; s < (kind == kKMixed ? 3 : 2); ++s)
    std::memcpy(rec + at + (s * rows + i) * 4, &scales[s], 4);
}

// The K-quant packers' type check: k_mixed records are for Q4_K and Q6_K only.
inline void check_k_mixed(bool k_mixed, int64_t type, const char* op) {
  TORCH_CHECK(!k_mixed || type == kQ4_K || type == kQ6_K, op,
              ": k_mixed records are for Q4_K and Q6_K blocks, not GGML type ", type);
}

// Weight j of a 4-bit block's bytes qs: GGUF keeps j < 16 in the low nibble of qs[j], j + 16
// in the high nibble of qs[j - 16].
inline uint8_t gguf_nibble(const uint8_t* qs, int64_t j) {
  return static_cast<uint8_t>(j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4);
}

// The type of a packed weight [N/16, K/32, record bytes], from its record size (`packer`: the
// op that makes such weights, for the error).
inline int64_t type_of_record(int64_t record_bytes, const char* op,
                              const char* packer = "pack_block_weights") {
  for (int64_t type : {kQ4_0, kQ4_1, kQ8_0})
    if (block_format(type).record_bytes == record_bytes) return type;
  TORCH_CHECK(false, op, ": w is not from ", packer, " (", record_bytes, "-byte records)");
}

#ifdef CONVEYOR_AVX512BF16

// A float32 product as numpy computes it, kept apart from a following sum: the empty asm
// hides that the value is a product, so the compiler cannot fuse the two into one rounding.
inline __m512 unfused(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

inline void store_bf16x32(uint16_t* dst, __m512 lo, __m512 hi) {
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// One record -> 16 rows of 32 bf16 values, row i at tile + i * row_stride.
template <int64_t Type>
inline void dequantize_record(const uint8_t* rec, uint16_t* tile, int64_t row_stride) {
  alignas(64) float d[16], m[16];
  if constexpr (Type == kQ8_0) {
    _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 512))));
    for (int i = 0; i < 16; ++i) {
      const uint8_t* q = rec + i * 32;
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
      const __m512 hi = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16))));
      store_bf16x32(tile + i * row_stride, _mm512_mul_ps(lo, _mm512_set1_ps(d[i])),
                    _mm512_mul_ps(hi, _mm512_set1_ps(d[i])));
    }
  } else {
    _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 256))));
    if constexpr (Type == kQ4_1)
      _mm512_store_ps(m, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 288))));
    // The 16 values a nibble can stand for, as floats: q - 8 (Q4_0) or q (Q4_1).
    const __m512 levels = Type == kQ4_0
        ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
        : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i = 0; i < 16; i += 2) {
      // Rows i and i + 1 share 32 bytes: weight j of row i in byte j's low nibble, of row
      // i + 1 in its high nibble (pack_block_weights). As 16-bit words, a row's indices are
      // the words or the words >> 4; vpermw reads 5 index bits, so row i's indices carry
      // row i + 1's lowest bit as bit 4, and the table holds its 16 values twice.
      const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(rec + i * 16)));
      const __m512i index[2] = {words, _mm512_srli_epi16(words, 4)};
      for (int r = 0; r < 2; ++r) {
        __m512 values = _mm512_mul_ps(levels, _mm512_set1_ps(d[i + r]));
        if constexpr (Type == kQ4_1) values = _mm512_add_ps(unfused(values), _mm512_set1_ps(m[i + r]));
        const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(values, values);
        _mm512_storeu_si512(tile + (i + r) * row_stride, _mm512_permutexvar_epi16(index[r], table));
      }
    }
  }
}

#endif  // CONVEYOR_AVX512BF16

}  // namespace conveyor
