// CPU kernels for the decode hot path: one op where the torch reference needs several.
//
// Every op reproduces the rounding of the torch reference (ops/reference.py): values are
// computed in float32 and rounded to the tensor's dtype exactly where the reference rounds,
// so greedy outputs match it. Work is split over rows with at::parallel_for (torch's own
// thread pool), decode attention's requests x KV heads with parallel_tasks (parallel_tasks.h).
//
// Registered as torch.ops.conveyor.*; built on first use by conveyor/ops/cpu_kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "parallel_tasks.h"
#include "prefill_attention.h"
#include "quant_linear.h"
#include "simd_math.h"
#include "token_passes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(CONVEYOR_AVX2)
#include <immintrin.h>
#endif

// CPUs with AVX2 but no AVX-512 (AMD Zen 2 and 3) run float32 decode attention (and
// silu_mul) with 8-lane vectors; everything else there runs the scalar loops.
#if defined(CONVEYOR_AVX2) && !defined(__AVX512F__)
#define CONVEYOR_AVX2_ONLY 1
#endif

namespace {

using at::BFloat16;
using at::Half;
#ifdef __AVX512F__
using conveyor::exp16;
#endif
#if defined(__AVX512F__) || defined(CONVEYOR_AVX2_ONLY)
using conveyor::prefetch_bytes;
#endif

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// Round a float to T the way torch does (round to nearest even for bf16/fp16).
template <typename T>
inline float round_as(float v) { return static_cast<float>(static_cast<T>(v)); }

// Rows per task so a task does ~16K elements of work: small batches stay on one thread.
inline int64_t row_grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / row_len); }

// ------------------------------------------------------------------ 16-lane float vectors
// With AVX-512 each kernel runs 16 floats at a time and finishes rows with the scalar loop
// (which is the whole kernel on CPUs without AVX-512).
#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// float -> bf16 bits in the high half of each lane, rounded to nearest even (NaN -> 0x7FC0,
// as c10::BFloat16 does).
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000));
}

// float -> bf16, rounded to nearest even: one instruction with AVX512-BF16 (which also flushes
// denormals below 1.2e-38 to zero, unlike c10::BFloat16), else the integer rounding above.
inline __m256i bf16_round(__m512 v) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16));
#endif
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_round(v));
}
inline void store16(Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// round_as<T> on 16 lanes.
template <typename T> inline __m512 round16(__m512 v);
template <> inline __m512 round16<float>(__m512 v) { return v; }
template <> inline __m512 round16<BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_round(v)), 16));
}
template <> inline __m512 round16<Half>(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

#endif

// The largest of n values, as float32 (-inf for n = 0).
template <typename T>
inline float row_max(const T* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, load16(x + i));
  m = _mm512_reduce_max_ps(mv);
#endif
  for (; i < n; ++i) m = std::max(m, to_f(x[i]));
  return m;
}

// ------------------------------------------------------------------ RMSNorm
// out = w * T(x * rsqrt(mean(x^2) + eps)), in float32 (HF LlamaRMSNorm).
template <typename T>
inline void rms_norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  float ss = 0.f;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) ss += to_f(x[i]) * to_f(x[i]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
#ifdef __AVX512F__
  const __m512 rv = _mm512_set1_ps(r);
  for (; i + 16 <= n; i += 16)
    store16(out + i, _mm512_mul_ps(load16(w + i), round16<T>(_mm512_mul_ps(load16(x + i), rv))));
#endif
  for (; i < n; ++i) out[i] = static_cast<T>(to_f(w[i]) * round_as<T>(to_f(x[i]) * r));
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, row_grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_norm_row(op + r * os, xp + r * xs, wp, n, (float)eps);
  });
}

// residual = T(residual + x); x = rms_norm(residual): the residual add of a decoder layer
// fused with the next norm (in place, like vLLM's fused_add_rms_norm).
template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, row_grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* xr = xp + r * xs;
      T* rr = rp + r * rs;
      int64_t i = 0;
#ifdef __AVX512F__
      for (; i + 16 <= n; i += 16) store16(rr + i, _mm512_add_ps(load16(rr + i), load16(xr + i)));
#endif
      for (; i < n; ++i) rr[i] = static_cast<T>(to_f(rr[i]) + to_f(xr[i]));
      rms_norm_row(xr, rr, wp, n, (float)eps);
    }
  });
}

// ------------------------------------------------------------------ SiLU * up
// gate_up: [T, 2I] -> [T, I] = T(T(silu(gate)) * up)
template <typename T>
void silu_mul_impl(at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), n = out.size(1);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, row_grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = gp + r * gs;
      const T* u = g + n;
      T* o = op + r * os;
      int64_t i = 0;
#ifdef __AVX512F__
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= n; i += 16) {
        const __m512 gv = load16(g + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        // g / (1 + e) without a division (~16 cycles per vector): a 14-bit reciprocal, one
        // Newton step, then the quotient corrected by its FMA residual (as the division
        // rounds, but for rare last-bit ties)
        const __m512 den = _mm512_add_ps(one, e);
        __m512 r = _mm512_rcp14_ps(den);
        r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(den, r, one), r);
        __m512 q = _mm512_mul_ps(gv, r);
        q = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(den, q, gv), q);
        const __m512 s = round16<T>(q);
        store16(o + i, _mm512_mul_ps(s, load16(u + i)));
      }
#elif defined(CONVEYOR_AVX2)
      if constexpr (std::is_same_v<T, float>) {  // float32 models on AVX2 CPUs
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= n; i += 8) {
          const __m256 gv = _mm256_loadu_ps(g + i);
          const __m256 e = conveyor::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
          const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
      }
#endif
      for (; i < n; ++i) {  // the columns past the last full vector, the same in every row
        const float gv = to_f(g[i]);
        o[i] = static_cast<T>(round_as<T>(gv / (1.f + std::exp(-gv))) * to_f(u[i]));
      }
    }
  });
}

// ------------------------------------------------------------------ RoPE
// Rotates the first `num_heads` heads of each row of x ([T, >= num_heads * D], "rotate half"
// layout) in place by the token's position. cos_sin: [max_pos, D] float32 = cos | sin
// halves. As the reference: cos and sin rounded to T, each product rounded, then the sum.
template <typename T>
void rotary_impl(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin,
                 int64_t num_heads, int64_t head_dim) {
  const int64_t rows = x.size(0), half = head_dim / 2;
  T* xp = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, row_grain(num_heads * head_dim), [&](int64_t b, int64_t e) {
    std::vector<float> c(half), s(half);
    for (int64_t r = b; r < e; ++r) {
      const float* cs = table + pos[r] * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        c[i] = round_as<T>(cs[i]);
        s[i] = round_as<T>(cs[half + i]);
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        T* v = xp + r * xs + h * head_dim;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= half; i += 16) {
          const __m512 x1 = load16(v + i), x2 = load16(v + half + i);
          const __m512 cv = load16(c.data() + i), sv = load16(s.data() + i);
          const __m512 a = _mm512_sub_ps(round16<T>(_mm512_mul_ps(x1, cv)),
                                         round16<T>(_mm512_mul_ps(x2, sv)));
          const __m512 bb = _mm512_add_ps(round16<T>(_mm512_mul_ps(x2, cv)),
                                          round16<T>(_mm512_mul_ps(x1, sv)));
          store16(v + i, a);
          store16(v + half + i, bb);
        }
#endif
        for (; i < half; ++i) {
          const float x1 = to_f(v[i]), x2 = to_f(v[half + i]);
          v[i] = static_cast<T>(round_as<T>(x1 * c[i]) + round_as<T>(-x2 * s[i]));
          v[half + i] = static_cast<T>(round_as<T>(x2 * c[i]) + round_as<T>(x1 * s[i]));
        }
      }
    }
  });
}

// ------------------------------------------------------------------ KV cache write
// k, v: [T, KVH, D] (rows may be strided); kv_cache: [2, blocks, bs, KVH, D] contiguous;
// slot_mapping: [T] flat slot (block * bs + offset) of each token.
template <typename T>
void write_kv_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
                   const at::Tensor& slot_mapping) {
  const int64_t rows = k.size(0), width = k.size(1) * k.size(2);
  const int64_t plane = kv_cache[0].numel();
  T* kc = kv_cache.data_ptr<T>();
  T* vc = kc + plane;
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, rows, row_grain(width), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      std::memcpy(kc + slots[r] * width, kp + r * ks, width * sizeof(T));
      std::memcpy(vc + slots[r] * width, vp + r * vs, width * sizeof(T));
    }
  });
}

// The tile layout (ops/reference.py): per (plane, block, KV head) a head-block of bs * D
// values, K as [bs / 16][D / 32][16 dim pairs][16 positions][2] (K^T in pairs of dims, as an
// AMX product reads it), V as [bs / 2][D][2] (pairs of positions). Calls f(dim i, offset of
// dim i of position t in the K head-block, in the V head-block) for each dim.
template <typename F>
inline void for_each_tiles_dim(int64_t d, int64_t t, F&& f) {
  const int64_t k_group = (t / 16) * 16 * d + (t % 16) * 2, v_pair = (t / 2) * d * 2 + t % 2;
  for (int64_t i = 0; i < d; ++i)
    f(i, k_group + ((i / 32) * 16 + (i % 32) / 2) * 32 + i % 2, v_pair + i * 2);
}

