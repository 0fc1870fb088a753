// Weight-only int8 products for a few rows (a decode step's): w (O, I) int8 with one fp32 scale per output row,
// y[m, o] = scale[o] * sum_i x[m, i] * w[o, i] (+ b[o]). Each weight row is read once for all input rows, as 1
// byte per weight instead of 4: at batch 1 a decode step reads a quarter of the fp32 bytes. The int8 values are
// widened to fp32 in registers (exact), so the sum is the fp32 product with the dequantized weight.
#include "ops.h"
#include "pool.h"
#include "simd.h"

namespace folio {

template <int R>
static inline void rows8(const int8_t* w, const float* x, float* y, const float* s, const float* b, int64_t I,
                         int64_t O, int64_t M) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_tile<R, 4>(w, x + m * I, y + m * O, s, b, I, O);
  for (; m + 2 <= M; m += 2) dot_tile<R, 2>(w, x + m * I, y + m * O, s, b, I, O);
  if (m < M) dot_tile<R, 1>(w, x + m * I, y + m * O, s, b, I, O);
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const OptionalTensor& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && scale.numel() == w.size(0),
              "linear_int8: shapes");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scale.is_contiguous() && x.scalar_type() == at::kFloat
              && w.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat && w.size(1) % 8 == 0
              && x.size(0) <= MAX_ROWS, "linear_int8: fp32 x, int8 w, fp32 scales, contiguous, in % 8 == 0");
  const int64_t M = x.size(0), I = w.size(1), O = w.size(0);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == O && bias->scalar_type() == at::kFloat, "linear_int8: bias");
    bp = bias->data_ptr<float>();
  }
  auto y = at::empty({M, O}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* xp = x.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (O + 7) / 8;
  // a task is worth a thread from ~256 KiB of weights (see linear.cpp's grain_for)
  const int64_t grain = std::max<int64_t>(1, (int64_t(256) << 10) / (8 * I));
  pool().run(blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; blk++) {
      const int64_t o = blk * 8;
      if (O - o >= 8) {
        rows8<8>(wp + o * I, xp, yp + o, sp + o, bp ? bp + o : nullptr, I, O, M);
      } else {
        for (int64_t r = o; r < O; r++) rows8<1>(wp + r * I, xp, yp + r, sp + r, bp ? bp + r : nullptr, I, O, M);
      }
    }
  });
  return y;
}

}  // namespace folio
