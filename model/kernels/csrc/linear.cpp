// Matrix products for a few rows (a decode step's), streaming each weight row once for all input rows: dot
// products from the weight as it is, or outer products from a copy packed in panels of 16 outputs.
#include <cstring>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "simd.h"

namespace folio {

// y[m, o + r] = sum_i x[m, i] * w[o + r, i] (+ b[o + r]) for r < R, m < MB; I % 8 == 0
template <int R, int MB>
static inline void tile(const float* w, const float* x, float* y, const float* b, int64_t I, int64_t O) {
  dot_tile<R, MB>(w, x, y, nullptr, b, I, O);
}

// rows o..o+R-1 of w for all M inputs, three at a time (12 accumulators: enough independent FMAs in flight)
template <int R>
static inline void rows(const float* w, const float* x, float* y, const float* b, int64_t I, int64_t O, int64_t M) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile<R, 3>(w, x + m * I, y + m * O, b, I, O);
  if (M - m == 2) tile<R, 2>(w, x + m * I, y + m * O, b, I, O);
  if (M - m == 1) tile<R, 1>(w, x + m * I, y + m * O, b, I, O);
}

template <int R>
static inline void one_row(const float* w, const float* x, float* y, const float* b, int64_t I) {
  tile<R, 1>(w, x, y, b, I, 0);
}

// the bias's data (nullptr without one), checked against O outputs
static const float* bias_data(const OptionalTensor& bias, int64_t O) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->is_contiguous() && bias->numel() == O && bias->scalar_type() == at::kFloat, "linear: bias");
  return bias->data_ptr<float>();
}

// Tasks per thread for tasks that each read `bytes` of weights and do `flops`: a task is worth a thread when it
// reads >= 512 KiB or does >= 2 MFLOP (waking a sleeping thread costs tens of microseconds, more than the whole
// product for the small layers of a small model)
static int64_t grain_for(int64_t bytes, int64_t flops) {
  return std::max<int64_t>(1, std::min((int64_t(512) << 10) / bytes, int64_t(2000000) / flops));
}

// x (M, I), w (O, I), b (O) or none -> (M, O); fp32, contiguous, I % 8 == 0
static at::Tensor small_linear(at::Tensor x, at::Tensor w, OptionalTensor bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: shapes");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == at::kFloat
              && w.scalar_type() == at::kFloat && w.size(1) % 8 == 0, "linear: fp32 contiguous, in % 8 == 0");
  const int64_t M = x.size(0), I = w.size(1), O = w.size(0);
  auto y = at::empty({M, O}, x.options());
  const float* wp = w.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* bp = bias_data(bias, O);
  auto grain = [&](int64_t rows_per_block) { return grain_for(rows_per_block * I * 4, 2 * rows_per_block * I * M); };
  if (M == 1) {  // decoding one row: 8 weight rows per tile (more streams in flight reads closer to bandwidth)
    const int64_t blocks = (O + 7) / 8;
    pool().run(blocks, grain(8), [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; blk++) {
        const int64_t o = blk * 8;
        const float* bo = bp ? bp + o : nullptr;
        if (O - o >= 8) {
          one_row<8>(wp + o * I, xp, yp + o, bo, I);
        } else {
          for (int64_t r = o; r < O; r++) one_row<1>(wp + r * I, xp, yp + r, bp ? bp + r : nullptr, I);
        }
      }
    });
    return y;
  }
  const int64_t blocks = (O + 3) / 4;
  pool().run(blocks, grain(4), [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; blk++) {
      const int64_t o = blk * 4;
      const float* bo = bp ? bp + o : nullptr;
      switch (std::min<int64_t>(4, O - o)) {
        case 4: rows<4>(wp + o * I, xp, yp + o, bo, I, O, M); break;
        case 3: rows<3>(wp + o * I, xp, yp + o, bo, I, O, M); break;
        case 2: rows<2>(wp + o * I, xp, yp + o, bo, I, O, M); break;
        default: rows<1>(wp + o * I, xp, yp + o, bo, I, O, M); break;
      }
    }
  });
  return y;
}

// The packed layout, for PACKED_MIN_ROWS..MAX_ROWS rows. The dot products above reduce each output across a
// vector at the end and read every input row once per four weight rows; with the weights packed as panels of 16
// outputs, wp[panel][i][16], a tile instead keeps 6 input rows x 16 outputs in 12 accumulators, broadcasting one
// input value against two weight vectors, with no reductions (bench/results/kernels.md has the figures). Below
// PACKED_MIN_ROWS rows the dot products are as fast (one row: faster, eight weight rows in flight).

// w (O, I) -> (ceil(O / 16), I, 16), the last panel zero-padded
at::Tensor pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack: a 2-D fp32 weight");
  w = w.contiguous();
  const int64_t O = w.size(0), I = w.size(1), P = (O + PANEL - 1) / PANEL;
  auto out = at::zeros({P, I, PANEL}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++)
      for (int64_t r = 0; r < PANEL && p * PANEL + r < O; r++)
        for (int64_t i = 0; i < I; i++) dst[(p * I + i) * PANEL + r] = src[(p * PANEL + r) * I + i];
  });
  return out;
}

