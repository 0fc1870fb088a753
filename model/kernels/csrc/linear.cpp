// Matrix products for a few rows (a decode step's), streaming each weight row once for all input rows: dot
// products from the weight as it is, or outer products from a copy packed in panels of 16 outputs. One code for
// every weight type: fp32, int8 with a scale per output row (weight-only quantization: a quarter of the bytes)
// and bf16 (half), each widened to fp32 in registers (simd.h), so the result is the fp32 product with the weight
// as stored; and for both vector widths (simd.h's Vec: AVX2's 8 lanes or AVX-512's 16).
#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "simd.h"

namespace folio {

// a tensor's data as the kernels' weight type
template <typename W>
static const W* weight_data(const at::Tensor& w) {
  if constexpr (std::is_same_v<W, bf16>) return reinterpret_cast<const bf16*>(w.data_ptr<at::BFloat16>());
  else return w.data_ptr<W>();
}

// an optional per-output fp32 vector's data (bias or scale; nullptr without one), checked against O outputs
static const float* per_output(const OptionalTensor& t, int64_t O, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->is_contiguous() && t->numel() == O && t->scalar_type() == at::kFloat, "linear: ", what);
  return t->data_ptr<float>();
}

// Tasks per thread for tasks that each read `bytes` of weights and do `flops`: a task is worth a thread when it
// reads >= 512 KiB or does >= 2 MFLOP (waking a sleeping thread costs tens of microseconds, more than the whole
// product for the small layers of a small model)
static int64_t grain_for(int64_t bytes, int64_t flops) {
  return std::max<int64_t>(1, std::min((int64_t(512) << 10) / std::max<int64_t>(1, bytes),
                                       int64_t(2000000) / std::max<int64_t>(1, flops)));
}

// one tile of dot products: fp32 activations (any weight type), or int16 ones with a scale per row (int8 weights)
template <int R, int MB, typename W>
static inline void tile(const W* w, const float* x, const float*, float* y, const float* s, const float* b, int64_t I,
                        int64_t O) {
  dot_tile<R, MB>(w, x, y, s, b, I, O);
}
#ifdef FOLIO_INT16_ACTIVATIONS
template <int R, int MB>
static inline void tile(const int8_t* w, const int16_t* x, const float* xs, float* y, const float* s, const float* b,
                        int64_t I, int64_t O) {
  dot_tile_i16<R, MB>(w, x, xs, y, s, b, I, O);
}
#endif

// rows o..o+R-1 of w for all M inputs, three at a time (12 accumulators: enough independent FMAs in flight)
template <int R, typename W, typename X>
static inline void rows(const W* w, const X* x, const float* xs, float* y, const float* s, const float* b, int64_t I,
                        int64_t O, int64_t M) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile<R, 3>(w, x + m * I, xs ? xs + m : xs, y + m * O, s, b, I, O);
  if (M - m == 2) tile<R, 2>(w, x + m * I, xs ? xs + m : xs, y + m * O, s, b, I, O);
  if (M - m == 1) tile<R, 1>(w, x + m * I, xs ? xs + m : xs, y + m * O, s, b, I, O);
}

// y (M, O) from the weight as it is: one input row against 8 weight rows per task (more streams in flight reads
// closer to bandwidth), more input rows against 4. x is fp32, or int16 with a scale per row in xs.
template <typename W, typename X>
static void dot_products(const W* w, const X* x, const float* xs, float* y, const float* s, const float* b,
                         int64_t M, int64_t I, int64_t O) {
  const int64_t R = M == 1 ? 8 : 4, blocks = (O + R - 1) / R;
  const int64_t grain = grain_for(R * I * int64_t(sizeof(W)), 2 * R * I * M);
  pool().run(blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; blk++) {
      const int64_t o = blk * R, n = std::min(R, O - o);
      const W* wo = w + o * I;
      const float *so = s ? s + o : nullptr, *bo = b ? b + o : nullptr;
      if (M == 1 && n == 8) {
        tile<8, 1>(wo, x, xs, y + o, so, bo, I, O);
      } else if (M == 1 || n == 1) {
        for (int64_t r = 0; r < n; r++)
          rows<1>(wo + r * I, x, xs, y + o + r, so ? so + r : so, bo ? bo + r : bo, I, O, M);
      } else if (n == 4) {
        rows<4>(wo, x, xs, y + o, so, bo, I, O, M);
      } else if (n == 3) {
        rows<3>(wo, x, xs, y + o, so, bo, I, O, M);
      } else {
        rows<2>(wo, x, xs, y + o, so, bo, I, O, M);
      }
    }
  });
}

