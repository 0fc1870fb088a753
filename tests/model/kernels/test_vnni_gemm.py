"""The kernels' own int8 GEMM (vnni_gemm.cpp), which takes int8 weights from 1 row (OWN_GEMM_MIN_ROWS) in the
avx512vnni variant (vpdpbusd; AMX-INT8's tiles from AMX_GEMM_MIN_ROWS rows where the CPU has them) and in the AVX2
variants (vpmaddubsw in avx2, AVX-VNNI's vpdpbusd in avx2vnni), each tested wherever this CPU runs it: the W8A8
product (conftest's `w8a8_product`, in float64) for shapes that leave partial tiles everywhere (rows past a multiple
of 4, 6, 8 and 16, outputs past a multiple of 8 and 16 and of a group of registers or tiles, widths that are a
multiple of 4 but not of 16 or 64), the largest values at the widest rows tested, and the widths it leaves to
oneDNN. The vpdpbusd tiles are tested with AMX turned off (`set_amx_min_rows`), so an AMX machine tests both. Where
the CPU or build has no such GEMM, the tests skip and say why. The AVX2 variants decide as on a CPU of their tier (no
AMX, no AVX512-BF16), so that FOLIO_CPU_KERNELS=avx2 measures that tier on any machine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from model import kernels
from model.kernels import build, loader
from model.kernels.loader import library
from model.quantize import Int4Linear, Int8Linear
from tests.model.conftest import INT8_GEMMS, gemm, rows_rounded_to, variant_library, w8a8_product


def _int8_linear(outputs: int, width: int, bias: bool, seed: int) -> Int8Linear:
    torch.manual_seed(seed)
    return Int8Linear(torch.nn.Linear(width, outputs, bias=bias))


# every variant's own GEMM in registers (vpdpbusd, vpmaddubsw), and the avx512vnni variant's in AMX tiles too
OWN_TILES = [(v, "vpdpbusd") for v in build.VARIANTS] + [(v, "amx") for v in build.VARIANTS if v.name == "avx512vnni"]


@pytest.fixture(params=OWN_TILES, ids=lambda p: f"{p[0].name}-{p[1]}")
def tiles(request: pytest.FixtureRequest) -> Iterator[str]:
    """A kernel variant this CPU runs as the process's kernels (as conftest's `kernel_variant`), with its own GEMM's
    tiles: "vpdpbusd" (registers; AMX turned off where the CPU has it) or "amx" (AMX-INT8's tiles, where the CPU
    and Linux grant them; else skipped, saying why)."""
    variant, name = request.param
    variant_library(variant)
    with loader.using(variant.name):
        lib = library()
        assert lib is not None
        before = lib.set_amx_min_rows(build.AMX_GEMM_MIN_ROWS if name == "amx" else 0)
        try:
            if name == "amx" and not lib.amx_gemm(build.AMX_GEMM_MIN_ROWS, 64):
                pytest.skip("this CPU has no AMX-INT8 tiles the kernels may use (no amx_int8 flag, or Linux refused "
                            "the tile state)")
            yield name
        finally:
            lib.set_amx_min_rows(before)


def _require_own(rows: int, q: Int8Linear, tiles: str) -> None:
    """Skip where the loaded kernels have no int8 GEMM of their own; else check which tiles take the rows."""
    if gemm(rows, q.stored) not in ("vnni int8", "amx int8"):
        pytest.skip("no int8 GEMM of the kernels' own here: the avx512 variant has none")
    amx = tiles == "amx" and rows >= build.AMX_GEMM_MIN_ROWS and q.stored.size(1) % 64 == 0
    assert gemm(rows, q.stored) == ("amx int8" if amx else "vnni int8")


@pytest.mark.parametrize("rows", [1, 2, 4, 8, 13, 16, 17, 32, 64, 100])
@pytest.mark.parametrize(("outputs", "width"), [(1000, 772), (33, 8192), (17, 16384), (50, 6144)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_own_gemm_is_the_w8a8_product(tiles: str, rows: int, outputs: int, width: int, bias: bool) -> None:
    """1000 outputs: 62 whole panels and one of 8 outputs, the last 3-panel group partial (AMX: groups of 4 or 2
    panels, the last of 3 or 1); 33: three panels, the last of one output; 17: a group of two panels; 50: a group of
    three with a 2-output panel. 772 columns: 193 groups of 4, not a multiple of 16 (nor of AMX's 64: vpdpbusd takes
    it). 1 row: the fewest the own GEMM takes (OWN_GEMM_MIN_ROWS: a batch-1 decode step); 8, the fewest AMX's tiles
    take (AMX_GEMM_MIN_ROWS), one tile of 8 rows; 13 and 100 rows: last tiles of 5 and 4 rows (8-row tiles), 1 and 4
    (6 and 4); for AMX, 16 rows fill one tile, 17 make two (padded), 100 three pairs and a lone last tile."""
    q = _int8_linear(outputs, width, bias, seed=rows + outputs)
    _require_own(rows, q, tiles)
    x = torch.randn(rows, width) * torch.rand(rows, 1) * 10
    x[-1] = 0.0  # an all-zero row: scale 1, the bias alone
    with torch.inference_mode():
        got = q(x)
    torch.testing.assert_close(got.double(), w8a8_product(x, q.stored, q.scale, q.bias), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_values_sum_exactly(tiles: str, sign: float) -> None:
    """16,384 columns of weights +-127 against rows at +-127 after rounding: vpdpbusd's and TDPBUSD's unsigned operand
    is 255 (or 1) and each int32 lane adds 16,384 products of up to 255 * 127 (532 million, exact), less the offset
    128 * sum(w) (AVX2's vpmaddubsw: 127 times +-127 in pairs, 32,258 each, within int16).
    The sums are +-127 * 127 * 16,384 = +-264 million: integers fp32 holds to 2^-24 of their size."""
    lin = torch.nn.Linear(16384, 20, bias=False)
    with torch.no_grad():
        lin.weight.fill_(0.5)
        lin.weight[::2] = -0.5
    q = Int8Linear(lin)
    assert q.stored.abs().min() == 127
    _require_own(9, q, tiles)
    with torch.inference_mode():
        got = q(torch.full((9, 16384), sign * 3.0))
    want = lin.weight.sum(dim=1).detach() * sign * 3.0
    torch.testing.assert_close(got, want.expand(9, -1), rtol=1e-6, atol=0)


def test_amx_takes_whole_tiles_from_its_rows_and_can_be_turned_off(kernel_variant: build.Variant) -> None:
    """Where the CPU has AMX-INT8 (the avx512vnni variant), int8 weights that are not small go to its tiles from
    AMX_GEMM_MIN_ROWS rows when their width is whole tiles of 64 columns, to vpdpbusd below that and for other
    widths, and to vpdpbusd alone once `set_amx_min_rows(0)`; without AMX, never to the tiles."""
    lib = library()
    assert lib is not None
    wide, odd = _int8_linear(512, 768, bias=True, seed=0), _int8_linear(512, 772, bias=True, seed=0)
    before = lib.set_amx_min_rows(build.AMX_GEMM_MIN_ROWS)
    try:
        has_amx = lib.amx_gemm(build.AMX_GEMM_MIN_ROWS, 64)
        if kernel_variant.name != "avx512vnni":
            assert not has_amx
        _require_own(1, wide, "vpdpbusd")
        for rows in (1, build.AMX_GEMM_MIN_ROWS - 1, build.AMX_GEMM_MIN_ROWS, 64, 512):
            assert gemm(rows, wide.stored) == ("amx int8" if has_amx and rows >= build.AMX_GEMM_MIN_ROWS
                                               else "vnni int8")
            assert gemm(rows, odd.stored) == "vnni int8"
        lib.set_amx_min_rows(0)
        assert all(gemm(rows, wide.stored) != "amx int8" for rows in (1, 8, 64, 512))
    finally:
        lib.set_amx_min_rows(before)


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
            assert gemm(rows, q.stored) == ("vnni int8" if rows >= build.OWN_GEMM_MIN_ROWS else None)
            assert gemm(rows, small.stored) is None
            assert rows_rounded_to(rows, q.stored, packed=True) == 127
            assert rows_rounded_to(rows, small.stored, packed=True) == (127 if rows <= kernels.MAX_ROWS else None)


def test_an_int8_weight_the_own_gemm_takes_keeps_no_second_packed_copy(kernel_variant: build.Variant) -> None:
    """The own GEMM keeps its own packed copy (its panels) and never reads the kernels' panels of 16 outputs for a
    weight it takes from one row, so `pack()` makes none for it (124 MB saved on int8 GPT-2 small); small weights,
    which the kernels' products take, and variants without the own GEMM still get theirs. Products are unchanged."""
    big, small = _int8_linear(512, 768, bias=True, seed=1), _int8_linear(40, 104, bias=True, seed=1)
    big.pack()
    small.pack()
    own = gemm(1, big.stored) in ("vnni int8", "amx int8")
    assert (big.packed is None) == own
    assert small.packed is not None
    x = torch.randn(5, 768)
    with torch.inference_mode():
        got = big(x)
    if own:
        torch.testing.assert_close(got.double(), w8a8_product(x, big.stored, big.scale, big.bias), rtol=1e-6,
                                   atol=1e-6)


def test_the_own_gemms_copies_count_in_the_packed_bytes(kernel_variant: build.Variant) -> None:
    """`install`'s report (the engine's `packed_bytes`, /info's `packed_weight_bytes`, what `memory_needed` estimates)
    counts the copy the own int8 GEMM makes of a weight it takes, as it counts the kernels' own packed copies: the
    panels of 16 outputs (512 outputs x 768 bytes) and an int32 offset per output; and the int4 GEMM's regrouped
    bytes, as large as the 4-bit weight, with its fp16 scales (one per 32 weights)."""
    model = torch.nn.Sequential(_int8_linear(512, 768, bias=True, seed=2), _int8_linear(40, 104, bias=True, seed=2),
                                Int4Linear(torch.nn.Linear(96, 61)))
    report = kernels.install(model)
    own = gemm(1, model[0].stored) in ("vnni int8", "amx int8")
    small, int4 = model[1].packed.numel(), 61 * 96 // 2 + 61 * (96 // 32) * 2
    assert model[2].packed is None
    assert report.packed_bytes == (512 * 768 + 4 * 512 if own else model[0].packed.numel()) + small + int4
