"""A server's frozen heap (model/heap.py): collections skip it, a thaw lets them free what sits in reference cycles
(a retired engine's), and a process that never froze its heap is left alone."""

from __future__ import annotations

import gc
import time
import weakref

from model import heap
from model.registry import ModelRegistry
from tests.model.test_registry import loader, models, run  # noqa: F401 (models: the fixture)


class Node:
    """One half of a reference cycle: freed by a collection only."""

    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> Node:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a


def test_a_frozen_cycle_is_collected_only_while_thawed(frozen_heap: None) -> None:
    held = [cycle()]
    alive = weakref.ref(held[0])
    heap.freeze()  # the cycle is frozen, then dropped: nothing outside it refers to it
    held.clear()
    gc.collect()
    assert alive() is not None  # collections skip the permanent generation
    with heap.thawed():
        gc.collect()
        assert alive() is None
    assert heap.frozen()  # and the heap is frozen again after


def test_a_heap_never_frozen_stays_unfrozen() -> None:
    assert not heap.frozen()
    heap.refreeze()
    with heap.thawed():
        pass
    assert gc.get_freeze_count() == heap.frozen_count() == 0


def test_refreeze_adds_what_a_load_made(frozen_heap: None) -> None:
    before = heap.frozen_count()
    made = [Node() for _ in range(1000)]
    heap.refreeze()
    assert heap.frozen_count() >= before + len(made)  # (as counted then: frozen objects freed since leave it)


def test_an_unloaded_engine_is_freed_from_a_frozen_heap(frozen_heap: None, models) -> None:  # noqa: F811
    """An engine sits in reference cycles: frozen with the heap, only the registry's thaw lets it go."""
    reg = ModelRegistry(models, loader())
    try:
        engine = run(reg.acquire("a"))[1]
        gone = weakref.ref(engine)
        del engine
        heap.refreeze()  # the load's objects frozen too, as in a server
        reg.unload("a")
        deadline = time.monotonic() + 20
        while (gone() is not None or not heap.frozen()) and time.monotonic() < deadline:
            time.sleep(0.1)  # the retirement's thread collects, then freezes the heap again
        assert gone() is None and heap.frozen()
    finally:
        reg.stop()


def test_pauses_count_each_collection_by_generation_into_its_bucket() -> None:
    pauses = heap.Pauses()
    pauses.watch()
    pauses.watch()  # once per process: a second call records nothing twice
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        pauses.unwatch()
    gc.collect(2)  # after unwatch: not recorded
    young, _, full = pauses.snapshot()
    assert full.count == 2 and young.count >= 1
    for g in (young, full):
        assert sum(g.buckets) == g.count and 0 < g.longest <= g.seconds
    assert pauses._callback not in gc.callbacks
