"""Section `slow_clients`: slowloris: as many connections as the server has slots send their headers and half a
body (more send half their headers, or nothing), each trickling a byte every 0.5 s, while ordinary requests come:
their statuses and latencies, how and when the server closed the slow connections, and /metrics after."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from app.testing import metric, serving
from bench.reliability.harness import Problems, ms, port_of, raw_head, scrape
from bench.report import pct

Kinds = dict[str, tuple[bytes, bytes, int]]  # kind -> (sent at once, trickled, how many connections)
Results = dict[str, list[dict[str, Any]]]  # kind -> per connection: what the server answered, when it closed


async def _slow_connection(port: int, data: bytes, trickle: bytes, t0: float, out: dict[str, Any]) -> None:
    """Send `data`, then one byte of `trickle` every 0.5 s (a slowloris keeps its connection busy) until the server
    closes the connection (or the task is cancelled): in `out`, what the server answered and when it closed."""
    out.update(answer=b"", closed_after=None)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)

    async def trickle_bytes() -> None:
        for i in range(len(trickle)):
            await asyncio.sleep(0.5)
            writer.write(trickle[i : i + 1])

    trickling = asyncio.ensure_future(trickle_bytes())
    try:
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                out["answer"] += chunk
        out["closed_after"] = time.perf_counter() - t0
    finally:
        trickling.cancel()
        writer.close()


def _kinds(connections: int) -> Kinds:
    body = json.dumps({"inputs": "ROMEO:", "parameters": {"max_new_tokens": 16}}).encode()
    head = raw_head(len(body))
    return {"half body": (head + body[: len(body) // 2], body[len(body) // 2 :], connections),
            "half headers": (head[: len(head) // 2], head[len(head) // 2 :], connections // 4),
            "headers from the first byte": (b"", head, connections // 8)}


async def _ordinary(client: httpx.AsyncClient, requests: int, clients: int,
                    problems: Problems) -> list[tuple[int, float]]:
    """`requests` ordinary sampled requests from `clients` clients: (status, latency) each."""
    answers: list[tuple[int, float]] = []

    async def one(i: int) -> None:
        t = time.perf_counter()
        r = await client.post("/generate", json={"inputs": "ROMEO:", "parameters": {
            "max_new_tokens": 16, "do_sample": True, "seed": i}})
        answers.append((r.status_code, time.perf_counter() - t))
        if r.status_code == 200 and len(r.json()["generated_text"]) != 16:
            problems.add(f"an ordinary request generated {len(r.json()['generated_text'])} tokens, not 16")

    async def client_loop(k: int) -> None:
        for i in range(k, requests, clients):
            await one(i)

    await asyncio.gather(*(client_loop(k) for k in range(clients)))
    return answers


async def _attack(base: str, kinds: Kinds, requests: int, clients: int, window: float,
                  problems: Problems) -> tuple[Results, list[tuple[int, float]], dict[str, Any]]:
    """The slow connections, the ordinary requests meanwhile, and what the server showed at their end; the slow
    connections still open after `window` s are closed from this side."""
    t0 = time.perf_counter()
    results: Results = {kind: [{} for _ in range(n)] for kind, (_, _, n) in kinds.items()}
    tasks = {kind: [asyncio.ensure_future(_slow_connection(port_of(base), data, trickle, t0, out))
                    for out in results[kind]] for kind, (data, trickle, _) in kinds.items()}
    await asyncio.sleep(0.2)  # the server has read what they sent
    during: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        answers = await _ordinary(client, requests, clients, problems)
        during["health"] = (await client.get("/health")).status_code
        text = (await client.get("/metrics")).text
        during["running"] = metric(text, "folio_running_batch_size")
        during["still_open"] = sum(not t.done() for ts in tasks.values() for t in ts)
    every = [t for ts in tasks.values() for t in ts]
    await asyncio.wait(every, timeout=max(0.0, window - (time.perf_counter() - t0)))
    for t in every:  # still open at the end of the window: closed from this side
        t.cancel()
    await asyncio.gather(*every, return_exceptions=True)
    return results, answers, during


def _after(base: str) -> dict[str, Any]:
    """The running batch, queue and reserved slots on /metrics, and an ordinary request's status."""
    text = scrape(base)
    after = {"running": metric(text, "folio_running_batch_size"), "queue": metric(text, "folio_queue_depth")}
    with contextlib.suppress(AssertionError):  # only where the server exports them
        after["reserved"] = metric(text, "folio_reserved_slots")
    after["ordinary_request"] = httpx.post(f"{base}/generate", json={"inputs": "ROMEO:"}, timeout=60).status_code
    return after


