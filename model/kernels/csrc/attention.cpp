// A cached forward's attention in one call: every new token's key and value into the cache, then each token's
// query against its row's cached keys, for every (token, head): a decode step's tokens one at a time, a prompt
// chunk's in blocks. The cache holds fp32 or fp16 (KV, widened to fp32 in registers; the new keys and values are
// rounded to it as they are written, so every query reads them as stored).
#include <cmath>
#include <algorithm>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "simd.h"

namespace folio {

template <typename KV>
static inline float dot(const float* a, const KV* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8_ps(b + i), acc);
  return hsum(acc);
}

// (sum a, sum b, sum c, sum d) of four vectors of eight
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // per 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// q . k[r] for the four rows k[0..3] (row stride n, n % 8 == 0): four independent chains, not one; in Vec lanes
// where n is a multiple of them, else eight
template <typename KV>
static inline __m128 dot4(const float* q, const KV* k, int64_t n) {
  if (n % LANES == 0) {
    Vec a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n; i += LANES) {
      const Vec qv = vload(q + i);
      a0 = vfma(qv, vload(k + i), a0), a1 = vfma(qv, vload(k + n + i), a1);
      a2 = vfma(qv, vload(k + 2 * n + i), a2), a3 = vfma(qv, vload(k + 3 * n + i), a3);
    }
    return hsum4(vhalves(a0), vhalves(a1), vhalves(a2), vhalves(a3));
  }
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, load8_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(qv, load8_ps(k + n + i), a1);
    a2 = _mm256_fmadd_ps(qv, load8_ps(k + 2 * n + i), a2);
    a3 = _mm256_fmadd_ps(qv, load8_ps(k + 3 * n + i), a3);
  }
  return hsum4(a0, a1, a2, a3);
}

// each cache line of `bytes` bytes from p into the caches: a (token, head)'s keys are a few KB at an address of
// their own, too short a stream for the hardware's prefetchers, which left attention waiting on memory
template <typename T>
static inline void prefetch(const T* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
}

// Whether a (token, head) fetches the next one's keys and values a few rows at a time as it reads its own (fp16:
// int8 GPT-2's attention at 32 rows and position 48 2.7 -> 1.7 ms, the step 9.5 -> 9.1 ms), or all at its start
// (fp32: spreading them was 10% slower at short contexts, its rows are twice as long for the same arithmetic)
template <typename KV>
static constexpr bool SPREAD_PREFETCH = sizeof(KV) == 2;

// out (hs) = out * corr + sum_j p[j] v[j] over j < n (value rows of stride hs), up to four vectors of outputs
// at a time, each its own chain of FMAs (one chain waited on each FMA's latency); value row j of `next` (n_next
// rows) is prefetched with row j
template <typename V, typename KV>
static inline void weigh_values(const float* p, const KV* v, int64_t n, int64_t hs, float corr, float* out,
                                const KV* next = nullptr, int64_t n_next = 0) {
  constexpr int64_t G = 4 * V::lanes;
  for (int64_t d = 0; d < hs; d += G) {
    const int64_t vecs = std::min<int64_t>(G, hs - d) / V::lanes;
    auto o0 = V::mul(V::load(out + d), V::set(corr)), o1 = o0, o2 = o0, o3 = o0;
    if (vecs > 1) o1 = V::mul(V::load(out + d + V::lanes), V::set(corr));
    if (vecs > 2) o2 = V::mul(V::load(out + d + 2 * V::lanes), V::set(corr));
    if (vecs > 3) o3 = V::mul(V::load(out + d + 3 * V::lanes), V::set(corr));
    for (int64_t j = 0; j < n; j++) {
      if (d == 0 && j < n_next) prefetch(next + j * hs, hs * int64_t(sizeof(KV)));
      const auto pj = V::set(p[j]);
      const KV* r = v + j * hs + d;
      o0 = V::fma(pj, V::load(r), o0);
      if (vecs > 1) o1 = V::fma(pj, V::load(r + V::lanes), o1);
      if (vecs > 2) o2 = V::fma(pj, V::load(r + 2 * V::lanes), o2);
      if (vecs > 3) o3 = V::fma(pj, V::load(r + 3 * V::lanes), o3);
    }
    V::store(out + d, o0);
    if (vecs > 1) V::store(out + d + V::lanes, o1);
    if (vecs > 2) V::store(out + d + 2 * V::lanes, o2);
    if (vecs > 3) V::store(out + d + 3 * V::lanes, o3);
  }
}
struct Lanes8 {
  static constexpr int64_t lanes = 8;
  template <typename T>
  static __m256 load(const T* p) { return load8_ps(p); }
  static __m256 set(float v) { return _mm256_set1_ps(v); }
  static __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
  static __m256 fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
};
struct LanesVec {
  static constexpr int64_t lanes = LANES;
  template <typename T>
  static Vec load(const T* p) { return vload(p); }
  static Vec set(float v) { return vbroadcast(v); }
  static Vec mul(Vec a, Vec b) { return folio::vmul(a, b); }
  static Vec fma(Vec a, Vec b, Vec c) { return vfma(a, b, c); }
  static void store(float* p, Vec v) { vstore(p, v); }
};

