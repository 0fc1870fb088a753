// A GPT-2 transformer block in one call from Python: a decode step of GPT-2 small then makes ~15 calls into C++
// instead of ~150 module and op calls, each a few microseconds, which mattered more than any kernel for small
// models.
#include <c10/core/InferenceMode.h>

#include "ops.h"
#include "pool.h"

namespace folio {

// One transformer block for B new tokens (a decode step's one per row, or prompt chunks), in one call: what
// Block.forward computes on the cached path, without a Python round trip per op. x (B, C) -> (B, C).
at::Tensor decode_block(at::Tensor x, at::Tensor ln1_w, OptionalTensor ln1_b, at::Tensor ln2_w, OptionalTensor ln2_b,
                        std::vector<at::Tensor> weights, std::vector<OptionalTensor> biases,
                        std::vector<OptionalTensor> scales, std::vector<OptionalTensor> packed, at::Tensor k_cache,
                        at::Tensor v_cache, at::Tensor rows, at::Tensor pos, int64_t n_head) {
  TORCH_CHECK(weights.size() == 4 && biases.size() == 4 && scales.size() == 4 && packed.size() == 4,
              "decode_block: a weight, bias, scale and packed copy (or None) for each of the four products");
  auto product = [&](const at::Tensor& in, int k) { return linear(in, weights[k], biases[k], packed[k], scales[k]); };
  const int64_t B = x.size(0), C = x.size(1);
  // torch's element-wise ops here (layer norms, GELU, residual adds) run on this thread alone: an OpenMP team
  // of their own would compete for the cores with this pool's workers, which spin between the products. With
  // more rows than the kernels take, torch's GEMM needs the team.
  OneOpenMPThread serial(B <= MAX_ROWS);
  auto h = at::layer_norm(x, {C}, ln1_w, ln1_b, 1e-5);
  auto y = decode_attention(product(h, 0), k_cache, v_cache, rows, pos, n_head);
  x = x + product(y, 1);
  h = product(at::layer_norm(x, {C}, ln2_w, ln2_b, 1e-5), 2);
  // GELU (torch's vectorised tanh, in place) split by rows over the pool: for many rows it is not small
  const int64_t width = h.size(1);
  pool().run(B, std::max<int64_t>(1, 65536 / width), [&](int64_t begin, int64_t end) {
    c10::InferenceMode inference;  // h may be an inference tensor; a worker thread starts outside inference mode
    auto part = h.narrow(0, begin, end - begin);
    at::gelu_(part, "tanh");
  });
  return x + product(h, 3);
}

}  // namespace folio
