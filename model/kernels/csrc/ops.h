// The kernels' entry points: defined in linear.cpp, attention.cpp and block.cpp, bound to Python in bindings.cpp.
#pragma once

#include <ATen/ATen.h>

#include <vector>

// the limits are defined once, in model/kernels/build.py, which passes them to the compiler
#if !defined(FOLIO_MAX_ROWS) || !defined(FOLIO_PACKED_MIN_ROWS) || !defined(FOLIO_PANEL) \
    || !defined(FOLIO_BF16_GEMM_MIN_ROWS)
#error "build with model/kernels/build.py: it defines FOLIO_MAX_ROWS, FOLIO_PACKED_MIN_ROWS and FOLIO_PANEL"
#endif

namespace folio {

using OptionalTensor = c10::optional<at::Tensor>;

// up to this many rows the kernels do a product; torch's blocked GEMM takes more
static constexpr int64_t MAX_ROWS = FOLIO_MAX_ROWS;
// from this many rows a weight's packed copy is used: below, the dot products are as fast
static constexpr int64_t PACKED_MIN_ROWS = FOLIO_PACKED_MIN_ROWS;
// from this many rows bf16 weights go to torch's bf16 GEMM where the CPU multiplies bf16 natively (linear.cpp)
static constexpr int64_t BF16_GEMM_MIN_ROWS = FOLIO_BF16_GEMM_MIN_ROWS;
// a packed weight's panels hold this many outputs each: (ceil(O / PANEL), I, PANEL) (made by ops.pack in Python)
static constexpr int64_t PANEL = FOLIO_PANEL;
static_assert(PANEL == 16, "linear.cpp's panel tiles hold 16 outputs");

// x (M, I) fp32 @ (w (O, I) * scale (O)).T + b -> (M, O): w fp32, int8 (a scale per output row) or bf16, through the
// packed copy, the dot products or torch's linear with the dequantized weight (see linear.cpp)
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const OptionalTensor& b, const OptionalTensor& packed,
                  const OptionalTensor& scale);

// whether `linear` sends `rows` rows against a weight of type `weight` to torch's bf16 GEMM: bf16 weights from
// BF16_GEMM_MIN_ROWS rows, int8 ones from more than MAX_ROWS, on a CPU with AVX512-BF16 or AMX-BF16 (linear.cpp)
bool bf16_gemm(int64_t rows, at::ScalarType weight);

// attention for B new tokens, writing their keys and values to the cache first: qkv (B, 3C) -> (B, C)
at::Tensor decode_attention(at::Tensor qkv, at::Tensor k_cache, at::Tensor v_cache, at::Tensor rows, at::Tensor pos,
                            int64_t n_head);

// a GPT-2 transformer block for B new tokens, x (B, C) -> (B, C) (see block.cpp); its four products (qkv,
// attention projection, MLP up and down) as weights, biases, scales and packed copies (each list in that order)
at::Tensor decode_block(at::Tensor x, at::Tensor ln1_w, OptionalTensor ln1_b, at::Tensor ln2_w, OptionalTensor ln2_b,
                        std::vector<at::Tensor> weights, std::vector<OptionalTensor> biases,
                        std::vector<OptionalTensor> scales, std::vector<OptionalTensor> packed, at::Tensor k_cache,
                        at::Tensor v_cache, at::Tensor rows, at::Tensor pos, int64_t n_head);

}  // namespace folio
