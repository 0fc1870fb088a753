// 4-bit weights (model/quantize's "int4", llama.cpp's q4_0 layout): w (O, I / 2) bytes, each group of INT4_GROUP
// (32) input weights of an output row in 16 bytes, weight j in the low nibble of byte j and weight 16 + j in its
// high one, each stored as q + 8 for q in [-8, 7]; a fp16 scale per group, scale (O, I / 32). The weight is q * scale.
//
// Every product multiplies in integers, as llama.cpp's ggml_vec_dot_q4_0_q8_0 does: each row
// of x is rounded to int8 per group of 32 (a scale max |x_g| / 127 per row and group, half to even), the nibbles
// (q + 8, unsigned) times those bytes summed in int32 lanes (AVX512-VNNI's vpdpbusd, AVX-VNNI's in avx2vnni; else
// vpmaddubsw then vpmaddwd, exact: at most 2 * 15 * 127 per pair), the +8 taken off by starting each lane at -8 times
// its bytes' sum, and each group's lanes added into fp32 times the group's two scales. Two ways, by the rows:
// - dot products (a few rows, AVX-512 builds: fewer than INT4_GEMM_MIN_ROWS): lanes over columns, a vector of a
//   weight row's bytes a block (4 groups; 2 with AVX2) whose low and high nibbles meet x's bytes laid out to match,
//   tiles of 4 weight rows x 4 (AVX-512) or 3 (AVX2) x rows, the weight rows split over the pool;
// - a GEMM (batched steps and prompts; in the AVX2 builds every product): registers of outputs x 4 columns, as
//   vnni_gemm.cpp's int8 GEMM, from a copy of the weight's bytes regrouped once so that a load and a mask or shift
//   give a register of them, the sums scaled per group into fp32 accumulators; docs/quantization.md.
#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "copies.h"
#include "ops.h"
#include "pool.h"
#include "quantized_rows.h"
#include "simd.h"