// One query against the p + 1 cached keys and values of its row and head (kr, vr: (L, hs)), into out (hs);
// s holds at least p + 1 + LANES scores. Meanwhile the next (token, head)'s n_next keys and values (nk, nv) are
// fetched into L2 (SPREAD_PREFETCH).
template <typename KV>
static inline void attend(const float* q, const KV* kr, const KV* vr, int64_t p, int64_t hs, float scale,
                          float* s, float* out, const KV* nk, const KV* nv, int64_t n_next) {
  const int64_t n = p + 1, row = hs * int64_t(sizeof(KV));
  if constexpr (!SPREAD_PREFETCH<KV>) {
    prefetch(nk, n_next * row), prefetch(nv, n_next * row);
    n_next = 0;
  }
  // scores four keys at a time (a single dot product per key waits on its own chain of FMAs)
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    if (j < n_next) prefetch(nk + j * hs, std::min<int64_t>(4, n_next - j) * row);
    _mm_storeu_ps(s + j, _mm_mul_ps(dot4(q, kr + j * hs, hs), _mm_set1_ps(scale)));
  }
  if (j < n_next) prefetch(nk + j * hs, (n_next - j) * row);  // where the next one has more keys
  for (; j < n; j++) s[j] = dot(q, kr + j * hs, hs) * scale;
  Vec top = vbroadcast(-INFINITY);
  for (j = 0; j < n; j += LANES) top = vmax(top, vfirst(vload(s + j), n - j, -INFINITY));
  const Vec mx = vbroadcast(vmaxof(top));
  Vec sum = vzero();
  for (j = 0; j < n; j += LANES) {
    const Vec e = vfirst(vexp(vsub(vload(s + j), mx)), n - j);
    vstore(s + j, e);
    sum = vadd(sum, e);
  }
  std::fill(out, out + hs, 0.f);
  if (hs % LANES == 0) weigh_values<LanesVec>(s, vr, n, hs, 1.f, out, nv, n_next);
  else weigh_values<Lanes8>(s, vr, n, hs, 1.f, out, nv, n_next);
  if (n < n_next) prefetch(nv + n * hs, (n_next - n) * row);
  const float inv = 1.f / vsum(sum);
  for (int64_t d = 0; d < hs; d++) out[d] *= inv;
}

// A prompt chunk's attention: a run of T consecutive tokens of one row (positions p0..p0+T-1, their keys and values
// already in the cache) for one head, QB queries at a time against the row's keys in blocks of LANES: the scores
// of QB queries x LANES keys from the keys transposed once per run (kt: (blocks, hs, LANES)), an online softmax
// (each query's running maximum and sum), and the values weighted into each query's output (out: (QB, hs)).
// Per token what `attend` computes; for a long prompt about 5x faster than it or torch's SDPA (no key is read
// once per query, no masked block is computed).
static constexpr int QB = 8;

