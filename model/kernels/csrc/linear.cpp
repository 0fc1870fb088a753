// Matrix products for a few rows (a decode step's), streaming each weight row once for all input rows: dot
// products from the weight as it is, or outer products from a copy packed in panels of 16 outputs. One code for
// every weight type: fp32, int8 with a scale per output row (weight-only quantization: a quarter of the bytes)
// and bf16 (half), each widened to fp32 in registers (simd.h), so the result is the fp32 product with the weight
// as stored; and for both vector widths (simd.h's Vec: AVX2's 8 lanes or AVX-512's 16).
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "copies.h"
#include "ops.h"
#include "pool.h"
#include "quantized_rows.h"
#include "simd.h"

namespace folio {

// a tensor's data as the kernels' weight type
template <typename W>
static const W* weight_data(const at::Tensor& w) {
  if constexpr (std::is_same_v<W, bf16>) return reinterpret_cast<const bf16*>(w.data_ptr<at::BFloat16>());
  else return w.data_ptr<W>();
}

// one tile of dot products: fp32 activations (any weight type), or integer ones with a scale per row (int8 weights:
// int16 rows in avx512vnni, int8 rows in the AVX2 builds)
template <int R, int MB, typename W>
static inline void tile(const W* w, const float* x, const float*, float* y, const float* s, const float* b, int64_t I,
                        int64_t O) {
  dot_tile<R, MB>(w, x, y, s, b, I, O);
}
#if defined(FOLIO_INT16_ACTIVATIONS) || defined(FOLIO_INT8_ACTIVATIONS)
template <int R, int MB, typename X, typename = std::enable_if_t<std::is_integral_v<X>>>
static inline void tile(const int8_t* w, const X* x, const float* xs, float* y, const float* s, const float* b,
                        int64_t I, int64_t O) {
  dot_tile_int<R, MB>(w, x, xs, y, s, b, I, O);
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

#ifdef FOLIO_INT16_ACTIVATIONS
// x rounded to int16 (15 bits: an error of at most half a step per value, far below the weights' own rounding),
// for int8 weights' products in VNNI's vpdpwssd
struct Int16Rows : QuantizedRows<int16_t> {
  Int16Rows(const float* x, int64_t M, int64_t I) : QuantizedRows(x, M, I, 32767.f) {}
};
#endif

// the largest integer the kernels' own products of int8 weights (`packed`: through the packed panels) round each row
// to first: 127 in the AVX2 builds (int8 rows, in dot products from the weight as stored, up to INT8_ROWS_MAX_WIDTH
// columns), 32767 in the avx512vnni build (int16 for VNNI's vpdpwssd: through the packed panels at any width, in the
// dot products up to INT16_MAX_WIDTH columns), else 0: the rows as they are, the weights widened to fp32
static int64_t kernel_rows_limit(bool packed, int64_t I) {
#if defined(FOLIO_INT16_ACTIVATIONS)
  return packed || I <= INT16_MAX_WIDTH ? 32767 : 0;
#elif defined(FOLIO_INT8_ACTIVATIONS)
  return (void)packed, I <= INT8_ROWS_MAX_WIDTH ? 127 : 0;
#else
  return (void)packed, (void)I, 0;
#endif
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
static inline void panel_tile(const W* __restrict wp, const float* __restrict x, const float*, float* __restrict y,
                              const float* s, const float* b, int64_t I, int64_t ys) {
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

#ifdef FOLIO_INT16_ACTIVATIONS
// int8 panels against int16-rounded activations (the rounding of the VNNI dot products): each pair of columns' 16
// weights interleaved in one register (vpermw) and multiplied with a row's pair of activations in vpdpwssd, 32
// multiply-adds per instruction where widening to fp32 does 16. The int32 sums are exact for INT32_EXACT_COLUMNS
// columns (512 * 127 * 32767 < 2^31); y sums them in fp32 every so many columns, then scales.
static constexpr int64_t INT32_EXACT_COLUMNS = 512;

template <int MR>
static inline void panel_tile(const int8_t* __restrict wp, const int16_t* __restrict x, const float* xs,
                              float* __restrict y, const float* s, const float* b, int64_t I, int64_t ys) {
  // from [a0..a15 b0..b15] (two columns' 16 weights, widened) to [a0 b0 a1 b1 ...]: a pair per int32 lane
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t start = 0; start < I; start += INT32_EXACT_COLUMNS) {
    const int64_t end = std::min(I, start + INT32_EXACT_COLUMNS);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
            a9 = a0, a10 = a0, a11 = a0;
#define FOLIO_PANEL_ROW(r) \
  if constexpr (MR > r)    \
    a##r = dpwssd(a##r, w, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + (r) * I + i)));
    int64_t i = start;
    if constexpr (MR == 1) {
      // one input row: a single accumulator would wait out vpdpwssd's latency at every pair of columns (~22 GB/s a
      // core here), so four take turns over the pairs and are added at the end (disjoint columns of the same
      // block: still exact)
      auto pair = [&](int64_t c) {
        const __m256i two = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + c * PANEL));
        return _mm512_permutexvar_epi16(pairs, _mm512_cvtepi8_epi16(two));
      };
      auto xv = [&](int64_t c) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + c)); };
      for (; i + 8 <= end; i += 8) {
        a0 = dpwssd(a0, pair(i), xv(i));
        a1 = dpwssd(a1, pair(i + 2), xv(i + 2));
        a2 = dpwssd(a2, pair(i + 4), xv(i + 4));
        a3 = dpwssd(a3, pair(i + 6), xv(i + 6));
      }
      a0 = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
    }
    for (; i < end; i += 2) {
      const __m256i two = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + i * PANEL));
      const __m512i w = _mm512_permutexvar_epi16(pairs, _mm512_cvtepi8_epi16(two));
      FOLIO_PANEL_ROW(0) FOLIO_PANEL_ROW(1) FOLIO_PANEL_ROW(2) FOLIO_PANEL_ROW(3) FOLIO_PANEL_ROW(4)
      FOLIO_PANEL_ROW(5) FOLIO_PANEL_ROW(6) FOLIO_PANEL_ROW(7) FOLIO_PANEL_ROW(8) FOLIO_PANEL_ROW(9)
      FOLIO_PANEL_ROW(10) FOLIO_PANEL_ROW(11)
    }