namespace folio {

#ifdef FOLIO_VEC512
using IVec = __m512i;
#else
using IVec = __m256i;
#endif
// A block of the dot products: one integer vector of a weight row's bytes, 4 * LANES bytes, which are GROUPS groups
// (4 with AVX-512, 2 with AVX2): its low nibbles are one vector of weights (each group's 0-15, 16 bytes a group), its
// high nibbles another (each group's 16-31), so that a load, a shift and two masks give both, each 4 lanes a group
static constexpr int64_t GROUPS = LANES / 4;
static constexpr int64_t BLOCK = GROUPS * INT4_GROUP;  // weights a block
static constexpr int64_t BLOCK_BYTES = BLOCK / 2;  // a weight row's bytes of a block: one vector
static constexpr int64_t RUN_GROUPS = 8;  // groups whose fp16 scales one 128-bit load holds, converted at once
static constexpr int64_t RUN = RUN_GROUPS / GROUPS;  // their blocks: 2 with AVX-512, 4 with AVX2
static constexpr int64_t AHEAD_BYTES = 8192;  // how far ahead of the rows it multiplies a batch-1 product fetches
static_assert(INT4_GROUP == 32 && BLOCK_BYTES == 4 * LANES, "int4.cpp: groups of 32, a vector of bytes a block");

void check_int4(const Weight& w) {
  TORCH_CHECK(w.I % INT4_GROUP == 0, "linear: an int4 weight's rows hold whole groups of 32 (I = ", w.I, ")");
  TORCH_CHECK(w.scale && w.scale->scalar_type() == at::kHalf && w.scale->is_contiguous() && w.scale->dim() == 2
              && w.scale->size(0) == w.O && w.scale->size(1) == w.I / INT4_GROUP,
              "linear: an int4 weight (O, I / 2) needs its fp16 scales (O, I / 32)");
  TORCH_CHECK(!w.packed, "linear: an int4 weight has no packed copy");
  check_floats(w.bias, w.O, "linear: bias");
}

// A group of x's row (INT4_GROUP values) rounded to int8 in q as a row of linear.cpp's int8 products is: returns
// the scale, max |x_g| / 127 (1 for all zeros), each value round(x / scale) half to even; for a group holding a NaN
// or an infinity NaN, and zeros
static float round_group(const float* xg, int8_t* q) {
  float scale;
  QuantizedRows<int8_t>::quantize_row(xg, INT4_GROUP, 127.f, 0, q, scale);
  return scale;
}

// Without vpdpbusd (the avx2 and avx512 builds), a GEMM tile keeps each group's products as vpmaddubsw's pairs in
// int16 lanes, widened to int32 once a group (vpmaddwd) rather than once per 4 columns: 8 steps of two pairs of at
// most 15 * 127 each, 30,480 at most, exact below 32,767.
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
static constexpr bool PAIRS_IN_INT16 = false;
#else
static constexpr bool PAIRS_IN_INT16 = true;
#endif

// the products of w's unsigned bytes with x's signed ones, summed by pairs into int16 lanes; their sum
static inline IVec pairs(IVec w, IVec x) {
#ifdef FOLIO_VEC512
  return _mm512_maddubs_epi16(w, x);
#else
  return _mm256_maddubs_epi16(w, x);
#endif
}
static inline IVec add_pairs(IVec a, IVec b) {
#ifdef FOLIO_VEC512
  return _mm512_add_epi16(a, b);
#else
  return _mm256_add_epi16(a, b);
#endif
}
// start + the int16 pairs summed by twos into int32 lanes
static inline IVec widen_pairs(IVec start, IVec p) {
#ifdef FOLIO_VEC512
  return _mm512_add_epi32(start, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
#else
  return _mm256_add_epi32(start, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

// start + the sums of each lane's 4 products of w's unsigned bytes with x's signed ones, exact in int32
static inline IVec dot(IVec w, IVec x, IVec start) {
#if defined(FOLIO_VEC512) && defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(start, w, x);
#elif defined(FOLIO_VEC512)
  return widen_pairs(start, pairs(w, x));
#else
  return products_by_fours(start, w, x);  // AVX-VNNI's vpdpbusd (avx2vnni), else vpmaddubsw and vpmaddwd (simd.h)
#endif
}

static inline IVec iload(const uint8_t* p) {
#ifdef FOLIO_VEC512
  return _mm512_loadu_si512(p);
#else
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
#endif
}

static inline IVec ibroadcast(int32_t v) {
#ifdef FOLIO_VEC512
  return _mm512_set1_epi32(v);
#else
  return _mm256_set1_epi32(v);
#endif
}

static inline void istore(uint8_t* p, IVec v) {
#ifdef FOLIO_VEC512
  _mm512_storeu_si512(p, v);
#else
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
#endif
}

static inline IVec iand(IVec a, IVec b) {
#ifdef FOLIO_VEC512
  return _mm512_and_si512(a, b);
#else
  return _mm256_and_si256(a, b);
#endif
}

// each 16-bit lane shifted right by 4: a byte's high nibble to its low one (the bits from the next byte masked after)
static inline IVec isrl4(IVec v) {
#ifdef FOLIO_VEC512
  return _mm512_srli_epi16(v, 4);
#else
  return _mm256_srli_epi16(v, 4);
#endif
}

static inline Vec to_floats(IVec v) {
#ifdef FOLIO_VEC512
  return _mm512_cvtepi32_ps(v);
#else
  return _mm256_cvtepi32_ps(v);
#endif
}

// x (M, I) rounded to int8 per group for the integer products: per row and block, the x bytes that meet the block's
// low nibbles (each group's values 0-15, 16 bytes a group) and then those that meet its high ones (16-31), 4 * LANES
// bytes each; LANES int32 of -8 times the sum of the 8 bytes each lane meets (the accumulators' start); and LANES
// fp32 of each lane's group's scale (0 past the row's last group; NaN for a group holding a NaN or an infinity, so
// its row comes out NaN). And each group's scale, in order (`group_scales`).
struct Int4Rows {
  static constexpr int64_t BLOCK_STRIDE = 4 * BLOCK_BYTES;  // bytes a block: low, high, starts, scales
  Int4Rows(const float* x, int64_t M, int64_t I)
      : blocks((I / INT4_GROUP + GROUPS - 1) / GROUPS), stride(BLOCK_STRIDE * blocks), groups(I / INT4_GROUP),
        data(M * stride, 0), scales(M * groups) {
    pool().run(M, std::max<int64_t>(1, 8192 / I), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; m++) row(x + m * I, I, data.data() + m * stride, scales.data() + m * groups);
    });
  }
  void row(const float* x, int64_t I, uint8_t* out, float* group_scales) const {
    for (int64_t g = 0; g < I / INT4_GROUP; g++) {
      uint8_t* blk = out + (g / GROUPS) * BLOCK_STRIDE;
      const int64_t h = g % GROUPS;
      int8_t q[INT4_GROUP];
      const float scale = group_scales[g] = round_group(x + g * INT4_GROUP, q);
      for (int64_t j = 0; j < INT4_GROUP; j++) blk[(j / 16) * BLOCK_BYTES + h * 16 + j % 16] = uint8_t(q[j]);
      float* lane_scales = reinterpret_cast<float*>(blk + 3 * BLOCK_BYTES);
      for (int64_t k = 0; k < 4; k++) lane_scales[h * 4 + k] = scale;
    }
    for (int64_t b = 0; b < blocks; b++) {  // each lane's start: -8 times the sum of its 4 low and 4 high bytes
      const int8_t* q = reinterpret_cast<const int8_t*>(out + b * BLOCK_STRIDE);
      int32_t* start = reinterpret_cast<int32_t*>(out + b * BLOCK_STRIDE + 2 * BLOCK_BYTES);
      for (int64_t lane = 0; lane < LANES; lane++) {
        int32_t sum = 0;
        for (int64_t k = 0; k < 4; k++) sum += q[4 * lane + k] + q[BLOCK_BYTES + 4 * lane + k];
        start[lane] = -8 * sum;
      }
    }
  }
  const uint8_t* block(int64_t m, int64_t b) const { return data.data() + m * stride + b * BLOCK_STRIDE; }
  // row m's scales of groups g.. (one each; `block` has them by lane)
  const float* group_scales(int64_t m, int64_t g) const { return scales.data() + m * groups + g; }
  int64_t blocks, stride, groups;
  std::vector<uint8_t> data;
  std::vector<float> scales;
};

// a weight row's bytes of a block (`groups` of its GROUPS there: fewer at the row's end, the rest read as zero),
// as its low nibbles and its high nibbles (q + 8, unsigned), each a vector of bytes in Int4Rows' order
static inline void unpack(const uint8_t* p, int64_t groups, IVec& low, IVec& high) {
#ifdef FOLIO_VEC512
  const IVec bytes = groups == GROUPS ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ull << (16 * groups)) - 1, p);
  const IVec nibble = _mm512_set1_epi8(0x0F);
  low = _mm512_and_si512(bytes, nibble);
  high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
#else
  const IVec bytes = groups == GROUPS ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                      : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const IVec nibble = _mm256_set1_epi8(0x0F);
  low = _mm256_and_si256(bytes, nibble);
  high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
#endif
}

