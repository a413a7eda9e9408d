// Matmuls on GGUF blocks (Q4_0, Q4_1, Q8_0; Q4_K repacked per 32 as Q4_1 with float32
// scales, Q6_K per 32 with a scale per half; both, for a matmul fused from the two, in one
// record kind: see kQ4KRecord, kQ6KRecord, kKMixedRecord) with int8 activations, for CPUs
// with AVX512-VNNI and AVX512-BF16 but no AMX (AMD Zen 4 and 5, Intel Cooper Lake): llama.cpp's
// way on such CPUs, at every batch size (dot_linear.cpp dispatches here; its notes on batch
// invariance hold).
//
// A full batch on these CPUs is bound by arithmetic, not by the weights' bytes. vdpbf16ps
// adds 32 products per instruction; vpdpbusd adds 64 (bytes, four per 32-bit lane) at the
// same rate. So each token's inputs are quantized per block of 32 to int8 with one float32
// scale (dx = max |x| / 127, qx = round(x * (127 / max |x|))). A weight is d * (s - o) + m',
// with s its stored byte (Q4_0, Q4_1: the 4-bit q; Q8_0: q + 128), o = 8 (Q8_0: 128), and
// m' = 0 but for Q4_1 (and Q4_K, repacked as Q4_1), whose d * q + m is d * (q - 8) +
// (m + 8d). A block's sum is then
//   d * dx * sum_k (s_k - o) qx_k  +  m' * sum_k x_k
// The first sum is an exact int32: vpdpbusd's products of the stored bytes with qx, started
// at -o * sum_k qx_k. The second (Q4_1 and Q4_K only) takes the block's float32 sum of x (not
// quantized, in one fixed order), as the bf16 kernel does. Counting the 4-bit values from
// their middle keeps Q4_1's two terms from being large and cancelling (its weights' m is
// about -8d): the inputs' rounding then errs on d * (q - 8), the size of the weights.
// (llama.cpp's Q4_1 x Q8_1 form, d * dx * sum q qx + m * dx * sum qx, needs no int32 start
// and ran the workload 1.02-1.07x faster, but errs by (m + 8d) * sum (x - dx qx) more: the
// default model's first token for "What is the capital of France?" moved 0.43 nats off
// float32's, and its greedy answer from Paris to "L'Etoile, la Marseillaise, ...".)
// Per block of 32 inputs, 16 rows and token: 8 vpdpbusd, then one conversion, one multiply
// and one fused multiply-add (and one more for Q4_1), in the same order for an output
// whatever the batch, tile or thread; a token's quantized inputs depend on that token
// alone: a row's result never depends on its batch. The results differ from the bf16
// kernel's by the inputs' rounding to 8 bits (as llama.cpp's Q8 activations do; measured in
// docs/benchmarks.md, checked against the dense weights at load).
//
// Records (pack_vnni_blocks, int8 tensors), per 16 output rows and 32-input block:
//   Q4_0, Q4_1: q[4 quad pairs][16 rows][4] bytes: input 8p + t in byte t's low nibble,
//               8p + 4 + t in its high one; d[16] fp16 (, m[16] fp16)   = 288 (320) bytes
//   Q8_0:       q[8 quads][16 rows][4] bytes (value + 128), d[16] fp16   = 544 bytes
//   Q4_K, Q6_K, both: 384, 512, 576 bytes (at their constants below)

#include "quant_linear.h"

