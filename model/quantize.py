"""Weight-only int8 quantization, installed as module swaps (like gpt-fast's `WeightOnlyInt8QuantHandler`):
`quantize_int8(model)` puts an `Int8Linear` in place of every `nn.Linear` of the transformer blocks and of the LM
head. Each output row's weights are scaled symmetrically into [-127, 127] (one fp32 scale per row:
max |w| / 127) and rounded; activations stay fp32. The LM head (tied to the token embedding, ~30% of GPT-2
small's bytes) gets its own int8 copy; the embedding lookup keeps the fp32 table (it reads one row a token).

A decode step reads 1 byte per weight instead of 4. The products run in the CPU kernels' `linear_int8` (the int8
values widened to fp32 in registers, so the sum is exactly the fp32 product with the dequantized weight) for up
to `MAX_ROWS` rows, and through torch with the dequantized weight otherwise (a prompt's prefill, or without the
kernels). Quality is measured, not assumed: `bench/quantize.py`, tests/model/test_quantize.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn import functional as F

from model.kernels.build import MAX_ROWS
from model.kernels.loader import library

QUANTIZATIONS = ("none", "int8")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weights, fp32 scale per output row) with weight ~= int8 * scale[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Linear(nn.Module):
    """`nn.Linear` with int8 weights and a scale per output row; fp32 in and out."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        self.register_buffer("weight_int8", q.to(linear.weight.device))
        self.register_buffer("scale", scale.to(linear.weight.device))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = library()
        rows = x.numel() // self.in_features
        if (lib is not None and x.device.type == "cpu" and x.dtype == torch.float32 and rows <= MAX_ROWS
                and self.in_features % 8 == 0 and not torch.is_grad_enabled()):
            y = lib.linear_int8(x.reshape(rows, self.in_features).contiguous(), self.weight_int8, self.scale,
                                self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per output row"


def quantize_int8(model: nn.Module) -> int:
    """Swap every `nn.Linear` of `model` (the blocks' products and the LM head) for an `Int8Linear`, in place;
    the weights it reads at a decode step shrink 4x. Returns the bytes of the int8 weights and their scales."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child))
    return sum(m.weight_int8.numel() + 4 * m.scale.numel() for m in model.modules() if isinstance(m, Int8Linear))


def quantize(model: nn.Module, kind: str) -> int:
    """`kind` ('none' or 'int8') applied to `model` in place; the bytes of quantized weights (0 for none)."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"quantize must be one of {QUANTIZATIONS}, got {kind!r}")
    return quantize_int8(model) if kind == "int8" else 0


def convert(checkpoint: str | Path, out: str | Path, kind: str = "int8") -> Path:
    """Write `checkpoint` quantized (`kind`) into `out`: a Folio checkpoint whose config.json says
    `"quantization": kind`, loaded as it is (no quantizing at load)."""
    from model.checkpoint import load_checkpoint, save_checkpoint  # lazily: model.checkpoint imports this module

    ck = load_checkpoint(checkpoint)
    if ck.meta.get("quantization", "none") != "none":
        raise ValueError(f"{checkpoint} is already quantized ({ck.meta['quantization']})")
    quantize(ck.model, kind)
    return save_checkpoint(out, ck.model, ck.tokenizer, training=ck.meta.get("training"), quantization=kind)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m model.quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a Folio checkpoint directory (fp32)")
    parser.add_argument("--out", required=True, help="the directory to write the quantized checkpoint into")
    parser.add_argument("--kind", default="int8", choices=[q for q in QUANTIZATIONS if q != "none"])
    args = parser.parse_args(argv)
    print(f"wrote {convert(args.checkpoint, args.out, args.kind)}")


if __name__ == "__main__":
    main()