// lane l of a block: the (l / 4)-th of its groups; `pick(k)` the index of that group's scale among a run's
static inline IVec pick(int64_t k) {
#ifdef FOLIO_VEC512
  return _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                          _mm512_set1_epi32(int32_t(GROUPS * k)));
#else
  return _mm256_add_epi32(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_set1_epi32(int32_t(GROUPS * k)));
#endif
}

static inline Vec permute(IVec index, Vec v) {
#ifdef FOLIO_VEC512
  return _mm512_permutexvar_ps(index, v);
#else
  return _mm256_permutevar8x32_ps(v, index);
#endif
}

// RUN_GROUPS fp32 from p in a vector's first lanes (`n` of them, the rest 0: what follows p may be another row's)
static inline Vec run_floats(const float* p, int64_t n = RUN_GROUPS) {
  float f[RUN_GROUPS] = {};
  if (n < RUN_GROUPS) {
    std::memcpy(f, p, n * sizeof(float));
    p = f;
  }
#ifdef FOLIO_VEC512
  return _mm512_castps256_ps512(_mm256_loadu_ps(p));
#else
  return _mm256_loadu_ps(p);
#endif
}

// RUN_GROUPS fp16 scales from s as fp32 in a vector's first lanes (`n` of them, the rest 0)
static inline Vec run_scales(const uint16_t* s, int64_t n = RUN_GROUPS) {
  uint16_t h[RUN_GROUPS] = {};
  if (n < RUN_GROUPS) {
    std::memcpy(h, s, n * sizeof(uint16_t));
    s = h;
  }
  const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
#ifdef FOLIO_VEC512
  return _mm512_castps256_ps512(f);
#else
  return f;
#endif
}