// write_kv_ into a tile-layout cache; with `read`, the reverse (k, v = the rows at the slots).
template <typename T>
void tiles_kv_impl(const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache,
                   const at::Tensor& slot_mapping, int64_t bs, bool read) {
  const int64_t rows = k.size(0), kvh = k.size(1), d = k.size(2);
  T* kc = kv_cache.data_ptr<T>();
  T* vc = kc + kv_cache[0].numel();
  T* kp = k.data_ptr<T>();
  T* vp = v.data_ptr<T>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::parallel_for(0, rows, row_grain(kvh * d), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t block = slots[r] / bs, t = slots[r] % bs;
      for (int64_t h = 0; h < kvh; ++h) {
        T* kb = kc + (block * kvh + h) * bs * d;
        T* vb = vc + (block * kvh + h) * bs * d;
        T* kr = kp + r * k.stride(0) + h * k.stride(1);
        T* vr = vp + r * v.stride(0) + h * v.stride(1);
        for_each_tiles_dim(d, t, [&](int64_t i, int64_t ko, int64_t vo) {
          if (read) {
            kr[i] = kb[ko];
            vr[i] = vb[vo];
          } else {
            kb[ko] = kr[i];
            vb[vo] = vr[i];
          }
        });
      }
    }
  });
}

// ------------------------------------------------------------------ decode attention
// In place: p = exp(p - max p); returns 1 / sum(p).
inline float softmax_(float* p, int64_t n) {
  const float m = row_max(p, n);
  float total = 0.f;
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + i), mv));
    _mm512_storeu_ps(p + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
#elif defined(CONVEYOR_AVX2_ONLY)
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = conveyor::exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), mv));
    _mm256_storeu_ps(p + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  total = conveyor::hsum8(sum);
#endif
  for (; i < n; ++i) {
    p[i] = std::exp(p[i] - m);
    total += p[i];
  }
  return 1.f / total;
}

// Calls f(slot row, position) for the first len cached positions of a request, block by
// block: a slot row holds every KV head of one position (contiguous within a block). Each
// position fetches the row kPrefetchRows positions on into L2 (the first ones all at the
// start; the blocks may lie anywhere) and, if `then` is given (the offset of the V plane while
// K is read), its own row of that plane for the pass after. A row or two per position, not a
// block's worth at once: bursts held the core's miss buffers while the loop's own loads
// waited (Zen 4, 13-48 requests x 300-1000 positions: 1.07-1.17x over 16 rows 4 blocks
// ahead at each block's start, which had been 1.3x over the next block into L1). Written out
// in the loop: a helper lambda for the address ran the loop 0.8x as fast.
constexpr int64_t kPrefetchRows = 64;  // how far ahead (32-64 alike; 16-24 less)
template <typename T, typename F>
inline void for_each_cached(const T* cache, const int64_t* table, int64_t len, int64_t bs,
                            int64_t tok_stride, int64_t row_bytes, int64_t then, F&& f) {
#if defined(__AVX512F__) || defined(CONVEYOR_AVX2_ONLY)
  for (int64_t pos = 0; pos < std::min(len, kPrefetchRows); ++pos)
    prefetch_bytes<_MM_HINT_T1>(cache + (table[pos / bs] * bs + pos % bs) * tok_stride, row_bytes);
#endif
  for (int64_t start = 0, blk = 0; start < len; start += bs, ++blk) {
    const T* row = cache + table[blk] * bs * tok_stride;
    const int64_t n = std::min(bs, len - start);
    for (int64_t o = 0; o < n; ++o, row += tok_stride) {
#if defined(__AVX512F__) || defined(CONVEYOR_AVX2_ONLY)
      const int64_t ahead = start + o + kPrefetchRows;
      if (ahead < len)
        prefetch_bytes<_MM_HINT_T1>(cache + (table[ahead / bs] * bs + ahead % bs) * tok_stride,
                                    row_bytes);
      if (then) prefetch_bytes<_MM_HINT_T1>(row + then, row_bytes);
#endif
      f(row, start + o);
    }
  }
}

#ifdef __AVX512F__
// r[i] = the sum of the 16 floats of rows[i], for i < n (0 beyond):
// a transposing tree of unpacks and 128-bit lane shuffles, 45 vector ops for 16 sums.
inline __m512 sum16_rows(const float (*rows)[16], int64_t n) {
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = i < n ? _mm512_load_ps(rows[i]) : _mm512_setzero_ps();
  __m512 w[8];  // per 128-bit lane: positions 0, 2 hold rows 2k; 1, 3 rows 2k + 1
  for (int k = 0; k < 8; ++k)
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  __m512 x[4];  // per 128-bit lane: position j holds row 4k + j
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(w[2 * k]), b = _mm512_castps_pd(w[2 * k + 1]);
    x[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 u[2];  // lanes: [x[2k] lanes 0+1, x[2k] lanes 2+3, x[2k+1] lanes 0+1, 2+3]
  for (int k = 0; k < 2; ++k)
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane L: rows 4L .. 4L + 3
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

using conveyor::FlushDenormals;

// out[i] = float(x[i]) * scale.
template <typename T>
inline void scaled_row(float* out, const T* x, int64_t d, float scale) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 sv = _mm512_set1_ps(scale);
  for (; i + 16 <= d; i += 16) _mm512_storeu_ps(out + i, _mm512_mul_ps(load16(x + i), sv));
#endif
  for (; i < d; ++i) out[i] = to_f(x[i]) * scale;
}

// One request and one KV head: its G query heads (qf: [G, D] float32, already scaled) attend
// to the first len cached positions; writes G output rows of D. scores: room for G * len.
// The vector path (NC = D / 16 and G known at compile time) keeps the queries and the
// accumulators in registers (up to G * NC = 32 each, where some spill) and converts each K
// and V row once for all G heads.
template <typename T, int NC, int G>
void attend_kv_head_vec(T* out, int64_t out_stride, const float* qf, const T* kc, const T* vc,
                        const int64_t* table, int64_t len, int64_t bs, int64_t tok_stride,
                        float* scores) {
#ifdef __AVX512F__
  const int64_t row_bytes = NC * 16 * sizeof(T);  // this head's part of a slot row
  __m512 qv[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) qv[g][c] = _mm512_loadu_ps(qf + g * NC * 16 + 16 * c);
  // Each position's G partial-sum vectors wait in `part`; one transposing reduction then
  // sums 16 positions at once (cheaper than a horizontal sum per position).
  alignas(64) float part[G][16][16];
  for_each_cached(kc, table, len, bs, tok_stride, row_bytes, vc - kc, [&](const T* kr, int64_t t) {
    __m512 kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = load16(kr + 16 * c);
    const int64_t j = t & 15;
    for (int g = 0; g < G; ++g) {
      __m512 sum = _mm512_mul_ps(kv[0], qv[g][0]);
      for (int c = 1; c < NC; ++c) sum = _mm512_fmadd_ps(kv[c], qv[g][c], sum);
      _mm512_store_ps(part[g][j], sum);
    }
    if (j == 15 || t == len - 1) {
      const __mmask16 m = static_cast<__mmask16>((1u << (j + 1)) - 1);
      for (int g = 0; g < G; ++g)
        _mm512_mask_storeu_ps(scores + g * len + t - j, m, sum16_rows(part[g], j + 1));
    }
  });
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = softmax_(scores + g * len, len);
  __m512 acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
  for_each_cached(vc, table, len, bs, tok_stride, row_bytes, 0, [&](const T* vr, int64_t t) {
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load16(vr + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 pv = _mm512_set1_ps(scores[g * len + t]);
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(pv, vv[c], acc[g][c]);
    }
  });
  for (int g = 0; g < G; ++g) {
    const __m512 iv = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < NC; ++c) store16(out + g * out_stride + 16 * c, _mm512_mul_ps(acc[g][c], iv));
  }
#endif
}

