// A GPT-2 model's transformer blocks in one call from Python: a decode step of GPT-2 small then makes one call
// into C++ for its twelve blocks, where module and op calls from Python (each a few microseconds, ~15 per block)
// cost as much as a small model's whole products. The element-wise work between the products (layer norms,
// residual adds, GELU) is done here, split over the kernels' pool for many rows.
#include <algorithm>
#include <array>
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

// The LoRA groups of one forward, checked once against the stack's shapes: per group its rows, its scaling and its
// factors (A, B^T as float pointers, nullptr where the adapter leaves a product alone) per block and product
struct LoraRows {
  const int64_t* rows;
  int64_t n, r;
  float scaling;
  std::vector<std::array<const float*, 2>> factors;  // [4 * block + product] = {A, B^T}
};

static constexpr int64_t LORA_COLUMNS = 64;  // output columns per piece of the B^T pass (4 or 8 registers a row)

// Every group's low-rank add to product k (of all the blocks' products, in order): y[rows] += scaling * (x[rows] @
// A^T) @ B^T for each group's rows, x (B, I), y (B, O), A (r, I), B^T (r, O); t holds the groups' n x r values.
// Two passes over the pool whatever the number of groups: all n x r dot products, then the output columns in pieces
// of LORA_COLUMNS (a piece's B^T columns stay in L1 across the rows).
static void add_lora(const std::vector<LoraRows>& groups, size_t k, const float* x, int64_t I, float* y, int64_t O,
                     float* t) {
  std::vector<int64_t> start{0};  // group g's values are t[start[g]:start[g + 1]]
  for (const auto& g : groups) start.push_back(start.back() + (g.factors[k][0] ? g.n * g.r : 0));
  const int64_t total = start.back();
  if (total == 0) return;
  pool().run(total, std::max<int64_t>(1, 16384 / I), [&](int64_t begin, int64_t end) {
    size_t g = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    for (int64_t v = begin; v < end; v++) {
      while (v >= start[g + 1]) g++;
      const LoraRows& group = groups[g];
      const int64_t m = (v - start[g]) / group.r, j = (v - start[g]) % group.r;
      const float *xr = x + group.rows[m] * I, *a = group.factors[k][0] + j * I;
      Vec acc = vzero();
      int64_t i = 0;
      for (; i + LANES <= I; i += LANES) acc = vfma(vload(xr + i), vload(a + i), acc);
      float sum = vsum(acc);
      for (; i < I; i++) sum += xr[i] * a[i];
      t[v] = group.scaling * sum;
    }
  });
  const int64_t pieces = (O + LORA_COLUMNS - 1) / LORA_COLUMNS;
  pool().run(pieces, std::max<int64_t>(1, 16384 / (total * LORA_COLUMNS)), [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      const int64_t o0 = p * LORA_COLUMNS, width = std::min(LORA_COLUMNS, O - o0);
      for (size_t g = 0; g < groups.size(); g++) {
        const float* Bt = groups[g].factors[k][1];
        if (!Bt) continue;
        const int64_t r = groups[g].r;
        for (int64_t m = 0; m < groups[g].n; m++) {
          float* yr = y + groups[g].rows[m] * O + o0;
          const float* tm = t + start[g] + m * r;
          if (width == LORA_COLUMNS) {
            Vec acc[LORA_COLUMNS / LANES];
            for (auto& v : acc) v = vzero();
            for (int64_t j = 0; j < r; j++) {
              const Vec tj = vbroadcast(tm[j]);
              const float* b = Bt + j * O + o0;
              for (int64_t v = 0; v < LORA_COLUMNS / LANES; v++) acc[v] = vfma(tj, vload(b + v * LANES), acc[v]);
            }
            for (int64_t v = 0; v < LORA_COLUMNS / LANES; v++)
              vstore(yr + v * LANES, vadd(vload(yr + v * LANES), acc[v]));
          } else {
            for (int64_t j = 0; j < r; j++)
              for (int64_t o = 0; o < width; o++) yr[o] += tm[j] * Bt[j * O + o0 + o];
          }
        }
      }
    }
  });
}