// acc[r][m] += weight rows r < R (from w, row_bytes apart) against x rows m0 + m < MB, over the run of blocks from
// b: RUN whole blocks (WHOLE), else the row's last ones, `groups` groups from b's first (its last block may hold
// fewer than GROUPS):
// each row's RUN_GROUPS group scales of the run converted once (times x's at one x row), a block's lanes picked from
// them by one permute; a block's two vectors of products summed into one int32 accumulator, converted and scaled
// once. `ahead`: the bytes of the next weight rows, fetched into the cache meanwhile (batch 1: the weights stream).
template <int R, int MB, bool WHOLE>
static inline void run_products(const uint8_t* w, const uint16_t* s, int64_t row_bytes, int64_t scale_stride,
                                const Int4Rows& x, int64_t m0, int64_t b, int64_t groups, const uint8_t* ahead,
                                Vec (&acc)[R][MB]) {
  // WHOLE: a run of RUN whole blocks (the loops unrolled, no masks)
  const int64_t in_run = WHOLE ? RUN_GROUPS : std::min<int64_t>(groups, RUN_GROUPS);
  Vec scales[R];
  for (int r = 0; r < R; r++) {
    scales[r] = WHOLE ? run_scales(s + r * scale_stride + b * GROUPS)
                      : run_scales(s + r * scale_stride + b * GROUPS, in_run);
    if constexpr (MB == 1)  // x's, once for all
      scales[r] = vmul(scales[r], WHOLE ? run_floats(x.group_scales(m0, b * GROUPS))
                                        : run_floats(x.group_scales(m0, b * GROUPS), in_run));
  }
  const int64_t blocks = WHOLE ? RUN : (in_run + GROUPS - 1) / GROUPS;
  for (int64_t k = 0; k < blocks; k++) {
    const IVec index = pick(k);
    const int64_t in_block = WHOLE ? GROUPS : std::min<int64_t>(in_run - k * GROUPS, GROUPS);
    for (int r = 0; r < R; r++) {
      const uint8_t* p = w + r * row_bytes + (b + k) * BLOCK_BYTES;
      if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * row_bytes + (b + k) * BLOCK_BYTES),
                                         _MM_HINT_T0);
      IVec low, high;
      unpack(p, in_block, low, high);
      const Vec sv = permute(index, scales[r]);
      for (int m = 0; m < MB; m++) {
        const uint8_t* xb = x.block(m0 + m, b + k);
        const IVec sums = dot(high, iload(xb + BLOCK_BYTES), dot(low, iload(xb), iload(xb + 2 * BLOCK_BYTES)));
        if constexpr (MB == 1) acc[r][m] = vfma(to_floats(sums), sv, acc[r][m]);
        else acc[r][m] = vfma(to_floats(sums), vmul(sv, vload(reinterpret_cast<const float*>(xb + 3 * BLOCK_BYTES))),
                              acc[r][m]);
      }
    }
  }
}

// y[m, o + r] for R weight rows from o and MB x rows from m0 (y's row stride O); at batch 1 the rows some
// AHEAD_BYTES further on are fetched into the cache while these are multiplied
template <int R, int MB>
static inline void int4_tile(const Weight& w, const Int4Rows& x, int64_t m0, int64_t o, float* y) {
  const int64_t row_bytes = w.I / 2, groups = w.I / INT4_GROUP;
  const uint8_t* wp = w.w.data_ptr<uint8_t>() + o * row_bytes;
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(w.scale->data_ptr<at::Half>()) + o * groups;
  // rows this far ahead (a multiple of R, some AHEAD_BYTES of them) are fetched into the cache meanwhile
  const int64_t rows_ahead = (AHEAD_BYTES / row_bytes + R) / R * R;
  const uint8_t* ahead = MB == 1 && o + rows_ahead + R <= w.O ? wp + rows_ahead * row_bytes : nullptr;
  Vec acc[R][MB];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) acc[r][m] = vzero();
  int64_t b = 0;
  for (; (b + RUN) * GROUPS <= groups; b += RUN)
    run_products<R, MB, true>(wp, sp, row_bytes, groups, x, m0, b, 0, ahead, acc);
  if (b * GROUPS < groups)
    run_products<R, MB, false>(wp, sp, row_bytes, groups, x, m0, b, groups - b * GROUPS, ahead, acc);
  const float* bias = w.bias ? w.bias->data_ptr<float>() + o : nullptr;
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MB; m++) y[(m0 + m) * w.O + o + r] = vsum(acc[r][m]) + (bias ? bias[r] : 0.f);
}

