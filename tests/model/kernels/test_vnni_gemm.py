"""The kernels' own int8 GEMM (vnni_gemm.cpp), which takes 4 rows or more against int8 weights in the avx512vnni
variant on a CPU without AMX-INT8 (vpdpbusd), and in the AVX2 variants (vpmaddubsw in avx2, AVX-VNNI's vpdpbusd in
avx2vnni), each tested wherever this CPU runs it: the W8A8 product (conftest's `w8a8_product`, in float64) for
shapes that leave partial tiles everywhere (rows past a multiple of 4, 6 and 8, outputs past a multiple of 8 and 16
and of a group of registers, widths that are a multiple of 4 but not of 16), the largest values at the widest rows
tested, and the widths it leaves to oneDNN. Where the CPU or build has no such GEMM, the tests skip and say why. The
AVX2 variants decide as on a CPU of their tier (no AMX, no AVX512-BF16), so that FOLIO_CPU_KERNELS=avx2 measures
that tier on any machine."""

from __future__ import annotations

import pytest
import torch

from model import kernels
from model.kernels import build, loader
from model.kernels.loader import library
from model.quantize import Int8Linear
from tests.model.conftest import INT8_GEMMS, gemm, rows_rounded_to, variant_library, w8a8_product


def _int8_linear(outputs: int, width: int, bias: bool, seed: int) -> Int8Linear:
    torch.manual_seed(seed)
    return Int8Linear(torch.nn.Linear(width, outputs, bias=bias))


def _require_vnni(rows: int, q: Int8Linear) -> None:
    if library() is None:
        pytest.skip("the kernels are not built on this machine")
    if gemm(rows, q.stored) != "vnni int8":
        pytest.skip("no int8 GEMM of the kernels' own here: the avx512 variant has none, and the avx512vnni one leaves "
                    "a CPU with AMX-INT8 to oneDNN's GEMM")


@pytest.mark.parametrize("rows", [1, 2, 4, 8, 13, 32, 64, 100])
@pytest.mark.parametrize(("outputs", "width"), [(1000, 772), (33, 8192), (17, 16384), (50, 6144)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_vnni_gemm_is_the_w8a8_product(kernel_variant: build.Variant, rows: int, outputs: int, width: int,
                                           bias: bool) -> None:
    """1000 outputs: 62 whole panels and one of 8 outputs, the last 3-panel group partial; 33: three panels, the
    last of one output; 17: a group of two panels; 50: a group of three with a 2-output panel. 772 columns: 193
    groups of 4, not a multiple of 16. 1 row: the fewest the AVX2 variants' takes (AVX2_GEMM_MIN_ROWS: a batch-1
    decode step); 4 rows: the fewest the avx512vnni variant's takes (VNNI_GEMM_MIN_ROWS), one partial tile; 13 and
    100 rows: last tiles of 5 and 4 rows (8-row tiles), 1 and 4 (6 and 4); 100 is a prompt's size."""
    q = _int8_linear(outputs, width, bias, seed=rows + outputs)
    _require_vnni(rows, q)
    x = torch.randn(rows, width) * torch.rand(rows, 1) * 10
    x[-1] = 0.0  # an all-zero row: scale 1, the bias alone
    with torch.inference_mode():
        got = q(x)
    torch.testing.assert_close(got.double(), w8a8_product(x, q.stored, q.scale, q.bias), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_values_sum_exactly(kernel_variant: build.Variant, sign: float) -> None:
    """16,384 columns of weights +-127 against rows at +-127 after rounding: vpdpbusd's unsigned operand is 255 (or 1)
    and each int32 lane adds 16,384 products of up to 255 * 127 (532 million, exact), less the offset 128 * sum(w)
    (AVX2's vpmaddubsw: 127 times +-127 in pairs, 32,258 each, within int16).
    The sums are +-127 * 127 * 16,384 = +-264 million: integers fp32 holds to 2^-24 of their size."""
    lin = torch.nn.Linear(16384, 20, bias=False)
    with torch.no_grad():
        lin.weight.fill_(0.5)
        lin.weight[::2] = -0.5
    q = Int8Linear(lin)
    assert q.stored.abs().min() == 127
    _require_vnni(9, q)
    with torch.inference_mode():
        got = q(torch.full((9, 16384), sign * 3.0))
    want = lin.weight.sum(dim=1).detach() * sign * 3.0
    torch.testing.assert_close(got, want.expand(9, -1), rtol=1e-6, atol=0)


def test_widths_not_a_multiple_of_4_go_to_onednn(kernel_variant: build.Variant) -> None:
    """vpdpbusd takes columns four at a time: a width of 770 is left to oneDNN's int8 GEMM, the same W8A8 product."""
    q = _int8_linear(400, 770, bias=True, seed=3)
    if gemm(16, q.stored) not in INT8_GEMMS:
        pytest.skip("no int8 GEMM here: the kernels are not loaded or the CPU has neither VNNI nor AMX-INT8")
    assert gemm(16, q.stored) == "int8"
    x = torch.randn(16, 770)
    with torch.inference_mode():
        got = q(x)
    torch.testing.assert_close(got.double(), w8a8_product(x, q.stored, q.scale, q.bias), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["avx2", "avx2vnni"])
def test_the_avx2_variants_decide_as_on_a_cpu_of_their_tier(name: str) -> None:
    """Whatever this CPU multiplies natively beyond AVX2 (AVX512-BF16, AMX), the AVX2 variants' rule sends nothing to
    those GEMMs, which no AVX2-only CPU has: int8 weights that are not small from AVX2_GEMM_MIN_ROWS rows (a decode
    step's, a prompt's) to the kernels' own int8 GEMM, small ones to their own dot products, the rows rounded to int8
    either way; bf16 weights never to the bf16 GEMM. So FOLIO_CPU_KERNELS=avx2 on an AVX-512 machine measures what
    an AVX2 machine runs."""
    variant_library(next(v for v in build.VARIANTS if v.name == name))
    q = _int8_linear(384, 768, bias=True, seed=0)
    small = _int8_linear(40, 104, bias=True, seed=0)
    with loader.using(name):
        lib = library()
        assert lib is not None
        for rows in (1, 3, 16, 64, 512):
            assert not lib.bf16_gemm(rows, torch.bfloat16, q.stored.numel())
            assert not lib.bf16_gemm(rows, torch.int8, q.stored.numel())
            assert gemm(rows, q.stored) == ("vnni int8" if rows >= build.AVX2_GEMM_MIN_ROWS else None)
            assert gemm(rows, small.stored) is None
            assert rows_rounded_to(rows, q.stored, packed=True) == 127
            assert rows_rounded_to(rows, small.stored, packed=True) == (127 if rows <= kernels.MAX_ROWS else None)
