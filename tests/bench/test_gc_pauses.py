"""bench/gc_pauses.py's reading of two /metrics records: each generation's collections between them, and the bucket
that holds the longest."""

from __future__ import annotations

from bench.gc_pauses import gc_delta


def record(count: float, seconds: float, buckets: dict[str, float]) -> dict:
    return {"count": count, "seconds": seconds, "buckets": buckets}


def test_the_longest_pause_is_the_first_bucket_holding_every_new_collection() -> None:
    before = {"0": record(10, 0.01, {"0.001": 10, "0.005": 10, "0.25": 10, "+Inf": 10}),
              "2": record(1, 0.19, {"0.001": 0, "0.005": 0, "0.25": 1, "+Inf": 1})}
    after = {"0": record(13, 0.013, {"0.001": 13, "0.005": 13, "0.25": 13, "+Inf": 13}),
             "2": record(3, 0.384, {"0.001": 0, "0.005": 1, "0.25": 3, "+Inf": 3})}
    delta = gc_delta(before, after)
    assert delta["0"]["count"] == 3 and delta["0"]["longest_at_most"] == "0.001"
    assert delta["2"]["count"] == 2 and delta["2"]["longest_at_most"] == "0.25"
    assert abs(delta["2"]["seconds"] - 0.194) < 1e-9
    assert gc_delta(after, after)["2"] == {"count": 0, "seconds": 0.0, "longest_at_most": None}