#undef FOLIO_PANEL_ROW
    const __m512i acc[TILE_ROWS] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};
    for (int m = 0; m < MR; m++) {
      const __m512 part = _mm512_cvtepi32_ps(acc[m]);
      float* ym = y + m * ys;
      _mm512_storeu_ps(ym, start == 0 ? part : _mm512_add_ps(_mm512_loadu_ps(ym), part));
    }
  }
  for (int m = 0; m < MR; m++) {
    float* ym = y + m * ys;
    __m512 out = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(ym), _mm512_set1_ps(xs[m])), _mm512_loadu_ps(s));
    if (b) out = _mm512_add_ps(out, _mm512_loadu_ps(b));
    _mm512_storeu_ps(ym, out);
  }
}
#endif

// the last MR < TILE_ROWS input rows against one panel
template <int MR, typename W, typename X>
static inline void panel_rest(int64_t n, const W* wp, const X* x, const float* xs, float* y, const float* s,
                              const float* b, int64_t I, int64_t ys) {
  if (n == MR) panel_tile<MR>(wp, x, xs, y, s, b, I, ys);
  else if constexpr (MR > 1) panel_rest<MR - 1>(n, wp, x, xs, y, s, b, I, ys);
}

// every input row against one panel, TILE_ROWS rows at a time (xs: int16 rows' scales, else nullptr)
template <typename W, typename X>
static inline void panel_rows(const W* wp, const X* x, const float* xs, float* y, const float* s, const float* b,
                              int64_t I, int64_t ys, int64_t M) {
  int64_t m = 0;
  for (; m + TILE_ROWS <= M; m += TILE_ROWS)
    panel_tile<TILE_ROWS>(wp, x + m * I, xs ? xs + m : xs, y + m * ys, s, b, I, ys);
  if (m < M) panel_rest<TILE_ROWS - 1>(M - m, wp, x + m * I, xs ? xs + m : xs, y + m * ys, s, b, I, ys);
}

