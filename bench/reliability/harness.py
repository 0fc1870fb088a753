"""What every reliability section shares: the sizes (full and `--quick`), the main server's settings, the
`Problems` list a section returns, and small probes of a running server (/metrics, /openapi.json, its RSS).

A section is a function that takes its sizes and returns a dict of figures holding `problems` (the requirements
that did not hold, empty when all did) and `problem_count`; `Problems.figures` adds both."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import httpx

from app.testing import metric
from model.testing import CHARS

BLOCK_SIZE = 64  # the test checkpoint's context (model/testing.py: 96 characters, block_size 64)
NEW_TOKENS_LIMIT = 512
MAIN_BATCH, MAIN_WAITING = 16, 32  # the main server's capacity: 48, below the load test's client count
# appended after app/testing.py's SERVER_ARGS, so these win
MAIN_ARGS = ["--max-batch-size", str(MAIN_BATCH), "--max-waiting", str(MAIN_WAITING), "--window-shift", "8",
             "--max-new-tokens-limit", str(NEW_TOKENS_LIMIT), "--max-body-bytes", str(2 * 1024 * 1024)]
PRINTABLE = [c for c in CHARS if c != "\n"]
MAX_PROBLEMS = 25  # problems kept per section (the count is kept in full)
MB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Sizes:
    fuzz_examples: int  # schemathesis cases per operation and generation mode
    load_requests: int
    load_clients: int
    load_warmup: int
    overload_batch: int
    overload_waiting: int
    overload_factor: int
    overload_new_tokens: int
    overload_rounds: int
    disconnect_streams: int
    disconnect_wave: int
    shutdown_streams: int
    drain_timeout: float
    fault_good: int
    fault_bad: int
    training_kills: int
    training_iters: int
    slow_batch: int  # the slow-clients server's capacity: batch + waiting
    slow_waiting: int
    slow_connections: int  # connections sending headers and half a body (a quarter more send half their headers)
    slow_requests: int  # ordinary requests meanwhile
    slow_timeout: float  # the server's header and body timeout (0: its defaults)
    stop_new_tokens: int
    stop_batch: int
    reload_clients: int  # streaming clients while the trainer writes and the server swaps
    reload_iters: int  # training steps of the resumed run (a checkpoint per improving evaluation)
    hot_reload_streams: int  # long streams running on the bundled model while its weights are replaced
    hot_reload_tokens: int  # each stream's max_new_tokens
    hot_reload_new: int  # requests sent while the new weights load and swap in


FULL = Sizes(fuzz_examples=150, load_requests=2000, load_clients=64, load_warmup=200, overload_batch=8,
             overload_waiting=8, overload_factor=10, overload_new_tokens=96, overload_rounds=3,
             disconnect_streams=200, disconnect_wave=36, shutdown_streams=32, drain_timeout=5.0, fault_good=24,
             fault_bad=8, training_kills=5, training_iters=300, slow_batch=16, slow_waiting=64, slow_connections=80,
             slow_requests=64, slow_timeout=3.0, stop_new_tokens=256, stop_batch=16, reload_clients=8,
             reload_iters=200, hot_reload_streams=32, hot_reload_tokens=1500, hot_reload_new=30)
QUICK = Sizes(fuzz_examples=25, load_requests=200, load_clients=16, load_warmup=40, overload_batch=2,
              overload_waiting=2, overload_factor=10, overload_new_tokens=128, overload_rounds=1,
              disconnect_streams=30, disconnect_wave=15, shutdown_streams=8, drain_timeout=3.0, fault_good=8,
              fault_bad=4, training_kills=2, training_iters=80, slow_batch=2, slow_waiting=2, slow_connections=8,
              slow_requests=8, slow_timeout=1.0, stop_new_tokens=64, stop_batch=4, reload_clients=4,
              reload_iters=60, hot_reload_streams=4, hot_reload_tokens=200, hot_reload_new=6)


class Problems(list):
    """A section's failed requirements: every one counted, the first MAX_PROBLEMS kept with their detail."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def add(self, message: str) -> None:
        self.count += 1
        if len(self) < MAX_PROBLEMS:
            self.append(message[:600])

    def figures(self, **figures: Any) -> dict[str, Any]:
        """A section's result: its figures, these problems and their count."""
        return {**figures, "problems": self, "problem_count": self.count}


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """Resident set size of a process, from /proc (Linux); `field="VmHWM"` for its peak so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def scrape(base: str) -> str:
    return httpx.get(f"{base}/metrics", timeout=10).text


def idle_at(base: str, timeout: float = 30.0) -> float:
    """Poll /metrics until the running batch and the queue are empty; when that was seen (inf if never)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        text = scrape(base)
        if metric(text, "folio_running_batch_size") == 0 and metric(text, "folio_queue_depth") == 0:
            return time.perf_counter()
        time.sleep(0.01)
    return math.inf


def documented_statuses(base: str) -> dict[tuple[str, str], set[int]]:
    """(METHOD, path) -> the statuses /openapi.json documents for it."""
    schema = httpx.get(f"{base}/openapi.json", timeout=10).json()
    return {(method.upper(), path): {int(s) for s in op["responses"]}
            for path, ops in schema["paths"].items() for method, op in ops.items()}


def raw_head(length: int) -> bytes:
    """The head of an HTTP/1.1 POST /generate of a JSON body of `length` bytes, for clients that write their own
    sockets (to hold connections open, or to send a request in pieces)."""
    return (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()
