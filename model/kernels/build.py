"""Building the C++ in `csrc/` into a library Python imports: once per variant, source and torch version.

The sources are compiled with `torch.utils.cpp_extension.load` (g++ and ninja) into `FOLIO_KERNEL_DIR/<name>`
(default ~/.cache/folio/kernels), where the name carries the variant and a hash of every source file, the
compiler flags, torch's version and the machine: a changed source or flag builds anew beside the old, and a
process that finds its library built imports it without a compiler (the Docker image ships it prebuilt:
`python -m model.kernels`).

A variant is one instruction set's build of the same sources: its compiler flags and the CPU flags it needs to
run. `best_variant` picks the most capable one this CPU runs. The thresholds below are defined here once and reach
the C++ as `-D` defines; the figures that chose them are in bench/results/kernels.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

# The thresholds of the library's one rule for who does a product (csrc/linear.cpp, `by_kernels`), each defined
# here once and passed to the C++ as a -D define (csrc/ops.h); the tests ask the library itself which way a product
# goes. The measurements behind each value are in bench/results/kernels.md ("Thresholds"), not here.
MAX_ROWS = 64  # up to this many rows (a step's tokens) the kernels do a product; more go to torch's blocked GEMM
PACKED_MIN_ROWS = 1  # from this many rows through a weight's packed copy, where it has one (else dot products)
# from this many rows bf16 weights go to torch's bf16 GEMM (oneDNN), where the CPU multiplies bf16 natively
BF16_GEMM_MIN_ROWS = 16
# from this many rows int8 weights go to an int8 GEMM (the rows rounded to int8: W8A8): the kernels' own
# (csrc/vnni_gemm.cpp), in every build that has one (avx2, avx2vnni, avx512vnni), at batch 1 too ...
OWN_GEMM_MIN_ROWS = 1
# ... in AMX-INT8's tiles from this many rows, where the CPU has them (fewer: vpdpbusd, which reads closer to
# bandwidth) ...
AMX_GEMM_MIN_ROWS = 8
# ... else (the avx512 build, a width the own GEMM does not take) oneDNN's, where the CPU multiplies int8 natively
# (VNNI, AMX); fewer rows are bandwidth-bound and keep the kernels' products
INT8_GEMM_MIN_ROWS = 8
# from this many rows 4-bit weights go to their GEMM (csrc/int4.cpp: panels unpacked to bytes, registers of outputs)
# in the AVX-512 builds, fewer to their dot products (lanes over columns); the AVX2 builds from OWN_GEMM_MIN_ROWS
INT4_GEMM_MIN_ROWS = 4
INT8_GEMM_MIN_WEIGHTS = 256 * 1024  # ... and only for weights of this many values or more (small ones: the kernels)
# a packed weight's panels hold this many outputs each: (ceil(O / PANEL), I, PANEL) (`ops.pack`)
PANEL = 16
# a cached forward of up to this many tokens (rows x chunk: a decode step, a prompt chunk) runs its blocks fused,
# each token a row, its attention in blocks per row; the bound is that call's scratch memory (~10 C floats a
# token, 120 MB for GPT-2 small at the bound)
FUSED_MAX_TOKENS = 4096

# a first build compiles every .cpp in csrc/ with -O3: about this many CPU-seconds of g++ in all (torch's headers are
# most of it; measured: bench/results/kernels.md), split over the cores by ninja. A line says how far it got every
# PROGRESS_EVERY s.
BUILD_CPU_SECONDS = 100
PROGRESS_EVERY = 30.0

CSRC = Path(__file__).with_name("csrc")
X86_64 = ("x86_64", "AMD64")


@dataclass(frozen=True)
class Variant:
    """One instruction set's build of the sources in `csrc/`."""

    name: str
    cflags: tuple[str, ...]  # what the compiler may use
    cpu_flags: frozenset[str]  # what the CPU must have to run it, as Linux's /proc/cpuinfo names them


# from the least to the most capable; every variant builds from the same sources, which pick their code by the
# compiler's flags (simd.h): "avx2" computes in 8 fp32 lanes and multiplies int8 weights with int8-rounded
# activations (vpmaddubsw, as llama.cpp's q8_0), "avx2vnni" the same in AVX-VNNI's 256-bit vpdpbusd (Intel from Alder
# Lake on), "avx512" in 16 lanes (and 12-row panel tiles), and "avx512vnni" also multiplies int8 weights with
# int16-rounded activations in VNNI's vpdpwssd. Each reads an fp16 KV cache with F16C's conversions (every AVX2 CPU
# has them).
VARIANTS = (
    Variant("avx2", ("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"})),
    Variant("avx2vnni", ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"), frozenset({"avx2", "fma", "f16c", "avx_vnni"})),
    Variant("avx512", ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl"),
            frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"})),
    Variant("avx512vnni", ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
            frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})),
)


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux names them; elsewhere those that torch's detected capability implies."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    return frozenset({"avx2", "fma", "f16c"}) if capability in ("AVX2", "AVX512") else frozenset()


