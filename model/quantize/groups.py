"""q4_0's rounding: 4-bit steps in groups of INT4_GROUP input weights, a fp16 scale each (llama.cpp's q4_0 layout),
shared by round-to-nearest (`quantize_groups`) and GPTQ (`model.quantize.gptq`)."""

from __future__ import annotations

import torch

from model.kernels.ops import INT4_GROUP


def group_scales(groups: torch.Tensor) -> torch.Tensor:
    """The fp16 scale (as fp32) of each group of `groups` (..., INT4_GROUP): as llama.cpp's q4_0, the group's value
    of largest magnitude / -8, so that value is exactly -8 steps and the full range of 16 levels is used."""
    largest = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True))
    return (largest / -8).to(torch.float16).float()


def round_to_steps(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(w / scale) (half to even) in [-8, 7], 0 where the scale is 0."""
    return torch.where(scale == 0, 0, torch.round(w / torch.where(scale == 0, 1, scale))).clamp(-8, 7)


def pack_groups(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps `q` (O, G, INT4_GROUP) in [-8, 7] and their scales (O, G, 1) as stored: the nibbles q + 8 two a byte
    (O, G * INT4_GROUP / 2) uint8, the first half of a group in the low nibbles, and the scales fp16 (O, G)."""
    out, n_groups, _ = q.shape
    nibbles = (q + 8).to(torch.uint8)
    packed = nibbles[:, :, : INT4_GROUP // 2] | (nibbles[:, :, INT4_GROUP // 2:] << 4)
    scales = scale.to(torch.float16).view(out, -1)
    return packed.reshape(out, n_groups * INT4_GROUP // 2).contiguous(), scales.contiguous()


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(4-bit weights packed two a byte (O, I / 2) uint8, fp16 scale per group (O, I / 32)) with weight ~= q * scale
    per group of INT4_GROUP input weights, q in [-8, 7] (`ops.int4_values` reads them back): round to nearest with
    `group_scales`, as llama.cpp's q4_0. `model.quantize.gptq.gptq_groups` writes the same layout."""
    w = weight.detach().float()
    out, n_in = w.shape
    assert n_in % INT4_GROUP == 0, f"4-bit groups of {INT4_GROUP} need an input width that is a multiple: {n_in}"
    groups = w.view(out, n_in // INT4_GROUP, INT4_GROUP)
    scale = group_scales(groups)
    return pack_groups(round_to_steps(groups, scale), scale)
