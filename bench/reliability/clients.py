"""`drive`: many concurrent clients working through a list of requests, retrying each 429 after a short pause, and
counting what came back (completed requests, tokens, finish reasons, latencies)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter
from typing import Any

import httpx

from bench.reliability.harness import Problems, ms
from bench.reliability.outcome import send
from bench.reliability.spec import Spec
from bench.report import pct


@dataclasses.dataclass
class _Tally:
    """What `drive`'s clients count together."""

    rejected: int = 0
    completed: int = 0
    tokens: int = 0
    attempts: int = 0
    latencies: list[float] = dataclasses.field(default_factory=list)
    finished: Counter[str] = dataclasses.field(default_factory=Counter)


async def _send_until_admitted(client: httpx.AsyncClient, spec: Spec, tally: _Tally, problems: Problems,
                               rng: random.Random, emitted: Counter[str] | None) -> None:
    """Send `spec`, again after a short random pause while it gets 429 (up to 1000 times); count what came."""
    for _ in range(1000):
        tally.attempts += 1
        t0 = time.perf_counter()
        try:
            out = await send(client, spec)
        except httpx.HTTPError as e:
            problems.add(f"{spec.route}: transport error {e!r} (cause {e.__cause__!r}) after "
                         f"{time.perf_counter() - t0:.3f} s, request {spec.request()[1]}"[:600])
            return
        if out.status == 429:
            tally.rejected += 1
            await asyncio.sleep(rng.uniform(0.01, 0.1))
            continue
        tally.latencies.append(time.perf_counter() - t0)
        if out.status != 200 or out.error:
            problems.add(f"{spec.route}: {out.status} {out.error or ''} for {spec.request()[1]}"[:500])
        for p in out.problems:
            problems.add(p)
        tally.completed += out.status == 200 and not out.problems and not out.error
        tally.tokens += out.tokens
        tally.finished[str(out.finish_reason)] += 1
        if emitted is not None:
            emitted.update(out.text)
        return
    problems.add(f"{spec.route}: still 429 after 1000 attempts")


async def drive(base: str, specs: list[Spec], clients: int, problems: Problems,
                emitted: Counter[str] | None = None) -> dict[str, Any]:
    """`clients` concurrent clients working through `specs`; a 429 is retried after a short random pause.
    The characters generated are counted into `emitted`."""
    pending = list(reversed(specs))
    tally = _Tally()
    rng = random.Random(len(specs))

    async def client_loop(client: httpx.AsyncClient) -> None:
        while pending:
            await _send_until_admitted(client, pending.pop(), tally, problems, rng, emitted)

    # an idle connection is dropped before uvicorn's 5 s keep-alive timeout would close it: at equal timeouts a
    # request sent just as the server closes the connection gets a reset (about 1 in 3,000 requests here)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients, keepalive_expiry=2.0)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=300) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    wall = time.perf_counter() - t0
    return {"requests": len(specs), "completed": tally.completed, "attempts": tally.attempts,
            "rejected_429": tally.rejected, "tokens": tally.tokens, "seconds": round(wall, 2),
            "requests_per_s": round(len(specs) / wall, 2), "tokens_per_s": round(tally.tokens / wall, 1),
            "finish_reasons": dict(tally.finished), "latency_p50_ms": ms(pct(tally.latencies, 0.5)),
            "latency_p99_ms": ms(pct(tally.latencies, 0.99))}
