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


def rounding_bound(x: torch.Tensor, w: torch.Tensor, limit: int) -> torch.Tensor:
    """How far an int8 product may be from the fp32 product with the dequantized weight `w` (O, I) when each row of
    x (M, I) is rounded to integers up to `limit` first (a scale max |x_m| / limit per row): half a step per value,
    times sum_i |w[o, i]|, plus fp32 summation slack. (M, O). The avx512vnni kernels round to int16 (32767) for a
    few rows; the int8 GEMM to int8 (127) for more (`ops.native_int8_gemm`)."""
    step = x.abs().amax(dim=1, keepdim=True).double() / limit
    return step / 2 * w.abs().sum(dim=1).double()[None, :] + 1e-5


def w8a8_product(x: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The int8 GEMM's product (linear.cpp's `int8_product`) in float64, independently: each row of x (M, I) rounded
    to int8 (scale max |x_m| / 127, torch.round of x / scale), the integer products summed exactly, times the row's
    and the output's scales, plus the bias. (M, O) float64."""
    row_scale = (x.abs().amax(dim=1) / 127).clamp(min=1e-30)
    xq = torch.round(x / row_scale[:, None])
    out = (xq.double() @ stored.double().T) * (row_scale.double()[:, None] * scale.double()[None, :])
    return out if bias is None else out + bias.double()


def bf16_gemm_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far a product against weights `w` (dequantized) may be from the fp32 one where it runs in torch's bf16
    GEMM (`ops.native_bf16_gemm`): x and (int8) w rounded to bf16, half a unit in the 8th bit each (2^-9
    relative), and the product rounded to bf16 on the way out (2^-9 of its size), plus fp32 summation slack."""
    xd, wd = x.double(), w.double()
    return xd.abs() @ wd.abs().T * 2**-8 + (xd @ wd.T).abs() * 2**-8 + 1e-4