// x rows a tile: 4 x 4 accumulators in AVX-512's 32 registers, 4 x 3 in AVX2's 16
#ifdef FOLIO_VEC512
static constexpr int TILE_X_ROWS = 4;
#else
static constexpr int TILE_X_ROWS = 3;
#endif

// R weight rows from o against the MB < TILE_X_ROWS x rows left from m
template <int R, int MB = TILE_X_ROWS - 1>
static inline void int4_rest(const Weight& w, const Int4Rows& x, int64_t left, int64_t m, int64_t o, float* y) {
  if (left == MB) int4_tile<R, MB>(w, x, m, o, y);
  else if constexpr (MB > 1) int4_rest<R, MB - 1>(w, x, left, m, o, y);
}

// R weight rows from o against every x row, TILE_X_ROWS at a time
template <int R>
static inline void int4_rows(const Weight& w, const Int4Rows& x, int64_t M, int64_t o, float* y) {
  int64_t m = 0;
  for (; m + TILE_X_ROWS <= M; m += TILE_X_ROWS) int4_tile<R, TILE_X_ROWS>(w, x, m, o, y);
  if (m < M) int4_rest<R>(w, x, M - m, m, o, y);
}

// the integer products for M rows: 4 weight rows a task, split over the pool
static void int4_kernel(const Weight& w, const float* x, int64_t M, float* y) {
  const Int4Rows rows(x, M, w.I);
  constexpr int64_t R = 4;
  const int64_t tasks = (w.O + R - 1) / R;
  const int64_t grain = grain_for(R * (w.I / 2 + w.I / INT4_GROUP * 2), 2 * R * w.I * M);
  pool().run(tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      const int64_t o = t * R, n = std::min(R, w.O - o);
      if (n == R) int4_rows<4>(w, rows, M, o, y);
      else
        for (int64_t r = 0; r < n; r++) int4_rows<1>(w, rows, M, o + r, y);
    }
  });
}

// The GEMM, for GEMM_MIN_ROWS rows or more (a batched decode step, a prompt; in the AVX2 builds every product):
// registers of LANES outputs x 4 columns, as vnni_gemm.cpp's int8 GEMM, instead of the dot products' lanes over
// columns, which reduce every output across a vector per row and load each x block's bytes, sums and scales once per
// weight row. The weight is packed once (pack_int4: its bytes regrouped, not unpacked, each group's fp16 scales
// beside them, so a copy as large as the weight and its scales) so that one load holds LANES outputs x 4 bytes of a
// group, each byte two 4-column steps' nibbles: an AND and a shift make two registers of weights. Every row meets
// them in tiles of GEMM_ROWS rows x GEMM_REGS registers: per group, the tile's int32 sums start at -8 times the
// row's group sum (the nibbles are q + 8), take 8 steps of 4 columns (each a register of weights times a row's 4
// bytes broadcast; without vpdpbusd as int16 pairs, PAIRS_IN_INT16), and are added into fp32 accumulators times the
// group's weight scales and the row's group scale. With more rows than a
// tile the task first splits its nibbles into a scratch of its thread, which every tile then loads. Before, each
// task transposed its outputs' bytes as well at every call (a 4 x 4 transpose of int32, then the split): at batch 1
// that took 5x the products' time.
#ifdef FOLIO_VEC512
static constexpr int GEMM_ROWS = 4, GEMM_REGS = 3;  // 12 int32 and 12 fp32 accumulators of AVX-512's 32 registers
#else
static constexpr int GEMM_ROWS = 3, GEMM_REGS = 2;  // 6 and 6 of AVX2's 16
#endif
static constexpr int64_t GEMM_OUTPUTS = GEMM_REGS * LANES;  // outputs a task: 48 (AVX-512) or 16 (AVX2)
static constexpr int64_t GROUP_BYTES = INT4_GROUP / 2 * GEMM_OUTPUTS;  // a task's nibbles a group
// a task's packed copy a group: its nibbles, then its outputs' fp16 scales
static constexpr int64_t PACKED_GROUP = GROUP_BYTES + 2 * GEMM_OUTPUTS;
// rows rounded at a time: x's bytes (GEMM_MAX_ROWS x I), read by every task, stay in L2
static constexpr int64_t GEMM_MAX_ROWS = 256;
// from how many rows: in the AVX2 builds from OWN_GEMM_MIN_ROWS (1: at batch 1 too, as their int8 GEMM)
#ifdef FOLIO_VEC512
static constexpr int64_t GEMM_MIN_ROWS = INT4_GEMM_MIN_ROWS;
#else
static constexpr int64_t GEMM_MIN_ROWS = OWN_GEMM_MIN_ROWS;
#endif

