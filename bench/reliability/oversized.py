"""Section `oversized`: the largest work one request may ask for: the longest /tokenize input the server accepts
(its time, the answer's size, the server's RSS and /health's latency meanwhile), bodies just under the size limit
made of unknown fields (four at once, /health's latency meanwhile), and 16 stop strings of the longest accepted
length against none (a request alone, and half of a batch)."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

from bench.reliability.harness import MB, PRINTABLE, Problems, ms, rss_kib
from bench.report import pct

T = TypeVar("T")


async def _with_health(base: str, work: Callable[[], Awaitable[T]]) -> tuple[T, float, list[float]]:
    """Await `work()` while /health is polled every 10 ms on a connection of its own: its result, its time, and the
    latency of each /health answer that came while it ran."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as prober:
        await prober.get("/health")
        health: list[float] = []
        done = asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                t = time.perf_counter()
                await prober.get("/health")
                if not done.is_set():
                    health.append(time.perf_counter() - t)
                await asyncio.sleep(0.01)

        probing = asyncio.ensure_future(probe())
        t0 = time.perf_counter()
        result = await work()
        elapsed = time.perf_counter() - t0
        done.set()
        await probing
    return result, elapsed, health


async def _timed_with_health(base: str, path: str, body: dict[str, Any]) -> tuple[httpx.Response, float, list[float]]:
    """POST `body` while /health is polled (`_with_health`)."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        return await _with_health(base, lambda: client.post(path, json=body))


def _stop_strings(length: int) -> list[str]:
    """16 stop strings of `length` characters that greedy output will not contain (they alternate two characters
    and end in a third)."""
    return [("ab" * length)[: length - 1] + PRINTABLE[i] for i in range(16)]


def _text(chars: int) -> str:
    line = "To be, or not to be: that is the question. "  # nothing JSON escapes: a character is a byte
    return (line * (chars // len(line) + 1))[:chars]


def _largest_tokenize(base: str, pid: int, problems: Problems) -> dict[str, Any]:
    """The longest /tokenize input the server accepts (a body's worth, or its --max-tokenize-chars): its time, the
    answer's size, the server's RSS before and after and its peak, and /health's latency meanwhile."""
    rss_before, peak_before = rss_kib(pid), rss_kib(pid, "VmHWM")
    chars = 2 * MB - 64  # a body's worth (--max-body-bytes 2 MiB on the main server)
    r, elapsed, health = asyncio.run(_timed_with_health(base, "/tokenize", {"inputs": _text(chars)}))
    over = None
    if r.status_code == 422 and (m := re.search(r"at most (\d+) characters", r.text)):
        over = {"chars": chars, "status": r.status_code, "seconds": round(elapsed, 3), "answer_bytes": len(r.content)}
        chars = int(m.group(1))
        r, elapsed, health = asyncio.run(_timed_with_health(base, "/tokenize", {"inputs": _text(chars)}))
    if r.status_code != 200 or len(r.json()) != chars:
        problems.add(f"the largest /tokenize ({chars} characters) got {r.status_code}: {r.text[:200]}")
    if not health and elapsed > 0.1:  # polled every 10 ms: the event loop was held for the whole request
        problems.add(f"/health did not answer during a {elapsed:.2f} s /tokenize")
    return {"chars": chars, "status": r.status_code, "seconds": round(elapsed, 3),
            "answer_mb": round(len(r.content) / MB, 2), "rss_before_mb": round(rss_before / 1024),
            "rss_after_mb": round(rss_kib(pid) / 1024), "peak_rss_before_mb": round(peak_before / 1024),
            "peak_rss_after_mb": round(rss_kib(pid, "VmHWM") / 1024), "health_answers_during": len(health),
            "health_latency_p50_ms": ms(pct(health, 0.5)), "health_latency_max_ms": ms(max(health, default=None)),
            "over_the_limit": over}


MANY_FIELDS = 150_000  # unknown fields in a body just under the main server's 2 MiB limit (~1.9 MB)
MANY_FIELDS_AT_ONCE = 4


def _many_fields(base: str, problems: Problems) -> dict[str, Any]:
    """Four bodies of 150,000 unknown fields each, sent at once while /health is polled: each must be one 422, and
    /health answered meanwhile (the server parses and validates bodies off its event loop; before, four such
    bodies held it for 2-7 s and some of them timed out, 408)."""
    # encoded once, here: encoding it in the client's event loop would hold the /health probe beside it
    body = json.dumps({"inputs": "hi", **{f"k{i}": 0 for i in range(MANY_FIELDS)}}).encode()

    async def send() -> httpx.Response:
        async with httpx.AsyncClient(base_url=base, timeout=600) as client:
            return await client.post("/generate", content=body, headers={"content-type": "application/json"})

    async def all_at_once() -> list[httpx.Response]:
        return list(await asyncio.gather(*(send() for _ in range(MANY_FIELDS_AT_ONCE))))

    answers, elapsed, health = asyncio.run(_with_health(base, all_at_once))
    if any(r.status_code != 422 or "fields" not in r.text for r in answers):
        problems.add(f"a body of {MANY_FIELDS} unknown fields got {[r.status_code for r in answers]}: "
                     f"{answers[0].text[:200]}")
    return {"fields": MANY_FIELDS, "at_once": MANY_FIELDS_AT_ONCE, "statuses": sorted(r.status_code for r in answers),
            "seconds": round(elapsed, 3), "health_answers_during": len(health),
            "health_latency_p50_ms": ms(pct(health, 0.5)), "health_latency_max_ms": ms(max(health, default=None))}


def _stop_request(new_tokens: int, stops: list[str]) -> dict[str, Any]:
    return {"inputs": "ROMEO:", "parameters": {"max_new_tokens": new_tokens, "details": True, "stop": stops}}


async def _concurrently(base: str, bodies: list[dict[str, Any]], problems: Problems) -> tuple[float, list[float]]:
    """`bodies` POSTed to /generate at once, each to run to its length: (wall time, each request's time)."""
    async with httpx.AsyncClient(base_url=base, timeout=600,
                                 limits=httpx.Limits(max_connections=len(bodies))) as client:
        async def one(b: dict[str, Any]) -> float:
            t = time.perf_counter()
            r = await client.post("/generate", json=b)
            if r.status_code != 200 or r.json()["details"]["finish_reason"] != "length":
                problems.add(f"a stop-string request got {r.status_code}: {r.text[:200]}")
            return time.perf_counter() - t

        t0 = time.perf_counter()
        times = await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - t0, list(times)


def _stop_strings_cost(base: str, new_tokens: int, batch: int, problems: Problems) -> dict[str, Any]:
    """A greedy request of `new_tokens` tokens with 16 stop strings of the longest length the server accepts (from
    4096 characters, halved while it answers 422) against the same request without them; then `batch` such
    requests at once, half with the stop strings, against `batch` without."""
    length = 4096
    while length > 1:
        r = httpx.post(f"{base}/generate", json=_stop_request(new_tokens, _stop_strings(length)), timeout=600)
        if r.status_code != 422:
            break
        length //= 2
    plain, stopped = _stop_request(new_tokens, []), _stop_request(new_tokens, _stop_strings(length))
    alone = {label: statistics.median(asyncio.run(_concurrently(base, [body], problems))[0] for _ in range(3))
             for label, body in (("without", plain), ("with", stopped))}
    plain_wall, _ = asyncio.run(_concurrently(base, [plain] * batch, problems))
    mixed_wall, mixed_times = asyncio.run(_concurrently(base, [plain] * (batch // 2) + [stopped]
                                                        * (batch - batch // 2), problems))
    return {"stop_strings": 16, "stop_length": length, "new_tokens": new_tokens,
            "alone_without_s": round(alone["without"], 3), "alone_with_s": round(alone["with"], 3),
            "alone_ratio": round(alone["with"] / alone["without"], 2), "batch": batch,
            "batch_plain_tokens_per_s": round(batch * new_tokens / plain_wall, 1),
            "batch_half_with_stops_tokens_per_s": round(batch * new_tokens / mixed_wall, 1),
            "batch_throughput_ratio": round(plain_wall / mixed_wall, 3),
            "plain_requests_in_the_mixed_batch_max_s": round(max(mixed_times[: batch // 2]), 3),
            "plain_batch_s": round(plain_wall, 3)}


def run(base: str, pid: int, new_tokens: int, batch: int) -> dict[str, Any]:
    """The largest work one request may ask for: the largest /tokenize, and the longest stop strings (`pid` is the
    server's, for its memory)."""
    problems = Problems()
    tokenize = _largest_tokenize(base, pid, problems)
    many_fields = _many_fields(base, problems)
    stops = _stop_strings_cost(base, new_tokens, batch, problems)
    return problems.figures(tokenize=tokenize, many_fields=many_fields, stop_strings=stops)
