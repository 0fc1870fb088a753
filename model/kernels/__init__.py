"""CPU kernels for decoding: products for a few rows at memory bandwidth, attention and a whole transformer block
in one call each, installed into a GPT by swapping its modules.

Decoding one token reads every weight once and does two flops per weight, so on a CPU a decode step is bound by
memory bandwidth, and torch's fp32 `linear` for one row (MKL's GEMV) reads the weights well below it; for 2-64 rows
MKL's GEMM is slower still. The kernels (C++ in `csrc/`) stream each weight row once for all (up to `MAX_ROWS`)
input rows: from a copy of the weight packed in panels of 16 outputs (from `PACKED_MIN_ROWS` rows), a tile of 6
input rows x 16 outputs accumulating outer products with no reductions; where there is no packed copy as dot
products (tiles of 4 weight rows x 3 input rows in AVX2 registers, 8 weight rows for one input row). A decode step's
attention (cache write, scores, softmax, weighted sum) for every row and head is one call where torch needs a dozen
small ops per layer, and `FusedBlocks` runs all of a model's transformer blocks in one call from Python: for small
models Python's per-op cost mattered more than any kernel. Everything runs on the kernels' own spinning thread pool
(sized by `torch.set_num_threads`; `csrc/pool.h` says why not OpenMP's); torch's element-wise ops inside run on the
calling thread alone, and `serial_torch_ops()` does the same for a whole decode step. Measured figures:
bench/results/kernels.md.

Use: `load()` builds (once per machine, `build.py`) and loads the library; `install(model)` swaps the model's
modules (`modules.py`); `status()` says whether the kernels are in use or why not. Where they cannot be used,
torch's ops serve with the same results up to float summation order (tests/model/kernels/test_kernels.py).
"""

from model.kernels.build import FUSED_MAX_TOKENS, MAX_ROWS, PACKED_MIN_ROWS, VARIANTS, Variant
from model.kernels.loader import disabled, library, load, status, variant
from model.kernels.modules import FusedBlocks, InstallReport, KernelLinear, install
from model.kernels.ops import decode_attention, linear, pack, serial_torch_ops, use_threads

__all__ = [
    "FUSED_MAX_TOKENS", "MAX_ROWS", "PACKED_MIN_ROWS", "VARIANTS", "FusedBlocks", "InstallReport", "KernelLinear",
    "Variant", "decode_attention", "disabled", "install", "library", "linear", "load", "pack", "serial_torch_ops",
    "status", "use_threads", "variant",
]