// x (M, I) rounded per row and group (round_group) in the columns' order, each (row, group)'s scale, and -8 times
// its bytes' sum (the accumulators' start: the nibbles are q + 8)
struct GemmRows {
  GemmRows(const float* x, int64_t M, int64_t I)
      : I(I), groups(I / INT4_GROUP), values(M * I), scales(M * groups), starts(M * groups) {
    pool().run(M, std::max<int64_t>(1, 8192 / I), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; m++)
        for (int64_t g = 0; g < groups; g++) {
          int8_t* q = values.data() + m * I + g * INT4_GROUP;
          scales[m * groups + g] = round_group(x + m * I + g * INT4_GROUP, q);
          int32_t sum = 0;
          for (int64_t j = 0; j < INT4_GROUP; j++) sum += q[j];
          starts[m * groups + g] = -8 * sum;
        }
    });
  }
  int64_t I, groups;
  std::vector<int8_t> values;
  std::vector<float> scales;
  std::vector<int32_t> starts;
};

// w packed for the GEMM: for each task's GEMM_OUTPUTS outputs (outputs past O repeat the last: computed, never
// stored) and group (PACKED_GROUP bytes), 4 pieces k of GEMM_OUTPUTS outputs x 4 bytes, bytes 4k..4k+3 of the output's
// 16 for the group (low nibbles: columns 4k..4k+3, high: 16 + 4k..16 + 4k + 3), then the outputs' scales for the
// group (fp16, as stored). Read from w.scale at each call instead, the scales took a scalar transpose per task and
// group (one value per 32 weights): at batch 1 on AVX2 about as long as the products.
static at::Tensor pack_int4(const Weight& w) {
  const int64_t groups = w.I / INT4_GROUP, row_bytes = w.I / 2, tasks = (w.O + GEMM_OUTPUTS - 1) / GEMM_OUTPUTS;
  at::Tensor out = at::empty({tasks, groups, PACKED_GROUP}, w.w.options());
  const uint8_t* wp = w.w.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(w.scale->data_ptr<at::Half>());
  uint8_t* dst = out.data_ptr<uint8_t>();
  pool().run(tasks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++)
      for (int64_t j = 0; j < GEMM_OUTPUTS; j++) {
        const int64_t o = std::min(t * GEMM_OUTPUTS + j, w.O - 1);
        for (int64_t g = 0; g < groups; g++) {
          uint8_t* group = dst + (t * groups + g) * PACKED_GROUP;
          for (int64_t k = 0; k < 4; k++)
            std::memcpy(group + k * GEMM_OUTPUTS * 4 + j * 4, wp + o * row_bytes + g * 16 + 4 * k, 4);
          std::memcpy(group + GROUP_BYTES + 2 * j, sp + o * groups + g, 2);
        }
      }
  });
  return out;
}

static WeightCopies<at::Tensor>& int4_copies() {
  static WeightCopies<at::Tensor> copies;
  return copies;
}

