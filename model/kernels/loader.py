"""The one kernel library a process uses: loaded once (the best variant this CPU runs), or why it is not.

Where the kernels cannot be used (no compiler for a first build, a CPU without AVX2, FOLIO_CPU_KERNELS=0),
`load()` logs why and torch's own ops serve everywhere: slower, same results. FOLIO_CPU_KERNELS=avx2 (a
variant's name) picks that variant instead of the best this CPU runs; `using(name)` does so within a block (tests).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import threading
from collections.abc import Iterator
from types import ModuleType

import torch

from model.kernels import build

log = logging.getLogger(__name__)

_lock = threading.Lock()
_library: ModuleType | None = None
_variant: build.Variant | None = None
_why_not: str | None = None
_disabled = False


def load() -> bool:
    """Build (once per source, variant and torch version) and load the kernels; True when they will be used."""
    global _library, _variant, _why_not
    with _lock:
        if _library is not None or _why_not is not None:
            return _library is not None
        variant, _why_not = chosen_variant(os.environ.get("FOLIO_CPU_KERNELS", "1"))
        if variant is not None:
            try:
                _library, _variant = build.build(variant), variant
            except Exception as e:  # no compiler, no ninja, a read-only cache: serve with torch's ops
                _why_not = f"could not be built: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
        if _why_not is not None:
            log.warning("CPU decode kernels %s; using torch's ops (slower on CPU, same results)", _why_not)
        else:
            log.info("CPU decode kernels loaded (%s)", variant.name)
        return _library is not None


def chosen_variant(setting: str) -> tuple[build.Variant | None, str | None]:
    """The variant FOLIO_CPU_KERNELS's value asks for ("1": the best this CPU runs, "0": none, or a variant's
    name, e.g. "avx2" to measure it on a CPU that has more), or None and why not."""
    best = build.best_variant()
    names = [v.name for v in build.VARIANTS]
    if setting == "0":
        return None, "turned off (FOLIO_CPU_KERNELS=0)"
    if best is None:
        return None, (f"needs an x86-64 CPU with AVX2 (this one: {platform.machine()}, "
                      f"{torch.backends.cpu.get_cpu_capability()})")
    if setting == "1":
        return best, None
    if setting not in names:
        return None, f"FOLIO_CPU_KERNELS={setting!r} is none of 0, 1, {', '.join(names)}"
    variant = build.VARIANTS[names.index(setting)]
    missing = sorted(variant.cpu_flags - build.cpu_flags())
    return (None, f"FOLIO_CPU_KERNELS={setting}: this CPU lacks {', '.join(missing)}") if missing else (variant, None)


def library() -> ModuleType | None:
    """The loaded library; None when it is not loaded (or cannot be) and within `disabled()`."""
    return None if _disabled else _library


def variant() -> build.Variant | None:
    """The variant loaded (None when none is)."""
    return _variant if library() is not None else None


def status() -> str:
    """'loaded (VARIANT)', 'not loaded' or why the kernels cannot be used (for /info and logs)."""
    return f"loaded ({_variant.name})" if library() is not None and _variant else (_why_not or "not loaded")


@contextlib.contextmanager
def using(name: str) -> Iterator[build.Variant]:
    """Within the block the process's kernels are the variant `name`'s (built here if need be) instead of those
    `load()` chose, as FOLIO_CPU_KERNELS=name would make them for a whole process: the tests run the arithmetic of
    every variant this CPU runs (an AVX2 machine's on an AVX-512 one). Modules installed within the block keep the
    variant's fused blocks. Raises ValueError where this CPU cannot run it, and what `build.build` raises where it
    cannot be built."""
    global _library, _variant, _why_not
    variant, why_not = chosen_variant(name)
    if variant is None:
        raise ValueError(f"the {name} kernels cannot be used here: {why_not}")
    lib = build.build(variant)
    with _lock:
        saved, (_library, _variant, _why_not) = (_library, _variant, _why_not), (lib, variant, None)
    try:
        yield variant
    finally:
        with _lock:
            _library, _variant, _why_not = saved


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block every kernel-backed module and function uses torch's own ops (references, benchmarks)."""
    global _disabled
    saved, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = saved
