// The vector type the kernels compute with, chosen by the build variant: 16 fp32 lanes where the compiler may use
// AVX-512 (the "avx512" variant), else 8 (AVX2). Every kernel is written once against these helpers. Weights come
// as fp32, int8 (with a scale per output row) or bf16 (raw bits); each is widened to fp32 in registers, exactly,
// so a product is the fp32 product with the weight as stored; except that int8 weights meet rows rounded to
// integers where the build multiplies integers: int8 rows in the AVX2 builds, int16 ones in avx512vnni (below).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace folio {

// the sum of an 8-lane vector's lanes (attention works in 8 lanes: head sizes are multiples of 8)
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// a bfloat16's bits: the upper half of an fp32
using bf16 = uint16_t;

// an IEEE half's bits (fp16: 5 exponent bits, 10 of mantissa): a KV cache stored in half precision, widened to fp32
// in registers by F16C's conversions
struct fp16 {
  uint16_t bits;
};
// the largest finite fp16: values beyond are stored as it (saturated), not as infinities
static constexpr float FP16_MAX = 65504.f;

// 8 values as fp32: the 8-lane loads of attention's head-size loops
static inline __m256 load8_ps(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_ps(const fp16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline float to_float(float v) { return v; }
static inline float to_float(fp16 v) { return _cvtsh_ss(v.bits); }

// n values (n % 8 == 0) stored as T: fp16 rounded to nearest even and saturated at +-FP16_MAX (NaN stays NaN; min
// and max return their second operand for a NaN), which is torch's x.clamp(-65504, 65504).half()
static inline void store_as(float* to, const float* from, int64_t n) { std::copy(from, from + n, to); }
static inline void store_as(fp16* to, const float* from, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(from + i);
    const __m256 sat = _mm256_max_ps(_mm256_set1_ps(-FP16_MAX), _mm256_min_ps(_mm256_set1_ps(FP16_MAX), v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i), _mm256_cvtps_ph(sat, _MM_FROUND_TO_NEAREST_INT));
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FOLIO_VEC512 1
using Vec = __m512;
static constexpr int LANES = 16;
static inline Vec vzero() { return _mm512_setzero_ps(); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
static inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
static inline Vec vset1(const float* p) { return _mm512_set1_ps(*p); }
static inline Vec vbroadcast(float v) { return _mm512_set1_ps(v); }
static inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
static inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
static inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }
static inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
static inline float vmaxof(Vec v) { return _mm512_reduce_max_ps(v); }
static inline bool vany_greater(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0; }
static inline bool vany_nan(Vec v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
// the lanes of v whose key is at least lo; the others (a NaN key's too) 0
static inline Vec vkeep(Vec v, Vec key, Vec lo) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(key, lo, _CMP_GE_OQ), v); }
// the lanes of v whose byte at `keep` (LANES of them) is nonzero; `fill` in the others
static inline Vec vkeep_bytes(Vec v, const bool* keep, float fill) {
  const __mmask16 k = _mm_test_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(keep)), _mm_set1_epi8(-1));
  return _mm512_mask_mov_ps(_mm512_set1_ps(fill), k, v);
}
static inline __m256 vhalves(Vec v) {  // the sum of v's two 8-lane halves
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
static inline Vec vround(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline Vec vtimes_pow2(Vec v, Vec n) { return _mm512_scalef_ps(v, n); }  // v * 2^n, n integral
// lanes j < n of v, the others `fill` (n may exceed the lanes)
static inline Vec vfirst(Vec v, int64_t n, float fill = 0.f) {
  return n >= 16 ? v : _mm512_mask_mov_ps(_mm512_set1_ps(fill), __mmask16((1u << n) - 1), v);
}
static inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
static inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
static inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline Vec vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline Vec vload(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline Vec vload(const fp16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// the first 8 lanes from p, the others zero: the end of a row whose length is a multiple of 8 but not of 16
static inline Vec vload8(const float* p) { return _mm512_maskz_loadu_ps(0xFF, p); }
static inline Vec vload8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline Vec vload8(const bf16* p) {
  const __m256i half = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#else
using Vec = __m256;
static constexpr int LANES = 8;
static inline Vec vzero() { return _mm256_setzero_ps(); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
static inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
static inline Vec vset1(const float* p) { return _mm256_broadcast_ss(p); }
static inline Vec vbroadcast(float v) { return _mm256_set1_ps(v); }
static inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
static inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
static inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }
static inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
static inline float vmaxof(Vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline Vec vround(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline __m256 vhalves(Vec v) { return v; }
static inline bool vany_greater(Vec a, Vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0; }
static inline bool vany_nan(Vec v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
static inline Vec vkeep(Vec v, Vec key, Vec lo) { return _mm256_and_ps(v, _mm256_cmp_ps(key, lo, _CMP_GE_OQ)); }
static inline Vec vkeep_bytes(Vec v, const bool* keep, float fill) {
  const __m256i k = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(keep)));
  const __m256 dropped = _mm256_castsi256_ps(_mm256_cmpeq_epi32(k, _mm256_setzero_si256()));
  return _mm256_blendv_ps(v, _mm256_set1_ps(fill), dropped);
}
static inline Vec vtimes_pow2(Vec v, Vec n) {  // v * 2^n, n integral in [-126, 127]
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(v, _mm256_castsi256_ps(bits));
}
static inline Vec vfirst(Vec v, int64_t n, float fill = 0.f) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lane));
  return _mm256_blendv_ps(_mm256_set1_ps(fill), v, keep);
}
static inline float vsum(Vec v) { return hsum(v); }
static inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
static inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline Vec vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline Vec vload(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline Vec vload(const fp16* p) { return load8_ps(p); }
template <typename W>
static inline Vec vload8(const W* p) { return vload(p); }
#endif

// e^x in every lane, within ~2 ulp: x = n ln2 + r with |r| <= ln2 / 2, Cephes' polynomial for e^r, times 2^n.
// x is clamped to [-87.3, 88.3] (e^x from ~1e-38 to ~2e38): callers zero what must be zero.
static inline Vec vexp(Vec x) {
  x = vmin(vmax(x, vbroadcast(-87.3f)), vbroadcast(88.3f));
  const Vec n = vround(vmul(x, vbroadcast(1.44269504089f)));
  Vec r = vsub(x, vmul(n, vbroadcast(0.693359375f)));
  r = vsub(r, vmul(n, vbroadcast(-2.12194440e-4f)));
  Vec p = vbroadcast(1.9875691500e-4f);
  p = vfma(p, r, vbroadcast(1.3981999507e-3f));
  p = vfma(p, r, vbroadcast(8.3334519073e-3f));
  p = vfma(p, r, vbroadcast(4.1665795894e-2f));
  p = vfma(p, r, vbroadcast(1.6666665459e-1f));
  p = vfma(p, r, vbroadcast(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vbroadcast(1.f)));
  return vtimes_pow2(p, n);
}

// GPT-2's GELU (tanh form), 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), as x / (1 + e^(-2u))
static inline Vec vgelu(Vec x) {
  const Vec u = vmul(vbroadcast(0.7978845608f), vfma(vmul(vbroadcast(0.044715f), vmul(x, x)), x, x));
  return vdiv(x, vadd(vbroadcast(1.f), vexp(vmul(vbroadcast(-2.f), u))));
}

// y[m * O + r] = (sum_i x[m, i] * w[r, i]) * scale[r] + b[r] for r < R, m < MB (no scale or bias where nullptr);
// each weight row streamed once for all MB inputs; I % 8 == 0
template <int R, int MB, typename W>
static inline void dot_tile(const W* w, const float* x, float* y, const float* scale, const float* b, int64_t I,
                            int64_t O) {
  Vec acc[R][MB];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) acc[r][m] = vzero();
  int64_t i = 0;
  for (; i + LANES <= I; i += LANES) {
    Vec xv[MB];
    for (int m = 0; m < MB; m++) xv[m] = vload(x + m * I + i);
    for (int r = 0; r < R; r++) {
      const Vec wv = vload(w + r * I + i);
      for (int m = 0; m < MB; m++) acc[r][m] = vfma(wv, xv[m], acc[r][m]);
    }
  }
  if constexpr (LANES > 8) {
    if (i < I) {  // the last 8 of a row
      Vec xv[MB];
      for (int m = 0; m < MB; m++) xv[m] = vload8(x + m * I + i);
      for (int r = 0; r < R; r++) {
        const Vec wv = vload8(w + r * I + i);
        for (int m = 0; m < MB; m++) acc[r][m] = vfma(wv, xv[m], acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) {
      const float sum = scale ? vsum(acc[r][m]) * scale[r] : vsum(acc[r][m]);
      y[m * O + r] = sum + (b ? b[r] : 0.f);
    }
}

#ifndef FOLIO_VEC512
// The AVX2 builds multiply int8 weights with activations rounded to int8 (a scale per input row: W8A8, as llama.cpp's
// q8_0 on AVX2), 32 products to 8 int32 lanes in two or three instructions (sign_split), where widening to fp32
// takes three per 8 weights. Exact in int32 up to INT8_ROWS_MAX_WIDTH columns (65,536 products of at most 128 * 127).
// (Rows held as int16 in vpmaddwd, each weight widened once for all rows, measured no faster: 16.8 against 16.0 ms
// for int8 GPT-2's batch-1 products on one thread of a Xeon, alternated.)
#define FOLIO_INT8_ACTIVATIONS 1
static constexpr int64_t INT8_ROWS_MAX_WIDTH = 65536;

// acc + the products of u (unsigned bytes) and s (signed bytes), summed by fours into 8 int32 lanes: AVX-VNNI's
// vpdpbusd where the build has it (the avx2vnni variant), else vpmaddubsw (pairs into int16) and vpmaddwd (into
// int32). vpmaddubsw saturates a pair above 32,767: callers keep u <= 128 and |s| <= 127 there (sign_split), or have
// vpdpbusd.
static inline __m256i products_by_fours(__m256i acc, __m256i u, __m256i s) {
#ifdef __AVXVNNI__
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// acc + the products of signed bytes w and x (|x| <= 127) by fours: |w| (unsigned; 128 for -128) times x with its
// sign flipped where w is negative (zero where w is), so that no pair of products exceeds 2 * 128 * 127
static inline __m256i sign_split(__m256i acc, __m256i w, __m256i x) {
  return products_by_fours(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}

// the sum of 8 int32 lanes
static inline int32_t isum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

// as dot_tile, for int8 weights and int8 rows x with a scale per row (xs); I % 8 == 0, I <= INT8_ROWS_MAX_WIDTH
template <int R, int MB>
static inline void dot_tile_int(const int8_t* w, const int8_t* x, const float* xs, float* y, const float* scale,
                                const float* b, int64_t I, int64_t O) {
  __m256i acc[R][MB];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) acc[r][m] = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= I; i += 32) {
    __m256i xv[MB];
    for (int m = 0; m < MB; m++) xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * I + i));
    for (int r = 0; r < R; r++) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * I + i));
      for (int m = 0; m < MB; m++) acc[r][m] = sign_split(acc[r][m], wv, xv[m]);
    }
  }
  for (; i < I; i += 8) {  // the last 8, 16 or 24 columns, 8 at a time (the zeros above them add nothing)
    auto load8 = [](const int8_t* p) {
      return _mm256_zextsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    };
    __m256i xv[MB];
    for (int m = 0; m < MB; m++) xv[m] = load8(x + m * I + i);
    for (int r = 0; r < R; r++) {
      const __m256i wv = load8(w + r * I + i);
      for (int m = 0; m < MB; m++) acc[r][m] = sign_split(acc[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) y[m * O + r] = float(isum(acc[r][m])) * xs[m] * scale[r] + (b ? b[r] : 0.f);
}
#endif

#if defined(FOLIO_VEC512) && defined(__AVX512VNNI__)
// int8 weights against activations rounded to int16 (a scale per input row): VNNI's vpdpwssd multiplies 32 pairs
// and adds them into 16 int32 lanes in one instruction, where widening to fp32 takes three per 16 weights. Each
// lane is exact in int32 for rows of up to INT16_MAX_WIDTH (it adds two products of at most 127 * 32767 per 32
// columns); the 16 lanes are added up in fp32 (their int32 sum overflowed from 517 columns of the largest values).
#define FOLIO_INT16_ACTIVATIONS 1
static constexpr int64_t INT16_MAX_WIDTH = 8192;

// acc += the pairwise products of a and b (int16) summed into int32 lanes: vpdpwssd, written as asm because g++ 12
// copies the accumulator around the intrinsic (_mm512_dpwssd_epi32) in a loop, a register move per instruction
// and spills across a tile of 12 (measured: no faster than widening to fp32)
static inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

template <int R, int MB>
static inline void dot_tile_int(const int8_t* w, const int16_t* x, const float* xs, float* y, const float* scale,
                                const float* b, int64_t I, int64_t O) {
  __m512i acc[R][MB];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) acc[r][m] = _mm512_setzero_si512();
  // the body written out twice, for whole columns and the masked end, as in dot_tile: a lambda for it (capturing
  // the accumulators by reference) or one masked loop made g++ store every accumulator to memory each iteration
  int64_t i = 0;
  for (; i + 32 <= I; i += 32) {
    __m512i xv[MB];
    for (int m = 0; m < MB; m++) xv[m] = _mm512_loadu_si512(x + m * I + i);
    for (int r = 0; r < R; r++) {
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * I + i)));
      for (int m = 0; m < MB; m++) acc[r][m] = dpwssd(acc[r][m], wv, xv[m]);
    }
  }
  if (i < I) {
    const __mmask32 k = (__mmask32(1) << (I - i)) - 1;
    __m512i xv[MB];
    for (int m = 0; m < MB; m++) xv[m] = _mm512_maskz_loadu_epi16(k, x + m * I + i);
    for (int r = 0; r < R; r++) {
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(k, w + r * I + i));
      for (int m = 0; m < MB; m++) acc[r][m] = dpwssd(acc[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++)
      y[m * O + r] = _mm512_reduce_add_ps(_mm512_cvtepi32_ps(acc[r][m])) * xs[m] * scale[r] + (b ? b[r] : 0.f);
}
#endif

}  // namespace folio