// int8 weights' dot products; with VNNI the activations are rounded to int16 first, a scale per row (max |x| /
// 32767: 15 bits, an error of at most half a step per value, far below the weights' own rounding)
static void int8_dot_products(const int8_t* w, const float* x, float* y, const float* s, const float* b, int64_t M,
                              int64_t I, int64_t O) {
#ifdef FOLIO_INT16_ACTIVATIONS
  if (I <= INT16_MAX_WIDTH) {
    std::vector<int16_t> xq(M * I);
    std::vector<float> xs(M);
    for (int64_t m = 0; m < M; m++) {
      float amax = 0.f;
      for (int64_t i = 0; i < I; i++) amax = std::max(amax, std::fabs(x[m * I + i]));
      xs[m] = amax > 0.f ? amax / 32767.f : 1.f;
      const float inv = 1.f / xs[m];
      for (int64_t i = 0; i < I; i++) xq[m * I + i] = int16_t(std::nearbyint(x[m * I + i] * inv));
    }
    dot_products(w, xq.data(), xs.data(), y, s, b, M, I, O);
    return;
  }
#endif
  dot_products(w, x, static_cast<const float*>(nullptr), y, s, b, M, I, O);
}

// The packed layout, for PACKED_MIN_ROWS..MAX_ROWS rows. The dot products above reduce each output across a
// vector at the end and read every input row once per four weight rows; with the weights packed as panels of 16
// outputs, wp[panel][i][16], a tile instead keeps input rows x 16 outputs in accumulators, broadcasting one input
// value against the panel's weights, with no reductions (bench/results/kernels.md has the figures). With 8 lanes
// a tile is 6 input rows x 2 vectors, with 16 lanes 12 input rows x 1 vector: 12 accumulators either way.

#ifdef FOLIO_VEC512
static constexpr int TILE_ROWS = 12;
#else
static constexpr int TILE_ROWS = 6;
#endif

