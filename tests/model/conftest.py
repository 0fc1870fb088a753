"""Model test fixtures: the CPU decode kernels, built and loaded once or as each variant this CPU runs, and the
products the kernels compute, written out independently in float64 with the bounds of their arithmetic."""

from __future__ import annotations

import platform
import shutil
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TypeVar

import pytest
import torch
from torch.utils.cpp_extension import get_cxx_compiler

from model import kernels
from model.kernels import build, loader

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


@pytest.fixture(params=build.VARIANTS, ids=lambda v: v.name)
def kernel_variant(request: pytest.FixtureRequest) -> Iterator[build.Variant]:
    """Each kernel variant this CPU runs as the process's kernels for the test, as FOLIO_CPU_KERNELS=<name> makes
    them for a server (`loader.using`); the others skipped, naming the flags this CPU lacks. So the arithmetic of
    every variant (8 or 16 lanes; int8 products from int16-rounded rows in avx512vnni) is tested wherever the suite
    runs: an AVX2 machine's on an AVX-512 one too."""
    variant_library(request.param)
    with loader.using(request.param.name) as variant:
        yield variant


def with_kernels_and_without(forward: Callable[[], T]) -> tuple[T, T]:
    """`forward()` through the kernels, then again within `kernels.disabled()` (torch's path)."""
    through_kernels = forward()
    with kernels.disabled():
        return through_kernels, forward()


def gemm(rows: int, weight: torch.Tensor) -> str | None:
    """The GEMM the loaded kernels' `linear` sends `rows` rows against `weight` (as stored) to, by the library's own
    rule (linear.cpp's `int8_gemm`, `vnni_gemm`, `bf16_gemm`; the thresholds are model/kernels/build.py's): "int8"
    (oneDNN's int8 GEMM, the rows rounded to int8), "vnni int8" (the same product in the kernels' own GEMM,
    vnni_gemm.cpp, in vpdpbusd or vpmaddubsw), "amx int8" (the kernels' own GEMM in AMX-INT8's tiles), "bf16"
    (torch's bf16 GEMM: x and the product rounded to bf16), or None: the kernels' products or torch's fp32 linear
    (always, without the kernels)."""
    lib = kernels.library()
    if lib is None:
        return None
    if lib.int8_gemm(rows, weight.dtype, weight.numel()):
        if not lib.vnni_gemm(weight.size(1)):
            return "int8"
        return "amx int8" if lib.amx_gemm(rows, weight.size(1)) else "vnni int8"
    return "bf16" if lib.bf16_gemm(rows, weight.dtype, weight.numel()) else None


INT8_GEMMS = ("int8", "vnni int8", "amx int8")


def rows_rounded_to(rows: int, weight: torch.Tensor, packed: bool) -> int | None:
    """The largest integer the loaded kernels' `linear` rounds each of `rows` rows of x to (a scale max |x_m| / it
    per row, half to even) before multiplying them with `weight` (as stored; `packed`: given its packed copy), by
    the library's own rule (linear.cpp): 127 in an int8 GEMM (W8A8), 32767 in the kernels' own int8 products of the
    avx512vnni variant (int16 for VNNI's vpdpwssd), None where x is multiplied as it is (and without the kernels)."""
    lib = kernels.library()
    if lib is None or weight.dim() != 2:
        return None
    return lib.rows_rounded_to(rows, weight.dtype, weight.size(0), weight.size(1), packed) or None


def rounded_product(x: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    limit: int) -> torch.Tensor:
    """An int8 weight's product with each row of x (M, I) rounded to integers up to `limit` first, independently
    of linear.cpp's: the row's scale max |x_m| / limit, torch.round of x / scale (half to even), the integer
    products summed exactly, times the row's and the output's scales, plus the bias. 127 is the int8 GEMM's W8A8
    product, 32767 the avx512vnni kernels' int16 one. (M, O) float64."""
    row_scale = (x.abs().amax(dim=1) / limit).clamp(min=1e-30)
    xq = torch.round(x / row_scale[:, None])
    out = (xq.double() @ stored.double().T) * (row_scale.double()[:, None] * scale.double()[None, :])
    return out if bias is None else out + bias.double()


def w8a8_product(x: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The int8 GEMM's product (linear.cpp's `int8_product`): x rounded to int8 per row (`rounded_product`)."""
    return rounded_product(x, stored, scale, bias, 127)


def int8_product_as_served(x: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                           packed: bool) -> torch.Tensor:
    """The loaded kernels' `linear` of x (M, I) against an int8 weight (`packed`: given its packed copy) as they
    compute it, in float64: the rows rounded as `rows_rounded_to` says (to int8 in an int8 GEMM, to int16 in
    the avx512vnni kernels), else the product with the dequantized weight. What the kernels return differs from it
    by fp32's summation order only. (M, O) float64."""
    limit = rows_rounded_to(x.shape[0], stored, packed)
    if limit is not None:
        return rounded_product(x, stored, scale, bias, limit)
    return x.double() @ (stored.double() * scale.double()[:, None]).T + (0 if bias is None else bias.double())


def bf16_gemm_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far a product against weights `w` (dequantized) may be from the fp32 one where it runs in torch's bf16
    GEMM (`gemm`: "bf16"): x and (int8) w rounded to bf16, half a unit in the 8th bit each (2^-9
    relative), and the product rounded to bf16 on the way out (2^-9 of its size), plus fp32 summation slack."""
    xd, wd = x.double(), w.double()
    return xd.abs() @ wd.abs().T * 2**-8 + (xd @ wd.T).abs() * 2**-8 + 1e-4