#ifdef CONVEYOR_AVX2_ONLY
// r lane i = the sum of the 8 floats of rows[i], for i < n (0 beyond): a tree of hadds.
inline __m256 sum8_rows(const float (*rows)[8], int64_t n) {
  __m256 v[8];
  for (int i = 0; i < 8; ++i) v[i] = i < n ? _mm256_load_ps(rows[i]) : _mm256_setzero_ps();
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a: rows 0-3's sums of lanes 0-3 (low half) and 4-7 (high half); b: rows 4-7's.
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// attend_kv_head_vec on 8-lane vectors, for a float32 cache (NC = D / 8).
template <int NC, int G>
void attend_kv_head_vec8(float* out, int64_t out_stride, const float* qf, const float* kc,
                         const float* vc, const int64_t* table, int64_t len, int64_t bs,
                         int64_t tok_stride, float* scores) {
  const int64_t row_bytes = NC * 8 * sizeof(float);
  alignas(32) float part[G][8][8];
  for_each_cached(kc, table, len, bs, tok_stride, row_bytes, vc - kc, [&](const float* kr, int64_t t) {
    const int64_t j = t & 7;
    for (int g = 0; g < G; ++g) {
      __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(kr), _mm256_loadu_ps(qf + g * NC * 8));
      for (int c = 1; c < NC; ++c)
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(kr + 8 * c), _mm256_loadu_ps(qf + g * NC * 8 + 8 * c), sum);
      _mm256_store_ps(part[g][j], sum);
    }
    if (j == 7 || t == len - 1) {
      const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(j + 1)), lanes);
      for (int g = 0; g < G; ++g)
        _mm256_maskstore_ps(scores + g * len + t - j, m, sum8_rows(part[g], j + 1));
    }
  });
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = softmax_(scores + g * len, len);
  __m256 acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm256_setzero_ps();
  for_each_cached(vc, table, len, bs, tok_stride, row_bytes, 0, [&](const float* vr, int64_t t) {
    for (int g = 0; g < G; ++g) {
      const __m256 pv = _mm256_set1_ps(scores[g * len + t]);
      for (int c = 0; c < NC; ++c)
        acc[g][c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * c), acc[g][c]);
    }
  });
  for (int g = 0; g < G; ++g) {
    const __m256 iv = _mm256_set1_ps(inv[g]);
    for (int c = 0; c < NC; ++c)
      _mm256_storeu_ps(out + g * out_stride + 8 * c, _mm256_mul_ps(acc[g][c], iv));
  }
}
#endif

// The same for any G and D, in scalar code.
template <typename T>
void attend_kv_head(T* out, int64_t out_stride, const float* qf, const T* kc, const T* vc,
                    const int64_t* table, int64_t len, int64_t bs, int64_t tok_stride,
                    float* scores, int64_t group, int64_t d, float* acc) {
  const int64_t row_bytes = d * sizeof(T);
  for_each_cached(kc, table, len, bs, tok_stride, row_bytes, vc - kc, [&](const T* kr, int64_t t) {
    for (int64_t g = 0; g < group; ++g) {
      float sum = 0.f;
      for (int64_t i = 0; i < d; ++i) sum += qf[g * d + i] * to_f(kr[i]);
      scores[g * len + t] = sum;
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    const float* p = scores + g * len;
    const float inv = softmax_(scores + g * len, len);
    std::fill(acc, acc + d, 0.f);
    for_each_cached(vc, table, len, bs, tok_stride, row_bytes, 0, [&](const T* vr, int64_t t) {
      for (int64_t i = 0; i < d; ++i) acc[i] += p[t] * to_f(vr[i]);
    });
    for (int64_t i = 0; i < d; ++i) out[g * out_stride + i] = static_cast<T>(acc[i] * inv);
  }
}

using AttendFn = void (*)(void*, int64_t, const float*, const void*, const void*, const int64_t*,
                          int64_t, int64_t, int64_t, float*);

template <typename T, int NC, int G>
void attend_erased(void* out, int64_t os, const float* qf, const void* kc, const void* vc,
                   const int64_t* table, int64_t len, int64_t bs, int64_t ts, float* scores) {
#ifdef CONVEYOR_AVX2_ONLY
  if constexpr (std::is_same_v<T, float>) {  // NC counts 8 lanes here
    attend_kv_head_vec8<NC, G>(static_cast<float*>(out), os, qf, static_cast<const float*>(kc),
                               static_cast<const float*>(vc), table, len, bs, ts, scores);
    return;
  }
#endif
  attend_kv_head_vec<T, NC, G>(static_cast<T*>(out), os, qf, static_cast<const T*>(kc),
                               static_cast<const T*>(vc), table, len, bs, ts, scores);
}

// The register-resident kernel for this head_dim and group size, or nullptr.
template <typename T>
AttendFn pick_attend(int64_t d, int64_t group) {
#ifdef __AVX512F__
  if (d == 64) {
    switch (group) {
      case 1: return &attend_erased<T, 4, 1>;
      case 2: return &attend_erased<T, 4, 2>;
      case 3: return &attend_erased<T, 4, 3>;
      case 4: return &attend_erased<T, 4, 4>;
    }
  } else if (d == 128) {
    switch (group) {
      case 1: return &attend_erased<T, 8, 1>;
      case 2: return &attend_erased<T, 8, 2>;
      case 4: return &attend_erased<T, 8, 4>;  // Llama 3 8B: 32 query heads over 8 KV heads
    }
  }
#elif defined(CONVEYOR_AVX2_ONLY)
  if constexpr (std::is_same_v<T, float>) {
    if (d == 64) {
      switch (group) {
        case 1: return &attend_erased<T, 8, 1>;
        case 2: return &attend_erased<T, 8, 2>;
        case 3: return &attend_erased<T, 8, 3>;
        case 4: return &attend_erased<T, 8, 4>;
      }
    } else if (d == 128) {
      switch (group) {
        case 1: return &attend_erased<T, 16, 1>;
        case 2: return &attend_erased<T, 16, 2>;
        case 4: return &attend_erased<T, 16, 4>;
      }
    }
  }
#endif
  return nullptr;
}

// The task loop of decode attention: one task per (request, KV head), so that a request's
// K/V rows stay in this core's cache. For each, attend(o, qf, table, len, b, kh, scores, acc)
// gets the task's G output rows, its G queries scaled in float32, the request's block table,
// context length and index, the KV head, and scratch space.
template <typename T, typename F>
void for_each_decode_task(at::Tensor& out, const at::Tensor& q, const at::Tensor& block_tables,
                          const at::Tensor& context_lens, double scale, int64_t kvh, F&& attend) {
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2), group = heads / kvh;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), table_w = block_tables.size(1);
  conveyor::parallel_tasks(batch * kvh, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush;
    std::vector<float> scores, qf(group * d), acc(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kvh, kh = item % kvh;
      const int64_t len = lens[b];
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g)
        scaled_row(qf.data() + g * d, qp + b * qs0 + (kh * group + g) * qs1, d, (float)scale);
      attend(op + (b * heads + kh * group) * d, qf.data(), tables + b * table_w, len, b, kh,
             scores.data(), acc.data());
    }
  });
}

// Each decode b: its H query heads (G = H / KVH per KV head) attend to the request's first
// context_lens[b] cached positions, read block by block where they lie.
// q: [B, H, D] (rows may be strided); out: [B, H, D] contiguous.
template <typename T>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           double scale) {
  const int64_t d = q.size(2), bs = kv_cache.size(2), kvh = kv_cache.size(3);
  const int64_t group = q.size(1) / kvh;
  const T* kc = kv_cache.data_ptr<T>();
  const T* vc = kc + kv_cache[0].numel();
  const int64_t tok_stride = kvh * d;  // elements between consecutive slots
  const AttendFn vec = pick_attend<T>(d, group);
  for_each_decode_task<T>(out, q, block_tables, context_lens, scale, kvh,
                          [&](T* o, const float* qf, const int64_t* table, int64_t len,
                              int64_t, int64_t kh, float* scores, float* acc) {
    if (vec) vec(o, d, qf, kc + kh * d, vc + kh * d, table, len, bs, tok_stride, scores);
    else attend_kv_head(o, d, qf, kc + kh * d, vc + kh * d, table, len, bs, tok_stride, scores,
                        group, d, acc);
  });
}

// ------------------------------------------------------------------ int8 KV cache
// kv_cache_dtype="int8": [2, blocks, KVH, bs * (D + 4)] int8. Each (plane, block, KV head)
// owns a contiguous head-block of bs * (D + 4) bytes: the bs positions' D values, then their
// bs float32 scales. A position's row x is stored as q = round(x * (127 / max|x|)) (nearest
// even) with scale max|x| / 127, x ~= scale * q. The values are laid out for the kernel:
//   K: [D / 4][bs][4]: 4 consecutive dims of a position in 4 bytes, and 16 positions' 4
//      bytes in one 64-byte vector, so that one VNNI instruction takes 16 positions'
//      products for 4 dims (no horizontal sums);
//   V: [bs / 4][D][4]: 4 consecutive positions of a dim in 4 bytes, and 16 dims' 4 bytes in
//      one 64-byte vector, so that one VNNI instruction takes 4 positions' weighted values
//      for 16 dims.
// bs must be a multiple of 16 (the kernel reads 16 positions at a time).
// conveyor/ops/reference.py writes and reads the same layout.
constexpr int64_t kScaleBytes = 4;

inline int64_t head_block_bytes(int64_t bs, int64_t d) { return bs * (d + kScaleBytes); }
// The head-block of KV head h in block blk of a plane (K or V).
template <typename P>
inline P* head_block(P* plane, int64_t blk, int64_t h, int64_t kvh, int64_t bs, int64_t d) {
  return plane + (blk * kvh + h) * head_block_bytes(bs, d);
}
// Where dim i of position t lies in a K head-block, and in a V head-block.
inline int64_t k_offset(int64_t bs, int64_t t, int64_t i) { return ((i / 4) * bs + t) * 4 + i % 4; }
inline int64_t v_offset(int64_t d, int64_t t, int64_t i) { return ((t / 4) * d + i) * 4 + t % 4; }

