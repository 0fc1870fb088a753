// A GPT-2 model's transformer blocks in one call from Python: a decode step of GPT-2 small then makes one call
// into C++ for its twelve blocks, where module and op calls from Python (each a few microseconds, ~15 per block)
// cost as much as a small model's whole products. The element-wise work between the products (layer norms,
// residual adds, GELU) is done here, split over the kernels' pool for many rows.
#include <cmath>

#include "ops.h"
#include "pool.h"
#include "simd.h"

namespace folio {

// y = (x - mean) / sqrt(var + 1e-5) * w + b for each of B rows of C values (C % 8 == 0): torch's layer_norm
static void layer_norm(const float* x, int64_t B, int64_t C, const float* w, const float* b, float* y) {
  const float n = static_cast<float>(C);
  for (int64_t r = 0; r < B; r++) {
    const float* xr = x + r * C;
    float* yr = y + r * C;
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < C; i += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(xr + i));
    const __m256 mean = _mm256_set1_ps(hsum(sum) / n);
    __m256 squares = _mm256_setzero_ps();
    for (int64_t i = 0; i < C; i += 8) {
      const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(xr + i), mean);
      squares = _mm256_fmadd_ps(d, d, squares);
    }
    const __m256 rstd = _mm256_set1_ps(1.f / std::sqrt(hsum(squares) / n + 1e-5f));
    for (int64_t i = 0; i < C; i += 8) {
      const __m256 normed = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xr + i), mean), rstd);
      const __m256 shift = b ? _mm256_loadu_ps(b + i) : _mm256_setzero_ps();
      _mm256_storeu_ps(yr + i, _mm256_fmadd_ps(normed, _mm256_loadu_ps(w + i), shift));
    }
  }
}

Stack::Stack(const std::vector<std::vector<OptionalTensor>>& blocks, int64_t n_head) : n_head_(n_head), C_(0) {
  for (const auto& p : blocks) {
    TORCH_CHECK(p.size() == 20 && p[0] && p[2] && p[4] && p[8] && p[12] && p[16],
                "stack: each block's two layer norms (weight, bias) and four products (weight, bias, scale, packed)");
    Block block{*p[0], *p[2], p[1], p[3], {}};
    for (int k = 0; k < 4; k++) block.products.emplace_back(*p[4 + 4 * k], p[5 + 4 * k], p[7 + 4 * k], p[6 + 4 * k]);
    C_ = block.ln1_w.numel();
    const auto& qkv = block.products[0];
    TORCH_CHECK(qkv.I == C_ && qkv.O == 3 * C_ && block.products[1].I == C_ && block.products[1].O == C_
                && block.products[2].I == C_ && block.products[3].I == block.products[2].O
                && block.products[3].O == C_, "stack: a GPT-2 block's product shapes");
    TORCH_CHECK(n_head > 0 && C_ % n_head == 0 && C_ / n_head % 8 == 0, "stack: head size a multiple of 8");
    check_floats(block.ln1_w, C_, "stack: ln_1"), check_floats(block.ln1_b, C_, "stack: ln_1");
    check_floats(block.ln2_w, C_, "stack: ln_2"), check_floats(block.ln2_b, C_, "stack: ln_2");
    blocks_.push_back(std::move(block));
  }
}

// GELU (vgelu) in place on n values
static void gelu(float* v, int64_t n) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) vstore(v + i, vgelu(vload(v + i)));
  for (; i < n; i++) v[i] = 0.5f * v[i] * (1.f + std::tanh(0.7978845608f * (v[i] + 0.044715f * v[i] * v[i] * v[i])));
}

// fn(first row, end row) over B rows of `width` values, split over the pool from 16K values
template <typename F>
static void by_rows(int64_t B, int64_t width, F fn) {
  pool().run(B, std::max<int64_t>(1, 16384 / width), [&](int64_t begin, int64_t end) { fn(begin, end); });
}

at::Tensor Stack::forward(const at::Tensor& x_in, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& rows,
                          const at::Tensor& pos) const {
  const int64_t B = x_in.size(0), C = C_, hs = C / n_head_, layers = blocks_.size();
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == C && x_in.scalar_type() == at::kFloat, "stack: x (B, C) fp32");
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == layers && k_cache.size(2) == n_head_ && k_cache.size(4) == hs
              && k_cache.is_contiguous() && v_cache.is_contiguous() && kv_cache_type(k_cache)
              && v_cache.scalar_type() == k_cache.scalar_type() && v_cache.sizes() == k_cache.sizes(),
              "stack: caches (n_layer, rows, n_head, max_len, head_size), both fp32 or both fp16");
  auto rows_c = rows.to(at::kLong).contiguous();
  auto pos_c = pos.to(at::kLong).contiguous();
  TORCH_CHECK(rows_c.numel() == B && pos_c.numel() == B, "stack: a cache row and a position per token");
  // torch's products here (bf16 weights from 16 rows, prompts of more than MAX_ROWS) run on this thread alone and
  // are split over the pool (linear.cpp): an OpenMP team of their own would compete for the cores with this pool's
  // workers, which spin between jobs
  OneOpenMPThread serial(true);
  auto x = x_in.contiguous().clone();
  const int64_t F = layers ? blocks_[0].products[2].O : 0;  // the MLP's width
  auto scratch = at::empty({B * (6 * C + F)}, x.options());
  float *xp = x.data_ptr<float>(), *h = scratch.data_ptr<float>(), *qkv = h + B * C, *att = qkv + 3 * B * C;
  float *t = att + B * C, *ff = t + B * C;
  const int64_t cache_rows = k_cache.size(1), L = k_cache.size(3), per_layer = cache_rows * n_head_ * L * hs;
  auto norm = [&](const at::Tensor& w, const OptionalTensor& b) {
    by_rows(B, C, [&](int64_t r0, int64_t r1) {
      layer_norm(xp + r0 * C, r1 - r0, C, w.data_ptr<float>(), b ? b->data_ptr<float>() : nullptr, h + r0 * C);
    });
  };
  auto add = [&](const float* y) {
    by_rows(B, C, [&](int64_t r0, int64_t r1) { for (int64_t i = r0 * C; i < r1 * C; i++) xp[i] += y[i]; });
  };
  for (int64_t l = 0; l < layers; l++) {
    const Block& blk = blocks_[l];
    norm(blk.ln1_w, blk.ln1_b);
    product_into(blk.products[0], h, B, qkv);
    with_kv_cache(k_cache, v_cache, [&](auto* kc, auto* vc) {
      attention_into(qkv, B, n_head_, hs, kc + l * per_layer, vc + l * per_layer, cache_rows, L,
                     rows_c.data_ptr<int64_t>(), pos_c.data_ptr<int64_t>(), att);
    });
    product_into(blk.products[1], att, B, t);
    add(t);
    norm(blk.ln2_w, blk.ln2_b);
    product_into(blk.products[2], h, B, ff);
    by_rows(B, F, [&](int64_t r0, int64_t r1) { gelu(ff + r0 * F, (r1 - r0) * F); });
    product_into(blk.products[3], ff, B, t);
    add(t);
  }
  return x;
}

}  // namespace folio
