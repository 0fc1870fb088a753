// Activations rounded to integers for the integer products: `QuantizedRows` (linear.cpp's int8 and int16 rows,
// int4.cpp's groups of 32).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "pool.h"
#include "simd.h"

namespace folio {

// x (M, I) rounded per row to integers: scale max |x_m| / limit, each value round(x / scale) (to nearest even, as
// torch.round), stored as T plus `offset` (oneDNN takes int8 rows as uint8 + 128; with offset 0 a uint8 holds the
// int8's bits). A row holding a NaN or an infinity gets scale NaN and zeros, so that its products come out NaN. Rows
// are split over the pool from 8K values a task (a decode batch's 32 rows of 768 went to one thread, ~4% of an int8
// GPT-2 step).
template <typename T>
struct QuantizedRows {
  QuantizedRows(const float* x, int64_t M, int64_t I, float limit, int offset = 0, int64_t rows = 0)
      : values(std::max(M, rows) * I, T(offset)), scales(M) {
    pool().run(M, std::max<int64_t>(1, 8192 / I), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; m++)
        quantize_row(x + m * I, I, limit, offset, values.data() + m * I, scales[m]);
    });
  }
  static void quantize_row(const float* x, int64_t I, float limit, int offset, T* q, float& scale) {
    // |x|'s maximum in vector lanes; x * 0 is 0 unless x is a NaN or an infinity, so `probe` stays 0 for a finite row
    Vec top = vzero(), probe = vzero();
    const Vec zero = vzero();
    int64_t i = 0;
    for (; i + LANES <= I; i += LANES) {
      const Vec v = vload(x + i);
      top = vmax(top, vmax(v, vsub(zero, v)));
      probe = vadd(probe, vmul(v, zero));
    }
    float amax = vmaxof(top), tail = vsum(probe);
    for (; i < I; i++) {
      amax = std::max(amax, std::fabs(x[i]));
      tail += x[i] * 0.f;
    }
    if (tail != 0.f || !std::isfinite(amax)) {
      scale = std::numeric_limits<float>::quiet_NaN();
      std::fill(q, q + I, T(offset));
      return;
    }
    scale = amax > 0.f ? amax / limit : 1.f;
    // x / scale rounded half to even (vround: as nearbyint), in vector lanes: one at a time this loop took ~5% of an
    // int8 GPT-2 step at 32 rows
    const Vec divisor = vbroadcast(scale);
    i = 0;
    for (; i + LANES <= I; i += LANES) store_ints(q + i, vround(vdiv(vload(x + i), divisor)), offset);
    for (; i < I; i++) q[i] = T(int(std::nearbyint(x[i] / scale)) + offset);
  }
  // LANES whole numbers (within T's range once offset) as T
  static void store_ints(T* q, Vec v, int offset) {
#ifdef FOLIO_VEC512
    const __m512i n = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(offset));
    if constexpr (sizeof(T) == 1) _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(n));
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(n));
#else
    // to int16 with signed saturation (the values fit), then to bytes: unsigned where offset (1..255), else signed
    const __m256i n = _mm256_add_epi32(_mm256_cvtps_epi32(v), _mm256_set1_epi32(offset));
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
    if constexpr (sizeof(T) == 2) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), words);
    } else {
      const __m128i bytes = offset ? _mm_packus_epi16(words, words) : _mm_packs_epi16(words, words);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q), bytes);
    }
#endif
  }
  std::vector<T> values;
  std::vector<float> scales;
};

}  // namespace folio