// y[m..m+R-1, o..] for R rows from m against the task's outputs from o (y's row stride O): `packed` its packed copy
// (PACKED_GROUP a group: the scales are read there), `panel` its nibbles: the same, or with SPLIT those nibbles split
// (split_panel: 2 GROUP_BYTES a group, the low nibbles' 4 pieces then the high ones')
template <int R, bool SPLIT>
static inline void gemm_tile(const GemmRows& x, int64_t m, const uint8_t* packed, const uint8_t* panel,
                             const float* bias, int64_t O, int64_t o, float* y) {
  const int64_t I = x.I, groups = x.groups;
  const IVec nibble = ibroadcast(0x0F0F0F0F);
  Vec f[R][GEMM_REGS];
  for (int r = 0; r < R; r++)
    for (int p = 0; p < GEMM_REGS; p++) f[r][p] = vzero();
  for (int64_t g = 0; g < groups; g++) {
    IVec acc[R][GEMM_REGS], held[R][GEMM_REGS];  // held: the group's pairs (PAIRS_IN_INT16), acc set after them
    if constexpr (!PAIRS_IN_INT16)
      for (int r = 0; r < R; r++) {
        const IVec start = ibroadcast(x.starts[(m + r) * groups + g]);
        for (int p = 0; p < GEMM_REGS; p++) acc[r][p] = start;
      }
    const uint8_t* pg = panel + g * (SPLIT ? 2 * GROUP_BYTES : PACKED_GROUP);
    const int8_t* xg = x.values.data() + m * I + g * INT4_GROUP;
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
      IVec low[GEMM_REGS], high[GEMM_REGS];
      for (int p = 0; p < GEMM_REGS; p++) {
        const uint8_t* piece = pg + k * GEMM_OUTPUTS * 4 + p * LANES * 4;
        if constexpr (SPLIT) {
          low[p] = iload(piece);
          high[p] = iload(piece + GROUP_BYTES);
        } else {
          const IVec v = iload(piece);
          low[p] = iand(v, nibble);
          high[p] = iand(isrl4(v), nibble);
        }
      }
      for (int r = 0; r < R; r++) {
        int32_t four;
        std::memcpy(&four, xg + r * I + 4 * k, 4);
        const IVec a = ibroadcast(four);
        std::memcpy(&four, xg + r * I + 16 + 4 * k, 4);
        const IVec b = ibroadcast(four);
        for (int p = 0; p < GEMM_REGS; p++) {
          if constexpr (PAIRS_IN_INT16) {
            const IVec both = add_pairs(pairs(low[p], a), pairs(high[p], b));
            held[r][p] = k == 0 ? both : add_pairs(held[r][p], both);
          } else {
            acc[r][p] = dot(high[p], b, dot(low[p], a, acc[r][p]));
          }
        }
      }
    }
    if constexpr (PAIRS_IN_INT16)
      for (int r = 0; r < R; r++) {
        const IVec start = ibroadcast(x.starts[(m + r) * groups + g]);
        for (int p = 0; p < GEMM_REGS; p++) acc[r][p] = widen_pairs(start, held[r][p]);
      }
    for (int p = 0; p < GEMM_REGS; p++) {
      const Vec ws = vload(reinterpret_cast<const fp16*>(packed + g * PACKED_GROUP + GROUP_BYTES) + p * LANES);
      for (int r = 0; r < R; r++)
        f[r][p] = vfma(to_floats(acc[r][p]), vmul(ws, vbroadcast(x.scales[(m + r) * groups + g])), f[r][p]);
    }
  }
  for (int p = 0; p < GEMM_REGS; p++) {
    const int64_t op = o + p * LANES, n = std::min<int64_t>(LANES, O - op);
    if (n <= 0) break;
    alignas(64) float b[LANES] = {}, out[LANES];
    if (bias) std::copy(bias + op, bias + op + n, b);
    for (int r = 0; r < R; r++) {
      vstore(out, vadd(f[r][p], vload(b)));
      std::copy(out, out + n, y + (m + r) * O + op);
    }
  }
}

// the last R < GEMM_ROWS rows from m
template <bool SPLIT, int R = GEMM_ROWS - 1>
static inline void gemm_rest(int64_t left, const GemmRows& x, int64_t m, const uint8_t* packed, const uint8_t* panel,
                             const float* bias, int64_t O, int64_t o, float* y) {
  if (left == R) gemm_tile<R, SPLIT>(x, m, packed, panel, bias, O, o, y);
  else if constexpr (R > 1) gemm_rest<SPLIT, R - 1>(left, x, m, packed, panel, bias, O, o, y);
}