// Quantizes a row of d values into dst[0..d) and returns its scale.
template <typename T>
inline float quantize_row(int8_t* dst, const T* x, int64_t d) {
  float amax = 0.f;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 mv = _mm512_setzero_ps();
  for (; i + 16 <= d; i += 16) mv = _mm512_max_ps(mv, _mm512_abs_ps(load16(x + i)));
  amax = _mm512_reduce_max_ps(mv);
#endif
  for (; i < d; ++i) amax = std::max(amax, std::fabs(to_f(x[i])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  i = 0;
#ifdef __AVX512F__
  const __m512 iv = _mm512_set1_ps(inv);
  for (; i + 16 <= d; i += 16) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + i), iv));  // nearest even
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtsepi32_epi8(q));
  }
#endif
  for (; i < d; ++i)
    dst[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(to_f(x[i]) * inv))));
  return amax / 127.f;
}

// Quantizes one position's K and V rows of one KV head into their head-blocks (slot t of
// block blk); q: scratch for d values.
template <typename T>
inline void write_int8_rows(int8_t* kc, int8_t* vc, int64_t blk, int64_t t, int64_t h,
                            int64_t kvh, int64_t bs, int64_t d, const T* k, const T* v,
                            int8_t* q) {
  int8_t* kb = head_block(kc, blk, h, kvh, bs, d);
  float scale = quantize_row(q, k, d);
  for (int64_t i = 0; i < d; i += 4) std::memcpy(kb + k_offset(bs, t, i), q + i, 4);
  std::memcpy(kb + bs * d + t * kScaleBytes, &scale, kScaleBytes);
  int8_t* vb = head_block(vc, blk, h, kvh, bs, d);
  scale = quantize_row(q, v, d);
  for (int64_t i = 0; i < d; ++i) vb[v_offset(d, t, i)] = q[i];
  std::memcpy(vb + bs * d + t * kScaleBytes, &scale, kScaleBytes);
}

template <typename T>
void write_kv_int8_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
                        const at::Tensor& slot_mapping, int64_t bs) {
  const int64_t rows = k.size(0), kvh = k.size(1), d = k.size(2);
  int8_t* kc = kv_cache.data_ptr<int8_t>();
  int8_t* vc = kc + kv_cache[0].numel();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  // A row's K lands in D / 4 cache lines of its head-block: rows are split finely so that
  // every core takes part in those misses.
  at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
    std::vector<int8_t> q(d);
    for (int64_t r = b; r < e; ++r)
      for (int64_t h = 0; h < kvh; ++h)
        write_int8_rows(kc, vc, slots[r] / bs, slots[r] % bs, h, kvh, bs, d,
                        kp + r * ks + h * d, vp + r * vs + h * d, q.data());
  });
}

inline float head_block_scale(const int8_t* hb, int64_t bs, int64_t d, int64_t t) {
  float scale;
  std::memcpy(&scale, hb + bs * d + t * kScaleBytes, kScaleBytes);
  return scale;
}

// k, v [T, KVH, D] = the rows at these slots as an int8 cache holds them (scale * q in
// float32, rounded to T): a prefill attends to exactly what later steps will read.
template <typename T>
void read_kv_int8_impl(at::Tensor& k, at::Tensor& v, const at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping, int64_t bs) {
  const int64_t rows = k.size(0), kvh = k.size(1), d = k.size(2);
  const int8_t* kc = kv_cache.data_ptr<int8_t>();
  const int8_t* vc = kc + kv_cache[0].numel();
  T* kp = k.data_ptr<T>();
  T* vp = v.data_ptr<T>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, rows, row_grain(kvh * d), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t blk = slots[r] / bs, t = slots[r] % bs;
      for (int64_t h = 0; h < kvh; ++h) {
        const int8_t* kb = head_block(kc, blk, h, kvh, bs, d);
        const int8_t* vb = head_block(vc, blk, h, kvh, bs, d);
        const float ksc = head_block_scale(kb, bs, d, t), vsc = head_block_scale(vb, bs, d, t);
        T* kr = kp + r * ks + h * d;
        T* vr = vp + r * vs + h * d;
        for (int64_t i = 0; i < d; ++i) {
          kr[i] = static_cast<T>(static_cast<float>(kb[k_offset(bs, t, i)]) * ksc);
          vr[i] = static_cast<T>(static_cast<float>(vb[v_offset(d, t, i)]) * vsc);
        }
      }
    }
  });
}

// Head-blocks fetched ahead of the one being read (the blocks of a request lie anywhere).
constexpr int64_t kInt8PrefetchBlocks = 2;

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// One request and one KV head over an int8 cache, vector path (bs % 16 == 0, D % 16 == 0).
// Scores: each query head is split into two int8 planes, q ~= qscale * (hi + lo / 256), and
// vpdpbusd multiplies unsigned by signed bytes, so K is read as k + 128 (sign bit flipped)
// and 128 * sum(plane) taken off: 16 positions x 4 dims per instruction, exact in int32.
template <typename T, int NC, int G>
void attend_int8_vec(T* out, int64_t out_stride, const float* qf, const int8_t* kc,
                     const int8_t* vc, const int64_t* table, int64_t len, int64_t bs,
                     int64_t kvh, int64_t kh, float* scores) {
  constexpr int64_t d = NC * 16;
  const int64_t head_bytes = head_block_bytes(bs, d);
  alignas(64) int8_t qhi[G][d], qlo[G][d];
  float qscale[G];
  int32_t off_hi[G], off_lo[G];
  for (int g = 0; g < G; ++g) {
    const float* q = qf + g * d;
    __m512 mv = _mm512_setzero_ps();
    for (int c = 0; c < NC; ++c) mv = _mm512_max_ps(mv, _mm512_abs_ps(_mm512_loadu_ps(q + 16 * c)));
    const float amax = _mm512_reduce_max_ps(mv);
    qscale[g] = amax / 127.f;
    const __m512 iv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512 lo_max = _mm512_set1_ps(127.f), lo_min = _mm512_set1_ps(-127.f);
    __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
    for (int c = 0; c < NC; ++c) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * c), iv);
      const __m512 hi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 lo = _mm512_min_ps(lo_max, _mm512_max_ps(lo_min, _mm512_roundscale_ps(
          _mm512_mul_ps(_mm512_sub_ps(x, hi), _mm512_set1_ps(256.f)),
          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      const __m512i hi_i = _mm512_cvtps_epi32(hi), lo_i = _mm512_cvtps_epi32(lo);
      sh = _mm512_add_epi32(sh, hi_i);
      sl = _mm512_add_epi32(sl, lo_i);
      _mm_store_si128(reinterpret_cast<__m128i*>(&qhi[g][16 * c]), _mm512_cvtsepi32_epi8(hi_i));
      _mm_store_si128(reinterpret_cast<__m128i*>(&qlo[g][16 * c]), _mm512_cvtsepi32_epi8(lo_i));
    }
    off_hi[g] = 128 * _mm512_reduce_add_epi32(sh);
    off_lo[g] = 128 * _mm512_reduce_add_epi32(sl);
  }
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t nblocks = (len + bs - 1) / bs;
  auto request_block = [&](const int8_t* plane, int64_t blk) {
    return head_block(plane, table[blk], kh, kvh, bs, d);
  };
  for (int64_t blk = 0; blk < std::min(kInt8PrefetchBlocks, nblocks); ++blk)
    prefetch_bytes<_MM_HINT_T0>(request_block(kc, blk), head_bytes);
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int8_t* kb = request_block(kc, blk);
    if (blk + kInt8PrefetchBlocks < nblocks)
      prefetch_bytes<_MM_HINT_T0>(request_block(kc, blk + kInt8PrefetchBlocks), head_bytes);
    prefetch_bytes<_MM_HINT_T1>(request_block(vc, blk), head_bytes);  // for the values' pass
    const int64_t start = blk * bs, n = std::min(bs, len - start);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      __m512i hi[G], lo[G];
      for (int g = 0; g < G; ++g) hi[g] = lo[g] = _mm512_setzero_si512();
      for (int64_t d4 = 0; d4 < d / 4; ++d4) {
        const __m512i kv = _mm512_xor_si512(_mm512_loadu_si512(kb + (d4 * bs + t0) * 4), flip);
        for (int g = 0; g < G; ++g) {
          int32_t h4, l4;
          std::memcpy(&h4, &qhi[g][4 * d4], 4);
          std::memcpy(&l4, &qlo[g][4 * d4], 4);
          hi[g] = _mm512_dpbusd_epi32(hi[g], kv, _mm512_set1_epi32(h4));
          lo[g] = _mm512_dpbusd_epi32(lo[g], kv, _mm512_set1_epi32(l4));
        }
      }
      const int64_t m_n = std::min<int64_t>(16, n - t0);
      const __mmask16 m = static_cast<__mmask16>((1u << m_n) - 1);
      const __m512 ks = _mm512_maskz_loadu_ps(m, kb + bs * d + t0 * kScaleBytes);
      for (int g = 0; g < G; ++g) {
        const __m512 h = _mm512_cvtepi32_ps(_mm512_sub_epi32(hi[g], _mm512_set1_epi32(off_hi[g])));
        const __m512 l = _mm512_cvtepi32_ps(_mm512_sub_epi32(lo[g], _mm512_set1_epi32(off_lo[g])));
        const __m512 dot = _mm512_fmadd_ps(l, _mm512_set1_ps(1.f / 256.f), h);
        _mm512_mask_storeu_ps(scores + g * len + start + t0, m,
                              _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(qscale[g])), ks));
      }
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = softmax_(scores + g * len, len);
  // Values, 16 positions at a time: their weights p * (V row scale) become unsigned bytes
  // (w ~= wscale * u8, wscale = max w / 255, per 16 positions and query head), and vpdpbusd
  // sums 4 positions' weighted values for 16 dims, exact in int32; each 16 positions'
  // integer sums are then scaled into float accumulators.
  alignas(64) float acc[G][NC][16] = {};
  alignas(64) uint8_t wq[G][16];
  float wscale[G];
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int8_t* vb = request_block(vc, blk);
    if (blk + kInt8PrefetchBlocks < nblocks)
      prefetch_bytes<_MM_HINT_T0>(request_block(vc, blk + kInt8PrefetchBlocks), head_bytes);
    const int64_t start = blk * bs, n = std::min(bs, len - start);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t m_n = std::min<int64_t>(16, n - t0);
      const __mmask16 m = static_cast<__mmask16>((1u << m_n) - 1);
      const __m512 vs = _mm512_maskz_loadu_ps(m, vb + bs * d + t0 * kScaleBytes);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, scores + g * len + start + t0), vs);
        const float wmax = _mm512_reduce_max_ps(w);
        wscale[g] = wmax / 255.f;
        const __m512 iv = _mm512_set1_ps(wmax > 0.f ? 255.f / wmax : 0.f);
        _mm_store_si128(reinterpret_cast<__m128i*>(wq[g]),
                        _mm512_cvtusepi32_epi8(_mm512_cvtps_epu32(_mm512_mul_ps(w, iv))));
      }
      __m512i sum[G][NC];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c) sum[g][c] = _mm512_setzero_si512();
      for (int64_t r = 0; r < (m_n + 3) / 4; ++r) {
        const int8_t* quad = vb + ((t0 / 4 + r) * d) * 4;
        for (int c = 0; c < NC; ++c) {
          const __m512i vv = _mm512_loadu_si512(quad + 64 * c);
          for (int g = 0; g < G; ++g) {
            int32_t w4;
            std::memcpy(&w4, &wq[g][4 * r], 4);
            sum[g][c] = _mm512_dpbusd_epi32(sum[g][c], _mm512_set1_epi32(w4), vv);
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512 ws = _mm512_set1_ps(wscale[g]);
        for (int c = 0; c < NC; ++c)
          _mm512_store_ps(acc[g][c], _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[g][c]), ws,
                                                     _mm512_load_ps(acc[g][c])));
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 iv = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < NC; ++c)
      store16(out + g * out_stride + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[g][c]), iv));
  }
}
#endif

