"""Device and dtype choices, in one place: what `auto` means and what a device runs in by default."""

from __future__ import annotations

import torch


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """`auto` (or None): CUDA where there is a GPU, else the CPU. A CUDA device asked for by name must exist
    (ValueError otherwise, naming it)."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(name)!r} was asked for, but CUDA is not available on this machine")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """What inference runs in unless told otherwise: bf16 on CUDA, fp32 on the CPU (where the kernels are)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32
