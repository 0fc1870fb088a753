// The kernels' entry points: defined in linear.cpp, attention.cpp and block.cpp, bound to Python in bindings.cpp.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

// the thresholds are defined once, in model/kernels/build.py, which passes them to the compiler
#if !defined(FOLIO_MAX_ROWS) || !defined(FOLIO_PACKED_MIN_ROWS) || !defined(FOLIO_PANEL) \
    || !defined(FOLIO_BF16_GEMM_MIN_ROWS) || !defined(FOLIO_INT8_GEMM_MIN_ROWS)             \
    || !defined(FOLIO_INT8_GEMM_MIN_WEIGHTS) || !defined(FOLIO_OWN_GEMM_MIN_ROWS)              \
    || !defined(FOLIO_AMX_GEMM_MIN_ROWS) || !defined(FOLIO_INT4_GEMM_MIN_ROWS)
#error "build with model/kernels/build.py: it defines the FOLIO_ limits"
#endif

namespace folio {

using OptionalTensor = c10::optional<at::Tensor>;

// the thresholds of linear.cpp's rule (by_kernels): what each means and why its value, in model/kernels/build.py
static constexpr int64_t MAX_ROWS = FOLIO_MAX_ROWS;
static constexpr int64_t PACKED_MIN_ROWS = FOLIO_PACKED_MIN_ROWS;
static constexpr int64_t BF16_GEMM_MIN_ROWS = FOLIO_BF16_GEMM_MIN_ROWS;
static constexpr int64_t INT8_GEMM_MIN_ROWS = FOLIO_INT8_GEMM_MIN_ROWS;
static constexpr int64_t OWN_GEMM_MIN_ROWS = FOLIO_OWN_GEMM_MIN_ROWS;
static constexpr int64_t AMX_GEMM_MIN_ROWS = FOLIO_AMX_GEMM_MIN_ROWS;
static constexpr int64_t INT4_GEMM_MIN_ROWS = FOLIO_INT4_GEMM_MIN_ROWS;
static constexpr int64_t INT8_GEMM_MIN_WEIGHTS = FOLIO_INT8_GEMM_MIN_WEIGHTS;
// a packed weight's panels hold this many outputs each: (ceil(O / PANEL), I, PANEL) (made by ops.pack in Python)
static constexpr int64_t PANEL = FOLIO_PANEL;
static_assert(PANEL == 16, "linear.cpp's panel tiles hold 16 outputs");

// that t, where given, holds n contiguous fp32 values (a bias, a scale, a layer norm's weight); `what` names it
inline void check_floats(const OptionalTensor& t, int64_t n, const char* what) {
  TORCH_CHECK(!t || (t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n), what);
}

// A product's weight as the kernels read it, checked once: w (O, I) fp32, int8 (with a fp32 scale per output row)
// or bf16, an optional fp32 bias (O) and the packed copy (ceil(O / PANEL), I, PANEL) of ops.pack, or none; or int4
// (below: w (O, I / 2) bytes, I counts the weights)
struct Weight {
  Weight(at::Tensor w, OptionalTensor bias, OptionalTensor packed, OptionalTensor scale);
  at::Tensor w;
  OptionalTensor bias, packed, scale;
  int64_t O, I;
};

// y (M, O) = x (M, I) fp32 @ (w * scale).T + b: the kernels for up to MAX_ROWS rows (from PACKED_MIN_ROWS rows
// through the packed copy when there is one, else dot products), torch's linear (or its int8 or bf16 GEMM) otherwise
void product_into(const Weight& w, const float* x, int64_t M, float* y);

// 4-bit weights (int4.cpp): w (O, I / 2) uint8, two weights a byte (q + 8 in each nibble, llama.cpp's q4_0 order),
// scale (O, I / INT4_GROUP) fp16; the weight is q * scale. `check_int4` checks a Weight of them (its constructor
// calls it); `int4_product` is product_into for them, any number of rows: x rounded to int8 per row and group of
// INT4_GROUP (a scale max |x_g| / 127, half to even), the integer products summed exactly per group
static constexpr int64_t INT4_GROUP = 32;
void check_int4(const Weight& w);
void int4_product(const Weight& w, const float* x, int64_t M, float* y);

// the same on tensors: x (M, I) -> (M, O) (any float type; the kernels take fp32)
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const OptionalTensor& b, const OptionalTensor& packed,
                  const OptionalTensor& scale);