#include "dot_tiles.h"
#include "gguf_blocks.h"
#include "simd_math.h"
#include "token_passes.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace conveyor {
namespace {

constexpr int64_t kVnniPass = 256;    // most tokens per pass over a task's unpacked weights
constexpr int64_t kVnniStreamed = 3;  // up to this many tokens (x 4 records of float sums in
                                      // registers), records are read in place
constexpr int kVnniOuter = 8;         // beyond: 8 tokens x one record's float and int sums
                                      // (and the quantized inputs' tiles: VnniCall)
constexpr int64_t kVnniInPlace = 16;  // up to this many, records are unpacked per 8 tokens

// Q4_K repacked per 32 like Q4_1, with its exact float32 scales d * sc and -dmin * m: 256
// nibble bytes, d[16] and m[16] float32 = 384 bytes (a size no other record has).
constexpr int64_t kQ4KRecord = 384;
// Q6_K (a weight is d * sc * (q - 32), q 6 bits, an int8 scale per 16) repacked per 32: the
// low nibbles as Q4's records hold them (256 bytes), the 2 high bits of quads 4h..4h+3 in run
// h of 64 bytes (bits 2u, 2u + 1 of a byte for quad 4h + u: 128 bytes), then d * sc of the
// block's two halves (inputs 0-15 and 16-31) as float32 [16] each (exact) = 512 bytes (a
// size no other record has).
constexpr int64_t kQ6KRecord = 512;
// kKMixed (a matmul fused from Q4_K and Q6_K parts) takes both as 6-bit records with an m:
// Q6_K's record, then m[16] float32 (Q6_K rows: 0; Q4_K rows hold q + 24, their halves'
// scales both d * sc and m = -dmin * m' + 8 * d * sc, so that d * sc * (q + 24 - 32) + m is
// their weight) = 576 bytes (a size no other record has).
constexpr int64_t kKMixedRecord = 576;

// A type's record bytes; the kernel knows a packed weight's type by them.
inline int64_t vnni_record_bytes(int64_t type) {
  switch (type) {
    case kQ4_K: return kQ4KRecord;
    case kQ6_K: return kQ6KRecord;
    case kKMixed: return kKMixedRecord;
    default: return block_format(type).record_bytes;
  }
}
inline int64_t vnni_type_of_record(int64_t bytes) {
  for (int64_t type : {kQ4_K, kQ6_K, kKMixed})
    if (vnni_record_bytes(type) == bytes) return type;
  return type_of_record(bytes, "dot_linear", "pack_vnni_blocks");
}
// Whether a type's records hold 6-bit values: the types with a scale per half block.
constexpr bool six_bit(int64_t type) { return half_scales(type); }

constexpr int64_t vnni_scale_offset(int64_t type) {
  return type == kQ8_0 ? 512 : six_bit(type) ? 384 : 256;
}
// The int32 sums count the 4-bit values from their middle (q - 8, Q4_1 too: its d * q + m is
// d * (q - 8) + (m + 8d), whose large terms would otherwise cancel after the inputs' rounding).
constexpr int32_t vnni_offset(int64_t type) {
  return type == kQ8_0 ? 128 : six_bit(type) ? 32 : 8;
}

#ifdef CONVEYOR_VNNI

// A call's tokens, quantized, in tiles of kVnniOuter tokens (`width`: fewer when the call has
// fewer), a tile's blocks one after another: per tile and block the tokens' 8 quads side by
// side (token i's quad c at word 8i + c), then per token its int32 sum start (-offset * sum
// qx; 6-bit types: of inputs 0-15), the 6-bit types' start of inputs 16-31, the scale dx and
// (Q4_1) the float32 sum of x. A register tile of tokens reads one run of memory per block,
// at constant offsets from one pointer. (Laid out quad by quad over all the call's tokens,
// a block's eight quads were eight lines far apart, addressed token by token: ~40 % of the
// inner loop's instructions computed addresses, and the matmuls at 2,048 rows ran ~1.2x
// slower, Zen 4.)
constexpr int64_t kVnniWords = 12;  // words per token and block: 8 quads, 4 scalars

// Tokens per tile of a call of m tokens: the writer's (quantize_tokens) and the readers'.
inline int64_t tile_width(int64_t m) { return std::min<int64_t>(m, kVnniOuter); }

struct VnniCall {
  const int32_t* tokens;  // [tiles][blocks][width * kVnniWords]
  int64_t width;          // tile_width(m)
  int64_t blocks, n;
  const float* bias;  // [n] or null
  uint16_t* y;        // [m, n] bf16
};

// Tokens [m0, m0 + MR) of one block (m0 starts a tile): their quads and per-token values
// (`Int`: const int32_t where the kernels read them, int32_t where they are written).
template <typename Int>
struct TokenBlockOf {
  using Float = std::conditional_t<std::is_const_v<Int>, const float, float>;
  Int *q, *init, *init_b;
  Float *dx, *sx;
  TokenBlockOf(Int* tokens, int64_t width, int64_t blocks, int64_t m0, int64_t b)
      : q(tokens + ((m0 / kVnniOuter) * blocks + b) * width * kVnniWords),
        init(q + 8 * width),
        init_b(init + width),
        dx(reinterpret_cast<Float*>(init_b + width)),
        sx(dx + width) {}
};
struct TokenBlock : TokenBlockOf<const int32_t> {
  TokenBlock(const VnniCall& p, int64_t m0, int64_t b)
      : TokenBlockOf(p.tokens, p.width, p.blocks, m0, b) {}
};

// One record (16 rows, one block) as the products read it: its 8 quads (bytes of inputs
// 4c..4c+3, one 32-bit lane per row), its scales d and, for Q4_1, m + 8d (Q6_K: d * sc of
// inputs 0-15 and of 16-31).
struct Record {
  __m512i quads[8];
  __m512 d, mv;
};
// A 6-bit record's: d and db scale inputs 0-15 and 16-31; mv is kKMixed's m (Q6_K: unused).
struct SixBitRecord : Record {
  __m512 db;
};
template <int64_t Type>
using RecordOf = std::conditional_t<six_bit(Type), SixBitRecord, Record>;

template <int64_t Type>
inline void unpack_record(const uint8_t* rec, RecordOf<Type>& r) {
  if constexpr (six_bit(Type)) {
    const __m512i mask = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x30);
    for (int64_t c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(rec + c * 64);
      r.quads[2 * c] = _mm512_and_si512(v, mask);
      r.quads[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    }
    for (int64_t h = 0; h < 2; ++h) {  // quad 4h + u's high bits to bits 4, 5: low | (b & 0x30)
      const __m512i b = _mm512_loadu_si512(rec + 256 + h * 64);
      const __m512i at[4] = {_mm512_slli_epi16(b, 4), _mm512_slli_epi16(b, 2), b,
                             _mm512_srli_epi16(b, 2)};
      for (int64_t u = 0; u < 4; ++u)
        r.quads[4 * h + u] = _mm512_ternarylogic_epi32(r.quads[4 * h + u], at[u], high, 0xF8);
    }
    r.d = _mm512_loadu_ps(rec + 384);
    r.db = _mm512_loadu_ps(rec + 448);
    r.mv = Type == kKMixed ? _mm512_loadu_ps(rec + 512) : _mm512_setzero_ps();
    return;
  }
  for (int64_t c = 0; c < 4; ++c) {
    if constexpr (Type == kQ8_0) {
      r.quads[2 * c] = _mm512_loadu_si512(rec + c * 128);
      r.quads[2 * c + 1] = _mm512_loadu_si512(rec + c * 128 + 64);
    } else {  // quads 2c and 2c + 1 are one 64-byte run's low and high nibbles
      const __m512i v = _mm512_loadu_si512(rec + c * 64), mask = _mm512_set1_epi8(0x0F);
      r.quads[2 * c] = _mm512_and_si512(v, mask);
      r.quads[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    }
  }
  const int64_t scales = vnni_scale_offset(Type);
  if constexpr (Type == kQ4_K) {
    r.d = _mm512_loadu_ps(rec + scales);
    r.mv = _mm512_fmadd_ps(r.d, _mm512_set1_ps(8.f), _mm512_loadu_ps(rec + scales + 64));
  } else {
    r.d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + scales)));
    r.mv = Type == kQ4_1 ? _mm512_fmadd_ps(r.d, _mm512_set1_ps(8.f),
                                           _mm512_cvtph_ps(_mm256_loadu_si256(
                                               (const __m256i*)(rec + scales + 32))))
                         : _mm512_setzero_ps();
  }
}