// The same for any shape, in scalar code, with float queries and weights.
template <typename T>
void attend_int8(T* out, int64_t out_stride, const float* qf, const int8_t* kc, const int8_t* vc,
                 const int64_t* table, int64_t len, int64_t bs, int64_t kvh, int64_t kh,
                 float* scores, int64_t group, int64_t d, float* acc) {
  for (int64_t t = 0; t < len; ++t) {
    const int8_t* kb = head_block(kc, table[t / bs], kh, kvh, bs, d);
    const int64_t o = t % bs;
    const float ks = head_block_scale(kb, bs, d, o);
    for (int64_t g = 0; g < group; ++g) {
      float sum = 0.f;
      for (int64_t i = 0; i < d; ++i) sum += qf[g * d + i] * kb[k_offset(bs, o, i)];
      scores[g * len + t] = sum * ks;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float* p = scores + g * len;
    const float inv = softmax_(scores + g * len, len);
    std::fill(acc, acc + d, 0.f);
    for (int64_t t = 0; t < len; ++t) {
      const int8_t* vb = head_block(vc, table[t / bs], kh, kvh, bs, d);
      const int64_t o = t % bs;
      const float pv = p[t] * head_block_scale(vb, bs, d, o);
      for (int64_t i = 0; i < d; ++i) acc[i] += pv * vb[v_offset(d, o, i)];
    }
    for (int64_t i = 0; i < d; ++i) out[g * out_stride + i] = static_cast<T>(acc[i] * inv);
  }
}

using AttendInt8Fn = void (*)(void*, int64_t, const float*, const int8_t*, const int8_t*,
                              const int64_t*, int64_t, int64_t, int64_t, int64_t, float*);

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <typename T, int NC, int G>
void attend_int8_erased(void* out, int64_t os, const float* qf, const int8_t* kc,
                        const int8_t* vc, const int64_t* table, int64_t len, int64_t bs,
                        int64_t kvh, int64_t kh, float* scores) {
  attend_int8_vec<T, NC, G>(static_cast<T*>(out), os, qf, kc, vc, table, len, bs, kvh, kh, scores);
}
#endif

template <typename T>
AttendInt8Fn pick_attend_int8(int64_t d, int64_t group, int64_t bs) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (bs % 16 == 0 && d == 64) {
    switch (group) {
      case 1: return &attend_int8_erased<T, 4, 1>;
      case 2: return &attend_int8_erased<T, 4, 2>;
      case 3: return &attend_int8_erased<T, 4, 3>;
      case 4: return &attend_int8_erased<T, 4, 4>;
    }
  } else if (bs % 16 == 0 && d == 128) {
    switch (group) {
      case 1: return &attend_int8_erased<T, 8, 1>;
      case 2: return &attend_int8_erased<T, 8, 2>;
      case 4: return &attend_int8_erased<T, 8, 4>;
    }
  }
#endif
  return nullptr;
}

// With k and v ([B, KVH, D], the decodes' new rows) and their slots, each task first writes
// its request's new row of its KV head, then attends (write_decode_attention_): the write
// and the reads share the cache misses of the request's last block.
template <typename T>
void decode_attention_int8_impl(at::Tensor& out, const at::Tensor& q, at::Tensor& kv_cache,
                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                double scale, int64_t bs, const at::Tensor* k = nullptr,
                                const at::Tensor* v = nullptr,
                                const at::Tensor* slot_mapping = nullptr) {
  const int64_t d = q.size(2), kvh = kv_cache.size(2), group = q.size(1) / kvh;
  int8_t* kc = kv_cache.data_ptr<int8_t>();
  int8_t* vc = kc + kv_cache[0].numel();
  const AttendInt8Fn vec = pick_attend_int8<T>(d, group, bs);
  const T* kp = k ? k->data_ptr<T>() : nullptr;
  const T* vp = v ? v->data_ptr<T>() : nullptr;
  const int64_t* slots = slot_mapping ? slot_mapping->data_ptr<int64_t>() : nullptr;
  const int64_t ks = k ? k->stride(0) : 0, vs = v ? v->stride(0) : 0;
  for_each_decode_task<T>(out, q, block_tables, context_lens, scale, kvh,
                          [&](T* o, const float* qf, const int64_t* table, int64_t len,
                              int64_t b, int64_t kh, float* scores, float* acc) {
    if (slots) {
      int8_t scratch[1024];  // head_dim <= 1024 (checked)
      write_int8_rows(kc, vc, slots[b] / bs, slots[b] % bs, kh, kvh, bs, d,
                      kp + b * ks + kh * d, vp + b * vs + kh * d, scratch);
    }
    if (vec) vec(o, d, qf, kc, vc, table, len, bs, kvh, kh, scores);
    else attend_int8(o, d, qf, kc, vc, table, len, bs, kvh, kh, scores, group, d, acc);
  });
}

// ------------------------------------------------------------------ greedy sampling
// out[r] = the first index of row r's maximum (torch.argmax, for rows without NaN), read in
// the logits' own dtype: no float32 copy of a [rows, vocab] tensor.
template <typename T>
void argmax_impl(at::Tensor& out, const at::Tensor& logits) {
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  const T* lp = logits.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* x = lp + r * stride;
      const float m = row_max(x, n);
      int64_t best = 0;
      while (best < n - 1 && to_f(x[best]) != m) ++best;
      op[r] = best;
    }
  });
}

// ------------------------------------------------------------------ checks and dispatch
void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have contiguous rows");
}

