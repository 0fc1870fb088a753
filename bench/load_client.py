"""bench/server_load.py's load generator: streaming (or whole-body) clients of one process, also run as its own
light process (it imports httpx and nothing of torch's) when the clients are spread over several:

    python -m bench.load_client PORT IDS PER_CLIENT NEW_TOKENS STREAM

prints "ready" once its connection pool is made, starts when a line arrives on its standard input, and prints its
result as one JSON line."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

PROMPTS = ["ROMEO:", "JULIET:\nO ", "First Citizen:\nWe are", "KING RICHARD III:\nNow is the winter",
           "HAMLET:\nTo be, or not", "MENENIUS:\nWhat", "LADY MACBETH:\nOut, damned", "BRUTUS:\nThe"]


async def clients(port: int, ids: list[int], per_client: int, new_tokens: int, stream: bool,
                   ready: Callable[[], object] | None = None) -> dict[str, Any]:
    """Clients `ids` in this process, streaming (or whole-body), `per_client` requests each, on one connection pool;
    `ready` is called (blocking) once the pool is made, before the first request. Their TTFTs and ITLs, tokens,
    failures, this process's CPU seconds, and when they started and ended (time.perf_counter: one clock for all
    processes of this machine)."""
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    failures = 0

    async def client(i: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens, failures
        for r in range(per_client):
            body = {"inputs": PROMPTS[(i + r) % len(PROMPTS)],
                    "parameters": {"max_new_tokens": new_tokens, "details": not stream}}
            t0 = time.perf_counter()
            try:
                if not stream:
                    resp = await http.post("/generate", json=body)
                    resp.raise_for_status()
                    tokens += new_tokens
                    continue
                last = None
                async with http.stream("POST", "/generate_stream", json=body) as resp:
                    resp.raise_for_status()
                    # count events in raw chunks (no per-line decoding: the client shares the server's CPUs,
                    # so a costly client would be measured as server time); events that arrive in one chunk
                    # arrived together
                    async for chunk in resp.aiter_raw():
                        now = time.perf_counter()
                        for _ in range(chunk.count(b"data:")):
                            if last is None:
                                ttft.append(now - t0)
                            else:
                                itl.append(now - last)
                            last = now
                            tokens += 1
            except httpx.HTTPError:
                failures += 1

    limits = httpx.Limits(max_connections=len(ids) + 4, max_keepalive_connections=len(ids) + 4)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as http:
        if ready is not None:
            ready()
        cpu, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in ids))
        end = time.perf_counter()
    return {"ttft": ttft, "itl": itl, "tokens": tokens, "failures": failures,
            "cpu_s": time.process_time() - cpu, "start": start, "end": end}


def main(argv: list[str]) -> int:
    port, ids, per_client, new_tokens, stream = argv
    result = asyncio.run(clients(int(port), [int(i) for i in ids.split(",")], int(per_client), int(new_tokens),
                                 stream == "1", ready=_wait_for_go))
    print(json.dumps(result), flush=True)
    return 0


def _wait_for_go() -> None:
    print("ready", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