// acc + the products of w's bytes (unsigned) with the 4 bytes at x (signed) broadcast, the
// broadcast folded into vpdpbusd's memory operand: GCC loads it with a separate
// vpbroadcastd, which on Zen 4 takes a slot of the pipes vpdpbusd needs.
inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

// dot[i] += token i's products with quads [C0, C1) of a record (q: token i's quad c at
// q[8i + c]), the tokens' chains side by side.
template <int C0, int C1, int MR>
inline void add_quads(__m512i (&dot)[MR], const Record& r, const int32_t* q) {
#pragma GCC unroll 8
  for (int c = C0; c < C1; ++c)
    for (int i = 0; i < MR; ++i) dot[i] = dpbusd_broadcast(dot[i], r.quads[c], q + 8 * i + c);
}

// A 6-bit record's block b for tokens [m0, m0 + MR): each half's int32 dot products (chains
// of 4 vpdpbusd from -32 * the half's sum of qx), then sum += (d * dot_a + db * dot_b) * dx
// (+ m * sx for kKMixed).
template <int64_t Type, int MR>
inline void add_six_bit_record(const VnniCall& p, const SixBitRecord& r, int64_t b, int64_t m0,
                               __m512 (&sums)[MR]) {
  const TokenBlock t(p, m0, b);
  __m512i dot[MR];
  __m512 half[MR];
  for (int i = 0; i < MR; ++i) dot[i] = _mm512_set1_epi32(t.init[i]);
  add_quads<0, 4>(dot, r, t.q);
  for (int i = 0; i < MR; ++i) {
    half[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[i]), r.d);
    dot[i] = _mm512_set1_epi32(t.init_b[i]);
  }
  add_quads<4, 8>(dot, r, t.q);
  for (int i = 0; i < MR; ++i) {
    half[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), r.db, half[i]);
    sums[i] = _mm512_fmadd_ps(half[i], _mm512_set1_ps(t.dx[i]), sums[i]);
    if constexpr (has_min(Type))
      sums[i] = _mm512_fmadd_ps(r.mv, _mm512_set1_ps(t.sx[i]), sums[i]);
  }
}

