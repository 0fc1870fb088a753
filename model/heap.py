"""A serving process's heap as the garbage collector sees it: frozen once the models are loaded.

A server holds a few hundred thousand long-lived objects (the libraries' modules and types, the routes' schemas, the
models' modules and tokenizers: 338,000 with the bundled model). A full collection walks all of them, about 185 ms
on a Zen 5 core, during which the event loop and the engine thread, which share the interpreter's lock, both stand
still: under load one came every 10 to 20 s, and made the longest gap between two tokens of every stream then.
`freeze` moves everything alive into the permanent generation, which collections skip (`gc.freeze`, as vLLM's
`freeze_gc_heap` does after its start-up): the collector then walks only what requests allocate, a few
milliseconds at most.

Frozen objects are never collected, so what becomes garbage only through a collection (objects in reference
cycles) must be thawed first: `thawed` is how the registry retires an engine (model/registry.py), and `refreeze`
freezes what a later load added. Both do nothing in a process that never froze its heap (the tests' processes,
which build and drop engines by the hundred).

`pauses` records every collection's duration by generation once `watched` (a server does, frozen or not): /metrics
shows them as `folio_gc_pause_seconds`, and bench/gc_pauses.py compares a frozen heap with one left alone.
"""

from __future__ import annotations

import bisect
import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

_lock = threading.Lock()  # one freeze or thaw at a time: a retirement must not be frozen again halfway
# the objects frozen, counted when frozen: `gc.get_freeze_count` walks the permanent generation's list, ~35 ms for
# 340,000 objects, which made every /metrics scrape that long
_frozen_count = 0


def _freeze() -> None:
    global _frozen_count
    gc.collect()
    gc.freeze()
    _frozen_count = gc.get_freeze_count()


def _unfreeze() -> None:
    global _frozen_count
    gc.unfreeze()
    _frozen_count = 0


def freeze() -> int:
    """Collect, then freeze every object alive: the number frozen."""
    with _lock:
        _freeze()
        return _frozen_count


def unfreeze() -> None:
    """Give every frozen object back to the collector (the oldest generation)."""
    with _lock:
        _unfreeze()


def frozen_count() -> int:
    """Objects in the permanent generation, out of the collector's reach (as of the last freeze)."""
    return _frozen_count


def frozen() -> bool:
    return _frozen_count > 0


def refreeze() -> None:
    """After a load, in a process whose heap is frozen: freeze what the load added too."""
    if frozen():
        freeze()


@contextmanager
def thawed() -> Iterator[None]:
    """Collections reach every object inside (each `gc.collect` there can free frozen cycles); frozen again after,
    if it was."""
    with _lock:
        was_frozen = frozen()
        if was_frozen:
            _unfreeze()
        try:
            yield
        finally:
            if was_frozen:
                _freeze()


# -- pauses ---------------------------------------------------------------------------------------------------

PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)  # seconds; +Inf after


@dataclass
class Generation:
    """One generation's collections: how many, their seconds in all, the longest, and a count per bucket of
    PAUSE_BUCKETS (each collection in the first bucket it fits, the last for longer ones)."""

    count: int = 0
    seconds: float = 0.0
    longest: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(PAUSE_BUCKETS) + 1))


class Pauses:
    """The collector's pauses, per generation (0, 1, 2), through `gc.callbacks`. A collection runs on whichever
    thread allocated, holding the interpreter's lock, and never two at once: the callback needs no lock of its
    own; a reader copies under the interpreter's lock too (`snapshot`)."""

    def __init__(self) -> None:
        self.generations = [Generation() for _ in range(3)]
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        g = self.generations[info["generation"]]
        g.count += 1
        g.seconds += seconds
        g.longest = max(g.longest, seconds)
        g.buckets[bisect.bisect_left(PAUSE_BUCKETS, seconds)] += 1

    def watch(self) -> None:
        """Record from now on (once per process: a second call adds nothing)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def unwatch(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def snapshot(self) -> list[Generation]:
        return [Generation(g.count, g.seconds, g.longest, list(g.buckets)) for g in self.generations]


pauses = Pauses()  # the process's: its server watches it, its /metrics reads it
