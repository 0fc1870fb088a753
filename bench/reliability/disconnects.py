"""Section `disconnects`: streams (and a quarter as many whole-body requests) cut at random points; the time
until /metrics shows an empty batch and queue; the server's greedy output before and after."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from typing import Any

import httpx

from app.testing import metric
from bench.reliability.clients import drive
from bench.reliability.harness import NEW_TOKENS_LIMIT, Problems, idle_at, ms, scrape
from bench.reliability.spec import ROUTES, Spec, random_spec


async def _cut(client: httpx.AsyncClient, spec: Spec, rng: random.Random) -> tuple[str, float]:
    """Send `spec` and hang up at a random point: a stream before its first event (within 50 ms) or after a
    random number of events; a whole-body request after a random wait. Returns how it was cut, and when."""
    path, body = spec.request()
    how = rng.choice(["before the answer", "mid-stream", "mid-stream"]) if spec.streamed else "whole, waiting"

    async def streamed(after_events: int) -> None:
        async with client.stream("POST", path, json=body) as r:
            seen = 0
            async for chunk in r.aiter_raw():
                seen += chunk.count(b"\n\n")
                if seen >= after_events:
                    return

    try:
        if how == "mid-stream":
            await streamed(rng.randint(1, spec.max_new_tokens // 2))
        elif how == "before the answer":
            await asyncio.wait_for(streamed(10**9), timeout=rng.uniform(0.0, 0.05))
        else:
            await asyncio.wait_for(client.post(path, json=body), timeout=rng.uniform(0.05, 1.0))
    except TimeoutError:
        pass
    return how, time.perf_counter()



def _wave(base: str, n: int, rng: random.Random) -> tuple[list[tuple[str, float]], float]:
    """`n` long streams and `n // 4` long whole-body requests, all cut: how each was cut and when, and the time
    from the last cut until the server's batch and queue were empty."""
    streamed = tuple(r for r in ROUTES if r.endswith("stream"))
    whole = tuple(r for r in ROUTES if not r.endswith("stream"))
    specs = [random_spec(rng, max_new_tokens=(200, NEW_TOKENS_LIMIT), routes=streamed) for _ in range(n)]
    specs += [random_spec(rng, max_new_tokens=(200, NEW_TOKENS_LIMIT), routes=whole) for _ in range(n // 4)]
    for spec in specs:
        spec.stop = []  # long generations: a slot that is not freed stays busy for seconds

    async def storm() -> list[tuple[str, float]]:
        limits = httpx.Limits(max_connections=len(specs))
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:
            return await asyncio.gather(*(_cut(client, s, rng) for s in specs))

    cuts = asyncio.run(storm())
    last_cut = max(t for _, t in cuts)
    return cuts, max(0.0, idle_at(base) - last_cut)


def run(base: str, streams: int, wave: int, seed: int) -> dict[str, Any]:
    """`streams` long streamed generations in waves of `wave`, each wave with a quarter as many whole-body
    requests beside it (all within the capacity, so none is refused), every one cut at a random point. After each
    wave, the time from its last cut until /metrics shows no running or waiting request. Afterwards the greedy
    output of a fixed prompt must be what it was before, and a batch of mixed requests must complete."""
    rng = random.Random(seed)
    problems = Problems()
    probe = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": 40}}
    before = httpx.post(f"{base}/generate", json=probe, timeout=60).json()
    cancelled_before = metric(scrape(base), "folio_cancelled_requests_total")
    free_times, hows = [], Counter()
    for done in range(0, streams, wave):
        cuts, freed = _wave(base, min(wave, streams - done), rng)
        hows.update(how for how, _ in cuts)
        free_times.append(freed)
    cancelled = metric(scrape(base), "folio_cancelled_requests_total") - cancelled_before
    worst = max(free_times)
    if worst > 1.0:
        problems.add(f"a wave's slots took {worst:.3f} s to free after its last cut (limit 1 s)")
    after = httpx.post(f"{base}/generate", json=probe, timeout=60)
    if after.status_code != 200 or after.json() != before:
        problems.add(f"after the storm: {after.status_code} {after.text[:200]}, before: {before}")
    if httpx.get(f"{base}/health", timeout=10).status_code != 200:
        problems.add("/health is not 200 after the storm")
    normal = asyncio.run(drive(base, [random_spec(rng) for _ in range(24)], 8, problems))
    return problems.figures(
        streams=streams, whole_requests=sum(n for how, n in hows.items() if how.startswith("whole")),
        waves=math.ceil(streams / wave), wave=wave, cut=dict(hows), completed_after=normal["completed"],
        cancelled_by_server=int(cancelled), slots_freed_max_ms=ms(worst),
        slots_freed_per_wave_ms=[ms(t) for t in free_times], answers_normally_after=not problems)