// Tokens [m0, m0 + MR) take block b of one record (16 outputs) into their float sums: each
// token's exact int32 dot products (chains of 8 vpdpbusd, the tokens' side by side: one
// vpdpbusd's latency is 4 cycles), then sum += (d * dx) * dot (+ (m + 8d) * sx where the
// type has an m: has_min).
// Every path below runs exactly this for every output and block, in block order.
template <int64_t Type, int MR>
inline void add_record(const VnniCall& p, const RecordOf<Type>& r, int64_t b, int64_t m0,
                       __m512 (&sums)[MR]) {
  if constexpr (six_bit(Type)) {
    add_six_bit_record<Type, MR>(p, r, b, m0, sums);
    return;
  }
  const TokenBlock t(p, m0, b);
  __m512i dot[MR];
  for (int i = 0; i < MR; ++i) dot[i] = _mm512_set1_epi32(t.init[i]);
  add_quads<0, 8>(dot, r, t.q);
  for (int i = 0; i < MR; ++i) {
    const __m512 ddx = _mm512_mul_ps(r.d, _mm512_set1_ps(t.dx[i]));
    sums[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), ddx, sums[i]);
    if constexpr (has_min(Type))
      sums[i] = _mm512_fmadd_ps(r.mv, _mm512_set1_ps(t.sx[i]), sums[i]);
  }
}

// The thread's next task's records (one contiguous range), brought into L2 a slice per block
// while this task computes (1.08-1.10x at 4-32 rows over no prefetch). Asking for the whole
// range at the task's start held the core's miss buffers and stalled the task's own loads:
// spread, the default model's decode steps ran 1.23x faster at 1 request, 1.15x at 4, 1.09x
// at 13, 1.03-1.05x at 32-64 (Zen 4, in-process A/B).
struct Ahead {
  const uint8_t* next = nullptr;  // null: nothing to fetch (the last task, or a later pass)
  int64_t slice = 0;              // bytes per block: the range / the blocks
  void at(int64_t b) const {
    if (next) prefetch_bytes<_MM_HINT_T1>(next + b * slice, slice);
  }
};

