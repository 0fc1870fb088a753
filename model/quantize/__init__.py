"""Weight-only quantization, installed as module swaps (like gpt-fast's `WeightOnlyInt8QuantHandler`):
`quantize(model, kind)` puts a `StoredLinear` in place of every `nn.Linear` of the transformer blocks and of the
LM head; activations stay fp32 (but see below for int8 products of many rows).
- "int8": each output row's weights scaled symmetrically into [-127, 127] (one fp32 scale per row,
  max |w| / 127) and rounded (`Int8Linear`): a decode step reads 1 byte per weight instead of 4;
- "bf16": each weight rounded to bfloat16 (`Bf16Linear`): 2 bytes per weight;
- "int4": each group of 32 input weights of an output row scaled symmetrically into [-8, 7] (llama.cpp's q4_0: a
  fp16 scale per group, the value of largest magnitude / -8) and rounded, two weights a byte (`Int4Linear`): 4.5
  bits per weight. The LM head, and a product whose input width is not a multiple of 32, are int8 instead
  (`four_bit` says why). Offline, with calibration text, the same layout is chosen by GPTQ instead of rounding to
  nearest (`python -m model.quantize --calibration FILE`, model/quantize/gptq.py).
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
from model.kernels.ops import INT4_GROUP
from model.quantize.gptq import gptq_groups
from model.quantize.groups import group_scales, pack_groups, quantize_groups, round_to_steps

__all__ = ["QUANTIZATIONS", "Bf16Linear", "Int4Linear", "Int8Linear", "four_bit", "four_bit_names", "group_scales",
           "pack_groups", "products", "quantize", "quantize_groups", "quantize_rows", "round_to_steps", "stored_linear"]

QUANTIZATIONS = ("none", "int8", "bf16", "int4")


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


class Int4Linear(StoredLinear):
    """`nn.Linear` with 4-bit weights, two a byte, and a fp16 scale per group of 32 input weights of each output
    row (`quantize_groups`); fp32 in and out. The kernels take the bytes as they are (csrc/int4.cpp): no packed
    copy."""

    def __init__(self, linear: nn.Linear, hessian: torch.Tensor | None = None) -> None:
        super().__init__(linear)
        if hessian is None:
            q, scale = quantize_groups(linear.weight)
        else:  # calibrated (model/quantize/gptq.py)
            q, scale = gptq_groups(linear.weight, hessian)
        self.register_buffer("weight_int4", q.to(linear.weight.device))
        self.register_buffer("scale", scale.to(linear.weight.device))

    @property
    def stored(self) -> torch.Tensor:
        return self.weight_int4

    @property
    def scale_or_none(self) -> torch.Tensor | None:
        return self.scale

    def pack(self) -> None:
        """Nothing to pack: the kernels read the bytes as stored."""

    def _apply(self, fn: Callable[..., torch.Tensor], recurse: bool = True) -> Int4Linear:
        # `.to(dtype)` converts every floating tensor; the scales stay fp16 (fp16 -> fp32 -> fp16 is exact)
        super()._apply(fn, recurse)
        self.scale = self.scale.to(torch.float16)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 in groups of {INT4_GROUP} "
                "(a fp16 scale each)")


SWAPS: dict[str, type[StoredLinear]] = {"int8": Int8Linear, "bf16": Bf16Linear, "int4": Int4Linear}


def four_bit(linear: nn.Linear, *, head: bool = False) -> bool:
    """Whether "int4" stores `linear` in 4 bits: not the LM head (`head`), nor a product whose input width holds no
    whole groups of 32 (none of GPT-2's), which are int8. The head stays int8 by measurement (bench/quantize.py,
    docs/quantization.md has the runs): on the bundled model it takes a quarter off int4's KL divergence from fp32
    (1.40e-2 with an int4 head, 1.07e-2 with an int8 one), on GPT-2's shape a ninth (9.8e-3, 8.7e-3), as llama.cpp
    keeps q4_0 models' output matrix at 6 bits; for GPT-2's 70 -> 87 MB a step, which at batch 1 was within 2% in
    the AVX-512 VNNI kernels and 8% and 26% slower in the AVX2 ones (their int8 products are bound by widening
    arithmetic, issue 31), and at batch 8 1-10% faster (the int8 GEMM takes the head's rows)."""
    return not head and linear.in_features % INT4_GROUP == 0


def stored_linear(kind: str, linear: nn.Linear, *, head: bool = False,
                  hessian: torch.Tensor | None = None) -> StoredLinear:
    """`linear` stored as `kind` says, except that under "int4" a product `four_bit` refuses is int8; a 4-bit one
    with its inputs' `hessian` is calibrated (GPTQ, model/quantize/gptq.py)."""
    if kind == "int4":
        return Int4Linear(linear, hessian) if four_bit(linear, head=head) else Int8Linear(linear)
    return SWAPS[kind](linear)


def products(model: nn.Module) -> list[tuple[nn.Module, str, str, nn.Linear]]:
    """Every `nn.Linear` of `model` (a KernelLinear too: a model the kernels were installed in) as (its parent, its
    name there, its full name, it)."""
    return [(parent, name, f"{parent_name}.{name}" if parent_name else name, child)
            for parent_name, parent in model.named_modules() for name, child in parent.named_children()
            if isinstance(child, nn.Linear)]


def four_bit_names(model: nn.Module) -> list[str]:
    """The names of `model`'s products that "int4" stores in 4 bits (those a calibration measures)."""
    return [full for _, name, full, linear in products(model) if four_bit(linear, head=name == "lm_head")]


def quantize(model: nn.Module, kind: str, hessians: dict[str, torch.Tensor] | None = None,
             progress: Callable[[str], None] | None = None) -> int:
    """`kind` (one of QUANTIZATIONS) applied to `model` in place: every `nn.Linear` (the blocks' products and the
    LM head) swapped for its stored form; under "int4", the products named in `hessians` calibrated by their inputs'
    second moments (`calibration.calibration_hessians`), `progress(name)` after each. Returns the bytes of the stored
    weights and their scales (0 for none)."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"quantize must be one of {QUANTIZATIONS}, got {kind!r}")
    if hessians and kind != "int4":
        raise ValueError(f"calibration (GPTQ) is for int4 weights, got quantize={kind!r}")
    if kind == "none":
        return 0
    for parent, name, full, linear in products(model):
        hessian = (hessians or {}).get(full)
        setattr(parent, name, stored_linear(kind, linear, head=name == "lm_head", hessian=hessian))
        if progress is not None and hessian is not None:
            progress(full)
    stored = [m for m in model.modules() if isinstance(m, StoredLinear)]
    return sum(t.numel() * t.element_size() for m in stored for t in (m.stored, m.scale_or_none) if t is not None)
