// The int8 GEMM for 4 rows or more (VNNI_GEMM_MIN_ROWS: a batched decode step, a prompt) against int8 weights, the
// rows rounded to int8, in AVX512-VNNI's vpdpbusd, in place of oneDNN's (linear.cpp's int8_product). oneDNN's packed
// call costs ~15 us of descriptors and allocations before it multiplies (an int8 GPT-2 step at 32 rows makes 98),
// returns sums that take a second pass to scale, and streamed the LM head's 38 MB at ~300 GMAC/s a thread; for a
// prompt, _int_mm repacks the weight at every call. Here the weights are packed once into panels of 16 outputs x 4
// columns (vpdpbusd's operand), a tile of 8 rows x 3 panels keeps 24 accumulators in registers, the next panels
// are prefetched while a group of panels computes, and the sums are scaled as they are stored. On AMD EPYC (Zen 5),
// one thread, 32 rows: 768 -> 2304 127 us against oneDNN's 144, 3072 -> 768 156 against 185, half the LM head
// (768 -> 25152) 1.52 ms against 1.97; int8 GPT-2's 32-row runner step 13.1 -> 9.5 ms, 31 prompts of 16 tokens
// 77 -> 61 ms. Where the CPU has AMX-INT8, oneDNN's AMX kernels multiply several times faster and keep the GEMM.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "copies.h"
#include "ops.h"
#include "pool.h"
#include "simd.h"

namespace folio {

#if defined(FOLIO_VEC512) && defined(__AVX512VNNI__)

// rows of up to this many columns: each int32 lane adds 4 products of at most 255 * 127 per 4 columns, exact below
// 2^31 up to 66,311 columns
static constexpr int64_t VNNI_MAX_WIDTH = 65536;
static constexpr int TILE_ROWS = 8, TILE_PANELS = 3;

bool vnni_gemm_cpu() {
  static const bool amx = __builtin_cpu_supports("amx-int8");
  return !amx;
}

bool vnni_gemm(int64_t columns) { return vnni_gemm_cpu() && columns % 4 == 0 && columns <= VNNI_MAX_WIDTH; }

// w (O, I) int8 as panels (P, I / 4, 16, 4): panel p's 4-column group g holds outputs 16p..16p+15, each with its 4
// columns' weights (zeros past O); and 128 times each output's sum of weights (the rows reach vpdpbusd as unsigned
// x + 128, and x . w = (x + 128) . w - 128 sum(w))
struct VnniPanels {
  at::Tensor panels, offsets;
};

static VnniPanels pack(const at::Tensor& w) {
  const int64_t O = w.size(0), I = w.size(1), P = (O + 15) / 16;
  VnniPanels out{at::zeros({P, I / 4, 16, 4}, w.options()), at::zeros({P * 16}, w.options().dtype(at::kInt))};
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = out.panels.data_ptr<int8_t>();
  int32_t* offsets = out.offsets.data_ptr<int32_t>();
  pool().run(O, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; o++) {
      int8_t* panel = dst + (o / 16) * I * 16 + (o % 16) * 4;
      int32_t sum = 0;
      for (int64_t i = 0; i < I; i++) {
        panel[(i / 4) * 64 + i % 4] = src[o * I + i];
        sum += src[o * I + i];
      }
      offsets[o] = 128 * sum;
    }
  });
  return out;
}