def _closed(results: Results, window: float, problems: Problems) -> dict[str, dict[str, Any]]:
    """Per kind: how many connections the server closed, what it answered them, and when."""
    closed: dict[str, dict[str, Any]] = {}
    for kind, outs in results.items():
        times = [o["closed_after"] for o in outs if o["closed_after"] is not None]
        answered = Counter(o["answer"].split(b" ", 2)[1].decode() if o["answer"] else "nothing" for o in outs
                           if o["closed_after"] is not None)
        closed[kind] = {"connections": len(outs), "closed_by_server": len(times), "answers": dict(answered),
                        "closed_after_p50_s": round(pct(times, 0.5), 2) if times else None,
                        "closed_after_max_s": round(max(times), 2) if times else None}
        if len(times) < len(outs):
            problems.add(f"{len(outs) - len(times)} of {len(outs)} '{kind}' connections still open after {window} s")
    return closed


def run(checkpoint: Path, workdir: Path, batch: int, waiting: int, connections: int, requests: int,
        timeout: float) -> dict[str, Any]:
    """Slowloris against a server of capacity `batch + waiting`: `connections` connections send their headers and
    half a JSON body, `connections // 4` half their headers, `connections // 8` nothing; then each trickles the
    rest, a byte every 0.5 s. Meanwhile `requests` ordinary requests from up to 8 clients (never more than the
    capacity): their statuses and latencies. Then how and when the server closed the slow connections (`timeout`
    > 0 starts the server with that header and body timeout; 0 leaves the server's defaults, for a server without
    those options), and what /metrics shows after."""
    problems = Problems()
    args = ["--max-batch-size", str(batch), "--max-waiting", str(waiting), "--window-shift", "8"]
    if timeout > 0:
        args += ["--header-timeout", str(timeout), "--body-timeout", str(timeout)]
    window = 2 * timeout + 3 if timeout > 0 else 6.0  # how long the slow connections are watched
    clients = min(8, batch + waiting)  # ordinary clients: never more than the capacity, so none needs a 429
    with serving(checkpoint, workdir / "slow.log", *args) as (base, _):
        results, answers, during = asyncio.run(_attack(base, _kinds(connections), requests, clients, window,
                                                       problems))
        time.sleep(0.5)  # the client side has closed whatever the server had not
        after = _after(base)
    statuses = Counter(str(s) for s, _ in answers)
    latencies = [lat for _, lat in answers]
    if statuses != Counter({"200": requests}):
        problems.add(f"ordinary requests during the attack got {dict(statuses)}, not {requests} x 200")
    closed = _closed(results, window, problems)
    if after["running"] or after["queue"] or after.get("reserved"):
        problems.add(f"after the attack /metrics shows {after}")
    if after["ordinary_request"] != 200:
        problems.add(f"an ordinary request after the attack got {after['ordinary_request']}")
    return problems.figures(
        capacity=batch + waiting, slow_connections=sum(len(o) for o in results.values()),
        timeout_s=timeout or "server default", ordinary_requests=requests, ordinary_statuses=dict(statuses),
        ordinary_latency_p50_ms=ms(pct(latencies, 0.5)), ordinary_latency_max_ms=ms(max(latencies, default=None)),
        during=during, closed=closed, after=after)
