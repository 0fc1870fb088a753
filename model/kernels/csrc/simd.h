// Small AVX2 helpers shared by the kernels.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace folio {

// the sum of a vector's eight lanes
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// 8 weights as floats: fp32 as they are, int8 widened (exactly)
static inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
static inline __m256 load8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

// y[m * O + r] = (sum_i x[m, i] * w[r, i]) * scale[r] + b[r] for r < R, m < MB (no scale or bias where nullptr);
// each weight row streamed once for all MB inputs; I % 8 == 0
template <int R, int MB, typename W>
static inline void dot_tile(const W* w, const float* x, float* y, const float* scale, const float* b, int64_t I,
                            int64_t O) {
  __m256 acc[R][MB];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) acc[r][m] = _mm256_setzero_ps();
  for (int64_t i = 0; i < I; i += 8) {
    __m256 xv[MB];
    for (int m = 0; m < MB; m++) xv[m] = _mm256_loadu_ps(x + m * I + i);
    for (int r = 0; r < R; r++) {
      __m256 wv = load8(w + r * I + i);
      for (int m = 0; m < MB; m++) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) {
      const float sum = scale ? hsum(acc[r][m]) * scale[r] : hsum(acc[r][m]);
      y[m * O + r] = sum + (b ? b[r] : 0.f);
    }
}

}  // namespace folio