template <typename KV>
static void attend_run(const float* q, int64_t q_stride, const KV* kr, const KV* vr, int64_t p0, int64_t T,
                       int64_t hs, float scale, float* y, int64_t y_stride, std::vector<float>& kt,
                       std::vector<float>& out) {
  const int64_t keys = p0 + T, blocks = (keys + LANES - 1) / LANES;
  kt.assign(blocks * hs * LANES, 0.f);
  for (int64_t j = 0; j < keys; j++) {
    float* to = kt.data() + (j / LANES) * hs * LANES + j % LANES;
    for (int64_t d = 0; d < hs; d++) to[d * LANES] = to_float(kr[j * hs + d]);
  }
  out.resize(QB * hs);
  float p[LANES];
  for (int64_t t0 = 0; t0 < T; t0 += QB) {
    const int nq = static_cast<int>(std::min<int64_t>(QB, T - t0));
    const float* qs[QB];
    for (int i = 0; i < QB; i++) qs[i] = q + (t0 + std::min(i, nq - 1)) * q_stride;
    float m[QB], l[QB];
    std::fill(m, m + QB, -INFINITY);
    std::fill(l, l + QB, 0.f);
    std::fill(out.begin(), out.end(), 0.f);
    for (int64_t j0 = 0; j0 <= p0 + t0 + nq - 1; j0 += LANES) {
      const float* kb = kt.data() + (j0 / LANES) * hs * LANES;
      Vec s0 = vzero(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
      for (int64_t d = 0; d < hs; d++) {
        const Vec k = vload(kb + d * LANES);
        s0 = vfma(vset1(qs[0] + d), k, s0), s1 = vfma(vset1(qs[1] + d), k, s1);
        s2 = vfma(vset1(qs[2] + d), k, s2), s3 = vfma(vset1(qs[3] + d), k, s3);
        s4 = vfma(vset1(qs[4] + d), k, s4), s5 = vfma(vset1(qs[5] + d), k, s5);
        s6 = vfma(vset1(qs[6] + d), k, s6), s7 = vfma(vset1(qs[7] + d), k, s7);
      }
      const Vec s[QB] = {s0, s1, s2, s3, s4, s5, s6, s7};
      for (int i = 0; i < nq; i++) {
        const int64_t valid = std::min<int64_t>(LANES, p0 + t0 + i - j0 + 1);  // keys up to the query's position
        if (valid <= 0) continue;
        const Vec si = vfirst(vmul(s[i], vbroadcast(scale)), valid, -INFINITY);
        const float top = std::max(m[i], vmaxof(si));
        const float corr = top > m[i] ? std::exp(m[i] - top) : 1.f;  // the running sum and output rescaled
        m[i] = top;
        const Vec e = vfirst(vexp(vsub(si, vbroadcast(top))), valid);
        vstore(p, e);
        l[i] = l[i] * corr + vsum(e);
        if (hs % LANES == 0) weigh_values<LanesVec>(p, vr + j0 * hs, valid, hs, corr, out.data() + i * hs);
        else weigh_values<Lanes8>(p, vr + j0 * hs, valid, hs, corr, out.data() + i * hs);
      }
    }
    for (int i = 0; i < nq; i++)
      for (int64_t d = 0; d < hs; d++) y[(t0 + i) * y_stride + d] = out[i * hs + d] / l[i];
  }
}

// Attention for B new tokens at once, every (token, head) (declared in ops.h). A decode step has one token per
// row; a prompt chunk several, which see each other's keys causally through their positions.
template <typename KV>
void attention_into(const float* qp, int64_t B, int64_t n_head, int64_t hs, KV* kc, KV* vc, int64_t cache_rows,
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
      store_as(kc + slot, qp + b * 3 * C + C + h * hs, hs);
      store_as(vc + slot, qp + b * 3 * C + 2 * C + h * hs, hs);
    }
  // runs of at least QB consecutive tokens of one row (a prompt chunk) in blocks; every other token on its own
  std::vector<int64_t> alone, runs;  // runs: (first token, length) pairs
  for (int64_t b = 0, end; b < B; b = end) {
    for (end = b + 1; end < B && rp[end] == rp[b] && pp[end] == pp[end - 1] + 1;) end++;
    if (end - b >= QB) runs.insert(runs.end(), {b, end - b});
    else for (int64_t t = b; t < end; t++) alone.push_back(t);
  }
  const int64_t n_alone = alone.size();
  pool().run(n_alone * n_head, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> s(L + LANES);
    auto cached_at = [&](int64_t bh) { return (rp[alone[bh / n_head]] * n_head + bh % n_head) * L * hs; };
    for (int64_t bh = begin; bh < end; bh++) {
      const int64_t b = alone[bh / n_head], h = bh % n_head;
      const int64_t cached = cached_at(bh);  // this row and head: (L, hs)
      // the next (token, head)'s keys and values on their way while this one computes
      const bool more = bh + 1 < end;
      const int64_t next = more ? cached_at(bh + 1) : 0, n_next = more ? pp[alone[(bh + 1) / n_head]] + 1 : 0;
      attend(qp + b * 3 * C + h * hs, kc + cached, vc + cached, pp[b], hs, scale, s.data(), yp + b * C + h * hs,
             kc + next, vc + next, n_next);
    }
  });
  pool().run(int64_t(runs.size() / 2) * n_head, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt, out;
    for (int64_t rh = begin; rh < end; rh++) {
      const int64_t b = runs[2 * (rh / n_head)], T = runs[2 * (rh / n_head) + 1], h = rh % n_head;
      const int64_t cached = (rp[b] * n_head + h) * L * hs;
      attend_run(qp + b * 3 * C + h * hs, 3 * C, kc + cached, vc + cached, pp[b], T, hs, scale, yp + b * C + h * hs,
                 C, kt, out);
    }
  });
}