// y rows [m0, m0 + MR), outputs [n0, n0 + 16 * groups) from records read in place (a task's
// groups: block 0's record at first[j], `stride` bytes to the next block; absent groups
// point at zeros): every block in turn, the sums in registers.
template <int64_t Type, int MR>
void streamed_tokens(const VnniCall& p, const uint8_t* const (&first)[kTaskGroups],
                     int64_t stride, int64_t groups, int64_t n0, int64_t m0, const Ahead& ahead) {
  __m512 sums[MR][kTaskGroups];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kTaskGroups; ++j) sums[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    ahead.at(b);
    for (int j = 0; j < kTaskGroups; ++j) {
      RecordOf<Type> r;
      unpack_record<Type>(first[j] + b * stride, r);
      __m512 s[MR];
      for (int i = 0; i < MR; ++i) s[i] = sums[i][j];
      add_record<Type, MR>(p, r, b, m0, s);
      for (int i = 0; i < MR; ++i) sums[i][j] = s[i];
    }
  }
  store_sums<MR>(sums, groups, p.bias, p.y, p.n, n0, m0);
}

// y rows [m0, m0 + MR), the 16 outputs from col: one record's blocks, the sums in registers.
// Without `records` the records are read where they lie (`rec`, `stride` bytes to the next
// block) and unpacked in registers: Q8_0's always (they hold their quads as they are: the LM
// head at 4-13 rows 1.1-1.2x faster than copying them out first), the others' for passes of
// up to kVnniInPlace tokens (decode steps at 5-13 requests 1.03-1.05x, 16 the same: Zen 4);
// else they were unpacked once (`records`, in block order).
template <int64_t Type, int MR>
void record_tokens(const VnniCall& p, const RecordOf<Type>* records, const uint8_t* rec,
                   int64_t stride, int64_t col, int64_t m0, const Ahead& ahead) {
  __m512 sums[MR];
  for (int i = 0; i < MR; ++i) sums[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    ahead.at(b);
    if (!records) {
      RecordOf<Type> r;
      unpack_record<Type>(rec + b * stride, r);
      add_record<Type, MR>(p, r, b, m0, sums);
    } else {
      add_record<Type, MR>(p, records[b], b, m0, sums);
    }
  }
  const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + col) : _mm512_setzero_ps();
  for (int i = 0; i < MR; ++i)
    _mm256_storeu_si256((__m256i*)(p.y + (m0 + i) * p.n + col),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums[i], bias)));
}

// One task: tokens [m0, m1) against the records of `groups` groups of 16 outputs from n0
// (block 0's record of group j at first[j], `stride` bytes to the next block).
struct VnniTask {
  const uint8_t* first[kTaskGroups];
  int64_t stride, groups, n0, m0, m1;
  Ahead ahead;
};