// y (M, O) from the packed copy (P, I, 16) of a weight with O outputs
template <typename W, typename X>
static void panel_products(const W* wp, const X* x, const float* xs, float* y, const float* s, const float* b,
                           int64_t M, int64_t I, int64_t O) {
  const int64_t P = (O + PANEL - 1) / PANEL;
  const int64_t grain = grain_for(PANEL * I * int64_t(sizeof(W)), 2 * PANEL * I * M);  // a panel's work
  pool().run(P, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      const int64_t o = p * PANEL;
      if (o + PANEL <= O) {
        panel_rows(wp + p * I * PANEL, x, xs, y + o, s ? s + o : s, b ? b + o : b, I, O, M);
        continue;
      }
      // the last, partial panel: into a buffer, then the outputs that exist
      float b16[PANEL] = {0}, s16[PANEL] = {0};
      if (b) std::memcpy(b16, b + o, (O - o) * sizeof(float));
      if (s) std::memcpy(s16, s + o, (O - o) * sizeof(float));
      std::vector<float> buf(M * PANEL);
      panel_rows(wp + p * I * PANEL, x, xs, buf.data(), s ? s16 : nullptr, b16, I, PANEL, M);
      for (int64_t m = 0; m < M; m++) std::memcpy(y + m * O + o, buf.data() + m * PANEL, (O - o) * sizeof(float));
    }
  });
}

// y (M, O) from x (M, I) fp32 against a weight of type W, through its packed copy or not
template <typename W>
static void kernel_product(const Weight& w, const float* x, int64_t M, float* y) {
  const float* s = w.scale ? w.scale->data_ptr<float>() : nullptr;
  const float* b = w.bias ? w.bias->data_ptr<float>() : nullptr;
  const bool packed = M >= PACKED_MIN_ROWS && w.packed;
  if constexpr (std::is_same_v<W, int8_t>) {
#ifdef FOLIO_INT16_ACTIVATIONS
    if (kernel_rows_limit(packed, w.I) == 32767) {
      const Int16Rows xq(x, M, w.I);
      if (packed) panel_products(weight_data<W>(*w.packed), xq.values.data(), xq.scales.data(), y, s, b, M, w.I, w.O);
      else dot_products(weight_data<W>(w.w), xq.values.data(), xq.scales.data(), y, s, b, M, w.I, w.O);
      return;
    }
#endif
#ifdef FOLIO_INT8_ACTIVATIONS
    // int8 rows: the dot products read the weight as stored (the packed panels interleave outputs, not columns)
    if (kernel_rows_limit(packed, w.I) == 127) {
      const QuantizedRows<int8_t> xq(x, M, w.I, 127.f);
      dot_products(weight_data<W>(w.w), xq.values.data(), xq.scales.data(), y, s, b, M, w.I, w.O);
      return;
    }
#endif
  }
  if (packed) panel_products(weight_data<W>(*w.packed), x, static_cast<const float*>(nullptr), y, s, b, M, w.I, w.O);
  else dot_products(weight_data<W>(w.w), x, static_cast<const float*>(nullptr), y, s, b, M, w.I, w.O);
}

// whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16). An AVX2 build decides as on a CPU of its
// tier, none of which has either: FOLIO_CPU_KERNELS=avx2 then measures that tier's products on any machine.
static bool native_bf16() {
#ifdef FOLIO_VEC512
  static const bool yes = __builtin_cpu_supports("avx512bf16") || __builtin_cpu_supports("amx-bf16");
  return yes;
#else
  return false;
#endif
}

// whether the CPU multiplies int8 natively (VNNI's vpdpbusd, or AMX-INT8), as oneDNN's int8 GEMM does (an AVX2
// build: AVX-VNNI only, as above)
static bool native_int8() {
#ifdef FOLIO_VEC512
  static const bool yes = __builtin_cpu_supports("avx512vnni") || __builtin_cpu_supports("avxvnni")
                          || __builtin_cpu_supports("amx-int8");
#else
  static const bool yes = __builtin_cpu_supports("avxvnni");
#endif
  return yes;
}

