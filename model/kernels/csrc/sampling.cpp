// What a sampler needs of a step's logits in one pass per row: each row's first largest value's index (the greedy
// choice, as torch's argmax picks it) and its log-sum-exp (a token's log-probability is its logit minus that).
// torch's argmax and log_softmax took ~2 ms of a 32-row step of GPT-2 small on one thread.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

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

// --- one draw per sampled row -------------------------------------------------------------------------------------
// model/sampler.py's steps 8-12 for rows of logits after steps 1-6, without sorting a row: temperature, top-k (the
// k-th largest found among the values that beat a rising threshold), top-p (the boundary found among the likely
// ids, else in a histogram of the probabilities' bits, and only the ids at the boundary sorted), min-p, then the
// draw: the first id whose cumulative weight reaches (1 - u) of the row's total, in double, located through the
// sums of blocks of ids. Weights are e^(s - max), unnormalised: what softmax divides by the total, the same
// decisions up to float rounding. torch's sort alone took 3.1 ms of a 50,304-id row on one core (Zen 5).
namespace {

constexpr int64_t BLOCK = 256;          // ids per block sum of the draw
constexpr float LIKELY = 1.f / 1024;    // top-p looks first among the ids of more than this weight (the largest: 1),
constexpr size_t MAX_LIKELY = 4096;     // when there are at most this many
constexpr int HIST_SHIFT = 19;          // top-p's histogram: a bin per exponent and 4 mantissa bits (1/16 octave)
constexpr int64_t HIST_BINS = (0x3F800000 >> HIST_SHIFT) + 1;  // weights are at most 1.0f

struct Scratch {
  std::vector<float> w;                           // the row's s, then its weights
  std::vector<float> best;                        // top-k's candidates
  std::vector<std::pair<float, int32_t>> ranked;  // top-p's ids at the boundary: (weight, id)
  std::vector<double> mass, blocks;               // top-p's histogram; the draw's block sums
};

// the k-th largest of n values (0 < k < n; -inf when fewer than k are finite): every value above a threshold is a
// candidate, and when there are many the threshold rises to the k-th largest candidate (the rest dropped), so that
// a row is mostly compared a vector at a time against it
float kth_largest(const float* s, int64_t n, int64_t k, std::vector<float>& best) {
  best.clear();
  float floor = -INFINITY;
  const size_t cap = size_t(std::max<int64_t>(4 * k, 1024));
  auto tighten = [&] {
    std::nth_element(best.begin(), best.begin() + (k - 1), best.end(), std::greater<float>());
    floor = best[k - 1];
    best.resize(size_t(k));  // the k largest: the k-th is the floor, none of the rest above it is needed
  };
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    if (!vany_greater(vload(s + i), vbroadcast(floor))) continue;
    for (int64_t j = i; j < i + LANES; j++)
      if (s[j] > floor) best.push_back(s[j]);
    if (best.size() >= cap) tighten();
  }
  for (; i < n; i++)
    if (s[i] > floor) best.push_back(s[i]);
  if (int64_t(best.size()) < k) return -INFINITY;
  std::nth_element(best.begin(), best.begin() + (k - 1), best.end(), std::greater<float>());
  return best[k - 1];
}