// A task: `streamed` (passes of up to kVnniStreamed tokens) reads the records in place;
// otherwise they are gone through a record and 8 tokens at a time (past kVnniInPlace tokens
// all but Q8_0's unpacked once first, `records`: [group][block]), the next task's records
// fetched in the first pass.
template <int64_t Type>
void vnni_task(const VnniCall& p, const VnniTask& t, bool streamed,
               std::vector<RecordOf<Type>>& records) {
  const auto& [first, stride, groups, n0, m0, m1, ahead] = t;
  if (streamed) {
    switch (m1 - m0) {
      case 1: streamed_tokens<Type, 1>(p, first, stride, groups, n0, m0, ahead); break;
      case 2: streamed_tokens<Type, 2>(p, first, stride, groups, n0, m0, ahead); break;
      default: streamed_tokens<Type, 3>(p, first, stride, groups, n0, m0, ahead); break;
    }
    return;
  }
  const bool in_place = Type == kQ8_0 || m1 - m0 <= kVnniInPlace;
  if (!in_place) {
    records.resize(static_cast<size_t>(groups * p.blocks));
    for (int64_t j = 0; j < groups; ++j)
      for (int64_t b = 0; b < p.blocks; ++b)
        unpack_record<Type>(first[j] + b * stride, records[j * p.blocks + b]);
  }
  for (int64_t j = 0; j < groups; ++j) {
    const RecordOf<Type>* r = in_place ? nullptr : records.data() + j * p.blocks;
    const uint8_t* rec = first[j];
    const int64_t col = n0 + j * kGroupRows;
    for (int64_t m = m0; m < m1; m += kVnniOuter) {
      const Ahead a = j == 0 && m == m0 ? ahead : Ahead{};
      switch (std::min<int64_t>(kVnniOuter, m1 - m)) {
        case 1: record_tokens<Type, 1>(p, r, rec, stride, col, m, a); break;
        case 2: record_tokens<Type, 2>(p, r, rec, stride, col, m, a); break;
        case 3: record_tokens<Type, 3>(p, r, rec, stride, col, m, a); break;
        case 4: record_tokens<Type, 4>(p, r, rec, stride, col, m, a); break;
        case 5: record_tokens<Type, 5>(p, r, rec, stride, col, m, a); break;
        case 6: record_tokens<Type, 6>(p, r, rec, stride, col, m, a); break;
        case 7: record_tokens<Type, 7>(p, r, rec, stride, col, m, a); break;
        default: record_tokens<Type, 8>(p, r, rec, stride, col, m, a); break;
      }
    }
  }
}

template <int64_t Type>
void vnni_run(const VnniCall& p, const uint8_t* w, int64_t groups, int64_t m) {
  const int64_t record = vnni_record_bytes(Type);
  const TokenPasses passes(m, kVnniPass, kVnniOuter);  // passes start tiles
  // Tasks: (token pass, outputs), pass-major, so a thread's run of tasks shares x's rows. A
  // few tokens take 64 outputs per task (their register tile); more go a record at a time
  // anyway and take 16, which splits a small matmul evenly (15 tasks of 64 outputs left one
  // of two threads idle an eighth of the time).
  const bool streamed = passes.len <= kVnniStreamed;
  const int64_t per_task = streamed ? kTaskGroups : 1;
  for_each_group_task<uint8_t, kTaskGroups>(
      w, p.blocks * record, groups, per_task, passes, m,
      [&](const GroupTask<uint8_t, kTaskGroups>& task, int64_t next) {
        // Kept between calls: a fresh buffer this size would be new pages, faulted in every
        // call.
        static thread_local std::vector<RecordOf<Type>> records;
        VnniTask t{{}, record, task.here, task.first * kGroupRows, task.m0, task.m1, {}};
        std::copy(task.group, task.group + kTaskGroups, t.first);
        if (next >= 0)  // the next task's records into L2, spread over this one's blocks
          t.ahead = {w + next * p.blocks * record, std::min(per_task, groups - next) * record};
        vnni_task<Type>(p, t, streamed, records);
      });
}

