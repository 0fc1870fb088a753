"""Section `load`: mixed routes, streaming and not, mixed parameters, from many concurrent clients against a
capacity below the client count, so some requests get a deliberate 429 and retry; every accepted request must
end with the right number of tokens; the server's RSS after the run against after a warm-up."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any

from app.testing import metric
from bench.reliability.clients import drive
from bench.reliability.harness import MAIN_BATCH, MAIN_WAITING, PRINTABLE, Problems, rss_kib, scrape
from bench.reliability.spec import random_spec


def run(base: str, pid: int, requests: int, clients: int, warmup: int, seed: int) -> dict[str, Any]:
    """`warmup` random requests, then `requests` more whose stop strings are drawn from the characters the warm-up
    generated most (so that some stop), from `clients` clients; `pid` is the server's, for its RSS."""
    rng = random.Random(seed)
    problems = Problems()
    emitted: Counter[str] = Counter()
    warm = asyncio.run(drive(base, [random_spec(rng) for _ in range(warmup)], clients, problems, emitted))
    time.sleep(0.5)
    rss_warm = rss_kib(pid)
    frequent = [c for c, _ in emitted.most_common(6) if c != "\n"] or PRINTABLE
    specs = [random_spec(rng, stop_chars=frequent) for _ in range(requests)]
    result = asyncio.run(drive(base, specs, clients, problems))
    time.sleep(0.5)
    rss_after = rss_kib(pid)
    growth = rss_after / rss_warm - 1
    if abs(growth) > 0.10:
        problems.add(f"RSS after the run {rss_after} KiB is {growth:+.1%} off {rss_warm} KiB after warm-up")
    if result["completed"] != requests:
        problems.add(f"{result['completed']} of {requests} requests completed correctly")
    text = scrape(base)
    if metric(text, "folio_running_batch_size") or metric(text, "folio_queue_depth"):
        problems.add("the batch or queue is not empty after the run")
    mix = Counter(s.route for s in specs)
    return problems.figures(
        **result, clients=clients, capacity=MAIN_BATCH + MAIN_WAITING, warmup_requests=warmup, warmup=warm,
        mix=dict(mix), streamed=sum(n for r, n in mix.items() if r.endswith("stream")),
        with_stop_strings=sum(1 for s in specs if s.stop), rss_after_warmup_kib=rss_warm,
        rss_after_run_kib=rss_after, rss_growth=round(growth, 4))