bool int8_gemm(int64_t rows, at::ScalarType weight, int64_t weights) {
  const bool own = vnni_gemm_cpu();
  return weight == at::kChar && rows >= (own ? OWN_GEMM_MIN_ROWS : INT8_GEMM_MIN_ROWS)
         && weights >= INT8_GEMM_MIN_WEIGHTS && (own || native_int8());
}

bool bf16_gemm(int64_t rows, at::ScalarType weight, int64_t weights) {
  return native_bf16() && ((weight == at::kBFloat16 && rows >= BF16_GEMM_MIN_ROWS)
                           || (weight == at::kChar && rows > MAX_ROWS && !int8_gemm(rows, weight, weights)));
}

// w as fp32, times its scale per output row where it has one
static at::Tensor dequantized(const at::Tensor& w, const OptionalTensor& scale) {
  auto full = w.to(at::kFloat);
  return scale.has_value() ? full * scale->unsqueeze(1) : full;
}

Weight::Weight(at::Tensor weight, OptionalTensor bias_, OptionalTensor packed_, OptionalTensor scale_)
    : w(std::move(weight)), bias(std::move(bias_)), packed(std::move(packed_)), scale(std::move(scale_)),
      O(w.size(0)), I(w.size(1) * (w.scalar_type() == at::kByte ? 2 : 1)) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "linear: a contiguous 2-D weight");
  if (w.scalar_type() == at::kByte) {  // two 4-bit weights a byte (int4.cpp)
    check_int4(*this);
    return;
  }
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kChar || w.scalar_type() == at::kBFloat16,
              "linear: weights are fp32, int8 or bf16, not ", w.scalar_type());
  TORCH_CHECK(w.scalar_type() != at::kChar || scale.has_value(), "linear: an int8 weight needs its scales");
  check_floats(bias, O, "linear: bias");
  check_floats(scale, O, "linear: scale");
  if (packed) {
    TORCH_CHECK(packed->dim() == 3 && packed->size(0) == (O + PANEL - 1) / PANEL && packed->size(1) == I
                && packed->size(2) == PANEL && packed->is_contiguous() && packed->scalar_type() == w.scalar_type(),
                "linear: the packed copy's shape or type");
  }
}

// The one rule for who does a product of M fp32 rows. Where the kernels have their own int8 GEMM (vnni_gemm_cpu: the
// AVX2 builds and avx512vnni, in AMX tiles from AMX_GEMM_MIN_ROWS where the CPU has them) int8 weights that are not
// small go to it from OWN_GEMM_MIN_ROWS rows, else on a CPU that multiplies int8 to oneDNN's from INT8_GEMM_MIN_ROWS,
// with x rounded to int8 (`int8_gemm`, `int8_product`); other products of int8 weights round x to int8 (AVX2) or int16
// (avx512vnni) in the kernels' own dot products and panels (`kernel_rows_limit`). On a
// CPU that multiplies bf16: bf16 weights from BF16_GEMM_MIN_ROWS rows, and a prompt against the other int8 weights
// (dequantized to bf16 once for the call, as it would be to fp32), go to torch's bf16 GEMM (oneDNN); x and the
// product are rounded to bf16, as in vLLM's bf16 mode. Else up to MAX_ROWS rows of a width that is a multiple of 8 go
// to the kernels, more to torch's linear with the dequantized weight. The thresholds are model/kernels/build.py's;
// the figures that chose them, bench/results/kernels.md's.
static bool by_kernels(at::ScalarType type, int64_t O, int64_t I, int64_t M) {
  return !int8_gemm(M, type, O * I) && !bf16_gemm(M, type, O * I) && M <= MAX_ROWS && I % 8 == 0;
}
static bool by_kernels(const Weight& w, int64_t M) { return by_kernels(w.w.scalar_type(), w.O, w.I, M); }