// y[m, 0..15] = (x[m] . panel) * s + b for MR <= TILE_ROWS input rows, written to y (row stride ys)
template <int MR, typename W>
static inline void panel_tile(const W* __restrict wp, const float* __restrict x, float* __restrict y, const float* s,
                              const float* b, int64_t I, int64_t ys) {
  // named accumulators, not an array: g++ keeps an array of vectors in memory across the loop
#ifdef FOLIO_VEC512
  Vec a0 = vzero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0,
      a11 = a0;
#define FOLIO_PANEL_ROW(r) \
  if constexpr (MR > r) a##r = vfma(w0, vset1(x + (r) * I + i), a##r);
  for (int64_t i = 0; i < I; i++) {
    const Vec w0 = vload(wp + i * PANEL);
    FOLIO_PANEL_ROW(0) FOLIO_PANEL_ROW(1) FOLIO_PANEL_ROW(2) FOLIO_PANEL_ROW(3) FOLIO_PANEL_ROW(4) FOLIO_PANEL_ROW(5)
    FOLIO_PANEL_ROW(6) FOLIO_PANEL_ROW(7) FOLIO_PANEL_ROW(8) FOLIO_PANEL_ROW(9) FOLIO_PANEL_ROW(10) FOLIO_PANEL_ROW(11)
  }
#undef FOLIO_PANEL_ROW
  const Vec acc[TILE_ROWS][1] = {{a0}, {a1}, {a2}, {a3}, {a4}, {a5}, {a6}, {a7}, {a8}, {a9}, {a10}, {a11}};
#else
  Vec a00 = vzero(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00, a40 = a00,
      a41 = a00, a50 = a00, a51 = a00;
  // input row r's value times both weight vectors, into row r's two accumulators
#define FOLIO_PANEL_ROW(r)                     \
  if constexpr (MR > r) {                      \
    const Vec v = vset1(x + (r) * I + i);      \
    a##r##0 = vfma(w0, v, a##r##0);            \
    a##r##1 = vfma(w1, v, a##r##1);            \
  }
  for (int64_t i = 0; i < I; i++) {
    const Vec w0 = vload(wp + i * PANEL), w1 = vload(wp + i * PANEL + 8);
    FOLIO_PANEL_ROW(0) FOLIO_PANEL_ROW(1) FOLIO_PANEL_ROW(2) FOLIO_PANEL_ROW(3) FOLIO_PANEL_ROW(4) FOLIO_PANEL_ROW(5)
  }
#undef FOLIO_PANEL_ROW
  const Vec acc[TILE_ROWS][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
#endif
  constexpr int V = PANEL / LANES;
  for (int m = 0; m < MR; m++)
    for (int v = 0; v < V; v++) {
      Vec out = s ? vmul(acc[m][v], vload(s + v * LANES)) : acc[m][v];
      if (b) out = vadd(out, vload(b + v * LANES));
      vstore(y + m * ys + v * LANES, out);
    }
}

// the last MR < TILE_ROWS input rows against one panel
template <int MR, typename W>
static inline void panel_rest(int64_t n, const W* wp, const float* x, float* y, const float* s, const float* b,
                              int64_t I, int64_t ys) {
  if (n == MR) panel_tile<MR>(wp, x, y, s, b, I, ys);
  else if constexpr (MR > 1) panel_rest<MR - 1>(n, wp, x, y, s, b, I, ys);
}

// every input row against one panel, TILE_ROWS rows at a time
template <typename W>
static inline void panel_rows(const W* wp, const float* x, float* y, const float* s, const float* b, int64_t I,
                              int64_t ys, int64_t M) {
  int64_t m = 0;
  for (; m + TILE_ROWS <= M; m += TILE_ROWS) panel_tile<TILE_ROWS>(wp, x + m * I, y + m * ys, s, b, I, ys);
  if (m < M) panel_rest<TILE_ROWS - 1>(M - m, wp, x + m * I, y + m * ys, s, b, I, ys);
}

// y (M, O) from the packed copy (P, I, 16) of a weight with O outputs
template <typename W>
static void panel_products(const W* wp, const float* x, float* y, const float* s, const float* b, int64_t M,
                           int64_t I, int64_t O) {
  const int64_t P = (O + PANEL - 1) / PANEL;
  const int64_t grain = grain_for(PANEL * I * int64_t(sizeof(W)), 2 * PANEL * I * M);  // a panel's work
  pool().run(P, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      const int64_t o = p * PANEL;
      if (o + PANEL <= O) {
        panel_rows(wp + p * I * PANEL, x, y + o, s ? s + o : s, b ? b + o : b, I, O, M);
        continue;
      }
      // the last, partial panel: into a buffer, then the outputs that exist
      float b16[PANEL] = {0}, s16[PANEL] = {0};
      if (b) std::memcpy(b16, b + o, (O - o) * sizeof(float));
      if (s) std::memcpy(s16, s + o, (O - o) * sizeof(float));
      std::vector<float> buf(M * PANEL);
      panel_rows(wp + p * I * PANEL, x, buf.data(), s ? s16 : nullptr, b16, I, PANEL, M);
      for (int64_t m = 0; m < M; m++) std::memcpy(y + m * O + o, buf.data() + m * PANEL, (O - o) * sizeof(float));
    }
  });
}