// top-p on weights w (the largest 1, dropped ids 0) of total `total`: the smallest weight kept, after zeroing the
// ids of that weight that come after the last one kept (ties are ranked by id, as a stable sort ranks them). An id
// is dropped when the weight strictly before it, in that ranking, reaches p of the total; the first never is.
float top_p_floor(float* w, int64_t n, double total, double p, Scratch& sc) {
  const double reach = p * total;
  auto& ranked = sc.ranked;
  ranked.clear();
  double before = 0;  // the weight of every id ranked above those in `ranked`
  double likely = 0;
  // the likely ids, where a trained model's mass mostly is: enough of them ranked, if they are few
  for (int64_t i = 0; i < n && ranked.size() <= MAX_LIKELY; i += LANES) {
    const int64_t m = std::min<int64_t>(LANES, n - i);
    if (m == LANES && !vany_greater(vload(w + i), vbroadcast(LIKELY))) continue;
    for (int64_t j = i; j < i + m; j++)
      if (w[j] > LIKELY) ranked.emplace_back(w[j], int32_t(j)), likely += w[j];
  }
  if (likely < reach || ranked.size() > MAX_LIKELY) {  // a flat row: the boundary's bin of weights, and its ids
    ranked.clear();
    auto& mass = sc.mass;
    mass.assign(size_t(HIST_BINS), 0.0);
    for (int64_t i = 0; i < n; i++) {
      uint32_t bits;
      std::memcpy(&bits, w + i, 4);
      mass[std::min<size_t>(bits >> HIST_SHIFT, HIST_BINS - 1)] += w[i];
    }
    int64_t bin = HIST_BINS - 1;
    for (; bin > 0 && before + mass[size_t(bin)] < reach; bin--) before += mass[size_t(bin)];
    for (int64_t i = 0; i < n; i++) {
      uint32_t bits;
      std::memcpy(&bits, w + i, 4);
      if (std::min<int64_t>(bits >> HIST_SHIFT, HIST_BINS - 1) == bin && w[i] > 0) ranked.emplace_back(w[i], int32_t(i));
    }
  }
  if (ranked.empty()) return std::numeric_limits<float>::denorm_min();  // the sums' rounding: p of it is all
  std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  size_t kept = 1;  // the first ranked is kept: the row's largest, or ranked below less than p of the total
  for (before += ranked[0].first; kept < ranked.size() && before < reach; kept++) before += ranked[kept].first;
  const auto [floor, last] = ranked[kept - 1];
  if (kept < ranked.size() && ranked[kept].first == floor)  // a tie across the boundary: the later ids go
    for (int64_t i = last + 1; i < n; i++)
      if (w[i] == floor) w[i] = 0;
  return floor;
}

// the sums of the weights of at least `floor` in each BLOCK of ids, into `blocks`; their total
double block_sums(const float* w, int64_t n, float floor, std::vector<double>& blocks) {
  blocks.assign(size_t((n + BLOCK - 1) / BLOCK), 0.0);
  const Vec lo = vbroadcast(floor);
  double total = 0;
  for (int64_t b = 0; b * BLOCK < n; b++) {
    const int64_t end = std::min(n, (b + 1) * BLOCK);
    Vec acc = vzero();
    int64_t i = b * BLOCK;
    for (; i + LANES <= end; i += LANES) {
      const Vec v = vload(w + i);
      acc = vadd(acc, vkeep(v, v, lo));
    }
    double sum = vsum(acc);
    for (; i < end; i++) sum += w[i] >= floor ? w[i] : 0.f;
    blocks[size_t(b)] = sum;
    total += sum;
  }
  return total;
}