int64_t rows_rounded_to(int64_t rows, at::ScalarType weight, int64_t O, int64_t I, bool packed) {
  if (int8_gemm(rows, weight, O * I)) return 127;
  if (weight != at::kChar || !by_kernels(weight, O, I, rows)) return 0;
  return kernel_rows_limit(packed && rows >= PACKED_MIN_ROWS, I);
}

// rows [begin, end) of w (O, I) int8 times their scales, rounded to bf16 (to nearest even, as torch's .to(bfloat16))
static void int8_rows_to_bf16(const int8_t* w, const float* scale, int64_t I, int64_t begin, int64_t end,
                              uint16_t* out) {
  for (int64_t o = begin; o < end; o++)
    for (int64_t i = 0; i < I; i++) {
      const float f = float(w[o * I + i]) * scale[o];
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof bits);
      out[o * I + i] = uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
    }
}

// int8 weights as bf16 for torch's bf16 GEMM, in one pass (three of torch's ops took as long as the GEMM's first
// layers); on torch's threads where this thread has several, else on this one (a piece of a split product)
static at::Tensor int8_to_bf16(const at::Tensor& w, const at::Tensor& scale) {
  const int64_t O = w.size(0), I = w.size(1);
  auto out = at::empty({O, I}, w.options().dtype(at::kBFloat16));
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, O, std::max<int64_t>(1, 65536 / I),
                   [&](int64_t begin, int64_t end) { int8_rows_to_bf16(wp, sp, I, begin, end, op); });
  return out;
}

// out (M, n) = x @ (w * scale).T + b for a weight's n rows, through torch: the bf16 GEMM where `xb` (x in bf16) is
// given (bf16_gemm), else torch's product with the weight in x's type (dequantized where stored otherwise)
static void torch_rows(const at::Tensor& w, const OptionalTensor& bias, const OptionalTensor& scale,
                       const at::Tensor& x, const at::Tensor& xb, at::Tensor out) {
  if (xb.defined()) {
    const auto product = at::mm(xb, (w.scalar_type() == at::kBFloat16 ? w : int8_to_bf16(w, *scale)).t());
    if (bias) at::add_out(out, product, *bias);  // widened to fp32 and the bias added in one pass
    else out.copy_(product);
  } else if (bias) {
    at::addmm_out(out, *bias, x, dequantized(w, scale).to(x.scalar_type()).t());
  } else {
    at::mm_out(out, x, dequantized(w, scale).to(x.scalar_type()).t());
  }
}

// outputs(o, n) for n outputs from o, covering [0, O): in one call where torch's ops may use several threads
// themselves (or there is one, or too few outputs), else in one piece per pool thread, each calling torch on that
// thread alone (OneOpenMPThread in block.cpp): before, a 32-row step of bf16 GPT-2 ran its GEMMs on one core
static void split_outputs(int64_t O, const std::function<void(int64_t, int64_t)>& outputs) {
  const int threads = pool().usable();
  if (threads == 1 || at::get_num_threads() > 1 || O < 4 * PANEL * threads) {
    outputs(0, O);
    return;
  }
  const int64_t step = (O + threads - 1) / threads;
  pool().run(threads, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode inference;  // out may be an inference tensor; a worker thread starts outside inference mode
    for (int64_t p = begin; p < end; p++) {
      const int64_t o = p * step, n = std::min(step, O - o);
      if (n > 0) outputs(o, n);
    }
  });
}

// oneDNN's int8 linear over a copy of a weight it packed once (onednn::qlinear_pointwise and qlinear_prepack, the ops
// torch's Inductor runs quantized linears with). at::_int_mm repacks the weight on every call, which for a decode
// step's 8-64 rows cost as much as the products: on AMD EPYC (Zen 5), one thread, 32 rows, 768 x 1536 took 197 us
// through _int_mm and 118 us packed once, half of GPT-2's LM head 3.2 ms and 1.7. For a prompt's hundreds of rows
// _int_mm was as fast or faster, and it is used there. Absent where torch was built without oneDNN.
class PackedInt8 {
 public:
  using Linear = at::Tensor(at::Tensor, double, int64_t, at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>,
                            double, int64_t, std::optional<at::ScalarType>, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, c10::string_view);
  using Prepack = at::Tensor(at::Tensor, std::optional<c10::List<int64_t>>);