// x (M, I) fp32 against a weight of type W (O, I), with its packed copy or not
template <typename W>
static at::Tensor product(const at::Tensor& x, const at::Tensor& w, const OptionalTensor& bias,
                          const OptionalTensor& packed, const OptionalTensor& scale) {
  const int64_t M = x.size(0), I = w.size(1), O = w.size(0);
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "linear: contiguous x and w");
  const float* s = per_output(scale, O, "scale");
  const float* b = per_output(bias, O, "bias");
  auto y = at::empty({M, O}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M >= PACKED_MIN_ROWS && packed.has_value()) {
    TORCH_CHECK(packed->dim() == 3 && packed->size(0) == (O + PANEL - 1) / PANEL && packed->size(1) == I
                && packed->size(2) == PANEL && packed->is_contiguous() && packed->scalar_type() == w.scalar_type(),
                "linear: the packed copy's shape or type");
    panel_products(weight_data<W>(*packed), xp, yp, s, b, M, I, O);
  } else if constexpr (std::is_same_v<W, int8_t>) {
    int8_dot_products(weight_data<W>(w), xp, yp, s, b, M, I, O);
  } else {
    dot_products(weight_data<W>(w), xp, static_cast<const float*>(nullptr), yp, s, b, M, I, O);
  }
  return y;
}

// whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16)
static bool native_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512bf16") || __builtin_cpu_supports("amx-bf16");
  return yes;
}

bool bf16_gemm(int64_t rows, at::ScalarType weight) {
  return native_bf16() && ((weight == at::kBFloat16 && rows >= BF16_GEMM_MIN_ROWS)
                           || (weight == at::kChar && rows > MAX_ROWS));
}

// w as fp32, times its scale per output row where it has one
static at::Tensor dequantized(const at::Tensor& w, const OptionalTensor& scale) {
  auto full = w.to(at::kFloat);
  return scale.has_value() ? full * scale->unsqueeze(1) : full;
}

// x (M, I) @ (w * scale).T + b: up to MAX_ROWS fp32 rows go to the kernels (from PACKED_MIN_ROWS rows through the
// packed copy when there is one, else the dot products), for a width that is a multiple of 8; torch's linear with
// the dequantized weight otherwise (the one place that rule lives: Python's `kernels.linear` and the fused block
// call this)
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const OptionalTensor& b, const OptionalTensor& packed,
                  const OptionalTensor& scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: shapes");
  TORCH_CHECK(w.scalar_type() != at::kChar || scale.has_value(), "linear: an int8 weight needs its scales");
  const int64_t M = x.size(0);
  if (x.scalar_type() == at::kFloat && bf16_gemm(M, w.scalar_type())) {
    // On a CPU that multiplies bf16: bf16 weights with enough rows, and a prompt against int8 weights (dequantized
    // to bf16 once for the call, as it would be to fp32), go to torch's bf16 GEMM (oneDNN), which beats widening
    // to fp32 from 16 rows (1.3-2x here) and fp32 GEMM 5x; x and the product are rounded to bf16, as in vLLM's
    // bf16 mode
    const auto w16 = w.scalar_type() == at::kBFloat16 ? w : dequantized(w, scale).to(at::kBFloat16);
    auto y = at::linear(x.to(at::kBFloat16), w16).to(at::kFloat);
    return b.has_value() ? y.add_(*b) : y;
  }
  if (M > MAX_ROWS || w.size(1) % 8 != 0 || x.scalar_type() != at::kFloat) {
    return at::linear(x, dequantized(w, scale).to(x.scalar_type()), b);
  }
  switch (w.scalar_type()) {
    case at::kFloat: return product<float>(x, w, b, packed, scale);
    case at::kChar: return product<int8_t>(x, w, b, packed, scale);
    case at::kBFloat16: return product<bf16>(x, w, b, packed, scale);
    default: TORCH_CHECK(false, "linear: weights are fp32, int8 or bf16, not ", w.scalar_type());
  }
}

}  // namespace folio
