// The kernels' own int8 GEMM against int8 weights, the rows rounded to int8 (linear.cpp's int8_product), in place of
// oneDNN's. In the avx512vnni build, from 4 rows (VNNI_GEMM_MIN_ROWS: a batched decode step, a prompt), in
// AVX512-VNNI's vpdpbusd: oneDNN's packed call costs ~15 us of descriptors and allocations before it multiplies (an
// int8 GPT-2 step at 32 rows makes 98), returns sums that take a second pass to scale, and streamed the LM head's
// 38 MB at ~300 GMAC/s a thread; for a prompt, _int_mm repacks the weight at every call. Here the weights are packed
// once into panels of 16 outputs x 4 columns (vpdpbusd's operand), a tile of 8 rows x 3 panels keeps 24
// accumulators in registers, the next panels are prefetched while a group of panels computes, and the sums are
// scaled as they are stored. On AMD EPYC (Zen 5), one thread, 32 rows: 768 -> 2304 127 us against oneDNN's 144,
// 3072 -> 768 156 against 185, half the LM head (768 -> 25152) 1.52 ms against 1.97; int8 GPT-2's 32-row runner
// step 13.1 -> 9.5 ms, 31 prompts of 16 tokens 77 -> 61 ms. Where the CPU has AMX-INT8, oneDNN's AMX kernels
// multiply several times faster and keep the GEMM. In the AVX2 builds, from 1 row (AVX2_GEMM_MIN_ROWS), the same
// panels in 8-output registers: AVX-VNNI's 256-bit vpdpbusd (avx2vnni) or vpmaddubsw (avx2); one prefetched
// sequence of panels reads closer to bandwidth than the dot products' 8 weight rows at a time, so batch-1 decode
// runs here too (bench/results/kernels.md, "The AVX2 tier").
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "copies.h"
#include "ops.h"
#include "pool.h"
#include "simd.h"

namespace folio {

// The kernels' own GEMM in the instructions of the build: 16 outputs a register in AVX512-VNNI's vpdpbusd; 8 in
// AVX-VNNI's 256-bit vpdpbusd (avx2vnni) or, on AVX2 alone, in vpmaddubsw and vpmaddwd with the sign split of
// simd.h (llama.cpp's q8_0 products on AVX2). A register holds outputs x 4 columns; a tile keeps TILE_ROWS rows x
// TILE_PANELS registers of sums (AVX2: 16 registers in all, the weights' and the row's included).
#if defined(FOLIO_VEC512) && defined(__AVX512VNNI__)
#define FOLIO_OWN_INT8_GEMM 1
using IVec = __m512i;
static constexpr int TILE_ROWS = 8, TILE_PANELS = 3, ROWS_OFFSET = 128;
static inline IVec iload(const int8_t* p) { return _mm512_loadu_si512(p); }
static inline IVec ibroadcast(int32_t v) { return _mm512_set1_epi32(v); }
static inline IVec izero() { return _mm512_setzero_si512(); }
static inline IVec isub(IVec a, IVec b) { return _mm512_sub_epi32(a, b); }
static inline Vec ifloat(IVec v) { return _mm512_cvtepi32_ps(v); }
// acc + x (4 unsigned bytes, broadcast) . w (4 signed bytes an output)
static inline IVec four_products(IVec acc, IVec x, IVec w) { return _mm512_dpbusd_epi32(acc, x, w); }
// n of 16 values (n < 16: those past them not read or written)
static inline Vec load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p); }
static inline void store_first(float* p, Vec v, int64_t n) { _mm512_mask_storeu_ps(p, __mmask16((1u << n) - 1), v); }
#elif !defined(FOLIO_VEC512)
#define FOLIO_OWN_INT8_GEMM 1
using IVec = __m256i;
#ifdef __AVXVNNI__
static constexpr int TILE_ROWS = 6, TILE_PANELS = 2, ROWS_OFFSET = 128;
static inline IVec four_products(IVec acc, IVec x, IVec w) { return products_by_fours(acc, x, w); }
#else
// vpmaddubsw would saturate unsigned x + 128 times w: the rows come signed, multiplied in the sign split
static constexpr int TILE_ROWS = 4, TILE_PANELS = 2, ROWS_OFFSET = 0;
static inline IVec four_products(IVec acc, IVec x, IVec w) { return sign_split(acc, w, x); }
#endif
static inline IVec iload(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline IVec ibroadcast(int32_t v) { return _mm256_set1_epi32(v); }
static inline IVec izero() { return _mm256_setzero_si256(); }
static inline IVec isub(IVec a, IVec b) { return _mm256_sub_epi32(a, b); }
static inline Vec ifloat(IVec v) { return _mm256_cvtepi32_ps(v); }
static inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline Vec load_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, first_lanes(n)); }
static inline void store_first(float* p, Vec v, int64_t n) { _mm256_maskstore_ps(p, first_lanes(n), v); }
#endif