  static PackedInt8& get() {
    static PackedInt8 one;
    return one;
  }
  bool available() const { return linear_.has_value(); }

  // the packed copy of rows [o, o + n) of w (made at first use, kept while w lives unchanged: copies.h), and the
  // unit scales and zero points its call takes
  struct Piece {
    at::Tensor packed, ones, zeros;
  };
  Piece piece(const at::Tensor& w, int64_t o, int64_t n) {
    return pieces_.get(w, o, n, [&] {
      return Piece{prepack_->call(w.narrow(0, o, n).contiguous(), std::nullopt),
                   at::ones({n}, w.options().dtype(at::kFloat)), at::zeros({n}, w.options().dtype(at::kInt))};
    });
  }

  // (M, n) fp32: the exact integer sums of xu8 - 128 (int8 rows stored with an offset of 128, as oneDNN takes
  // them) times the weight's rows
  at::Tensor sums(const at::Tensor& xu8, const Piece& p) const {
    return linear_->call(xu8, 1.0, 128, p.packed, p.ones, p.zeros, std::nullopt, 1.0, 0, at::kFloat, "none",
                         c10::List<std::optional<at::Scalar>>(), "");
  }

 private:
  PackedInt8() {
    auto& dispatcher = c10::Dispatcher::singleton();
    const auto linear = dispatcher.findSchema({"onednn::qlinear_pointwise", ""});
    const auto prepack = dispatcher.findSchema({"onednn::qlinear_prepack", ""});
    if (linear && prepack) linear_.emplace(linear->typed<Linear>()), prepack_.emplace(prepack->typed<Prepack>());
  }
  std::optional<c10::TypedOperatorHandle<Linear>> linear_;
  std::optional<c10::TypedOperatorHandle<Prepack>> prepack_;
  WeightCopies<Piece> pieces_;
};

// y[:, o:o+n] (row stride O) = sums * (row scale * output scale) + bias
template <typename S>
static void scale_sums(const S* sums, int64_t M, int64_t n, const float* xs, const float* ws, const float* b,
                       float* y, int64_t O) {
  for (int64_t m = 0; m < M; m++) {
    const S* sm = sums + m * n;
    float* ym = y + m * O;
    if (b) for (int64_t j = 0; j < n; j++) ym[j] = float(sm[j]) * (xs[m] * ws[j]) + b[j];
    else for (int64_t j = 0; j < n; j++) ym[j] = float(sm[j]) * (xs[m] * ws[j]);
  }
}