// whether `linear` sends `rows` rows against a weight of type `weight` and `weights` values to torch's bf16 GEMM
// (the rule: linear.cpp, by_kernels)
bool bf16_gemm(int64_t rows, at::ScalarType weight, int64_t weights);

// whether `linear` sends them to an int8 GEMM (the kernels' VNNI one where it takes the width, else oneDNN's) with
// the rows rounded to int8, a scale per row (the rule: linear.cpp, by_kernels)
bool int8_gemm(int64_t rows, at::ScalarType weight, int64_t weights);

// the largest integer `linear` rounds each of `rows` rows to (a scale max |x_m| / it per row) before multiplying them
// with a weight of type `weight`, O x I (`packed`: with its packed copy): 127 where an int8 GEMM takes them (W8A8),
// 32767 where the kernels' own int8 products do (the avx512vnni build: int16 for VNNI's vpdpwssd), 0 where the rows
// are multiplied as they are (fp32; the bf16 GEMM rounds them to bf16 instead) (linear.cpp)
int64_t rows_rounded_to(int64_t rows, at::ScalarType weight, int64_t O, int64_t I, bool packed);

// whether this build has the kernels' own int8 GEMM: avx512vnni (AVX512-VNNI's vpdpbusd, AMX-INT8's tiles where the
// CPU has them), or an AVX2 build (AVX-VNNI's vpdpbusd in avx2vnni, else vpmaddubsw), and
// whether it multiplies rows of `columns` int8 values: a multiple of 4 within int32's exact range (vnni_gemm.cpp)
bool vnni_gemm_cpu();
bool vnni_gemm(int64_t columns);

// whether the kernels' own int8 GEMM multiplies `rows` rows of `columns` in AMX-INT8's tiles (the avx512vnni build on
// a CPU with AMX, where Linux grants its state, from AMX_GEMM_MIN_ROWS rows), and how many rows the rows' buffer must
// hold for it (padded to whole tiles) (vnni_gemm.cpp)
bool amx_gemm(int64_t rows, int64_t columns);
int64_t vnni_rows(int64_t rows, int64_t columns);
// from how many rows the process's products go to AMX's tiles from now on (0: never), so that the tests and
// benchmarks compare both on one CPU; returns the previous count (0 in a build without AMX code)
int64_t set_amx_min_rows(int64_t rows);

// the offset the GEMM takes its int8 rows with, as unsigned bytes: 128 where it multiplies in vpdpbusd (unsigned
// times signed), 0 (the int8's own bits) in AVX2's vpmaddubsw
int vnni_rows_offset();

// y (M, O) = (x - offset) . w.T * (xs[m] * ws[o]) + b[o]: x (M, I) int8 rows stored as unsigned bytes with the
// offset above and a scale per row (x's buffer holding `held` >= M rows: vnni_rows), w (O, I) int8 (packed at first
// use and kept while w lives unchanged: not an inference tensor), ws its scale per output, b a bias or nullptr; split
// over the pool (vnni_gemm.cpp)
void vnni_product(const at::Tensor& w, const uint8_t* x, int64_t held, const float* xs, int64_t M, const float* ws,
                  const float* b, float* y);

// an IEEE half's bits (simd.h): a KV cache's element where it is stored in fp16
struct fp16;

// whether the kernels' attention reads a cache of t's type: fp32 or fp16
inline bool kv_cache_type(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf;
}