#ifdef FOLIO_OWN_INT8_GEMM

// the outputs a register holds, and the registers to a panel of 16 (the packed layout's)
static constexpr int OUTPUTS = LANES, PER_PANEL = 16 / LANES;

// rows of up to this many columns: each int32 lane adds 4 products of at most 255 * 127 per 4 columns, exact below
// 2^31 up to 66,311 columns
static constexpr int64_t VNNI_MAX_WIDTH = 65536;

bool vnni_gemm_cpu() {
#ifdef FOLIO_VEC512
  static const bool amx = __builtin_cpu_supports("amx-int8");
  return !amx;
#else
  return true;  // the AVX2 tier has no AMX (decided as on a CPU of the tier, as linear.cpp's native_int8)
#endif
}

bool vnni_gemm(int64_t columns) { return vnni_gemm_cpu() && columns % 4 == 0 && columns <= VNNI_MAX_WIDTH; }

int vnni_rows_offset() { return ROWS_OFFSET; }

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

// the first byte of output block q's weights: its OUTPUTS outputs x 4 columns in each 64-byte group of the layout
static inline const int8_t* block(const int8_t* panels, int64_t I, int64_t q) {
  return panels + (q / PER_PANEL) * I * 16 + (q % PER_PANEL) * OUTPUTS * 4;
}
// how far block q + p's weights are from block q's, q a multiple of PER_PANEL (p a constant once the loop over the
// tile's blocks is unrolled: pointers kept per block spilled in the avx512vnni tile, 3 loads from the stack per 24
// vpdpbusd)
static inline int64_t block_step(int p, int64_t I) { return (p / PER_PANEL) * I * 16 + (p % PER_PANEL) * OUTPUTS * 4; }

