// What a sampler needs of a step's logits in one pass per row: each row's first largest value's index (the greedy
// choice, as torch's argmax picks it) and its log-sum-exp (a token's log-probability is its logit minus that).
// torch's argmax and log_softmax took ~2 ms of a 32-row step of GPT-2 small on one thread.
#include <cmath>
#include <tuple>

#include "ops.h"
#include "pool.h"
#include "simd.h"

namespace folio {

// the index of the first largest of n values, and that value: a vector of values is looked at one by one only
// when one of them beats the largest so far (a handful of times in a row of logits)
static std::pair<int64_t, float> first_max(const float* x, int64_t n) {
  int64_t best = 0, i = 0;
  float top = x[0];
  for (; i + LANES <= n; i += LANES) {
    if (!vany_greater(vload(x + i), vbroadcast(top))) continue;
    for (int64_t k = i; k < i + LANES; k++)
      if (x[k] > top) top = x[k], best = k;
  }
  for (; i < n; i++)
    if (x[i] > top) top = x[i], best = i;
  return {best, top};
}

std::tuple<at::Tensor, at::Tensor> row_argmax_logsumexp(const at::Tensor& logits) {
  // rows may be apart by more than their width: the usable ids of a padded vocabulary, a view (no copy)
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.size(1) > 0,
              "row_argmax_logsumexp: fp32 logits (rows, vocab), each row contiguous");
  const int64_t R = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  auto ids = at::empty({R}, logits.options().dtype(at::kLong));
  auto lse = at::empty({R}, logits.options());
  const float* x = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* lp = lse.data_ptr<float>();
  pool().run(R, std::max<int64_t>(1, 32768 / V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      const float* row = x + r * stride;
      const auto [best, top] = first_max(row, V);
      ip[r] = best;
      if (!std::isfinite(top)) {  // all -inf (or a +inf, a NaN): as torch's logsumexp
        lp[r] = top;
        continue;
      }
      Vec sum = vzero();
      const Vec shift = vbroadcast(top);
      bool nan = false;  // vexp clamps a NaN away: NaN is said as such (the caller then asks torch)
      int64_t i = 0;
      for (; i + LANES <= V; i += LANES) {
        const Vec v = vload(row + i);
        nan |= vany_nan(v);
        sum = vadd(sum, vexp(vsub(v, shift)));
      }
      float total = vsum(sum);
      for (; i < V; i++) total += std::exp(row[i] - top);
      lp[r] = nan ? NAN : top + std::log(total);
    }
  });
  return {ids, lse};
}

}  // namespace folio
