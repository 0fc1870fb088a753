"""/metrics' garbage-collector figures (app/http/metrics.py's GcCollector over model/heap.py)."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from app.http.metrics import GcCollector
from app.testing import metric
from model import heap


def test_a_scrape_reads_the_frozen_count_without_walking_the_frozen_heap(frozen_heap: None,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """gc.get_freeze_count walks the permanent generation's list (~35 ms for a server's 340,000 objects), which
    made every scrape that long: the count is the one taken when the heap was frozen."""
    monkeypatch.setattr(gc, "get_freeze_count", lambda: pytest.fail("a scrape walked the frozen heap"))
    registry = CollectorRegistry()
    registry.register(GcCollector())
    text = generate_latest(registry).decode()
    assert metric(text, "folio_gc_frozen_objects") == heap.frozen_count() > 10_000
    assert metric(text, "folio_gc_pause_seconds_bucket", generation="2", le="+Inf") == metric(
        text, "folio_gc_pause_seconds_count", generation="2")
