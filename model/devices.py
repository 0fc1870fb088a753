"""Device and dtype choices, in one place: what `auto` means, what a device runs in by default, and how much memory
is left on one."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.config import available_memory


def resolve_device(name: str | torch.device | None = "auto", kinds: tuple[str, ...] = ("cpu", "cuda")) -> torch.device:
    """`auto` (CUDA where there is one, else the CPU) or a device of one of `kinds` (`cpu`, `cuda`, `cuda:N`,
    `mps`) that this machine has; a ValueError naming `--device` and saying why otherwise. None means `auto`."""
    if isinstance(name, torch.device):
        name = str(name)
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = ["auto", *(n for k in kinds for n in ((k, f"{k}:N") if k == "cuda" else (k,)))]
    usage = f"use {', '.join(names[:-1])} or {names[-1]}"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device name; {usage}") from None
    if device.type not in kinds:
        raise ValueError(f"--device {name}: not supported here; {usage}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {name}: MPS is not available on this machine")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """What inference runs in unless told otherwise: bf16 on CUDA, fp32 on the CPU (where the kernels are)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def free_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on `device`: a GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory()


def to_device(values: Sequence, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` (numbers, or lists of them) as a tensor on `device`, copied from the host without waiting for the
    device: `torch.tensor(values, device=...)` waits for all the work queued on a GPU before it copies."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
