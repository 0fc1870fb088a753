// The kernels' entry points: defined in linear.cpp, attention.cpp and block.cpp, bound to Python in bindings.cpp.
#pragma once

#include <ATen/ATen.h>

#include <vector>

// the limits are defined once, in model/kernels/build.py, which passes them to the compiler
#if !defined(FOLIO_MAX_ROWS) || !defined(FOLIO_PACKED_MIN_ROWS)
#error "build with model/kernels/build.py: it defines FOLIO_MAX_ROWS and FOLIO_PACKED_MIN_ROWS"
#endif

namespace folio {

using OptionalTensor = c10::optional<at::Tensor>;

// up to this many rows the kernels do a product; torch's blocked GEMM takes more
static constexpr int64_t MAX_ROWS = FOLIO_MAX_ROWS;
// from this many rows a weight's packed copy is used: below, the dot products are as fast
static constexpr int64_t PACKED_MIN_ROWS = FOLIO_PACKED_MIN_ROWS;
// a packed weight's panels hold this many outputs each: (ceil(O / PANEL), I, PANEL)
static constexpr int64_t PANEL = 16;

// w (O, I) -> its packed copy, (ceil(O / 16), I, 16), the last panel zero-padded
at::Tensor pack(at::Tensor w);

// x (M, I) @ w.T + b -> (M, O), through the packed copy, the dot products or torch's linear (see linear.cpp)
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const OptionalTensor& b, const OptionalTensor& packed);

// x (M, I) fp32 @ (w (O, I) int8 * scale (O)).T + b -> (M, O), for M <= MAX_ROWS (see int8_linear.cpp)
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const OptionalTensor& b);

// attention for B new tokens, writing their keys and values to the cache first: qkv (B, 3C) -> (B, C)
at::Tensor decode_attention(at::Tensor qkv, at::Tensor k_cache, at::Tensor v_cache, at::Tensor rows, at::Tensor pos,
                            int64_t n_head);

// a GPT-2 transformer block for B new tokens, x (B, C) -> (B, C) (see block.cpp)
at::Tensor decode_block(at::Tensor x, at::Tensor ln1_w, OptionalTensor ln1_b, at::Tensor attn_w, OptionalTensor attn_b,
                        at::Tensor proj_w, OptionalTensor proj_b, at::Tensor ln2_w, OptionalTensor ln2_b,
                        at::Tensor fc_w, OptionalTensor fc_b, at::Tensor fc2_w, OptionalTensor fc2_b,
                        at::Tensor k_cache, at::Tensor v_cache, at::Tensor rows, at::Tensor pos, int64_t n_head,
                        std::vector<OptionalTensor> packed);

}  // namespace folio