// float32, bfloat16 and float16: the dtypes the engine runs in.
#define CONVEYOR_DISPATCH(dtype, name, ...)                      \
  AT_DISPATCH_SWITCH(dtype, name,                                \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && w.is_contiguous() && w.numel() == x.size(1) &&
              w.scalar_type() == x.scalar_type(), "rms_norm: bad shapes or dtypes");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  CONVEYOR_DISPATCH(x.scalar_type(), "rms_norm", [&] { rms_norm_impl<scalar_t>(out, x, w, eps); });
  return out;
}

void add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes() && w.numel() == x.size(1) &&
              w.is_contiguous() && x.scalar_type() == residual.scalar_type() &&
              w.scalar_type() == x.scalar_type(), "add_rms_norm_: bad shapes or dtypes");
  CONVEYOR_DISPATCH(x.scalar_type(), "add_rms_norm_",
                    [&] { add_rms_norm_impl<scalar_t>(x, residual, w, eps); });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: bad shape");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  CONVEYOR_DISPATCH(gate_up.scalar_type(), "silu_mul",
                    [&] { silu_mul_impl<scalar_t>(out, gate_up); });
  return out;
}

void rotary_(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos_sin,
             int64_t num_heads, int64_t head_dim) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= num_heads * head_dim && head_dim % 2 == 0 &&
              positions.scalar_type() == at::kLong && positions.is_contiguous() &&
              positions.numel() == x.size(0) && cos_sin.scalar_type() == at::kFloat &&
              cos_sin.is_contiguous() && cos_sin.size(1) == head_dim,
              "rotary_: bad shapes or dtypes");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < positions.numel(); ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cos_sin.size(0), "rotary_: position ", pos[i],
                " outside the RoPE table of ", cos_sin.size(0), " positions");
  CONVEYOR_DISPATCH(x.scalar_type(), "rotary_",
                    [&] { rotary_impl<scalar_t>(x, positions, cos_sin, num_heads, head_dim); });
}

// The cache's geometry for head_dim d: {blocks, block size, KV heads, tiles}. A cache in the
// model's dtype is [2, blocks, bs, KVH, D], or in the tile layout [2, blocks, KVH, bs * D];
// an int8 one [2, blocks, KVH, bs * (D + 4)] (see above).
struct CacheShape {
  int64_t blocks, bs, kvh;
  bool tiles = false;  // the tile layout [2, blocks, KVH, bs * D] (ops/reference.py)
};

CacheShape cache_shape(const at::Tensor& kv_cache, int64_t d, const char* op) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.size(0) == 2, op,
              ": kv_cache must be a contiguous [2, blocks, ...] tensor");
  if (kv_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(3) % (d + kScaleBytes) == 0, op,
                ": an int8 kv_cache must be [2, blocks, KVH, bs * (D + 4)]");
    return {kv_cache.size(1), kv_cache.size(3) / (d + kScaleBytes), kv_cache.size(2)};
  }
  if (kv_cache.dim() == 4) {
    TORCH_CHECK(d % 32 == 0 && kv_cache.size(3) % (16 * d) == 0, op,
                ": a tile-layout kv_cache must be [2, blocks, KVH, bs * D], bs a multiple of 16 "
                "and D of 32");
    return {kv_cache.size(1), kv_cache.size(3) / d, kv_cache.size(2), true};
  }
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(4) == d, op,
              ": kv_cache must be [2, blocks, bs, KVH, D]");
  return {kv_cache.size(1), kv_cache.size(2), kv_cache.size(3)};
}

// Checks k, v [T, KVH, D] and their slots against the cache; returns its geometry.
CacheShape check_write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache,
                          const at::Tensor& slot_mapping, const char* op = "write_kv_") {
  TORCH_CHECK(k.dim() == 3, op, ": k must be [T, KVH, D]");
  const CacheShape shape = cache_shape(kv_cache, k.size(2), op);
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) == shape.kvh && k.stride(2) == 1 &&
              v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2) &&
              (int8 || k.scalar_type() == kv_cache.scalar_type()) &&
              v.scalar_type() == k.scalar_type() &&
              (!int8 || (k.size(2) % 4 == 0 && k.size(2) <= 1024)),
              op, ": bad shapes or dtypes");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == k.size(0), op, ": bad slot_mapping");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = shape.blocks * shape.bs;
  for (int64_t i = 0; i < slot_mapping.numel(); ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, op, ": slot ", slots[i],
                " outside the cache's ", num_slots, " slots");
  return shape;
}

// Checks q [B, H, D], the block tables and the context lengths against the cache.
CacheShape check_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables,
                                  const at::Tensor& context_lens) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "decode_attention: q must be [B, H, D]");
  const CacheShape shape = cache_shape(kv_cache, q.size(2), "decode_attention");
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK(q.size(1) % shape.kvh == 0 && (int8 || kv_cache.scalar_type() == q.scalar_type()),
              "decode_attention: bad kv_cache shape or dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
              block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
              context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
              context_lens.numel() == q.size(0), "decode_attention: bad block tables or lengths");
  const int64_t bs = shape.bs, width = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * bs, "decode_attention: context length ",
                lens[b], " outside [1, ", width * bs, "]");
    for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(tables[b * width + i] >= 0 && tables[b * width + i] < shape.blocks,
                  "decode_attention: block ", tables[b * width + i], " outside the cache");
  }
  return shape;
}

void write_kv_(const at::Tensor& k, const at::Tensor& v, at::Tensor kv_cache,
               const at::Tensor& slot_mapping) {
  const CacheShape shape = check_write_kv(k, v, kv_cache, slot_mapping);
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  CONVEYOR_DISPATCH(k.scalar_type(), "write_kv_", [&] {
    if (shape.tiles) tiles_kv_impl<scalar_t>(k, v, kv_cache, slot_mapping, shape.bs, false);
    else if (int8) write_kv_int8_impl<scalar_t>(k, v, kv_cache, slot_mapping, shape.bs);
    else write_kv_impl<scalar_t>(k, v, kv_cache, slot_mapping);
  });
}

void read_kv_(at::Tensor k, at::Tensor v, const at::Tensor& kv_cache,
              const at::Tensor& slot_mapping) {
  const CacheShape shape = check_write_kv(k, v, kv_cache, slot_mapping, "read_kv_");
  TORCH_CHECK(kv_cache.scalar_type() == at::kChar || shape.tiles,
              "read_kv_: for an int8 or tile-layout kv_cache");
  CONVEYOR_DISPATCH(k.scalar_type(), "read_kv_", [&] {
    if (shape.tiles) tiles_kv_impl<scalar_t>(k, v, kv_cache, slot_mapping, shape.bs, true);
    else read_kv_int8_impl<scalar_t>(k, v, kv_cache, slot_mapping, shape.bs);
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            double scale) {
  const CacheShape shape = check_decode_attention(q, kv_cache, block_tables, context_lens);
  if (shape.tiles)
    return conveyor::decode_attention_tiles(q, kv_cache, block_tables, context_lens, scale);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  at::Tensor cache = kv_cache;  // read only
  CONVEYOR_DISPATCH(q.scalar_type(), "decode_attention", [&] {
    if (cache.scalar_type() == at::kChar)
      decode_attention_int8_impl<scalar_t>(out, q, cache, block_tables, context_lens, scale,
                                           shape.bs);
    else decode_attention_impl<scalar_t>(out, q, cache, block_tables, context_lens, scale);
  });
  return out;
}

// A decode-only batch: write_kv_(k, v, kv_cache, slot_mapping), then decode_attention. With
// an int8 cache each attention task writes its own new row first (one pass over the blocks).
at::Tensor write_decode_attention_(const at::Tensor& k, const at::Tensor& v, at::Tensor kv_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& q,
                                   const at::Tensor& block_tables,
                                   const at::Tensor& context_lens, double scale) {
  if (kv_cache.scalar_type() != at::kChar) {
    write_kv_(k, v, kv_cache, slot_mapping);
    return decode_attention(q, kv_cache, block_tables, context_lens, scale);
  }
  check_write_kv(k, v, kv_cache, slot_mapping);
  const CacheShape shape = check_decode_attention(q, kv_cache, block_tables, context_lens);
  TORCH_CHECK(k.size(0) == q.size(0) && k.scalar_type() == q.scalar_type(),
              "write_decode_attention_: one new K/V row per query, in its dtype");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  CONVEYOR_DISPATCH(q.scalar_type(), "write_decode_attention_", [&] {
    decode_attention_int8_impl<scalar_t>(out, q, kv_cache, block_tables, context_lens, scale,
                                         shape.bs, &k, &v, &slot_mapping);
  });
  return out;
}

at::Tensor argmax(const at::Tensor& logits) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax: logits must be [rows, vocab]");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  CONVEYOR_DISPATCH(logits.scalar_type(), "argmax", [&] { argmax_impl<scalar_t>(out, logits); });
  return out;
}

// Structured outputs: token t of logits row rows[i] stays only if bit t % 32 of word t / 32 of
// bitmask row i is set, else becomes -inf (tokens past the mask's words too). One pass over
// the mask's words, skipping the all-allowed ones: ~1 us a row, where numpy's unpacking and
// masked writes took ~25 us (a constrained step's 64 rows: 1.7 ms, serial after the forward).
template <typename T>
void apply_token_bitmask_impl(at::Tensor& logits, const at::Tensor& bitmask,
                              const at::Tensor& rows) {
  const int64_t vocab = logits.size(1), words = bitmask.size(1);
  const T neg_inf = T(-std::numeric_limits<float>::infinity());
  const auto* mask = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const auto* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    T* out = logits.data_ptr<T>() + row_ids[i] * vocab;
    const uint32_t* bits = mask + i * words;
    for (int64_t w = 0; w * 32 < vocab; ++w) {
      const uint32_t word = w < words ? bits[w] : 0u;
      if (word == 0xFFFFFFFFu) continue;
      const int64_t end = std::min<int64_t>(32, vocab - w * 32);
      for (int64_t b = 0; b < end; ++b)
        if (!((word >> b) & 1u)) out[w * 32 + b] = neg_inf;
    }
  }
}