// acc[r * NP + p] = row r of x (R rows of I bytes, stride I) . block q + p's outputs, from the packed panels (q and
// next multiples of PER_PANEL: each group of blocks starts a panel).
// Accumulators in registers: the caller's tile stores them once.
// Meanwhile the NP blocks from `next` (or none: the next group's, which come from memory: a step reads every weight
// once) are fetched into L2, spread over the group's `tiles` row tiles: this one fetches every tiles-th 4-column
// group of them, from the `countdown`-th (1-based). All of a group's prefetches in its first tile (36 KB in
// ~0.6 us) made int8 GPT-2's 32-row step 9.5 -> 10.7 ms (AVX512-VNNI). (Passed as a struct, the countdown lived on
// the stack in the loop, 3% slower.)
template <int R, int NP>
__attribute__((always_inline)) static inline void tile_sums(const uint8_t* x, int64_t I, const int8_t* panels,
                                                            int64_t q, int64_t next, int64_t tiles,
                                                            int64_t countdown, IVec* out) {
  IVec acc[R * NP];
#pragma GCC unroll 32
  for (int k = 0; k < R * NP; k++) acc[k] = izero();
  const int8_t *wq = block(panels, I, q), *ahead = next >= 0 ? block(panels, I, next) : nullptr;
  for (int64_t g = 0; g < I / 4; g++) {
    IVec w[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; p++) w[p] = iload(wq + block_step(p, I) + g * 64);
    if (ahead && --countdown < 0) {  // a countdown, not g % tiles: no division in the loop
      countdown = tiles - 1;
#pragma GCC unroll 4
      for (int p = 0; p < NP; p += PER_PANEL)  // a panel's blocks share each 64-byte group
        _mm_prefetch(reinterpret_cast<const char*>(ahead + block_step(p, I) + g * 64), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      int32_t four;
      std::memcpy(&four, x + r * I + 4 * g, 4);
      const IVec a = ibroadcast(four);
#pragma GCC unroll 4
      for (int p = 0; p < NP; p++) acc[r * NP + p] = four_products(acc[r * NP + p], a, w[p]);
    }
  }
#pragma GCC unroll 32
  for (int k = 0; k < R * NP; k++) out[k] = acc[k];
}

// The arguments of one product: y (M, O) = (x (M, I) bytes - ROWS_OFFSET) . w * (xs[m] * ws[o]) + b[o]
struct VnniArgs {
  const uint8_t* x;
  const float *xs, *ws, *b;
  const int8_t* panels;
  const int32_t* offsets;
  float* y;
  int64_t M, I, O;
};

// R rows from row m against NP output blocks from block q, into y
template <int R, int NP>
static void tile(const VnniArgs& a, int64_t m, int64_t q, int64_t next, int64_t tiles, int64_t turn) {
  alignas(64) IVec acc[R * NP];
  tile_sums<R, NP>(a.x + m * a.I, a.I, a.panels, q, next, tiles, turn, acc);
  for (int p = 0; p < NP; p++) {
    const int64_t o = (q + p) * OUTPUTS, n = std::min<int64_t>(OUTPUTS, a.O - o);
    const bool whole = n == OUTPUTS;
    const Vec ws = whole ? vload(a.ws + o) : load_first(a.ws + o, n);
    const Vec b = !a.b ? vzero() : whole ? vload(a.b + o) : load_first(a.b + o, n);
    // x . w = (x + 128) . w - 128 sum(w), where the rows come with the offset
    const IVec offset = iload(reinterpret_cast<const int8_t*>(a.offsets + o));
    for (int r = 0; r < R; r++) {
      const Vec sums = ifloat(ROWS_OFFSET ? isub(acc[r * NP + p], offset) : acc[r * NP + p]);
      const Vec out = vfma(sums, vmul(ws, vbroadcast(a.xs[m + r])), b);
      float* y = a.y + (m + r) * a.O + o;
      if (whole) vstore(y, out);
      else store_first(y, out, n);
    }
  }
}

// rows rows (1..TILE_ROWS) from row m against NP blocks
template <int NP, int R = TILE_ROWS>
static void rows_tile(int64_t rows, const VnniArgs& a, int64_t m, int64_t q, int64_t next, int64_t tiles,
                      int64_t turn) {
  if (rows == R) tile<R, NP>(a, m, q, next, tiles, turn);
  else if constexpr (R > 1) rows_tile<NP, R - 1>(rows, a, m, q, next, tiles, turn);
}

// every row against NP blocks from block q, TILE_ROWS rows at a time; the blocks from `next` (or none: -1) are
// prefetched meanwhile, spread over the tiles
template <int NP>
static void block_group(const VnniArgs& a, int64_t q, int64_t next) {
  for (int64_t m = 0; m < a.M; m += TILE_ROWS)
    rows_tile<NP>(std::min<int64_t>(TILE_ROWS, a.M - m), a, m, q, next, (a.M + TILE_ROWS - 1) / TILE_ROWS,
                  m / TILE_ROWS + 1);
}

// the last group's n < TILE_PANELS blocks
template <int NP = TILE_PANELS - 1>
static void last_group(int64_t n, const VnniArgs& a, int64_t q) {
  if (n == NP) block_group<NP>(a, q, -1);
  else if constexpr (NP > 1) last_group<NP - 1>(n, a, q);
}

static WeightCopies<VnniPanels>& vnni_copies() {
  static WeightCopies<VnniPanels> copies;
  return copies;
}

void vnni_product(const at::Tensor& w, const uint8_t* x, const float* xs, int64_t M, const float* ws, const float* b,
                  float* y) {
  const int64_t O = w.size(0), I = w.size(1), Q = (O + OUTPUTS - 1) / OUTPUTS;
  TORCH_CHECK(w.scalar_type() == at::kChar && vnni_gemm(I), "vnni_product: int8 weights of a supported width");
  const VnniPanels packed = vnni_copies().get(w, 0, O, [&] { return pack(w); });
  const VnniArgs a{x, xs, ws, b, packed.panels.data_ptr<int8_t>(), packed.offsets.data_ptr<int32_t>(), y, M, I, O};
  const int64_t groups = (Q + TILE_PANELS - 1) / TILE_PANELS, group_bytes = TILE_PANELS * OUTPUTS * I;
  pool().run(groups, grain_for(group_bytes, 2 * group_bytes * M), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g++) {
      const int64_t q = g * TILE_PANELS, n = std::min<int64_t>(TILE_PANELS, Q - q);
      // the next group's blocks, where this thread takes it next and it is whole
      const int64_t next = g + 1 < end && q + 2 * TILE_PANELS <= Q ? q + TILE_PANELS : -1;
      if (n == TILE_PANELS) block_group<TILE_PANELS>(a, q, next);
      else last_group(n, a, q);
    }
  });
}

#else

bool vnni_gemm_cpu() { return false; }
bool vnni_gemm(int64_t) { return false; }
int vnni_rows_offset() { return 128; }

void vnni_product(const at::Tensor&, const uint8_t*, const float*, int64_t, const float*, const float*, float*) {
  TORCH_CHECK(false, "vnni_product: this build has no int8 GEMM of its own");
}

#endif

}  // namespace folio
