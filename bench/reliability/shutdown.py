"""Section `shutdown`: SIGTERM during active streams: how each stream ended, the exit code and time, and what new
requests got meanwhile."""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from app.testing import serving
from bench.reliability.harness import Problems
from bench.reliability.outcome import Outcome, read_outcome
from bench.reliability.spec import Spec

MARGIN = 5.0  # exit within the drain timeout plus this: the final writes (2 s) and a loaded 2-core machine's slack


class _Streams:
    """`n` streamed generations, each read to its end in a thread of its own; `outcomes[i]` once it has ended."""

    def __init__(self, base: str, n: int, drain: float, rng: random.Random) -> None:
        self.base, self.drain = base, drain
        self.specs = [Spec("completions_stream" if i % 2 else "generate_stream", "ROMEO:",
                           rng.randint(20, 300) if i % 4 == 0 else 4096, {"seed": i} if i % 2 else {"details": True})
                      for i in range(n)]
        self.started = [threading.Event() for _ in range(n)]
        self.outcomes: dict[int, Outcome] = {}
        self.threads = [threading.Thread(target=self.consume, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def consume(self, i: int) -> None:
        path, body = self.specs[i].request()
        raw = b""
        try:
            with httpx.stream("POST", f"{self.base}{path}", json=body, timeout=self.drain + 60) as r:
                for chunk in r.iter_raw():
                    raw += chunk
                    self.started[i].set()
                status, ctype = r.status_code, r.headers.get("content-type", "")
        except httpx.HTTPError as e:
            self.outcomes[i] = Outcome(0, problems=[f"stream {i}: transport error {type(e).__name__}: {e}"])
            return
        finally:
            self.started[i].set()
        self.outcomes[i] = read_outcome(self.specs[i], status, ctype, raw)


def _terminate(proc: subprocess.Popen, base: str, drain: float, problems: Problems,
               probes: Counter[str]) -> tuple[int | None, float]:
    """SIGTERM, then new requests on fresh connections until the process exits: (exit code, seconds to exit)."""
    signalled = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    while proc.poll() is None and time.perf_counter() - signalled < drain + 30:
        try:
            r = httpx.post(f"{base}/generate", json={"inputs": "late", "parameters": {"max_new_tokens": 2}},
                           timeout=5)
            probes[str(r.status_code)] += 1
            if r.status_code != 503:
                problems.add(f"a request after SIGTERM got {r.status_code}: {r.text[:200]}")
        except httpx.TransportError as e:
            probes[type(e).__name__] += 1
        time.sleep(0.05)
    try:
        rc = proc.wait(max(0.0, drain + 30 - (time.perf_counter() - signalled)))
    except subprocess.TimeoutExpired:
        rc = None
    return rc, time.perf_counter() - signalled


def _endings(streams: _Streams, problems: Problems) -> Counter[str]:
    """How each stream ended: completed, or a final error event saying the engine stopped."""
    ended: Counter[str] = Counter()
    for i in range(len(streams.specs)):
        out = streams.outcomes.get(i)
        if out is None:
            problems.add(f"stream {i} never ended")
            continue
        for p in out.problems:
            problems.add(f"stream {i}: {p}")
        if out.error is not None:
            if "engine stopped" not in out.error:
                problems.add(f"stream {i} ended with an unexpected error: {out.error}")
            ended["final error event"] += 1
        elif out.status == 200 and not out.problems:
            ended["completed"] += 1
    return ended


def run(checkpoint: Path, workdir: Path, streams: int, drain: float, seed: int) -> dict[str, Any]:
    """SIGTERM while `streams` generations stream (all in the running batch); short ones may finish within the
    drain, long ones cannot. Meanwhile new requests keep arriving on fresh connections."""
    rng = random.Random(seed)
    problems = Problems()
    args = ["--max-batch-size", str(streams), "--max-waiting", "4", "--drain-timeout", str(drain),
            "--window-shift", "8", "--max-new-tokens-limit", "4096"]
    log = workdir / "shutdown.log"
    probes: Counter[str] = Counter()
    with serving(checkpoint, log, *args) as (base, proc):
        running = _Streams(base, streams, drain, rng)
        if not all(e.wait(120) for e in running.started):
            problems.add("not every stream started within 120 s")
        rc, exit_s = _terminate(proc, base, drain, problems, probes)
        for t in running.threads:
            t.join(30)
    if rc != 0:
        problems.add(f"exit code {rc} after SIGTERM: {log.read_text()[-500:]}")
    if exit_s > drain + MARGIN:
        problems.add(f"exited {exit_s:.2f} s after SIGTERM, drain timeout {drain} s + {MARGIN} s")
    ended = _endings(running, problems)
    return problems.figures(streams=streams, drain_timeout_s=drain, exit_code=rc, exit_after_s=round(exit_s, 3),
                            ended=dict(ended), requests_after_signal=dict(probes),
                            admitted_after_signal=probes.get("200", 0))