void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(),
              "apply_token_bitmask_: logits must be contiguous [rows, vocab]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt &&
                  bitmask.is_contiguous() && rows.dim() == 1 &&
                  rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "apply_token_bitmask_: bitmask must be int32 [len(rows), words], rows int64");
  const int64_t n = logits.size(0);
  const auto* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < n, "apply_token_bitmask_: row ", row_ids[i],
                " out of range for ", n, " rows");
  CONVEYOR_DISPATCH(logits.scalar_type(), "apply_token_bitmask_",
                    [&] { apply_token_bitmask_impl<scalar_t>(logits, bitmask, rows); });
}

// ------------------------------------------------------------------ the decode loop
// y = x W^T + b with W pre-packed by oneDNN (conveyor.model.layers.PackedLinear).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  using Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                        c10::string_view, c10::List<std::optional<c10::Scalar>>,
                        std::optional<c10::string_view>);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<Fn>();
  return op.call(x, w, b, "none", c10::List<std::optional<c10::Scalar>>(), std::nullopt);
}

// A oneDNN-packed matmul of a few rows: from the GGUF blocks when it has them (quant_linear.cpp,
// AMX: bit-identical, fewer bytes read, any number of rows), else oneDNN's one call, which
// gives every row the same bits up to kOneDnnSmallRows rows.
int64_t small_rows(const std::optional<at::Tensor>& blocks) {
  return blocks.has_value() ? conveyor::kQuantizedMaxRows : conveyor::kOneDnnSmallRows;
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& packed,
                        const std::optional<at::Tensor>& blocks,
                        const std::optional<at::Tensor>& b) {
  if (blocks.has_value() && x.size(0) >= 1) return conveyor::quantized_linear(x, *blocks, b);
  return packed_linear(x, packed, b);
}

// oneDNN picks its algorithm by the call's shape and thread count, and with it a row's last
// bits: on a 2-core AMX Xeon its bf16 matmul with 1536 inputs and 576 outputs gave other bits
// at 150-256 rows than at 1-149 or 257-2048, so a row's result depended on its batch. So the
// first call of each row count M above small_rows for a weight shape (and thread count)
// computes the rows in small calls and keeps oneDNN's one call for that M only if it gave
// every row the same bits; else that M always runs as two halves (each one a call of this
// function). The verdict is per shape, so the model's 30 layers share it, and a first call
// costs one layer about a small-call pass more (all the model's matmuls: 1.5-10 ms more at
// 150-777 rows on a 2-core AMX Xeon), besides oneDNN's own first call at a new row count
// (4-6 ms: it builds a primitive; docs/benchmarks.md). Up to kQuantizedMaxRows rows, weights
// with GGUF blocks pay neither.
using RowsKey = std::tuple<int64_t, int64_t, bool, int, int64_t>;  // N, K, blocks, threads, M
std::mutex one_call_mutex;
std::map<RowsKey, bool>& one_call_verdicts() {
  static std::map<RowsKey, bool> verdicts;
  return verdicts;
}

at::Tensor large_linear(const at::Tensor& x, const at::Tensor& packed,
                        const std::optional<at::Tensor>& blocks,
                        const std::optional<at::Tensor>& b) {
  const int64_t rows = x.size(0), most = small_rows(blocks);
  if (rows <= most) return small_linear(x, packed, blocks, b);
  const RowsKey key{packed.size(0), packed.size(1), blocks.has_value(), at::get_num_threads(),
                    rows};
  std::optional<bool> one_call;
  {
    const std::lock_guard<std::mutex> lock(one_call_mutex);
    const auto found = one_call_verdicts().find(key);
    if (found != one_call_verdicts().end()) one_call = found->second;
  }
  if (one_call.value_or(false)) return packed_linear(x, packed, b);
  if (one_call.has_value()) {  // oneDNN's one call changes bits at this row count: halves
    const int64_t half = rows / 2;
    return at::cat({large_linear(x.narrow(0, 0, half), packed, blocks, b),
                    large_linear(x.narrow(0, half, rows - half), packed, blocks, b)});
  }
  // The first call of this row count: small calls (the fewest passes of at most `most`, all
  // alike), and oneDNN's one call to compare with them.
  const conveyor::TokenPasses passes(rows, most);
  std::vector<at::Tensor> parts;
  for (int64_t i = 0; i < passes.count; ++i) {
    const int64_t start = passes.begin(i);
    parts.push_back(small_linear(x.narrow(0, start, passes.end(i, rows) - start), packed,
                                 blocks, b));
  }
  at::Tensor y = at::cat(parts);
  const bool same = at::equal(packed_linear(x, packed, b), y);
  const std::lock_guard<std::mutex> lock(one_call_mutex);
  one_call_verdicts()[key] = same;
  return y;
}

// The matmul of a layer's weight, by the weight's layout. oneDNN-packed (MkldnnCPU): small
// batches from the GGUF blocks when it has them, larger ones as oneDNN keeps each row's bits
// (above). Pair tiles (pack_dot_weight; CPUs with AVX512-BF16 and no AMX) or lane tiles
// (float32): dot_linear at every batch size, from the blocks when it has them, so a row's
// result never depends on the batch (dot_linear.cpp).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const std::optional<at::Tensor>& blocks, const std::optional<at::Tensor>& b) {
  if (!packed.is_mkldnn()) return conveyor::dot_linear(x, blocks.has_value() ? *blocks : packed, b);
  return large_linear(x, packed, blocks, b);
}

using Blocks = c10::List<std::optional<at::Tensor>>;  // per layer: GGUF blocks or None

// A decode batch's per-request inputs: x (the embeddings [T, hidden], used as the residual
// stream in place), positions, slots, block tables and context lengths, one row each.
struct DecodeRows {
  at::Tensor x, positions, slot_mapping, block_tables, context_lens;

  DecodeRows narrow(int64_t start, int64_t length) const {
    return {x.narrow(0, start, length), positions.narrow(0, start, length),
            slot_mapping.narrow(0, start, length), block_tables.narrow(0, start, length),
            context_lens.narrow(0, start, length)};
  }
};

// What decode_layers reads of the model: per layer its norms and matmul weights (packed, and
// their GGUF blocks or None), the final norm and the attention shape.
struct DecodeModel {
  at::TensorList input_norms, post_norms, qkv_w;
  const Blocks& qkv_b;
  at::TensorList o_w, gate_up_w, down_w;
  const Blocks &qkv_q, &o_q, &gate_up_q, &down_q;
  const at::Tensor& final_norm;
  double eps;
  int64_t num_heads, num_kv_heads, head_dim;
};

// Every layer for `rows`, then the final norm: the same ops in the same order as
// CausalLM.forward in Python. Returns the final-normed hidden states [T, hidden].
at::Tensor decode_rows(const DecodeRows& rows, const at::Tensor& cos_sin, at::Tensor& kv_caches,
                       const DecodeModel& m) {
  const int64_t t = rows.x.size(0), q_size = m.num_heads * m.head_dim,
                kv_size = m.num_kv_heads * m.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(m.head_dim));
  at::Tensor residual = rows.x;
  at::Tensor h = rms_norm(rows.x, m.input_norms[0], m.eps);
  for (int64_t l = 0; l < static_cast<int64_t>(m.input_norms.size()); ++l) {
    if (l > 0) add_rms_norm_(h, residual, m.input_norms[l], m.eps);
    at::Tensor qkv = linear(h, m.qkv_w[l], m.qkv_q.get(l), m.qkv_b.get(l));
    rotary_(qkv, rows.positions, cos_sin, m.num_heads + m.num_kv_heads, m.head_dim);
    at::Tensor attn = write_decode_attention_(
        qkv.narrow(1, q_size, kv_size).view({t, m.num_kv_heads, m.head_dim}),
        qkv.narrow(1, q_size + kv_size, kv_size).view({t, m.num_kv_heads, m.head_dim}),
        kv_caches.select(0, l), rows.slot_mapping,
        qkv.narrow(1, 0, q_size).view({t, m.num_heads, m.head_dim}), rows.block_tables,
        rows.context_lens, scale);
    h = linear(attn.view({t, q_size}), m.o_w[l], m.o_q.get(l), std::nullopt);
    add_rms_norm_(h, residual, m.post_norms[l], m.eps);
    h = linear(silu_mul(linear(h, m.gate_up_w[l], m.gate_up_q.get(l), std::nullopt)),
               m.down_w[l], m.down_q.get(l), std::nullopt);
  }
  add_rms_norm_(h, residual, m.final_norm, m.eps);
  return h;
}