// every row from m0 against a task's outputs, GEMM_ROWS at a time
template <bool SPLIT>
static void gemm_rows(const GemmRows& x, int64_t M, const uint8_t* packed, const uint8_t* panel, const float* bias,
                      int64_t O, int64_t o, float* y) {
  int64_t m = 0;
  for (; m + GEMM_ROWS <= M; m += GEMM_ROWS) gemm_tile<GEMM_ROWS, SPLIT>(x, m, packed, panel, bias, O, o, y);
  if (m < M) gemm_rest<SPLIT>(M - m, x, m, packed, panel, bias, O, o, y);
}

// a task's packed nibbles (groups x PACKED_GROUP) split into `out` (groups x 2 GROUP_BYTES): for more than one tile
// of rows, which then load their weights rather than each split them again
static void split_panel(const uint8_t* packed, int64_t groups, uint8_t* out) {
  const IVec nibble = ibroadcast(0x0F0F0F0F);
  for (int64_t g = 0; g < groups; g++)
    for (int64_t b = 0; b < GROUP_BYTES; b += 4 * LANES) {
      const IVec v = iload(packed + g * PACKED_GROUP + b);
      istore(out + 2 * g * GROUP_BYTES + b, iand(v, nibble));
      istore(out + (2 * g + 1) * GROUP_BYTES + b, iand(isrl4(v), nibble));
    }
}

// M rows through the GEMM: GEMM_OUTPUTS outputs a task, split over the pool, from the weight's packed copy (made at
// first use and kept while the weight and its scales live unchanged; an inference tensor, which has no version
// counter to tell, is packed for the call)
static void int4_gemm(const Weight& w, const float* x, int64_t M, float* y) {
  const at::Tensor packed = w.w.is_inference() || w.scale->is_inference()
                                ? pack_int4(w)
                                : int4_copies().get(w.w, 0, w.O, [&] { return pack_int4(w); }, &*w.scale);
  const GemmRows rows(x, M, w.I);
  const int64_t groups = w.I / INT4_GROUP, tasks = (w.O + GEMM_OUTPUTS - 1) / GEMM_OUTPUTS;
  const int64_t grain = grain_for(groups * PACKED_GROUP, 2 * GEMM_OUTPUTS * w.I * M);
  const float* bias = w.bias ? w.bias->data_ptr<float>() : nullptr;
  const uint8_t* bytes = packed.data_ptr<uint8_t>();
  pool().run(tasks, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> split;
    split.resize(M > GEMM_ROWS ? 2 * groups * GROUP_BYTES : 0);
    for (int64_t t = begin; t < end; t++) {
      const int64_t o = t * GEMM_OUTPUTS;
      const uint8_t* packed = bytes + t * groups * PACKED_GROUP;
      if (M > GEMM_ROWS) {
        split_panel(packed, groups, split.data());
        gemm_rows<true>(rows, M, packed, split.data(), bias, w.O, o, y);
      } else {
        gemm_rows<false>(rows, M, packed, packed, bias, w.O, o, y);
      }
    }
  });
}

// Any number of rows: fewer than GEMM_MIN_ROWS through the dot products above (each piece's rounded rows, 3 bytes a
// value, stay in L2 while every weight row streams past them), more through the GEMM, GEMM_MAX_ROWS at a time.
// Dequantizing the weight to bf16 for torch's bf16 GEMM instead (what a prompt's rows against bf16 weights get) was
// slower for a batch (32 rows of GPT-2's four block products: 44 ms to dequantize through torch's ops, 4.7 ms to
// multiply, 6.5 in the GEMM here); for a 512-row prompt torch's bf16 GEMM in AMX took 31 ms against 64 here, which
// a dequantization of a few ms in C++ could turn into a win on CPUs with AMX (not done: docs/quantization.md).
void int4_product(const Weight& w, const float* x, int64_t M, float* y) {
  if (M >= GEMM_MIN_ROWS) {
    for (int64_t m = 0; m < M; m += GEMM_MAX_ROWS)
      int4_gemm(w, x + m * w.I, std::min(GEMM_MAX_ROWS, M - m), y + m * w.O);
    return;
  }
  for (int64_t m = 0; m < M; m += MAX_ROWS) int4_kernel(w, x + m * w.I, std::min(MAX_ROWS, M - m), y + m * w.O);
}

}  // namespace folio