// y[m, 0..15] = x[m] . panel (+ b) for MR <= 6 input rows, written to y (row stride ys)
template <int MR>
static inline void panel_tile(const float* __restrict wp, const float* __restrict x, float* __restrict y,
                              const float* b, int64_t I, int64_t ys) {
  // named accumulators, not an array: g++ keeps an array of vectors in memory across the loop
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
         a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  // input row r's value times both weight vectors, into row r's two accumulators
#define FOLIO_PANEL_ROW(r)                            \
  v = _mm256_broadcast_ss(x + (r) * I + i);           \
  a##r##0 = _mm256_fmadd_ps(w0, v, a##r##0);          \
  a##r##1 = _mm256_fmadd_ps(w1, v, a##r##1);
  for (int64_t i = 0; i < I; i++) {
    const __m256 w0 = _mm256_loadu_ps(wp + i * PANEL), w1 = _mm256_loadu_ps(wp + i * PANEL + 8);
    __m256 v;
    FOLIO_PANEL_ROW(0)
    if constexpr (MR > 1) { FOLIO_PANEL_ROW(1) }
    if constexpr (MR > 2) { FOLIO_PANEL_ROW(2) }
    if constexpr (MR > 3) { FOLIO_PANEL_ROW(3) }
    if constexpr (MR > 4) { FOLIO_PANEL_ROW(4) }
    if constexpr (MR > 5) { FOLIO_PANEL_ROW(5) }
  }
#undef FOLIO_PANEL_ROW
  const __m256 zero = _mm256_setzero_ps(), b0 = b ? _mm256_loadu_ps(b) : zero, b1 = b ? _mm256_loadu_ps(b + 8) : zero;
  const __m256 acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int m = 0; m < MR; m++) {
    _mm256_storeu_ps(y + m * ys, _mm256_add_ps(acc[m][0], b0));
    _mm256_storeu_ps(y + m * ys + 8, _mm256_add_ps(acc[m][1], b1));
  }
}

// every input row against one panel, six rows at a time
static inline void panel_rows(const float* wp, const float* x, float* y, const float* b, int64_t I, int64_t ys,
                              int64_t M) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) panel_tile<6>(wp, x + m * I, y + m * ys, b, I, ys);
  switch (M - m) {
    case 5: panel_tile<5>(wp, x + m * I, y + m * ys, b, I, ys); break;
    case 4: panel_tile<4>(wp, x + m * I, y + m * ys, b, I, ys); break;
    case 3: panel_tile<3>(wp, x + m * I, y + m * ys, b, I, ys); break;
    case 2: panel_tile<2>(wp, x + m * I, y + m * ys, b, I, ys); break;
    case 1: panel_tile<1>(wp, x + m * I, y + m * ys, b, I, ys); break;
    default: break;
  }
}

// x (M, I) against a packed weight (P, I, 16) holding `O` outputs, + b -> (M, O)
static at::Tensor packed_linear(at::Tensor x, at::Tensor wp, OptionalTensor bias, int64_t O) {
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(1) == x.size(1) && wp.size(2) == PANEL
              && wp.size(0) == (O + PANEL - 1) / PANEL && x.is_contiguous() && wp.is_contiguous()
              && x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat, "packed linear: shapes");
  const int64_t M = x.size(0), I = x.size(1), P = wp.size(0);
  auto y = at::empty({M, O}, x.options());
  const float* wpp = wp.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* bp = bias_data(bias, O);
  const int64_t grain = grain_for(PANEL * I * 4, 2 * PANEL * I * M);  // a panel's work
  pool().run(P, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      const int64_t o = p * PANEL;
      if (o + PANEL <= O) {
        panel_rows(wpp + p * I * PANEL, xp, yp + o, bp ? bp + o : nullptr, I, O, M);
        continue;
      }
      // the last, partial panel: into a buffer, then the outputs that exist
      float b16[PANEL] = {0};
      if (bp) std::memcpy(b16, bp + o, (O - o) * sizeof(float));
      std::vector<float> buf(M * PANEL);
      panel_rows(wpp + p * I * PANEL, xp, buf.data(), b16, I, PANEL, M);
      for (int64_t m = 0; m < M; m++) std::memcpy(yp + m * O + o, buf.data() + m * PANEL, (O - o) * sizeof(float));
    }
  });
  return y;
}

// x (M, I) @ w.T + b: PACKED_MIN_ROWS..MAX_ROWS rows go to the packed kernel when the weight has a packed copy, else
// to the dot products when I % 8 == 0; torch's linear otherwise (the one place that rule lives: Python's
// `kernels.linear` and the fused block call this)
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const OptionalTensor& b, const OptionalTensor& packed) {
  const int64_t M = x.size(0);
  if (M >= PACKED_MIN_ROWS && M <= MAX_ROWS && packed.has_value()) return packed_linear(x, *packed, b, w.size(0));
  if (M <= MAX_ROWS && w.size(1) % 8 == 0) return small_linear(x, w, b);
  return at::linear(x, w, b);
}

}  // namespace folio