// The tokens' inputs quantized per block of 32 (see the top of the file), in VnniCall's
// layout: the calling thread's buffer, kept between calls (grown, never shrunk) so that no
// call writes to fresh pages.
// A block with a NaN or an infinity gets the scale NaN and zeros for values: its products are
// NaN, as the bf16 kernels' are (rounding NaN to an integer would give INT_MIN).
template <int64_t Type>
const int32_t* quantize_tokens(const uint16_t* x, int64_t m, int64_t k) {
  const int64_t blocks = k / 32, width = tile_width(m);
  const int64_t tiles = (m + kVnniOuter - 1) / kVnniOuter;
  static thread_local std::vector<int32_t> mine;
  std::vector<int32_t>& t = mine;  // the lambda below runs on other threads: not their `mine`
  const auto words = static_cast<size_t>(tiles * blocks * width * kVnniWords);
  if (t.size() < words) t.resize(words);
  // Block-major (block i / m, token i % m): a thread's share is whole blocks, so the threads
  // write apart. (Measured on the earlier layout, quad by quad over all tokens: token-major,
  // at 16-32 tokens both threads wrote every line, and decode steps at 16 requests ran
  // 1.17-1.19x faster block-major, 1.03x at 32, the same at 1-13 and 60; Zen 4.)
  at::parallel_for(0, m * blocks, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t token = i % m, b = i / m, lane = token % kVnniOuter;
      const TokenBlockOf<int32_t> at(t.data(), width, blocks, token, b);
      const __m512i words = _mm512_loadu_si512(x + token * k + b * 32);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));  // even inputs
      const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(-65536)));
      if constexpr (has_min(Type)) at.sx[lane] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const bool finite = std::isfinite(amax) && !_mm512_cmp_ps_mask(lo, hi, _CMP_UNORD_Q);
      const float inv = finite && amax > 0.f ? 127.f / amax : 0.f;
      at.dx[lane] = finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
      const __m512i qlo = finite ? _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)))
                                 : _mm512_setzero_si512();
      const __m512i qhi = finite ? _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)))
                                 : _mm512_setzero_si512();
      const __m512i both = _mm512_add_epi32(qlo, qhi);  // lanes 0-7: inputs 0-15
      if constexpr (six_bit(Type)) {
        at.init[lane] = -vnni_offset(Type) * _mm512_mask_reduce_add_epi32(0x00FF, both);
        at.init_b[lane] = -vnni_offset(Type) * _mm512_mask_reduce_add_epi32(0xFF00, both);
      } else {
        at.init[lane] = -vnni_offset(Type) * _mm512_reduce_add_epi32(both);
      }
      // Back to input order (even inputs in qlo, odd in qhi): word c = byte 2c | byte 2c + 1.
      const __m512i bytes = _mm512_set1_epi32(0xFF);
      const __m512i pairs = _mm512_or_si512(_mm512_and_si512(qlo, bytes),
                                            _mm512_slli_epi32(_mm512_and_si512(qhi, bytes), 8));
      _mm256_storeu_si256((__m256i*)(at.q + 8 * lane), _mm512_cvtepi32_epi16(pairs));
    }
  });
  return t.data();
}

#endif  // CONVEYOR_VNNI

}  // namespace

bool vnni_blocks_available() {
#ifdef CONVEYOR_VNNI
  return true;
#else
  return false;
#endif
}

namespace {

// Row i of a record of `kind`: the values' low nibbles as Q4's records hold them (input
// 8p + t in byte t of run p's low nibble, 8p + 4 + t in its high one); for 6-bit kinds their
// high bits (run h: quad 4h + u's in bits 2u, 2u + 1); the scales from vnni_scale_offset on
// (float32, exact: Q4_K's d and m; 6-bit kinds' halves' d, then kKMixed's m).
void put_k_row(uint8_t* rec, int64_t i, const KBlock& k, int64_t kind) {
  const bool six_bits = six_bit(kind);
  for (int64_t l = 0; l < 32; ++l) {
    const int64_t quad = l / 4, byte = l % 4;
    rec[((quad / 2) * kGroupRows + i) * 4 + byte] |=
        static_cast<uint8_t>((k.q[l] & 0xF) << (4 * (quad & 1)));
    if (six_bits)
      rec[256 + ((quad / 4) * kGroupRows + i) * 4 + byte] |=
          static_cast<uint8_t>((k.q[l] >> 4) << (2 * (quad % 4)));
  }
  put_k_scales(rec, vnni_scale_offset(kind), kGroupRows, i, kind, k);
}

// Q4_K or Q6_K super-blocks -> per-32 records [N/16, K/32, bytes]: their own (kQ4_K's,
// kQ6_K's), or with `mixed` kKMixed's.
at::Tensor pack_vnni_k_quant(const at::Tensor& raw, int64_t type, bool mixed) {
  const int64_t kind = mixed ? kKMixed : type;
  return repack_k_blocks(raw, type, "pack_vnni_blocks", kGroupRows, vnni_record_bytes(kind),
                         at::kChar, [&](uint8_t* rec, int64_t i, KBlock k) {
    if (mixed && type == kQ4_K) {  // d * (q + 24 - 32) + (m + 8d) is the weight d * q + m
      for (uint8_t& v : k.q) v = static_cast<uint8_t>(v + 24);
      k.m += 8.f * k.da;
    }
    put_k_row(rec, i, k, kind);
  });
}

}  // namespace