// fn(k, v) with the caches' data as float* or fp16* (the two of one type, checked by the caller)
template <typename F>
void with_kv_cache(const at::Tensor& k, const at::Tensor& v, F fn) {
  if (k.scalar_type() == at::kHalf)
    fn(reinterpret_cast<fp16*>(k.data_ptr()), reinterpret_cast<fp16*>(v.data_ptr()));
  else
    fn(k.data_ptr<float>(), v.data_ptr<float>());
}

// Attention for B new tokens (attention.cpp): qkv (B, 3C) holds each token's query, key and value; each token's
// key and value go to slot pos[b] of cache row rows[b] of k_cache, v_cache ((cache rows, n_head, L, hs) each, KV
// float or fp16: rounded to it as written), then each query attends to slots 0..pos[b] of its row, into y (B, C).
// The rows and positions are checked.
template <typename KV>
void attention_into(const float* qkv, int64_t B, int64_t n_head, int64_t hs, KV* k_cache, KV* v_cache,
                    int64_t cache_rows, int64_t L, const int64_t* rows, const int64_t* pos, float* y);

// the same on tensors: qkv (B, 3C) -> (B, C)
at::Tensor decode_attention(at::Tensor qkv, at::Tensor k_cache, at::Tensor v_cache, at::Tensor rows, at::Tensor pos,
                            int64_t n_head);

// each row of logits (rows, vocab) fp32: the index of its first largest value (torch's argmax) and its log-sum-exp
// (sampling.cpp)
std::tuple<at::Tensor, at::Tensor> row_argmax_logsumexp(const at::Tensor& logits);

// one id drawn from each row of logits (rows, vocab) fp32 after model/sampler.py's steps 1-6, with that row's
// temperature (fp32), top-k (int64, 0: off), top-p (fp64, 1: off), min-p (fp32, 0: off) and uniform number u in
// [0, 1) (fp64): steps 8-12, the row's inverse cumulative distribution at 1 - u (sampling.cpp). A row holding a NaN,
// or no finite largest logit, gets the last id.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniform);

// structured output's masks, in place: row rows[j] of logits (rows, vocab) fp32 gets -inf wherever allowed[j] (bool,
// (len(rows), vocab)) is false (sampling.cpp); torch's masked_fill took 0.15 ms a 50,257-id row on one core
void fill_disallowed(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& allowed);

// A GPT-2 model's transformer blocks for B new tokens in one call (block.cpp): made once from the blocks'
// parameters, each block's as ln_1 weight, ln_1 bias, ln_2 weight, ln_2 bias, then the four products' (qkv,
// attention projection, MLP up and down) weight, bias, scale and packed copy each (None where a block has none).
// One LoRA adapter's share of a Stack forward: the token rows (int64 indices into its B rows) it applies to, its
// scaling, and for each block's four products in order the factors A (r, I) and B transposed (r, O), fp32 and
// contiguous (None, None where the adapter leaves a product alone): 8 per block. Each product's output rows in
// `rows` get scaling * (x @ A^T) @ B^T added, x being the product's input rows, fp32 whatever the weight's type.
using LoraGroup = std::tuple<at::Tensor, double, std::vector<OptionalTensor>>;

class Stack {
 public:
  Stack(const std::vector<std::vector<OptionalTensor>>& blocks, int64_t n_head);
  // x (B, C) -> (B, C) after every block; k_cache, v_cache: (n_layer, cache rows, n_head, L, hs), fp32 or fp16;
  // `lora`: the adapters applied to some rows (each row in at most one group), none for the base alone
  at::Tensor forward(const at::Tensor& x, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& rows,
                     const at::Tensor& pos, const std::vector<LoraGroup>& lora) const;

 private:
  struct Block {
    at::Tensor ln1_w, ln2_w;
    OptionalTensor ln1_b, ln2_b;
    std::vector<Weight> products;  // qkv, attention projection, MLP up, MLP down
  };
  std::vector<Block> blocks_;
  int64_t n_head_, C_;
};

}  // namespace folio
