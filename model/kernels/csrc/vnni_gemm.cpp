// The kernels' own int8 GEMM against int8 weights, the rows rounded to int8 (linear.cpp's int8_product), in place of
// oneDNN's, from 1 row (OWN_GEMM_MIN_ROWS: batch-1 decode, batched steps and prompts alike). The weights are packed
// once into panels of 16 outputs x 4 columns (vpdpbusd's operand, and AMX's TDPBUSD's as they are).
// - AVX512-VNNI's vpdpbusd (the avx512vnni build): a tile of 8 rows x 3 panels keeps 24 accumulators in registers,
//   the next panels are prefetched while a group of panels computes, and the sums are scaled as they are stored.
//   oneDNN's packed call costs ~15 us of descriptors and allocations before it multiplies (an int8 GPT-2 step at 32
//   rows makes 98), returns sums that take a second pass to scale, and streamed the LM head's 38 MB at ~300 GMAC/s a
//   thread; for a prompt, _int_mm repacks the weight at every call. On AMD EPYC (Zen 5), one thread, 32 rows:
//   768 -> 2304 127 us against oneDNN's 144, 3072 -> 768 156 against 185, half the LM head (768 -> 25152) 1.52 ms
//   against 1.97; int8 GPT-2's 32-row runner step 13.1 -> 9.5 ms, 31 prompts of 16 tokens 77 -> 61 ms. At batch 1
//   one prefetched sequence of panels reads closer to bandwidth than dot products over 8 weight rows at a time: on an
//   Intel Xeon with AMX (2 vCPUs), int8 GPT-2 at batch 1 75.8 -> 147.5 tok/s against them.
// - AMX-INT8's tiles where the CPU has them (Intel Xeon from Sapphire Rapids on), from AMX_GEMM_MIN_ROWS rows: a
//   tile of 16 rows x 64 columns against up to 4 panels' tiles at a time. On that Xeon, int8 GPT-2's products for a
//   step 1.4x vpdpbusd's speed at 16 and 32 rows, 1.5-1.7x at 48-64, 0.9-1.1x below 8 (python -m bench.int8_gemm);
//   the engine's 32 concurrent requests 909.6 tok/s with oneDNN's AMX GEMM, 1,479.4 here (bench/results/kernels.md).
// - In the AVX2 builds the same panels in 8-output registers: AVX-VNNI's 256-bit vpdpbusd (avx2vnni) or vpmaddubsw
//   (avx2) (bench/results/kernels.md, "The AVX2 tier").
#include <ATen/ATen.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
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
#define FOLIO_AMX_INT8 1  // the tiles' code is compiled for AMX alone (target attributes) and run where the CPU has it
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

bool vnni_gemm_cpu() { return true; }

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

// row m's sums against output block q (its OUTPUTS outputs, those past O dropped), scaled into y
static inline void store_sums(const VnniArgs& a, int64_t m, int64_t q, IVec acc) {
  const int64_t o = q * OUTPUTS, n = std::min<int64_t>(OUTPUTS, a.O - o);
  const bool whole = n == OUTPUTS;
  const Vec ws = whole ? vload(a.ws + o) : load_first(a.ws + o, n);
  const Vec b = !a.b ? vzero() : whole ? vload(a.b + o) : load_first(a.b + o, n);
  // x . w = (x + 128) . w - 128 sum(w), where the rows come with the offset
  const IVec offset = iload(reinterpret_cast<const int8_t*>(a.offsets + o));
  const Vec sums = ifloat(ROWS_OFFSET ? isub(acc, offset) : acc);
  const Vec out = vfma(sums, vmul(ws, vbroadcast(a.xs[m])), b);
  float* y = a.y + m * a.O + o;
  if (whole) vstore(y, out);
  else store_first(y, out, n);
}