// acc[r * NP + p] = row r of x (R rows of I unsigned bytes, stride I) . panel p's outputs, from NP panels at wp
// (panel stride I * 16). Accumulators in registers: the caller's tile stores them once.
// Meanwhile the NP panels at `next` (or none: the next group's, which come from memory: a step reads every weight
// once) are fetched into L2, spread over the group's `tiles` row tiles: this one fetches every tiles-th 4-column
// group of them, from the `countdown`-th (1-based). All of a group's prefetches in its first tile (36 KB in
// ~0.6 us) made int8 GPT-2's 32-row step 9.5 -> 10.7 ms. (Passed as a struct, the countdown lived on the stack
// in the loop, 3% slower.)
template <int R, int NP>
__attribute__((always_inline)) static inline void tile_sums(const uint8_t* x, int64_t I, const int8_t* wp,
                                                            const int8_t* next, int64_t tiles, int64_t countdown,
                                                            __m512i* out) {
  __m512i acc[R * NP];
#pragma GCC unroll 32
  for (int k = 0; k < R * NP; k++) acc[k] = _mm512_setzero_si512();
  const int64_t panel = I * 16;
  for (int64_t g = 0; g < I / 4; g++) {
    __m512i w[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; p++) w[p] = _mm512_loadu_si512(wp + p * panel + g * 64);
    if (next && --countdown < 0) {  // a countdown, not g % tiles: no division in the loop
      countdown = tiles - 1;
#pragma GCC unroll 4
      for (int p = 0; p < NP; p++)
        _mm_prefetch(reinterpret_cast<const char*>(next + p * panel + g * 64), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      int32_t four;
      std::memcpy(&four, x + r * I + 4 * g, 4);
      const __m512i a = _mm512_set1_epi32(four);
#pragma GCC unroll 4
      for (int p = 0; p < NP; p++) acc[r * NP + p] = _mm512_dpbusd_epi32(acc[r * NP + p], a, w[p]);
    }
  }
#pragma GCC unroll 32
  for (int k = 0; k < R * NP; k++) _mm512_store_si512(out + k, acc[k]);
}

// The arguments of one product: y (M, O) = (x (M, I) unsigned - 128) . w * (xs[m] * ws[o]) + b[o]
struct VnniArgs {
  const uint8_t* x;
  const float *xs, *ws, *b;
  const int8_t* panels;
  const int32_t* offsets;
  float* y;
  int64_t M, I, O;
};

// R rows from row m against NP panels from panel p, into y
template <int R, int NP>
static void tile(const VnniArgs& a, int64_t m, int64_t p, const int8_t* next, int64_t tiles, int64_t turn) {
  alignas(64) __m512i acc[R * NP];
  tile_sums<R, NP>(a.x + m * a.I, a.I, a.panels + p * a.I * 16, next, tiles, turn, acc);
  for (int q = 0; q < NP; q++) {
    const int64_t o = (p + q) * 16;
    const __mmask16 k = a.O - o >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (a.O - o)) - 1);
    const __m512 ws = _mm512_maskz_loadu_ps(k, a.ws + o);
    const __m512 b = a.b ? _mm512_maskz_loadu_ps(k, a.b + o) : _mm512_setzero_ps();
    const __m512i offset = _mm512_loadu_si512(a.offsets + o);
    for (int r = 0; r < R; r++) {
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r * NP + q], offset));
      const __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(a.xs[m + r]));
      _mm512_mask_storeu_ps(a.y + (m + r) * a.O + o, k, _mm512_fmadd_ps(sums, scale, b));
    }
  }
}

// rows rows (1..TILE_ROWS) from row m against NP panels
template <int NP, int R = TILE_ROWS>
static void rows_tile(int64_t rows, const VnniArgs& a, int64_t m, int64_t p, const int8_t* next, int64_t tiles,
                      int64_t turn) {
  if (rows == R) tile<R, NP>(a, m, p, next, tiles, turn);
  else if constexpr (R > 1) rows_tile<NP, R - 1>(rows, a, m, p, next, tiles, turn);
}

// every row against NP panels from panel p, TILE_ROWS rows at a time; the panels after them (`next`, or none) are
// prefetched meanwhile, spread over the tiles
template <int NP>
static void panel_group(const VnniArgs& a, int64_t p, const int8_t* next) {
  for (int64_t m = 0; m < a.M; m += TILE_ROWS)
    rows_tile<NP>(std::min<int64_t>(TILE_ROWS, a.M - m), a, m, p, next, (a.M + TILE_ROWS - 1) / TILE_ROWS,
                  m / TILE_ROWS + 1);
}

static WeightCopies<VnniPanels>& vnni_copies() {
  static WeightCopies<VnniPanels> copies;
  return copies;
}

void vnni_product(const at::Tensor& w, const uint8_t* x, const float* xs, int64_t M, const float* ws, const float* b,
                  float* y) {
  const int64_t O = w.size(0), I = w.size(1), P = (O + 15) / 16;
  TORCH_CHECK(w.scalar_type() == at::kChar && vnni_gemm(I), "vnni_product: int8 weights of a supported width");
  const VnniPanels packed = vnni_copies().get(w, 0, O, [&] { return pack(w); });
  const VnniArgs a{x, xs, ws, b, packed.panels.data_ptr<int8_t>(), packed.offsets.data_ptr<int32_t>(), y, M, I, O};
  const int64_t groups = (P + TILE_PANELS - 1) / TILE_PANELS, group_bytes = TILE_PANELS * 16 * I;
  pool().run(groups, grain_for(group_bytes, 2 * TILE_PANELS * 16 * I * M), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g++) {
      const int64_t p = g * TILE_PANELS, n = std::min<int64_t>(TILE_PANELS, P - p);
      // the next group's panels, where this thread takes it next and it is whole
      const int8_t* next = g + 1 < end && p + 2 * TILE_PANELS <= P ? a.panels + (p + TILE_PANELS) * I * 16 : nullptr;
      if (n == TILE_PANELS) panel_group<TILE_PANELS>(a, p, next);
      else if (n == 2) panel_group<2>(a, p, nullptr);
      else panel_group<1>(a, p, nullptr);
    }
  });
}

#else

bool vnni_gemm_cpu() { return false; }
bool vnni_gemm(int64_t) { return false; }

void vnni_product(const at::Tensor&, const uint8_t*, const float*, int64_t, const float*, const float*, float*) {
  TORCH_CHECK(false, "vnni_product: this build has no AVX512-VNNI");
}

#endif

}  // namespace folio