def best_variant(flags: frozenset[str] | None = None) -> Variant | None:
    """The most capable variant a CPU with `flags` (default: this one) runs; None if it runs none."""
    if platform.machine() not in X86_64:
        return None
    flags = cpu_flags() if flags is None else flags
    runnable = [v for v in VARIANTS if v.cpu_flags <= flags]
    return runnable[-1] if runnable else None


def cflags(variant: Variant) -> list[str]:
    return ["-O3", *variant.cflags, f"-DFOLIO_MAX_ROWS={MAX_ROWS}", f"-DFOLIO_PACKED_MIN_ROWS={PACKED_MIN_ROWS}",
            f"-DFOLIO_PANEL={PANEL}", f"-DFOLIO_BF16_GEMM_MIN_ROWS={BF16_GEMM_MIN_ROWS}",
            f"-DFOLIO_INT8_GEMM_MIN_ROWS={INT8_GEMM_MIN_ROWS}", f"-DFOLIO_OWN_GEMM_MIN_ROWS={OWN_GEMM_MIN_ROWS}",
            f"-DFOLIO_INT8_GEMM_MIN_WEIGHTS={INT8_GEMM_MIN_WEIGHTS}",
            f"-DFOLIO_AMX_GEMM_MIN_ROWS={AMX_GEMM_MIN_ROWS}", f"-DFOLIO_INT4_GEMM_MIN_ROWS={INT4_GEMM_MIN_ROWS}"]


def sources() -> list[Path]:
    """Every C++ source and header (the headers count for the hash, the .cpp files are compiled)."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))


def library_name(variant: Variant) -> str:
    key = hashlib.sha256()
    for path in sources():
        key.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    key.update(" ".join([*cflags(variant), torch.__version__, platform.machine()]).encode())
    return f"folio_kernels_{variant.name}_{key.hexdigest()[:12]}"


def build_directory(variant: Variant) -> Path:
    default = Path.home() / ".cache" / "folio" / "kernels"
    return Path(os.environ.get("FOLIO_KERNEL_DIR") or default) / library_name(variant)


def import_built(variant: Variant) -> ModuleType | None:
    """The library an earlier `build` made, without invoking the compiler (or needing one); None if none."""
    name = library_name(variant)
    built = build_directory(variant) / f"{name}.so"
    if not built.is_file():
        return None
    loader = importlib.machinery.ExtensionFileLoader(name, str(built))
    spec = importlib.util.spec_from_file_location(name, built, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def build(variant: Variant) -> ModuleType:
    """The variant's library, imported: built before, or compiled now (`BUILD_CPU_SECONDS` of g++, saying how far it
    got as it goes). Raises where it cannot be compiled (no compiler, no ninja, a read-only cache). The CPU must run
    the variant: importing runs its code."""
    module = import_built(variant)
    if module is not None:
        return module
    from torch.utils.cpp_extension import load  # only when compiling: a built library needs none of it

    directory = build_directory(variant)
    directory.mkdir(parents=True, exist_ok=True)
    # One build at a time, under a lock the OS releases when its holder dies: torch's own lock file (`lock`) stays
    # behind when a build is killed (Ctrl-C during a first start), and every later build would wait on it forever.
    with open(directory / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        module = import_built(variant)  # another process may have built it while this one waited
        if module is not None:
            return module
        (directory / "lock").unlink(missing_ok=True)  # a killed build's; no build runs now
        files = [str(p) for p in sources() if p.suffix == ".cpp"]
        cores = os.cpu_count() or 1
        log.info("building the CPU decode kernels (%s) once into %s: %d C++ files, ~%d CPU-seconds of g++ (~%d s on "
                 "%d idle cores, longer on a busy machine)", variant.name, directory, len(files), BUILD_CPU_SECONDS,
                 BUILD_CPU_SECONDS / min(cores, len(files)), cores)
        started, done, before = time.monotonic(), threading.Event(), _objects(directory)
        progress = threading.Thread(target=_report_progress, args=(directory, before, len(files), started, done),
                                    name="folio-kernel-build", daemon=True)
        progress.start()
        try:
            module = load(library_name(variant), files, extra_cflags=cflags(variant), build_directory=str(directory),
                          verbose=False)
        finally:
            done.set()
            progress.join()
        log.info("built the CPU decode kernels (%s) in %.0f s", variant.name, time.monotonic() - started)
        return module


def _objects(directory: Path) -> dict[str, int]:
    """The object files in a build directory and when each was written (ns)."""
    found = {}
    for obj in directory.glob("*.o"):
        try:
            found[obj.name] = obj.stat().st_mtime_ns
        except FileNotFoundError:  # replaced as we looked
            continue
    return found


def _report_progress(directory: Path, before: dict[str, int], files: int, started: float,
                     done: threading.Event) -> None:
    """Every PROGRESS_EVERY seconds until `done`: how many of the build's `files` are compiled (objects new or
    rewritten since `before`, the directory's when it started: file times follow a coarser clock than
    time.time's) and for how long it has run."""
    while not done.wait(PROGRESS_EVERY):
        compiled = sum(before.get(name) != written for name, written in _objects(directory).items())
        log.info("still building the CPU decode kernels: %d of %d files compiled, %.0f s so far", compiled, files,
                 time.monotonic() - started)