// out (M, O) contiguous = x @ (w * scale).T + b with x rounded per row to int8 (`int8_gemm`: W8A8, as llama.cpp's
// q8_0 and vLLM's int8 modes do): the kernels' own GEMM where `vnni_gemm` (vnni_gemm.cpp: AVX512-VNNI's, faster
// than oneDNN's for decode steps and prompts alike; AVX-VNNI's or AVX2's in the AVX2 builds), else oneDNN's int8 GEMM
// (VNNI or AMX) adds the integer products exactly (in int32; packed once and up to MAX_ROWS rows, in fp32, exact
// below 2^24 and to fp32's rounding above), then each sum is scaled by its row's and output's scales. Split by
// outputs over the pool as below.
static void int8_product(const Weight& w, const at::Tensor& x, at::Tensor out) {
  TORCH_CHECK(out.is_contiguous(), "linear: a contiguous output");
  const int64_t M = x.size(0), O = w.O;
  auto& packed = PackedInt8::get();
  const float *ws = w.scale->data_ptr<float>(), *b = w.bias ? w.bias->data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  // the kernels' VNNI GEMM and oneDNN's packed one take the rows as unsigned bytes and keep a packed copy of the
  // weight, which needs its version counter (an inference tensor has none)
  const bool packable = !w.w.is_inference(), vnni = packable && vnni_gemm(w.I);
  if (vnni || (packable && M <= MAX_ROWS && packed.available())) {
    const int64_t held = vnni ? vnni_rows(M, w.I) : M;
    const QuantizedRows<uint8_t> xq(x.data_ptr<float>(), M, w.I, 127.f, vnni ? vnni_rows_offset() : 128, held);
    if (vnni) {
      vnni_product(w.w, xq.values.data(), held, xq.scales.data(), M, ws, b, y);
      return;
    }
    const at::Tensor xu8 = at::from_blob(const_cast<uint8_t*>(xq.values.data()), {M, w.I}, at::kByte);
    split_outputs(O, [&](int64_t o, int64_t n) {
      const at::Tensor sums = packed.sums(xu8, packed.piece(w.w, o, n));
      scale_sums(sums.data_ptr<float>(), M, n, xq.scales.data(), ws + o, b ? b + o : nullptr, y + o, O);
    });
    return;
  }
  const QuantizedRows<int8_t> xq(x.data_ptr<float>(), M, w.I, 127.f);
  const at::Tensor xt = at::from_blob(const_cast<int8_t*>(xq.values.data()), {M, w.I}, at::kChar);
  split_outputs(O, [&](int64_t o, int64_t n) {
    const at::Tensor sums = at::_int_mm(xt, w.w.narrow(0, o, n).t());  // (M, n) int32
    scale_sums(sums.data_ptr<int32_t>(), M, n, xq.scales.data(), ws + o, b ? b + o : nullptr, y + o, O);
  });
}

// The product through torch into out (M, O): int8 weights in the int8 GEMM where `int8_gemm` says so, else
// `torch_rows`, split by outputs (split_outputs).
static void torch_product(const Weight& w, const at::Tensor& x, at::Tensor out) {
  if (x.scalar_type() == at::kFloat && int8_gemm(x.size(0), w.w.scalar_type(), w.O * w.I)) {
    int8_product(w, x.contiguous(), out);
    return;
  }
  const bool bf16 = x.scalar_type() == at::kFloat && bf16_gemm(x.size(0), w.w.scalar_type(), w.O * w.I);
  const at::Tensor xb = bf16 ? x.to(at::kBFloat16) : at::Tensor();
  auto part = [&](const OptionalTensor& t, int64_t o, int64_t n) -> OptionalTensor {
    return t ? OptionalTensor(t->narrow(0, o, n)) : t;
  };
  split_outputs(w.O, [&](int64_t o, int64_t n) {
    torch_rows(w.w.narrow(0, o, n), part(w.bias, o, n), part(w.scale, o, n), x, xb, out.narrow(1, o, n));
  });
}

void product_into(const Weight& w, const float* x, int64_t M, float* y) {
  if (w.w.scalar_type() == at::kByte) return int4_product(w, x, M, y);  // any rows (int4.cpp)
  if (!by_kernels(w, M)) {
    torch_product(w, at::from_blob(const_cast<float*>(x), {M, w.I}, at::kFloat), at::from_blob(y, {M, w.O}));
    return;
  }
  switch (w.w.scalar_type()) {
    case at::kFloat: return kernel_product<float>(w, x, M, y);
    case at::kChar: return kernel_product<int8_t>(w, x, M, y);
    default: return kernel_product<bf16>(w, x, M, y);
  }
}

// x (M, I) @ (w * scale).T + b through the one rule above (Python's `kernels.linear` calls this)
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const OptionalTensor& b, const OptionalTensor& packed,
                  const OptionalTensor& scale) {
  const Weight weight(w, b, packed, scale);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.I, "linear: shapes");
  const int64_t M = x.size(0);
  auto y = at::empty({M, weight.O}, x.options());
  if (w.scalar_type() != at::kByte && (x.scalar_type() != at::kFloat || !by_kernels(weight, M))) {
    torch_product(weight, x, y);
    return y;
  }
  TORCH_CHECK(x.is_contiguous(), "linear: contiguous x");
  product_into(weight, x.data_ptr<float>(), M, y.data_ptr<float>());
  return y;
}

}  // namespace folio
