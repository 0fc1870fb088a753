"""The kernels' AVX512-VNNI int8 GEMM (vnni_gemm.cpp), which takes 4 rows or more against int8 weights on a CPU
with AVX512-VNNI and no AMX-INT8: the W8A8 product (conftest's `w8a8_product`, in float64) for shapes that leave
partial tiles everywhere (rows past a multiple of 8, outputs past a multiple of 16 and of a 3-panel group, widths
that are a multiple of 4 but not of 16), the largest values at the widest rows tested, and the widths it leaves to
oneDNN. Where the CPU or build has no such GEMM, the tests skip and say why."""

from __future__ import annotations

import pytest
import torch

from model import kernels
from model.kernels.loader import library
from model.quantize import Int8Linear
from tests.model.conftest import INT8_GEMMS, gemm, w8a8_product


def _int8_linear(outputs: int, width: int, bias: bool, seed: int) -> Int8Linear:
    torch.manual_seed(seed)
    return Int8Linear(torch.nn.Linear(width, outputs, bias=bias))


def _require_vnni(rows: int, q: Int8Linear) -> None:
    kernels.load()
    if library() is None:
        pytest.skip("the kernels are not built on this machine")
    if gemm(rows, q.stored) != "vnni int8":
        pytest.skip("no VNNI int8 GEMM here: the kernels' build lacks AVX512-VNNI, or the CPU has AMX-INT8 "
                    "(oneDNN's GEMM takes those rows)")


@pytest.mark.parametrize("rows", [4, 8, 13, 32, 64, 100])
@pytest.mark.parametrize(("outputs", "width"), [(1000, 772), (33, 8192), (17, 16384), (50, 6144)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_vnni_gemm_is_the_w8a8_product(rows: int, outputs: int, width: int, bias: bool) -> None:
    """1000 outputs: 62 whole panels and one of 8 outputs, the last 3-panel group partial; 33: three panels, the
    last of one output; 17: a group of two panels; 50: a group of three with a 2-output panel. 772 columns: 193
    groups of 4, not a multiple of 16. 4 rows: the fewest it takes (VNNI_GEMM_MIN_ROWS), one partial tile; 13 and
    100 rows: a last tile of 5 and 4 rows; 100 is a prompt's size."""
    q = _int8_linear(outputs, width, bias, seed=rows + outputs)
    _require_vnni(rows, q)
    x = torch.randn(rows, width) * torch.rand(rows, 1) * 10
    x[1] = 0.0  # an all-zero row: scale 1, the bias alone
    with torch.inference_mode():
        got = q(x)
    torch.testing.assert_close(got.double(), w8a8_product(x, q.stored, q.scale, q.bias), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_values_sum_exactly(sign: float) -> None:
    """16,384 columns of weights +-127 against rows at +-127 after rounding: vpdpbusd's unsigned operand is 255 (or 1)
    and each int32 lane adds 16,384 products of up to 255 * 127 (532 million, exact), less the offset 128 * sum(w).
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


def test_widths_not_a_multiple_of_4_go_to_onednn() -> None:
    """vpdpbusd takes columns four at a time: a width of 770 is left to oneDNN's int8 GEMM, the same W8A8 product."""
    q = _int8_linear(400, 770, bias=True, seed=3)
    kernels.load()
    if gemm(16, q.stored) not in INT8_GEMMS:
        pytest.skip("no int8 GEMM here: the kernels are not loaded or the CPU has neither VNNI nor AMX-INT8")
    assert gemm(16, q.stored) == "int8"
    x = torch.randn(16, 770)
    with torch.inference_mode():
        got = q(x)
    torch.testing.assert_close(got.double(), w8a8_product(x, q.stored, q.scale, q.bias), rtol=1e-6, atol=1e-6)
