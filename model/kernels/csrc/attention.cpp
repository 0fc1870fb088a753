// A decode step's attention in one call: every new token's key and value into the cache, then each token's
// query against its row's cached keys, for every (token, head).
#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "simd.h"

namespace folio {

static inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  return hsum(acc);
}

// (sum a, sum b, sum c, sum d) of four vectors of eight
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // per 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// q . k[r] for the four rows k[0..3] (row stride n, n % 8 == 0): four independent chains, not one
static inline __m128 dot4(const float* q, const float* k, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + n + i), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * n + i), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * n + i), a3);
  }
  return hsum4(a0, a1, a2, a3);
}

// out[0..8NV) = scale * sum_j s[j] v[j][0..8NV) over j < n (row stride hs): NV independent accumulators
template <int NV>
static inline void weighted_sum(const float* s, const float* v, int64_t n, int64_t hs, float* out, float scale) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t j = 0; j < n; j++) {
    const __m256 w = _mm256_set1_ps(s[j]);
    const float* r = v + j * hs;
    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r), a0);
    if constexpr (NV > 1) a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8), a1);
    if constexpr (NV > 2) a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 16), a2);
    if constexpr (NV > 3) a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 24), a3);
    if constexpr (NV > 4) a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 32), a4);
    if constexpr (NV > 5) a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 40), a5);
    if constexpr (NV > 6) a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 48), a6);
    if constexpr (NV > 7) a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 56), a7);
  }
  const __m256 f = _mm256_set1_ps(scale);
  const __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
  for (int k = 0; k < NV; k++) _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(acc[k], f));
}

// One query against the p + 1 cached keys and values of its row and head (kr, vr: (L, hs)), into out (hs);
// s holds at least p + 1 scores
static inline void attend(const float* q, const float* kr, const float* vr, int64_t p, int64_t hs, float scale,
                          float* s, float* out) {
  // scores four keys at a time (a single dot product per key waits on its own chain of FMAs)
  int64_t j = 0;
  for (; j + 4 <= p + 1; j += 4) _mm_storeu_ps(s + j, _mm_mul_ps(dot4(q, kr + j * hs, hs), _mm_set1_ps(scale)));
  for (; j <= p; j++) s[j] = dot(q, kr + j * hs, hs) * scale;
  float mx = -INFINITY;
  for (j = 0; j <= p; j++) mx = std::max(mx, s[j]);
  float sum = 0.f;
  for (j = 0; j <= p; j++) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  // the weighted sum of the values, up to 64 dimensions at a time in registers
  for (int64_t d = 0; d < hs; d += 64) {
    const float* v = vr + d;
    switch (std::min<int64_t>(8, (hs - d) / 8)) {
      case 8: weighted_sum<8>(s, v, p + 1, hs, out + d, 1.f / sum); break;
      case 7: weighted_sum<7>(s, v, p + 1, hs, out + d, 1.f / sum); break;
      case 6: weighted_sum<6>(s, v, p + 1, hs, out + d, 1.f / sum); break;
      case 5: weighted_sum<5>(s, v, p + 1, hs, out + d, 1.f / sum); break;
      case 4: weighted_sum<4>(s, v, p + 1, hs, out + d, 1.f / sum); break;
      case 3: weighted_sum<3>(s, v, p + 1, hs, out + d, 1.f / sum); break;
      case 2: weighted_sum<2>(s, v, p + 1, hs, out + d, 1.f / sum); break;
      default: weighted_sum<1>(s, v, p + 1, hs, out + d, 1.f / sum); break;
    }
  }
}

// Attention for B new tokens at once, every (token, head) (declared in ops.h). A decode step has one token per
// row; a prompt chunk several, which see each other's keys causally through their positions.
void attention_into(const float* qp, int64_t B, int64_t n_head, int64_t hs, float* kc, float* vc, int64_t cache_rows,
                    int64_t L, const int64_t* rp, const int64_t* pp, float* yp) {
  TORCH_CHECK(hs % 8 == 0, "attention: head size");
  for (int64_t b = 0; b < B; b++)
    TORCH_CHECK(rp[b] >= 0 && rp[b] < cache_rows && pp[b] >= 0 && pp[b] < L, "attention: row or position");
  const int64_t C = n_head * hs;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  int64_t longest = 0;
  for (int64_t b = 0; b < B; b++) longest = std::max(longest, pp[b] + 1);
  // about 4 flops per cached value read; a thread for every >= 1 MFLOP (see linear's grain)
  const int64_t grain = std::max<int64_t>(1, 250000 / (longest * hs));
  // the writes before any read: a token of a chunk may read the key of one before it in another thread's task
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < n_head; h++) {
      const int64_t slot = ((rp[b] * n_head + h) * L + pp[b]) * hs;
      std::memcpy(kc + slot, qp + b * 3 * C + C + h * hs, hs * sizeof(float));
      std::memcpy(vc + slot, qp + b * 3 * C + 2 * C + h * hs, hs * sizeof(float));
    }
  pool().run(B * n_head, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> s(L);
    for (int64_t bh = begin; bh < end; bh++) {
      const int64_t b = bh / n_head, h = bh % n_head;
      const int64_t cached = (rp[b] * n_head + h) * L * hs;  // this row and head: (L, hs)
      attend(qp + b * 3 * C + h * hs, kc + cached, vc + cached, pp[b], hs, scale, s.data(), yp + b * C + h * hs);
    }
  });
}

at::Tensor decode_attention(at::Tensor qkv, at::Tensor k_cache, at::Tensor v_cache, at::Tensor rows, at::Tensor pos,
                            int64_t n_head) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat, "attention: qkv");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous()
              && k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat
              && v_cache.sizes() == k_cache.sizes(), "attention: cache");
  const int64_t B = qkv.size(0), C = qkv.size(1) / 3, hs = C / n_head;
  TORCH_CHECK(k_cache.size(1) == n_head && k_cache.size(3) == hs, "attention: head size");
  auto rows_c = rows.to(at::kLong).contiguous();
  auto pos_c = pos.to(at::kLong).contiguous();
  TORCH_CHECK(rows_c.numel() == B && pos_c.numel() == B, "attention: a row and a position per token");
  auto y = at::empty({B, C}, qkv.options());
  attention_into(qkv.data_ptr<float>(), B, n_head, hs, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                 k_cache.size(0), k_cache.size(2), rows_c.data_ptr<int64_t>(), pos_c.data_ptr<int64_t>(),
                 y.data_ptr<float>());
  return y;
}

}  // namespace folio
