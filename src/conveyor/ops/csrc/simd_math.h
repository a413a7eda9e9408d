// Vector code shared by the kernels (cpu_ops.cpp, quant_linear.cpp, prefill_attention.cpp,
// vnni_blocks.cpp).
#pragma once

#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The kernels that multiply bf16 pairs with vdpbf16ps (dot_linear.cpp, and prefill attention
// without AMX) need AVX512-BF16 (with BW for the word shuffles).
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define CONVEYOR_AVX512BF16 1
#endif

// The int8-activation block matmuls (vnni_blocks.cpp) need AVX512-VNNI besides.
#if defined(CONVEYOR_AVX512BF16) && defined(__AVX512VNNI__)
#define CONVEYOR_VNNI 1
#endif

// The float32 kernels (f32_linear.cpp) need AVX2 with FMA, and F16C for the GGUF scales.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CONVEYOR_AVX2 1
#endif

namespace conveyor {

#ifdef __AVX512F__
// exp(x) = 2^n * p(r) with |r| <= ln2/2, |rel err| < 2e-7; x clamped to [-87.3, 88.7].
inline __m512 exp16(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

#endif

#ifdef CONVEYOR_AVX2
// exp16's polynomial on 8 lanes (for CPUs with AVX2 but no AVX-512); x clamped to [-87.3, 88].
inline __m256 exp8(__m256 x) {
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
  r = _mm256_fnmadd_ps(n, ln2_lo, r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^n (n in [-126, 127]) built in the exponent bits.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The sum of 8 lanes, in one fixed order.
inline float hsum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#endif

#ifdef __AVX512F__
// r[0..16) of 16 lanes each -> their transpose (lane j of r[i] moves to lane i of r[j]).
inline void transpose16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// rows [n][16 * pair_blocks] of 32-bit words (pairs of bf16; a row every `stride` words) ->
// for each 16-word block b and 16-row tile t, their transpose [16 words][16 rows] at
// out + (b * row_tiles + t) * 256; rows past n are zero. The second operand of an AMX bf16
// product is laid out this way (pairs of the inner dimension x 16 columns).
inline void transpose_pairs(uint32_t* out, const uint32_t* rows, int64_t n, int64_t stride,
                            int64_t pair_blocks, int64_t row_tiles) {
  const auto* words = reinterpret_cast<const float*>(rows);
  __m512 r[16];
  for (int64_t tt = 0; tt < row_tiles; ++tt)
    for (int64_t b = 0; b < pair_blocks; ++b) {
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t row = tt * 16 + j;
        r[j] = row < n ? _mm512_loadu_ps(words + row * stride + b * 16) : _mm512_setzero_ps();
      }
      transpose16x16(r);
      float* dst = reinterpret_cast<float*>(out) + (b * row_tiles + tt) * 256;
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_ps(dst + p * 16, r[p]);
    }
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// Asks for bytes [p, p + bytes) with the prefetch hint Hint (_MM_HINT_T0: into L1, T1: L2).
template <int Hint>
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    _mm_prefetch(static_cast<const char*>(p) + o, static_cast<_mm_hint>(Hint));
}
#endif

// Flushes denormal floats to zero on this thread while alive (MXCSR FTZ and DAZ): the tail of
// a peaked softmax underflows, and each denormal operand or result costs a microcode assist
// of ~100 cycles. Values below 1.2e-38 do not change an attention output.
struct FlushDenormals {
#if defined(__AVX512F__) || defined(CONVEYOR_AVX2)
  unsigned int saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

}  // namespace conveyor