at::Tensor pack_vnni_blocks(const at::Tensor& raw, int64_t type, bool k_mixed) {
  check_k_mixed(k_mixed, type, "pack_vnni_blocks");
  if (type == kQ4_K || type == kQ6_K) return pack_vnni_k_quant(raw, type, k_mixed);
  return repack_blocks(raw, type, "pack_vnni_blocks", kGroupRows,
                       block_format(type, "pack_vnni_blocks").record_bytes,
                       vnni_scale_offset(type), at::kChar,
                       [type](uint8_t* rec, int64_t i, const uint8_t* qs) {
    if (type == kQ8_0) {
      for (int64_t j = 0; j < 32; ++j)  // quad j / 4, row i, byte j % 4: the value + 128
        rec[((j / 4) * kGroupRows + i) * 4 + j % 4] = static_cast<uint8_t>(qs[j] ^ 0x80);
      return;
    }
    for (int64_t p = 0; p < 4; ++p)  // quads 2p and 2p + 1: low and high nibbles
      for (int64_t t = 0; t < 4; ++t)
        rec[(p * kGroupRows + i) * 4 + t] = static_cast<uint8_t>(
            gguf_nibble(qs, 8 * p + t) | (gguf_nibble(qs, 8 * p + 4 + t) << 4));
  });
}

at::Tensor vnni_blocks_linear(const at::Tensor& x, const at::Tensor& w, const float* bias) {
  [[maybe_unused]] const int64_t type = vnni_type_of_record(w.size(2));
  const int64_t groups = w.size(0), n = groups * kGroupRows, m = x.size(0);
  [[maybe_unused]] const int64_t blocks = w.size(1);
  at::Tensor y = at::empty({m, n}, x.options());
#ifdef CONVEYOR_VNNI
  const at::Tensor xc = x.contiguous();
  const auto* xd = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  // The offset (vnni_offset: 8, Q8_0's 128, the 6-bit values' 32), whether x's sums are
  // needed and whether the sum starts are per half depend on the type alone.
  const int64_t k = blocks * 32;
  const int32_t* t = type == kQ8_0     ? quantize_tokens<kQ8_0>(xd, m, k)
                     : type == kQ6_K   ? quantize_tokens<kQ6_K>(xd, m, k)
                     : type == kKMixed ? quantize_tokens<kKMixed>(xd, m, k)
                     : has_min(type)   ? quantize_tokens<kQ4_1>(xd, m, k)
                                       : quantize_tokens<kQ4_0>(xd, m, k);
  const VnniCall p{t, tile_width(m), blocks, n, bias,
                   reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>())};
  const auto* wd = reinterpret_cast<const uint8_t*>(w.data_ptr<int8_t>());
  switch (type) {
    case kQ4_0: vnni_run<kQ4_0>(p, wd, groups, m); break;
    case kQ4_1: vnni_run<kQ4_1>(p, wd, groups, m); break;
    case kQ4_K: vnni_run<kQ4_K>(p, wd, groups, m); break;
    case kQ6_K: vnni_run<kQ6_K>(p, wd, groups, m); break;
    case kKMixed: vnni_run<kKMixed>(p, wd, groups, m); break;
    default: vnni_run<kQ8_0>(p, wd, groups, m); break;
  }
#else
  TORCH_CHECK(false, "dot_linear: int8 block records need a CPU with AVX512-VNNI");
#endif
  return y;
}

}  // namespace conveyor