int64_t sample_one(const float* x, int64_t n, float temperature, int64_t top_k, double top_p, float min_p,
                   double u, Scratch& sc) {
  const float top = first_max(x, n).second;
  bool nan = false;
  for (int64_t i = 0; i + LANES <= n; i += LANES) nan |= vany_nan(vload(x + i));
  for (int64_t i = n - n % LANES; i < n; i++) nan |= std::isnan(x[i]);
  // no distribution: the last id (the sampler fails a row whose own logits hold a NaN or an infinity by that id's
  // log-probability; a row whose every id a constraint bans, the engine fails before it samples)
  if (nan || !std::isfinite(top)) return n - 1;
  sc.w.resize(size_t(n));
  float* w = sc.w.data();
  // s = (x - max) / temperature, as the sampler's torch path computes it (top-k compares these)
  const Vec shift = vbroadcast(top), temp = vbroadcast(temperature);
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) vstore(w + i, vdiv(vsub(vload(x + i), shift), temp));
  for (; i < n; i++) w[i] = (x[i] - top) / temperature;
  const float kth = 0 < top_k && top_k < n ? kth_largest(w, n, top_k, sc.best) : -INFINITY;
  // weights e^s; 0 below the k-th and where e^s is below float's normal range (-inf: a banned id)
  const Vec below = vbroadcast(std::max(kth, -87.3f));
  for (i = 0; i + LANES <= n; i += LANES) {
    const Vec s = vload(w + i);
    vstore(w + i, vkeep(vexp(s), s, below));
  }
  if (i < n) {  // the last ids through vexp too: an id's weight must not depend on where it sits (ties stay ties)
    float tail[LANES];
    std::fill(tail, tail + LANES, -INFINITY);
    std::copy(w + i, w + n, tail);
    const Vec s = vload(tail);
    vstore(tail, vkeep(vexp(s), s, below));
    std::copy(tail, tail + (n - i), w + i);
  }
  // top-p, then min-p: the weights kept are those of at least `floor` (the largest, 1, always is)
  float floor = min_p > 0 ? min_p : std::numeric_limits<float>::denorm_min();
  if (top_p < 1) floor = std::max(floor, top_p_floor(w, n, block_sums(w, n, 0.f, sc.blocks), top_p, sc));
  // the draw: the block where the cumulative weight reaches (1 - u) of the total, then the id in it
  const double total = block_sums(w, n, floor, sc.blocks);
  const double reach = (1 - u) * total;
  double before = 0;
  int64_t b = 0;
  const int64_t nb = int64_t(sc.blocks.size());
  for (; b < nb - 1 && before + sc.blocks[size_t(b)] < reach; b++) before += sc.blocks[size_t(b)];
  int64_t last = -1;  // the last id kept so far: where the sums' rounding leaves the total short of `reach`
  for (i = b * BLOCK; i < n; i++) {
    if (w[i] < floor) continue;
    last = i;
    before += w[i];
    if (before >= reach) return i;
  }
  return last >= 0 ? last : n - 1;
}

}  // namespace

void fill_disallowed(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& allowed) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "fill_disallowed: fp32 logits (rows, vocab), each row contiguous");
  const int64_t R = logits.size(0), V = logits.size(1), stride = logits.stride(0), n = rows.numel();
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "fill_disallowed: rows as int64 indices");
  TORCH_CHECK(allowed.dim() == 2 && allowed.size(0) == n && allowed.size(1) == V &&
                  allowed.scalar_type() == at::kBool && allowed.is_contiguous(),
              "fill_disallowed: allowed (len(rows), vocab) bool, contiguous");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; j++) TORCH_CHECK(0 <= r[j] && r[j] < R, "fill_disallowed: row ", r[j], " of ", R);
  float* x = logits.data_ptr<float>();
  const bool* ok = allowed.data_ptr<bool>();
  pool().run(n, std::max<int64_t>(1, 32768 / std::max<int64_t>(V, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; j++) {
      float* row = x + r[j] * stride;
      const bool* keep = ok + j * V;
      int64_t i = 0;
      for (; i + LANES <= V; i += LANES) vstore(row + i, vkeep_bytes(vload(row + i), keep + i, -INFINITY));
      for (; i < V; i++)
        if (!keep[i]) row[i] = -INFINITY;
    }
  });
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.size(1) > 0,
              "sample_rows: fp32 logits (rows, vocab), each row contiguous");
  const int64_t R = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  auto check = [R](const at::Tensor& t, at::ScalarType type, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == R && t.scalar_type() == type && t.is_contiguous(), "sample_rows: ",
                name, " needs one value per row, contiguous, of type ", type);
  };
  check(temperature, at::kFloat, "temperature");
  check(top_k, at::kLong, "top_k");
  check(top_p, at::kDouble, "top_p");
  check(min_p, at::kFloat, "min_p");
  check(uniform, at::kDouble, "uniform");
  TORCH_CHECK(V < (int64_t(1) << 31), "sample_rows: at most 2^31 - 1 ids");
  auto ids = at::empty({R}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float *tp = temperature.data_ptr<float>(), *mp = min_p.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const double *pp = top_p.data_ptr<double>(), *up = uniform.data_ptr<double>();
  int64_t* out = ids.data_ptr<int64_t>();
  pool().run(R, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch sc;
    for (int64_t r = begin; r < end; r++) out[r] = sample_one(x + r * stride, V, tp[r], kp[r], pp[r], mp[r], up[r], sc);
  });
  return ids;
}

}  // namespace folio
