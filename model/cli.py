"""Start-up plumbing shared by Folio's commands (`python -m app`, `python -m model.train`): a mistake on the
command line, in the environment or about the machine ends as one `error:` line on stderr and exit code 2,
never a usage dump or a traceback; and `--device` names are turned into a device this machine has."""

from __future__ import annotations

import argparse
import os
from typing import NoReturn

import torch


class ArgumentParser(argparse.ArgumentParser):
    """argparse, whose usage errors are one line (`error: <what> (see <prog> --help)`) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def resolve_device(name: str, kinds: tuple[str, ...] = ("cpu", "cuda")) -> torch.device:
    """`auto` (CUDA where there is one, else the CPU) or a device of one of `kinds` (`cpu`, `cuda`, `cuda:N`,
    `mps`) that this machine has; a ValueError naming `--device` and saying why otherwise."""
    if name == "auto":
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


def check_threads(threads: int) -> int:
    """`--threads` between 0 (torch's default) and the machine's cores: far more threads than cores only slows
    torch down, and tens of thousands crash it (OpenMP cannot create them)."""
    cores = os.cpu_count() or 1
    if not 0 <= threads <= cores:
        raise ValueError(f"must be between 0 (all cores) and this machine's {cores} cores, got {threads}")
    return threads