// A decode step of a few rows spends much of its time in the ~300 parallel regions of its
// ops, each a fork and a join over little work, the matmuls' threads idle while attention
// reads memory and the reverse. With at least kDecodeRowsPerPart rows a thread, each thread
// instead runs every layer for its own share of the requests, one region for the whole
// step: both read the weights (the second mostly from L3), but a row's result is the same
// (the kernels give a row the same bits whatever its batch: dot_linear.cpp). Measured on 2
// threads only (Zen 4: decode steps of 13-64 requests 1.05-1.16x, 8 requests 0.98-1.05x,
// the reference workload 1.01-1.03x; fewer requests slower: docs/benchmarks.md), so only
// there; oneDNN-packed weights (AMX) keep the split by op.
constexpr int64_t kDecodeRowsPerPart = 4;
constexpr int64_t kDecodePartsThreads = 2;

int64_t decode_parts(int64_t rows, const at::Tensor& packed) {
  const int64_t threads = at::get_num_threads();
  const bool apart = threads == kDecodePartsThreads && rows >= kDecodeRowsPerPart * threads &&
                     !packed.is_mkldnn() && !at::in_parallel_region();
  return apart ? threads : 1;
}

// Whether rows i - 1 and i are one request's (a verify's rows, or a float32 prefill chunk's,
// which run as decodes: consecutive positions under the same block table). A share must hold
// all of a request's rows: a row reads the K/V that the rows before it write in the same
// layer, and another thread's share would write them at another time.
bool same_request(const at::Tensor& tables, const int64_t* len, int64_t i) {
  if (len[i] != len[i - 1] + 1) return false;
  const auto* row = static_cast<const char*>(tables.data_ptr());
  const int64_t bytes = tables.size(1) * tables.element_size(),
                stride = tables.stride(0) * tables.element_size();
  return std::memcmp(row + i * stride, row + (i - 1) * stride, bytes) == 0;
}

// The first row of each run of about equal cost (at most `parts` runs, fewer where a
// request's rows leave no other cut): a request's matmuls (~12 hidden^2 multiply-adds a
// layer, ~100 G/s on a Zen 4 thread at 6-16 rows) plus its attention's reads (2 kv_size
// cached values a position, ~10 GB/s), each cut between requests where nearest its share.
std::vector<int64_t> decode_part_starts(const DecodeRows& rows, const at::Tensor& kv_caches,
                                        int64_t kv_size, int64_t parts) {
  const int64_t t = rows.x.size(0), hidden = rows.x.size(1);
  const double row = 12.0 * hidden * hidden / 100e9,
               position = 2.0 * kv_size * kv_caches.element_size() / 10e9;
  const at::Tensor lens = rows.context_lens.to(at::kLong), tables = rows.block_tables;
  const int64_t* len = lens.data_ptr<int64_t>();
  std::vector<double> cost(t + 1, 0.0);  // cost[i]: rows [0, i)
  for (int64_t i = 0; i < t; ++i) cost[i + 1] = cost[i] + row + position * len[i];
  std::vector<int64_t> starts{0};
  for (int64_t p = 1; p < parts; ++p) {
    const double target = cost[t] * p / parts;
    int64_t best = -1;
    for (int64_t i = starts.back() + 1; i < t; ++i)
      if (!same_request(tables, len, i) &&
          (best < 0 || std::abs(cost[i] - target) < std::abs(cost[best] - target)))
        best = i;
    if (best < 0) break;
    starts.push_back(best);
  }
  starts.push_back(t);
  return starts;
}

// The first row of each share decode_layers runs side by side, and the end: {0, rows} when
// it runs them as one batch.
std::vector<int64_t> decode_shares(const DecodeRows& rows, const at::Tensor& kv_caches,
                                   int64_t kv_size, const at::Tensor& packed) {
  const int64_t t = rows.x.size(0), most = decode_parts(t, packed);
  if (most == 1) return {0, t};
  return decode_part_starts(rows, kv_caches, kv_size, most);
}

// decode_shares for tests: x [T, hidden], the step's block tables and context lengths, the
// KV cache and a layer's packed qkv weight.
std::vector<int64_t> decode_shares_of(const at::Tensor& x, const at::Tensor& block_tables,
                                      const at::Tensor& context_lens, const at::Tensor& kv_caches,
                                      int64_t kv_size, const at::Tensor& packed) {
  return decode_shares({x, at::Tensor(), at::Tensor(), block_tables, context_lens}, kv_caches,
                       kv_size, packed);
}

// Every decoder layer of a Llama-family model (no q/k norm) for a batch of decodes only, and
// the final norm, without returning to Python between ops (in a decode step, the
// interpreter's own work between ~300 small ops costs more than the ops).
at::Tensor decode_layers(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos_sin,
                         at::Tensor kv_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         at::TensorList input_norms, at::TensorList post_norms,
                         at::TensorList qkv_w, const Blocks& qkv_b, at::TensorList o_w,
                         at::TensorList gate_up_w, at::TensorList down_w, const Blocks& qkv_q,
                         const Blocks& o_q, const Blocks& gate_up_q, const Blocks& down_q,
                         const at::Tensor& final_norm, double eps, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim) {
  const auto layers = input_norms.size();
  TORCH_CHECK(layers >= 1 && kv_caches.size(0) == static_cast<int64_t>(layers) &&
              post_norms.size() == layers && qkv_w.size() == layers &&
              qkv_b.size() == layers && o_w.size() == layers && gate_up_w.size() == layers &&
              down_w.size() == layers && qkv_q.size() == layers && o_q.size() == layers &&
              gate_up_q.size() == layers && down_q.size() == layers,
              "decode_layers: one weight of each kind per layer");
  const DecodeModel model{input_norms, post_norms, qkv_w, qkv_b, o_w, gate_up_w, down_w,
                          qkv_q, o_q, gate_up_q, down_q, final_norm, eps, num_heads,
                          num_kv_heads, head_dim};
  const DecodeRows rows{x, positions, slot_mapping, block_tables, context_lens};
  const auto starts = decode_shares(rows, kv_caches, num_kv_heads * head_dim, qkv_w[0]);
  const int64_t parts = static_cast<int64_t>(starts.size()) - 1;
  if (parts == 1) return decode_rows(rows, cos_sin, kv_caches, model);
  std::vector<at::Tensor> out(parts);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      out[p] = decode_rows(rows.narrow(starts[p], starts[p + 1] - starts[p]), cos_sin,
                           kv_caches, model);
  });
  return at::cat(out);
}

}  // namespace

TORCH_LIBRARY(conveyor, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor w, float eps) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor positions, Tensor cos_sin, int num_heads, int head_dim) -> ()");
  m.def("write_kv_(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("read_kv_(Tensor(a!) k, Tensor(b!) v, Tensor kv_cache, Tensor slot_mapping) -> ()");
  m.def("decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor context_lens, "
        "float scale) -> Tensor");
  m.def("write_decode_attention_(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor q, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
  m.def("argmax(Tensor logits) -> Tensor");
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.def("linear(Tensor x, Tensor packed, Tensor? blocks, Tensor? bias) -> Tensor", &linear);
  // For every backend: its weights are oneDNN-packed (MkldnnCPU), pair tiles (dot_linear) or
  // lane tiles (f32_linear), with GGUF block records beside them where the backend reads them.
  m.def("decode_layers(Tensor(a!) x, Tensor positions, Tensor cos_sin, Tensor(b!) kv_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, Tensor[] input_norms, "
        "Tensor[] post_norms, Tensor[] qkv_w, Tensor?[] qkv_b, Tensor[] o_w, Tensor[] gate_up_w, "
        "Tensor[] down_w, Tensor?[] qkv_q, Tensor?[] o_q, Tensor?[] gate_up_q, Tensor?[] down_q, "
        "Tensor final_norm, float eps, int num_heads, int num_kv_heads, "
        "int head_dim) -> Tensor",
        &decode_layers);
  // Where decode_layers cuts a batch into shares of requests run side by side (tests).
  m.def("decode_shares(Tensor x, Tensor block_tables, Tensor context_lens, Tensor kv_caches, "
        "int kv_size, Tensor packed) -> int[]", &decode_shares_of);
}

TORCH_LIBRARY_IMPL(conveyor, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_", &rotary_);
  m.impl("write_kv_", &write_kv_);
  m.impl("read_kv_", &read_kv_);
  m.impl("decode_attention", &decode_attention);
  m.impl("write_decode_attention_", &write_decode_attention_);
  m.impl("argmax", &argmax);
  m.impl("apply_token_bitmask_", &apply_token_bitmask_);
}
