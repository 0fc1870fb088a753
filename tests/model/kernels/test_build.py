"""Building the kernels: which variant a CPU gets, what the library's name (its cache key) follows, that the C++
sources ship with the package, and what a first build tells the user while it runs."""

from __future__ import annotations

import logging
import platform
import shutil
import threading
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from types import ModuleType

import pytest
from torch.utils import cpp_extension

from model.kernels import build


def test_the_best_variant_is_the_most_capable_one_the_cpu_runs() -> None:
    avx2 = build.VARIANTS[0]
    x86 = platform.machine() in build.X86_64
    assert avx2.name == "avx2" and avx2.cpu_flags == {"avx2", "fma", "f16c"}
    assert build.best_variant(frozenset({"sse2", "avx", "avx2", "fma", "f16c", "avx512f"})) == (avx2 if x86 else None)
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}
    named = {v.name: v for v in build.VARIANTS}
    avx2vnni = {"avx2", "fma", "f16c", "avx_vnni"}  # Intel's client CPUs from Alder Lake on
    assert build.best_variant(frozenset(avx2vnni)) == (named["avx2vnni"] if x86 else None)
    assert build.best_variant(frozenset(avx512)) == (named["avx512"] if x86 else None)
    assert build.best_variant(frozenset(avx512 | {"avx512_vnni"})) == (named["avx512vnni"] if x86 else None)
    # Sapphire Rapids and Zen 5 have both VNNIs: the AVX-512 one, with twice the lanes
    assert build.best_variant(frozenset(avx512 | avx2vnni | {"avx512_vnni"})) == (named["avx512vnni"] if x86 else None)
    assert build.best_variant(frozenset({"sse2", "avx", "avx2", "f16c"})) is None  # no FMA
    assert build.best_variant(frozenset({"avx2", "fma"})) is None  # no F16C (the fp16 KV cache's conversions)
    assert build.best_variant(frozenset()) is None


def test_the_library_name_follows_every_source_and_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    variant = build.VARIANTS[0]
    name = build.library_name(variant)
    assert name.startswith("folio_kernels_avx2_") and build.library_name(variant) == name
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    monkeypatch.setattr(build, "CSRC", copy)
    assert build.library_name(variant) == name
    header = copy / "simd.h"  # a header counts too: a .cpp that includes it compiles differently
    header.write_text(header.read_text() + "\n")
    changed = build.library_name(variant)
    assert changed != name
    monkeypatch.setattr(build, "MAX_ROWS", build.MAX_ROWS // 2)  # a -D define
    assert build.library_name(variant) not in (name, changed)
    assert "-DFOLIO_MAX_ROWS=32" in build.cflags(variant)


def test_the_sources_ship_with_the_package(repo: Path) -> None:
    """pyproject's package data names every file of csrc/ (a wheel without them could not build the kernels)."""
    config = tomllib.loads((repo / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["model.kernels"]
    files = [p.relative_to(build.CSRC.parent).as_posix() for p in build.CSRC.iterdir()]
    assert {p.suffix for p in build.sources()} == {".cpp", ".h"}
    assert [f for f in files if not any(fnmatch(f, pattern) for pattern in patterns)] == []


def test_a_build_says_what_it_costs_how_far_it_got_and_what_it_took(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A first build names its files and their cost in CPU time (not "about a minute": it took 5 on a busy 2-vCPU
    machine), says every PROGRESS_EVERY seconds how many files are compiled, and at the end how long it took. The
    compiler is replaced by a stand-in that writes two of the objects and returns once a line has counted them."""
    monkeypatch.setenv("FOLIO_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(build, "PROGRESS_EVERY", 0.01)
    monkeypatch.setattr(build.log, "disabled", False)  # a server's logging config earlier in the run may disable it
    counted = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "2 of" in record.getMessage():
                counted.set()

    def compile_two(name: str, sources: list[str], *, build_directory: str, **_: object) -> ModuleType:
        for source in sources[:2]:
            (Path(build_directory) / Path(source).with_suffix(".o").name).write_bytes(b"")
        assert counted.wait(timeout=60), "no progress line counted the compiled files"
        return ModuleType(name)

    watch = Watch()
    build.log.addHandler(watch)
    monkeypatch.setattr(cpp_extension, "load", compile_two)
    try:
        with caplog.at_level(logging.INFO, logger=build.log.name):
            module = build.build(build.VARIANTS[0])
    finally:
        build.log.removeHandler(watch)
    assert module.__name__ == build.library_name(build.VARIANTS[0])
    lines = [r.getMessage() for r in caplog.records]
    files = len([p for p in build.sources() if p.suffix == ".cpp"])
    assert f"{files} C++ files, ~{build.BUILD_CPU_SECONDS} CPU-seconds of g++" in lines[0]
    assert "about a minute" not in lines[0]
    assert any(f"still building the CPU decode kernels: 2 of {files} files compiled" in line for line in lines)
    assert lines[-1].startswith("built the CPU decode kernels (avx2) in ")
