"""Model test fixtures: the CPU decode kernels, built and loaded once."""

from __future__ import annotations

import platform
import shutil
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import pytest
import torch
from torch.utils.cpp_extension import get_cxx_compiler

from model import kernels
from model.kernels import build

T = TypeVar("T")


@pytest.fixture(scope="session")
def built() -> None:
    """The kernels loaded; a skip, saying why, on a CPU they cannot run on or a machine with no compiler."""
    if platform.machine() not in ("x86_64", "AMD64") or torch.backends.cpu.get_cpu_capability() not in (
            "AVX2", "AVX512"):
        pytest.skip(f"the CPU kernels need x86-64 with AVX2 (this CPU: {torch.backends.cpu.get_cpu_capability()})")
    if not kernels.load() and shutil.which(compiler := get_cxx_compiler()) is None:
        pytest.skip(f"no C++ compiler ({compiler}) to build the CPU kernels: apt-get install g++ (.ci/run installs "
                    f"it); the server then serves with torch's ops")
    assert kernels.load(), f"the CPU kernels should build on this machine: {kernels.status()}"


def variant_library(variant: build.Variant) -> ModuleType:
    """`variant`'s library (built here if need be); a skip naming the flags this CPU lacks to run it, or why it
    cannot be built (no compiler: the kernels are not used either)."""
    missing = sorted(variant.cpu_flags - build.cpu_flags())
    if build.best_variant() is None or missing:
        pytest.skip(f"this CPU cannot run the {variant.name} kernels: no {', '.join(missing) or 'x86-64 AVX2'}")
    try:
        return build.build(variant)
    except Exception as e:
        pytest.skip(f"the {variant.name} kernels cannot be built here: {e}")


def with_kernels_and_without(forward: Callable[[], T]) -> tuple[T, T]:
    """`forward()` through the kernels, then again within `kernels.disabled()` (torch's path)."""
    through_kernels = forward()
    with kernels.disabled():
        return through_kernels, forward()


def int16_rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far an int8 product may be from the fp32 product with the dequantized weight `w` (O, I) when the kernels
    round each row of x (M, I) to int16 (the avx512vnni variant): half a step (max |x_m| / 32767 / 2) per value,
    times sum_i |w[o, i]|, plus fp32 summation slack. (M, O)."""
    step = x.abs().amax(dim=1, keepdim=True).double() / 32767
    return step / 2 * w.abs().sum(dim=1).double()[None, :] + 1e-5


def bf16_gemm_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far a product against weights `w` (dequantized) may be from the fp32 one where it runs in torch's bf16
    GEMM (`ops.native_bf16_gemm`): x and (int8) w rounded to bf16, half a unit in the 8th bit each (2^-9
    relative), and the product rounded to bf16 on the way out (2^-9 of its size), plus fp32 summation slack."""
    xd, wd = x.double(), w.double()
    return xd.abs() @ wd.abs().T * 2**-8 + (xd @ wd.T).abs() * 2**-8 + 1e-4