template void attention_into<float>(const float*, int64_t, int64_t, int64_t, float*, float*, int64_t, int64_t,
                                     const int64_t*, const int64_t*, float*);
template void attention_into<fp16>(const float*, int64_t, int64_t, int64_t, fp16*, fp16*, int64_t, int64_t,
                                    const int64_t*, const int64_t*, float*);

at::Tensor decode_attention(at::Tensor qkv, at::Tensor k_cache, at::Tensor v_cache, at::Tensor rows, at::Tensor pos,
                            int64_t n_head) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat, "attention: qkv");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && kv_cache_type(k_cache)
              && v_cache.scalar_type() == k_cache.scalar_type() && v_cache.sizes() == k_cache.sizes(),
              "attention: cache (fp32 or fp16)");
  const int64_t B = qkv.size(0), C = qkv.size(1) / 3, hs = C / n_head;
  TORCH_CHECK(k_cache.size(1) == n_head && k_cache.size(3) == hs, "attention: head size");
  auto rows_c = rows.to(at::kLong).contiguous();
  auto pos_c = pos.to(at::kLong).contiguous();
  TORCH_CHECK(rows_c.numel() == B && pos_c.numel() == B, "attention: a row and a position per token");
  auto y = at::empty({B, C}, qkv.options());
  with_kv_cache(k_cache, v_cache, [&](auto* kc, auto* vc) {
    attention_into(qkv.data_ptr<float>(), B, n_head, hs, kc, vc, k_cache.size(0), k_cache.size(2),
                   rows_c.data_ptr<int64_t>(), pos_c.data_ptr<int64_t>(), y.data_ptr<float>());
  });
  return y;
}

}  // namespace folio
