"""Weight-only quantization, installed as module swaps (like gpt-fast's `WeightOnlyInt8QuantHandler`):
`quantize(model, kind)` puts a `StoredLinear` in place of every `nn.Linear` of the transformer blocks and of the
LM head; activations stay fp32 (but see below for int8 products of many rows).
- "int8": each output row's weights scaled symmetrically into [-127, 127] (one fp32 scale per row,
  max |w| / 127) and rounded (`Int8Linear`): a decode step reads 1 byte per weight instead of 4;
- "bf16": each weight rounded to bfloat16 (`Bf16Linear`): 2 bytes per weight.
The LM head (tied to the token embedding, ~30% of GPT-2 small's bytes) gets its own copy; the embedding lookup
keeps the fp32 table (it reads one row a token).

The products run in the CPU kernels' `linear` (the stored values widened to fp32 in registers, so the sum is the
fp32 product with the weight as stored) for up to `MAX_ROWS` rows, and through torch with the dequantized weight
otherwise (a long prompt's prefill, or without the kernels); where the kernels or the CPU multiply int8 natively,
int8 products round each activation row to integers first: to int8 for an int8 GEMM (W8A8; batched steps and
prompts) and in the AVX2 kernels' own products, to int16 in the avx512vnni kernels' (docs/quantization.md, and
linear.cpp). Quality is measured, not assumed: `bench/quantize.py`, tests/model/test_quantize.py.

`python -m model.quantize` (`__main__.py`) writes a checkpoint quantized.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from model.kernels.modules import StoredLinear

QUANTIZATIONS = ("none", "int8", "bf16")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weights, fp32 scale per output row) with weight ~= int8 * scale[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Linear(StoredLinear):
    """`nn.Linear` with int8 weights and a scale per output row; fp32 in and out."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        q, scale = quantize_rows(linear.weight)
        self.register_buffer("weight_int8", q.to(linear.weight.device))
        self.register_buffer("scale", scale.to(linear.weight.device))

    @property
    def stored(self) -> torch.Tensor:
        return self.weight_int8

    @property
    def scale_or_none(self) -> torch.Tensor | None:
        return self.scale

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per output row"


class Bf16Linear(StoredLinear):
    """`nn.Linear` with bfloat16 weights (round to nearest even); fp32 in and out."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.register_buffer("weight_bf16", linear.weight.detach().to(torch.bfloat16).contiguous())

    @property
    def stored(self) -> torch.Tensor:
        return self.weight_bf16

    def _apply(self, fn: Callable[..., torch.Tensor], recurse: bool = True) -> Bf16Linear:
        # `.to(dtype)` converts every floating tensor; the stored weight and its packed copy stay bf16 (bf16 -> fp32
        # -> bf16 is exact)
        super()._apply(fn, recurse)
        self.weight_bf16 = self.weight_bf16.to(torch.bfloat16)
        if self.packed is not None:
            self.packed = self.packed.to(torch.bfloat16)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16"


SWAPS: dict[str, type[StoredLinear]] = {"int8": Int8Linear, "bf16": Bf16Linear}


def quantize(model: nn.Module, kind: str) -> int:
    """`kind` (one of QUANTIZATIONS) applied to `model` in place: every `nn.Linear` (the blocks' products and the
    LM head) swapped for its stored form. Returns the bytes of the stored weights and their scales (0 for none)."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"quantize must be one of {QUANTIZATIONS}, got {kind!r}")
    if kind == "none":
        return 0
    swap = SWAPS[kind]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):  # a KernelLinear too (a model the kernels were installed in)
                setattr(parent, name, swap(child))
    stored = [m for m in model.modules() if isinstance(m, StoredLinear)]
    return sum(t.numel() * t.element_size() for m in stored for t in (m.stored, m.scale_or_none) if t is not None)
