"""Section `overload`: ten times the capacity (max_batch_size + max_waiting) at once on pre-opened connections:
the latency of each 429, and the accepted requests' throughput against a burst of exactly the capacity; then the
latency of lone requests refused while the server is held full."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from app.testing import metric, serving
from bench.reliability.harness import Problems, idle_at, ms, port_of, raw_head
from bench.reliability.shapes import check_response
from bench.report import pct

Answer = tuple[int, float, bytes]  # (status, latency, body)


async def _burst(port: int, n: int, body: bytes) -> list[Answer]:
    """`n` POST /generate at once, each on its own connection opened beforehand: (status, latency, body)."""
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]
    request = raw_head(len(body)) + body

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, t0: float) -> Answer:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        data = await reader.readexactly(length)
        latency = time.perf_counter() - t0
        writer.close()
        return status, latency, data

    starts = []
    for _, writer in conns:
        writer.write(request)
        starts.append(time.perf_counter())
    for _, writer in conns:
        await writer.drain()
    return await asyncio.gather(*(one(r, w, t0) for (r, w), t0 in zip(conns, starts)))


async def _lone_refusals(base: str, capacity: int, n: int) -> list[tuple[int, float]]:
    """With the server held at capacity by long generations, `n` requests one after another on a kept-alive
    connection: (status, latency) each. The held generations are cancelled at the end (their sockets closed)."""
    body = json.dumps({"inputs": "hold", "parameters": {"max_new_tokens": 4096}}).encode()
    held = [await asyncio.open_connection("127.0.0.1", port_of(base)) for _ in range(capacity)]
    for _, writer in held:
        writer.write(raw_head(len(body)) + body)
    out = []
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for _ in range(3000):  # until all are admitted (a request being prefilled shows in neither gauge)
            text = (await client.get("/metrics")).text
            if metric(text, "folio_running_batch_size") + metric(text, "folio_queue_depth") >= capacity:
                break
            await asyncio.sleep(0.01)
        probe = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": 16}}
        for _ in range(n):
            t0 = time.perf_counter()
            r = await client.post("/generate", json=probe)
            out.append((r.status_code, time.perf_counter() - t0))
    for _, writer in held:
        writer.close()
    return out


@dataclasses.dataclass
class _Bursts:
    """What the bursts measured, and the problems they showed."""

    capacity: int
    new_tokens: int
    problems: Problems = dataclasses.field(default_factory=Problems)
    tokens_per_s: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {"plain": [], "overloaded": []})
    rejected: list[float] = dataclasses.field(default_factory=list)  # latencies of the overloaded bursts' 429s
    accepted: list[float] = dataclasses.field(default_factory=list)  # and of their admitted requests
    accepted_counts: list[int] = dataclasses.field(default_factory=list)

    def add(self, label: str, n: int, results: list[Answer]) -> None:
        """Check one burst of `n` requests and record its figures."""
        accepted = [(lat, data) for status, lat, data in results if status == 200]
        rejected = [lat for status, lat, _ in results if status == 429]
        other = [status for status, _, _ in results if status not in (200, 429)]
        if other:
            self.problems.add(f"{label} burst: statuses other than 200 and 429: {Counter(other)}")
        for status, _, data in results:
            for p in check_response("/generate", False, status, "application/json", data):
                self.problems.add(p)
        tokens = 0
        for _, data in accepted:
            text = json.loads(data)["generated_text"]
            if len(text) != self.new_tokens:
                self.problems.add(f"an accepted request generated {len(text)} tokens, not {self.new_tokens}")
            tokens += len(text)
        wall = max(lat for lat, _ in accepted) if accepted else math.nan
        self.tokens_per_s[label].append(tokens / wall)
        if label == "plain" and rejected:
            self.problems.add(f"a burst of exactly the capacity ({self.capacity}) got {len(rejected)} 429s")
        if label == "overloaded":
            self.rejected += rejected
            self.accepted += [lat for lat, _ in accepted]
            self.accepted_counts.append(len(accepted))
            if len(accepted) < self.capacity:
                self.problems.add(f"only {len(accepted)} of {n} admitted, capacity is {self.capacity}")
            if len(accepted) + len(rejected) != n:
                self.problems.add(f"{n - len(accepted) - len(rejected)} requests neither admitted nor refused")


def _figures(b: _Bursts, lone: list[tuple[int, float]], ratios: list[float]) -> dict[str, Any]:
    lone_latencies = [lat for _, lat in lone]
    return {
        "accepted_per_burst": b.accepted_counts, "rejected": len(b.rejected),
        "rejected_latency_p50_ms": ms(pct(b.rejected, 0.5)), "rejected_latency_p99_ms": ms(pct(b.rejected, 0.99)),
        "rejected_latency_max_ms": ms(max(b.rejected, default=None)),
        "rejected_within_50ms": sum(lat <= 0.05 for lat in b.rejected),
        "accepted_latency_min_ms": ms(min(b.accepted, default=None)),
        "accepted_latency_max_ms": ms(max(b.accepted, default=None)),
        "plain_tokens_per_s": [round(x, 1) for x in b.tokens_per_s["plain"]],
        "overloaded_tokens_per_s": [round(x, 1) for x in b.tokens_per_s["overloaded"]],
        "throughput_ratios": [round(r, 3) for r in ratios], "throughput_ratio": round(statistics.median(ratios), 3),
        "lone_rejected": len(lone), "lone_rejected_latency_p50_ms": ms(pct(lone_latencies, 0.5)),
        "lone_rejected_latency_p99_ms": ms(pct(lone_latencies, 0.99)),
        "lone_rejected_within_50ms": sum(lat <= 0.05 for lat in lone_latencies)}


def run(checkpoint: Path, workdir: Path, batch: int, waiting: int, factor: int, new_tokens: int,
        rounds: int, timing: bool = True) -> dict[str, Any]:
    """Bursts of `capacity` requests (the non-overloaded figure) and of `factor * capacity` requests, alternated
    `rounds` times, each on connections opened beforehand. Throughput: accepted tokens over the time from the
    burst to the last accepted response; the ratio is taken per round (the bursts of a round run back to back),
    then the median. Then lone requests while the server is held at capacity: a 429 that queues behind no other.
    With `timing`, the issue's two timing requirements count as problems: every 429 of a burst within 50 ms, and
    the throughput ratio at least 0.9 (the CI test leaves them to this bench and checks a relative bound)."""
    capacity = batch + waiting
    bursts = _Bursts(capacity, new_tokens)
    problems = bursts.problems
    body = json.dumps({"inputs": "ROMEO:", "parameters": {"max_new_tokens": new_tokens, "do_sample": True,
                                                           "seed": 1}}).encode()
    args = ["--max-batch-size", str(batch), "--max-waiting", str(waiting), "--window-shift", "8"]
    with serving(checkpoint, workdir / "overload.log", *args) as (base, _):
        asyncio.run(_burst(port_of(base), capacity, body))  # warm-up
        for _ in range(rounds):
            for label, n in (("plain", capacity), ("overloaded", factor * capacity)):
                bursts.add(label, n, asyncio.run(_burst(port_of(base), n, body)))
        lone = asyncio.run(_lone_refusals(base, capacity, 50))
        if any(status != 429 for status, _ in lone):
            problems.add(f"a lone request while at capacity got {Counter(s for s, _ in lone)}")
        if not math.isfinite(idle_at(base)):
            problems.add("the held generations were not cancelled")
    ratios = [o / p for p, o in zip(bursts.tokens_per_s["plain"], bursts.tokens_per_s["overloaded"])]
    slow = [lat for lat in bursts.rejected if lat > 0.05]
    if timing and slow:
        problems.add(f"{len(slow)} of {len(bursts.rejected)} 429s of the bursts took over 50 ms "
                     f"(max {max(slow) * 1000:.1f} ms)")
    if timing and statistics.median(ratios) < 0.9:
        problems.add(f"overloaded throughput is {statistics.median(ratios):.3f} of the plain figure, below 0.9")
    return problems.figures(capacity=capacity, max_batch_size=batch, max_waiting=waiting, burst=factor * capacity,
                            new_tokens=new_tokens, rounds=rounds, **_figures(bursts, lone, ratios))