// `lora` checked against B rows and the stack's blocks (shapes, types, rows in range and in one group at most)
static std::vector<LoraRows> lora_rows(const std::vector<LoraGroup>& lora, int64_t B,
                                       const std::vector<std::array<int64_t, 2>>& shapes) {
  std::vector<LoraRows> groups;
  std::vector<char> taken(B, 0);
  for (const auto& [rows, scaling, factors] : lora) {
    TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
                "stack: a LoRA group's rows, int64 (n)");
    TORCH_CHECK(factors.size() == 2 * shapes.size(), "stack: a LoRA group's factors, A and B^T per product");
    LoraRows g{rows.data_ptr<int64_t>(), rows.numel(), 0, static_cast<float>(scaling), {}};
    for (int64_t m = 0; m < g.n; m++) {
      TORCH_CHECK(g.rows[m] >= 0 && g.rows[m] < B && !taken[g.rows[m]], "stack: LoRA rows within the batch, each ",
                  "in one group at most; got row ", g.rows[m]);
      taken[g.rows[m]] = 1;
    }
    for (size_t k = 0; k < shapes.size(); k++) {
      const auto &A = factors[2 * k], &Bt = factors[2 * k + 1];
      TORCH_CHECK(A.has_value() == Bt.has_value(), "stack: a LoRA product's A and B^T, both or neither");
      if (!A) {
        g.factors.push_back({nullptr, nullptr});
        continue;
      }
      const int64_t r = A->dim() == 2 ? A->size(0) : 0;
      TORCH_CHECK(r > 0 && (g.r == 0 || r == g.r), "stack: one LoRA rank per group");
      g.r = r;
      check_floats(A, r * shapes[k][0], "stack: a LoRA A (r, I), fp32, contiguous");
      check_floats(Bt, r * shapes[k][1], "stack: a LoRA B^T (r, O), fp32, contiguous");
      TORCH_CHECK(A->size(1) == shapes[k][0] && Bt->dim() == 2 && Bt->size(1) == shapes[k][1],
                  "stack: a LoRA factor's shape against its product's");
      g.factors.push_back({A->data_ptr<float>(), Bt->data_ptr<float>()});
    }
    if (g.n && g.r) groups.push_back(std::move(g));
  }
  return groups;
}

at::Tensor Stack::forward(const at::Tensor& x_in, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& rows,
                          const at::Tensor& pos, const std::vector<LoraGroup>& lora) const {
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
  // the LoRA groups and their scratch (n x r values a group), only where the call has any: a base-only step
  // builds neither
  std::vector<LoraRows> groups;
  at::Tensor lora_scratch;
  if (!lora.empty()) {
    std::vector<std::array<int64_t, 2>> shapes;  // each block's products' (I, O), in order
    for (const auto& blk : blocks_)
      for (const auto& w : blk.products) shapes.push_back({w.I, w.O});
    groups = lora_rows(lora, B, shapes);
    int64_t values = 0;
    for (const auto& g : groups) values += g.n * g.r;
    if (!groups.empty()) lora_scratch = at::empty({values}, x_in.options());
  }
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
  // product k of block l: x (B, I) -> y (B, O), then each adapter's low-rank add for its rows
  auto product = [&](int64_t l, int k, const float* in, float* out) {
    const Weight& w = blocks_[l].products[k];
    product_into(w, in, B, out);
    if (!groups.empty()) add_lora(groups, 4 * l + k, in, w.I, out, w.O, lora_scratch.data_ptr<float>());
  };
  for (int64_t l = 0; l < layers; l++) {
    const Block& blk = blocks_[l];
    norm(blk.ln1_w, blk.ln1_b);
    product(l, 0, h, qkv);
    with_kv_cache(k_cache, v_cache, [&](auto* kc, auto* vc) {
      attention_into(qkv, B, n_head_, hs, kc + l * per_layer, vc + l * per_layer, cache_rows, L,
                     rows_c.data_ptr<int64_t>(), pos_c.data_ptr<int64_t>(), att);
    });
    product(l, 1, att, t);
    add(t);
    norm(blk.ln2_w, blk.ln2_b);
    product(l, 2, h, ff);
    by_rows(B, F, [&](int64_t r0, int64_t r1) { gelu(ff + r0 * F, (r1 - r0) * F); });
    product(l, 3, ff, t);
    add(t);
  }
  return x;
}

}  // namespace folio
