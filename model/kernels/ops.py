"""The kernels as functions on tensors, each handing work to torch's own op where the kernels do not apply."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.nn import functional as F

from model.devices import to_device
from model.kernels.build import PANEL
from model.kernels.loader import library

# the weight types the kernels read (widened to fp32 in registers; uint8: two 4-bit weights a byte, csrc/int4.cpp);
# activations are fp32
KERNEL_WEIGHTS = (torch.float32, torch.int8, torch.bfloat16, torch.uint8)
INT4_GROUP = 32  # 4-bit weights a scale (csrc/ops.h's INT4_GROUP)


def int4_values(packed: torch.Tensor) -> torch.Tensor:
    """4-bit weights as stored (O, I / 2) uint8, llama.cpp's q4_0 order: in each group of 32 weights' 16 bytes,
    weight j in byte j's low nibble and weight 16 + j in its high one, each q + 8) as their values q (O, I) int8,
    in [-8, 7]."""
    out, half = packed.shape
    groups = packed.view(out, half // (INT4_GROUP // 2), INT4_GROUP // 2)
    q = torch.cat([groups & 0x0F, groups >> 4], dim=2).view(out, 2 * half)
    return q.to(torch.int8) - 8


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A stored weight (fp32, bf16, int8 with a scale per output row, or 4-bit in bytes with a fp16 scale per group
    of INT4_GROUP input weights) as `dtype`: what the kernels compute with (int4: q * scale, exact in fp32)."""
    if weight.dtype == torch.uint8:
        assert scale is not None, "4-bit weights need their scales"
        q = int4_values(weight).float().view(weight.shape[0], -1, INT4_GROUP)
        return (q * scale.float()[:, :, None]).view(weight.shape[0], -1).to(dtype)
    w = weight.to(dtype)
    return w if scale is None else w * scale.to(dtype)[:, None]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, dequantize(weight, scale), bias)`. At inference with fp32 CPU inputs and a weight stored as
    fp32, int8 (with `scale`) or bf16, up to `MAX_ROWS` rows (all leading dims together) go through the kernels:
    from `PACKED_MIN_ROWS` rows on through `packed`, the weight's copy from `pack` when given, else dot products
    from the weight itself (when its width is a multiple of 8). Anything else is `F.linear` with the dequantized
    weight. Equal to that up to float summation order, except where the library's rule (linear.cpp, `by_kernels`;
    its thresholds in build.py) sends the product to a GEMM: int8 weights to an int8 GEMM with the rows rounded to
    int8, bf16 weights (and int8 ones for a prompt the int8 GEMM does not take) to torch's bf16 GEMM with x rounded
    to bf16; and the avx512vnni kernels' own int8 products round the rows to int16. The library answers which, for
    any rows and weight (`bf16_gemm`, `int8_gemm`, `vnni_gemm`, `rows_rounded_to`: what the tests' bounds read).
    4-bit weights (uint8, `scale` per group) go through the kernels at any number of rows (csrc/int4.cpp: dot
    products for a few rows, a GEMM from `INT4_GEMM_MIN_ROWS` in build.py): each row rounded to int8 per group of
    32, the integer products summed exactly, then scaled."""
    lib = library()
    if (lib is None or torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype not in KERNEL_WEIGHTS):
        return F.linear(x, dequantize(weight, scale, x.dtype), bias)
    *lead, n_in = x.shape
    # the library picks (its `linear`): a kernel for <= MAX_ROWS rows, else torch's linear
    y = lib.linear(x.reshape(-1, n_in).contiguous(), weight.contiguous(), bias, packed, scale)
    return y.view(*lead, weight.shape[0])


def row_argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `logits` (rows, vocab): the index of its first largest value (as `argmax`) and its log-sum-exp,
    in one kernel pass per row on CPU (torch's argmax and log-softmax took ~2 ms for a 32-row step of a 50K
    vocabulary on one thread); torch's own ops elsewhere, and for rows with a NaN or an infinity."""
    lib = library()
    if lib is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        # each row contiguous is enough: rows apart by more than their width (a view of a padded vocabulary's
        # usable ids) are read where they are
        rows = logits if logits.stride(-1) == 1 else logits.contiguous()
        ids, lse = lib.row_argmax_logsumexp(rows)
        if bool(torch.isfinite(lse).all()):
            return ids, lse
    return logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1)


def sample_rows(logits: torch.Tensor, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float],
                min_p: Sequence[float], uniform: Sequence[float]) -> torch.Tensor | None:
    """One id drawn from each row of `logits` (rows, vocab) after the sampler's steps 1-6, with each row's
    temperature (above 0), top-k (0: off), top-p (1: off), min-p (0: off) and uniform number u in [0, 1): steps
    8-12 of model/sampler.py in one kernel pass per row on CPU, no row sorted (csrc/sampling.cpp). A row holding a
    NaN or no finite largest logit gets the last id. None where the kernels cannot (not loaded, not fp32 on CPU):
    the caller's torch path then."""
    lib = library()
    if lib is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    rows = logits if logits.stride(-1) == 1 else logits.contiguous()
    return lib.sample_rows(rows, torch.tensor(temperature, dtype=torch.float32), torch.tensor(top_k, dtype=torch.long),
                           torch.tensor(top_p, dtype=torch.float64), torch.tensor(min_p, dtype=torch.float32),
                           torch.tensor(uniform, dtype=torch.float64))


def fill_disallowed(logits: torch.Tensor, rows: Sequence[int], allowed: torch.Tensor) -> None:
    """Structured output's masks, in place: row `rows[j]` of `logits` (rows, vocab) gets -inf wherever `allowed[j]`
    ((len(rows), vocab) bool) is false. The kernels' vectorised select on CPU (torch's masked_fill took 0.15 ms of a
    50,257-id row on one core of an AMD EPYC, Zen 5); torch's masked_fill elsewhere."""
    lib = library()
    index = to_device(rows, logits.device)
    if lib is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and logits.stride(-1) == 1:
        lib.fill_disallowed(logits, index, allowed.contiguous())
        return
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device, non_blocking=True), float("-inf"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A 2-D weight (O, I) of any type packed for `linear`: panels of 16 outputs, (ceil(O / 16), I, 16), the last
    one zero-padded. As much memory again as the weight."""
    with torch.no_grad():
        out, n_in = weight.shape
        full, rest = divmod(out, PANEL)
        packed = weight.new_zeros(full + (rest > 0), n_in, PANEL)  # written in place: no transient copies
        packed[:full].copy_(weight[: full * PANEL].detach().view(full, PANEL, n_in).transpose(1, 2))
        if rest:
            packed[full, :, :rest].copy_(weight[full * PANEL:].detach().T)
        return packed


def reads_packed(weight: torch.Tensor) -> bool:
    """Whether the loaded kernels' products read `pack(weight)` at some number of rows: not for int8 weights that the
    kernels' own int8 GEMM takes from one row (it keeps its own packed copy, csrc/vnni_gemm.cpp), so that a model
    holds one packed copy of those, not two; without the kernels, whatever `pack` is asked for."""
    lib = library()
    if lib is None or weight.dtype != torch.int8 or weight.dim() != 2:
        return True
    return not (lib.int8_gemm(1, weight.dtype, weight.numel()) and lib.vnni_gemm(weight.size(1)))


def own_copy_bytes(weight: torch.Tensor) -> int:
    """The memory of the copy the loaded kernels' own GEMMs make of `weight` (as stored) at its first use and keep:
    an int8 weight the own int8 GEMM takes (`reads_packed` false: panels of 16 outputs and an int32 offset each), a
    4-bit one (its bytes regrouped, as large, and its fp16 scales, one per 32 weights; csrc/int4.cpp); 0 for any
    other, and without the kernels."""
    if library() is None or weight.dim() != 2:
        return 0
    if weight.dtype == torch.uint8:
        return weight.numel() + weight.numel() // 8  # 16 bytes of nibbles to each 2-byte scale
    if weight.dtype == torch.int8 and not reads_packed(weight):
        padded = -(-weight.size(0) // PANEL) * PANEL
        return padded * weight.size(1) + 4 * padded
    return 0


def decode_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     pos: torch.Tensor, n_head: int) -> torch.Tensor:
    """Attention for B new tokens in one call: qkv (B, 3C) -> (B, C). Writes each token's key and value to slot
    `pos[b]` of cache row `rows[b]` (caches: (rows, n_head, max_len, head_size)), then attends to slots 0..pos[b]
    of that row: what the cached path of `CausalSelfAttention` computes with index_put, a mask and SDPA."""
    lib = library()
    assert lib is not None, "decode_attention needs the kernels loaded"
    return lib.decode_attention(qkv.contiguous(), k_cache, v_cache, rows, pos, n_head)


def use_threads(n: int) -> None:
    """The calling thread's kernel jobs use n of the pool's threads (the pool grows to n if it is smaller) and its
    torch ops n OpenMP threads: an engine's thread calls it at its start with its model's thread count, so that
    engines of differently sized models in one process each keep theirs. A no-op without the kernels."""
    lib = library()
    if lib is not None:
        lib.use_threads(n)


@contextlib.contextmanager
def serial_torch_ops() -> Iterator[None]:
    """Within the block, torch's own ops called from this thread run on it alone (OpenMP's per-thread count),
    while the kernels still use their pool. For decode steps: an OpenMP team would spin on the cores after each
    small op (layer norm, embedding, log-softmax) and compete with the kernels' workers. Other threads are
    unaffected; a no-op without the kernels."""
    lib = library()
    if lib is None:
        yield
        return
    previous = lib.set_torch_threads(1)
    try:
        yield
    finally:
        lib.set_torch_threads(previous)
