"""Model test fixtures: the CPU decode kernels, built and loaded once."""

from __future__ import annotations

import platform

import pytest
import torch

from model import kernels


@pytest.fixture(scope="session")
def built() -> None:
    """The kernels loaded; a skip, saying why, on a CPU they cannot run on."""
    if platform.machine() not in ("x86_64", "AMD64") or torch.backends.cpu.get_cpu_capability() not in (
            "AVX2", "AVX512"):
        pytest.skip(f"the CPU kernels need x86-64 with AVX2 (this CPU: {torch.backends.cpu.get_cpu_capability()})")
    assert kernels.load(), f"the CPU kernels should build on this machine: {kernels.status()}"