// R rows from row m against NP output blocks from block q, into y
template <int R, int NP>
static void tile(const VnniArgs& a, int64_t m, int64_t q, int64_t next, int64_t tiles, int64_t turn) {
  alignas(64) IVec acc[R * NP];
  tile_sums<R, NP>(a.x + m * a.I, a.I, a.panels, q, next, tiles, turn, acc);
  for (int p = 0; p < NP; p++)
    for (int r = 0; r < R; r++) store_sums(a, m + r, q + p, acc[r * NP + p]);
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

#ifdef FOLIO_AMX_INT8
// AMX-INT8: the panels are TDPBUSD's B operand as they are, a tile of 16 4-column groups (64 columns) x 16 outputs
// (64 bytes a row), so one packed copy serves both GEMMs; a tile of up to 16 rows x 64 columns of x (unsigned,
// offset 128, as vpdpbusd takes them) is the A operand; the sums stay in int32 tiles over the whole width, then are
// scaled as they are stored. Linux hands a process the tiles' 8 KB of state only when asked (arch_prctl), once.

static std::atomic<int64_t> amx_min_rows{AMX_GEMM_MIN_ROWS};  // `set_amx_min_rows`
static constexpr int64_t AMX_ROWS = 16;  // a tile's rows

static bool amx_granted() {
  static const bool yes = [] {
    if (!__builtin_cpu_supports("amx-int8") || !__builtin_cpu_supports("amx-tile")) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return yes;
}

// the CPU has AMX-INT8, Linux granted the tile data, enough rows (none: turned off); whole tiles of columns
bool amx_gemm(int64_t rows, int64_t columns) {
  const int64_t min_rows = amx_min_rows.load(std::memory_order_relaxed);
  return min_rows > 0 && rows >= min_rows && columns % 64 == 0 && columns <= VNNI_MAX_WIDTH && amx_granted();
}

int64_t set_amx_min_rows(int64_t rows) { return amx_min_rows.exchange(rows); }

// the rows the tiles read: past one tile, whole tiles of them
static int64_t amx_rows_read(int64_t rows) {
  return rows > AMX_ROWS ? (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : rows;
}

int64_t vnni_rows(int64_t rows, int64_t columns) { return amx_gemm(rows, columns) ? amx_rows_read(rows) : rows; }

// LDTILECFG's operand: tiles 0..3 the sums (rows x 16 int32), 4 the rows (rows x 64 bytes), 5..7 panels' 16 groups
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int r) {
    for (int t = 0; t < 8; t++) {
      bytes[t] = 64;
      rows[t] = t < 5 ? uint8_t(r) : uint8_t(16);
    }
  }
};

// How many 64-column steps ahead amx_sums fetches its panels into L1. A tile register is not renamed: the load of
// the next step's panel tile waits for the products reading the last one, so each step waited on its panels from
// memory. On the Xeon with AMX (2 vCPUs), int8 GPT-2's products for a step, median of 40 paired runs: 1.07-1.17x at
// 8 to 64 rows; 1, 2 or 3 steps ahead alike.
static constexpr int64_t AMX_FETCH_AHEAD = 2;

// RT tiles of rows from row m (RT x 16 rows, or the R configured where M <= 16) against NP panels from panel p, RT x NP
// <= 4 sums tiles: tiles 4 and 5 hold rows, the others panels; sums[(j * 32 + row) * 16 + output] for panel p + j.
// With `fetch` (the first pass over these panels), each step fetches the panels' columns AMX_FETCH_AHEAD steps ahead
// (past their end, the next panels', the next group's: the panels are laid out one after another).
template <int RT, int NP>
__attribute__((target("amx-tile,amx-int8"))) static void amx_sums(const VnniArgs& a, int64_t m, int64_t p,
                                                                   int32_t* sums, bool fetch) {
  static_assert((RT == 1 && NP <= 4) || (RT == 2 && NP <= 2));
  const int64_t I = a.I, panel = I * 16;
  const uint8_t* x = a.x + m * I;
  const int8_t* w = a.panels + p * panel;
  const int8_t* end = a.panels + (a.O + 15) / 16 * panel;
  // sums tile j (RT 1: panel j), or 2 r + j (RT 2: row tile r, panel j)
  _tile_zero(0);
  if constexpr (NP > 1) _tile_zero(1);
  if constexpr (NP > 2 || RT == 2) _tile_zero(2);
  if constexpr (NP > 3 || (RT == 2 && NP > 1)) _tile_zero(3);
  // each panel's 16 groups from column k: k / 4 groups of 64 bytes in
  for (int64_t k = 0; k < I; k += 64) {
    if (fetch) {
      const int64_t ahead = k + AMX_FETCH_AHEAD * 64;
      const int8_t* first = ahead < I ? w + ahead * 16 : w + NP * panel + (ahead - I) * 16;
      if (first + (NP - 1) * panel + 1024 <= end) {
#pragma GCC unroll 4
        for (int j = 0; j < NP; j++)
#pragma GCC unroll 16
          for (int i = 0; i < 1024; i += 64)
            _mm_prefetch(reinterpret_cast<const char*>(first + j * panel + i), _MM_HINT_T0);
      }
    }
    if constexpr (RT == 1) {
      _tile_loadd(4, x + k, I);
      _tile_loadd(5, w + k * 16, 64);
      _tile_dpbusd(0, 4, 5);
      if constexpr (NP > 1) {
        _tile_loadd(6, w + panel + k * 16, 64);
        _tile_dpbusd(1, 4, 6);
      }
      if constexpr (NP > 2) {
        _tile_loadd(7, w + 2 * panel + k * 16, 64);
        _tile_dpbusd(2, 4, 7);
      }
      if constexpr (NP > 3) {
        _tile_loadd(5, w + 3 * panel + k * 16, 64);
        _tile_dpbusd(3, 4, 5);
      }
    } else {
      _tile_loadd(4, x + k, I);
      _tile_loadd(5, x + 16 * I + k, I);
      _tile_loadd(6, w + k * 16, 64);
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(2, 5, 6);
      if constexpr (NP > 1) {
        _tile_loadd(7, w + panel + k * 16, 64);
        _tile_dpbusd(1, 4, 7);
        _tile_dpbusd(3, 5, 7);
      }
    }
  }
  constexpr int64_t S = 2 * AMX_ROWS * 16;
  if constexpr (RT == 1) {
    _tile_stored(0, sums, 64);
    if constexpr (NP > 1) _tile_stored(1, sums + S, 64);
    if constexpr (NP > 2) _tile_stored(2, sums + 2 * S, 64);
    if constexpr (NP > 3) _tile_stored(3, sums + 3 * S, 64);
  } else {
    _tile_stored(0, sums, 64);
    _tile_stored(2, sums + AMX_ROWS * 16, 64);
    if constexpr (NP > 1) {
      _tile_stored(1, sums + S, 64);
      _tile_stored(3, sums + S + AMX_ROWS * 16, 64);
    }
  }
}

__attribute__((target("amx-tile,amx-int8"))) static void amx_configure(const TileConfig& c) { _tile_loadconfig(&c); }
__attribute__((target("amx-tile,amx-int8"))) static void amx_release() { _tile_release(); }

// The product in AMX tiles. Up to 16 rows: one tile of them against groups of 4 panels (each panel read once). More:
// the rows padded to whole tiles of 16 (vnni_rows; the padding's sums not stored), two tiles against groups of 2
// panels (the rows and the panels each loaded once for two products), the last tile alone where their number is
// odd. The groups are split over the pool, each thread's tiles configured for its share.
static void amx_product(const VnniArgs& a) {
  const int64_t P = (a.O + 15) / 16, per_group = a.M <= AMX_ROWS ? 4 : 2, groups = (P + per_group - 1) / per_group;
  const int R = int(std::min<int64_t>(a.M, AMX_ROWS));
  const int64_t group_bytes = per_group * 16 * a.I;
  pool().run(groups, grain_for(group_bytes, 2 * group_bytes * a.M), [&](int64_t begin, int64_t end) {
    const TileConfig config(R);
    amx_configure(config);
    alignas(64) int32_t sums[4 * 2 * AMX_ROWS * 16];
    for (int64_t g = begin; g < end; g++) {
      const int64_t p = g * per_group, np = std::min<int64_t>(per_group, P - p);
      for (int64_t m = 0; m < a.M; m += 2 * AMX_ROWS) {
        const bool fetch = m == 0;
        if (m + AMX_ROWS < a.M) {  // two tiles of rows (past 16 rows, so groups of 2 panels)
          if (np == 2) amx_sums<2, 2>(a, m, p, sums, fetch);
          else amx_sums<2, 1>(a, m, p, sums, fetch);
        } else {
          switch (np) {
            case 4: amx_sums<1, 4>(a, m, p, sums, fetch); break;
            case 3: amx_sums<1, 3>(a, m, p, sums, fetch); break;
            case 2: amx_sums<1, 2>(a, m, p, sums, fetch); break;
            default: amx_sums<1, 1>(a, m, p, sums, fetch);
          }
        }
        const int64_t rows = std::min<int64_t>(2 * AMX_ROWS, a.M - m);
        for (int64_t j = 0; j < np; j++)
          for (int64_t r = 0; r < rows; r++)
            store_sums(a, m + r, (p + j) * PER_PANEL, _mm512_load_si512(sums + (j * 2 * AMX_ROWS + r) * 16));
      }
    }
    amx_release();
  });
}
#endif

void vnni_product(const at::Tensor& w, const uint8_t* x, int64_t held, const float* xs, int64_t M, const float* ws,
                  const float* b, float* y) {
  const int64_t O = w.size(0), I = w.size(1), Q = (O + OUTPUTS - 1) / OUTPUTS;
  TORCH_CHECK(w.scalar_type() == at::kChar && vnni_gemm(I), "vnni_product: int8 weights of a supported width");
  const VnniPanels packed = vnni_copies().get(w, 0, O, [&] { return pack(w); });
  const VnniArgs a{x, xs, ws, b, packed.panels.data_ptr<int8_t>(), packed.offsets.data_ptr<int32_t>(), y, M, I, O};
#ifdef FOLIO_AMX_INT8
  // the tiles read whole tiles of rows past 16: only where x's buffer holds them (set_amx_min_rows may have changed
  // since vnni_rows sized it)
  if (amx_gemm(M, I) && held >= amx_rows_read(M)) return amx_product(a);
#endif
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

void vnni_product(const at::Tensor&, const uint8_t*, int64_t, const float*, int64_t, const float*, const float*,
                  float*) {
  TORCH_CHECK(false, "vnni_product: this build has no int8 GEMM of its own");
}

#endif

#ifndef FOLIO_AMX_INT8
bool amx_gemm(int64_t, int64_t) { return false; }
int64_t set_amx_min_rows(int64_t) { return 0; }
int64_t vnni_rows(int64_t rows, int64_t) { return rows; }
#endif

}  // namespace folio
