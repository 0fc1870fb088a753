"""Section `hot_reload`: weights replaced under load. A server with `--watch` serves a copy of a checkpoint while
`streams` long streams run on it; its weights are then replaced twice, once atomically (`save_checkpoint` over it:
temp files and renames, as the trainer writes) and once by a plain `cp` of another checkpoint's two files (written in
place, not atomically), while new requests keep arriving. Every stream must finish on the weights it started on,
with all its tokens; no request may fail; the server must not crash; requests sent once the swap is seen get the new
weights. Figures: streams completed on their old weights, what the new requests got (which weights, latency), the
swap latency (from the files' replacement to /info reporting the new config.json; up to WATCH_S of it is the
watcher's interval), and /health's slowest answer
during each round (the event loop's responsiveness while the new engine loads).

The server's batch holds every stream and 16 more, so that requests sent while the new weights load (they go to the
old engine, which serves them to the end) start at once rather than behind a 1,500-token stream. The run on
record: `python -m bench.reliability --only hot_reload --out bench/results/reliability_hot_reload.json`."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from app.testing import serving
from bench.reliability.harness import Problems, ms
from bench.reliability.outcome import Outcome, read_outcome
from bench.reliability.spec import Spec
from bench.report import pct
from model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_checkpoint, save_checkpoint

WATCH_S = 0.2
STARTED_TOKENS = 20  # tokens every stream has received before the weights are replaced: it runs on the old ones
NEW_TOKENS = 16  # of each request sent during the swap
NEW_EVERY_S = 0.1  # between two of the requests sent during the swap


def perturbed(source: Path, directory: Path, seed: int) -> Path:
    """A checkpoint of `source`'s shape with other weights (each tensor plus noise of its own scale): its answers
    differ, its files are the same size."""
    ck = load_checkpoint(source)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ck.model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.5 * p.std().nan_to_num())
    return save_checkpoint(directory, ck.model, ck.tokenizer, training={"perturbed_from": source.name, "seed": seed})


class _Stream:
    """One long streamed generation read to its end in a thread of its own."""

    def __init__(self, base: str, http: httpx.Client, i: int, tokens: int) -> None:
        self.spec = Spec("generate_stream", "ROMEO:", tokens, {"details": True, "do_sample": True, "seed": i})
        self.base, self.http = base, http
        self.events = 0
        self.started = threading.Event()
        self.checkpoint: str | None = None
        self.outcome: Outcome | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        path, body = self.spec.request()
        raw = b""
        try:
            with self.http.stream("POST", f"{self.base}{path}", json=body) as r:
                self.checkpoint = r.headers.get("x-folio-checkpoint")
                for chunk in r.iter_raw():
                    raw += chunk
                    self.events += chunk.count(b"data:")
                    if self.events >= STARTED_TOKENS:
                        self.started.set()
                status, ctype = r.status_code, r.headers.get("content-type", "")
            self.outcome = read_outcome(self.spec, status, ctype, raw)
        except httpx.HTTPError as e:
            self.outcome = Outcome(0, error=f"transport error {type(e).__name__}: {e}")
        finally:
            self.started.set()


class _NewRequests:
    """`n` short requests, one every NEW_EVERY_S: at most half of them before the swap is seen (`swapped`), the rest
    after. Each answer: (status, seconds, weights that answered, when it was sent, error text)."""

    def __init__(self, base: str, http: httpx.Client, n: int, swapped: threading.Event) -> None:
        self.base, self.http, self.n, self.swapped = base, http, n, swapped
        self.answers: list[tuple[int, float, str | None, float, str]] = []
        self.pacer = threading.Thread(target=self._pace, daemon=True)
        self.senders: list[threading.Thread] = []

    def _send(self, i: int) -> None:
        sent = time.monotonic()
        try:
            r = self.http.post(f"{self.base}/generate", json={"inputs": "JULIET:", "parameters": {
                "max_new_tokens": NEW_TOKENS, "do_sample": True, "seed": 1000 + i}})
            self.answers.append((r.status_code, time.monotonic() - sent, r.headers.get("x-folio-checkpoint"), sent,
                                 r.text[:200] if r.status_code != 200 else ""))
        except httpx.HTTPError as e:
            self.answers.append((0, time.monotonic() - sent, None, sent, f"{type(e).__name__}: {e}"))

    def _pace(self) -> None:
        for i in range(self.n):
            if i == self.n - self.n // 2:
                self.swapped.wait(300)
            t = threading.Thread(target=self._send, args=(i,), daemon=True)
            t.start()
            self.senders.append(t)
            time.sleep(NEW_EVERY_S)

    def start(self) -> None:
        self.pacer.start()

    def join(self, timeout: float) -> None:
        """Wait for every answer: the pacer first (until it has started all `n` requests), then each request."""
        deadline = time.monotonic() + timeout
        self.pacer.join(timeout)
        for t in self.senders:
            t.join(max(0.0, deadline - time.monotonic()))


def _served_config(http: httpx.Client, base: str) -> str | None:
    return http.get(f"{base}/info").json()["models"][0]["config_sha256"]


def _health_probe(http: httpx.Client, base: str, stop: threading.Event, out: list[float | None]) -> None:
    """GET /health every 50 ms until `stop`: each answer's seconds (None: no answer)."""
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            http.get(f"{base}/health", timeout=30)
            out.append(time.perf_counter() - t0)
        except httpx.HTTPError:
            out.append(None)
        time.sleep(0.05)


def _round(name: str, base: str, proc: subprocess.Popen, http: httpx.Client, live: Path, replace: Any,
           streams: int, tokens: int, new_requests: int, problems: Problems) -> dict[str, Any]:
    """Start `streams` long streams, replace the weights (`replace()`) once each has begun, then send
    `new_requests` while the server notices, loads and swaps them in; then check how every request ended."""
    old_fingerprint = http.post(f"{base}/generate", json={"inputs": "A", "parameters": {"max_new_tokens": 1}}
                                ).headers["x-folio-checkpoint"]
    running = [_Stream(base, http, i, tokens) for i in range(streams)]
    for s in running:
        s.started.wait(600)
    health: list[float | None] = []
    probing = threading.Event()
    prober = threading.Thread(target=_health_probe, args=(http, base, probing, health), daemon=True)
    prober.start()
    seen = threading.Event()
    late = _NewRequests(base, http, new_requests, seen)
    replace()
    replaced = time.monotonic()
    late.start()
    want = hashlib.sha256((live / CONFIG_FILE).read_bytes()).hexdigest()
    swapped = None
    while time.monotonic() - replaced < 300 and proc.poll() is None:
        try:
            if _served_config(http, base) == want:
                swapped = time.monotonic()
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    seen.set()
    late.join(600)
    probing.set()
    prober.join(60)
    for s in running:
        s.thread.join(3600)
    crashed = proc.poll() is not None
    if crashed:
        problems.add(f"{name}: the server exited with {proc.returncode}")
    if swapped is None:
        problems.add(f"{name}: /info never reported the new config.json")
    new_fingerprint = None if crashed else http.post(f"{base}/generate", json={
        "inputs": "A", "parameters": {"max_new_tokens": 1}}).headers["x-folio-checkpoint"]

    completed = on_old = 0
    for i, s in enumerate(running):
        out = s.outcome
        if out is None or out.status != 200 or out.error or out.problems or out.tokens != tokens:
            detail = "no outcome" if out is None else f"{out.status} {out.error} {out.problems} {out.tokens} tokens"
            problems.add(f"{name}: stream {i} did not complete: {detail}")
            continue
        completed += 1
        if s.checkpoint == old_fingerprint:
            on_old += 1
        else:
            problems.add(f"{name}: stream {i} was answered by {s.checkpoint}, not the old weights {old_fingerprint}")
    failed = [a for a in late.answers if a[0] != 200]
    for status, _, _, _, text in failed:
        problems.add(f"{name}: a request sent during the swap got {status}: {text}")
    after_swap = [a for a in late.answers if swapped is not None and a[3] > swapped]
    for a in after_swap:
        if a[2] != new_fingerprint:
            problems.add(f"{name}: a request sent after the swap was answered by {a[2]}, not {new_fingerprint}")
    ok = [a for a in late.answers if a[0] == 200]
    latencies = [a[1] for a in ok]
    answered = [h for h in health if h is not None]
    return {
        "streams": streams, "stream_tokens": tokens, "streams_completed": completed,
        "streams_completed_on_old_weights": on_old, "crashed": crashed, "exit_code": proc.returncode,
        "swap_latency_s": None if swapped is None else round(swapped - replaced, 3),
        "new_requests": {
            "sent": len(late.answers), "failed": len(failed),
            "on_old_weights": sum(a[2] == old_fingerprint for a in ok),
            "on_new_weights": sum(a[2] == new_fingerprint for a in ok),
            "sent_after_swap": len(after_swap),
            "sent_after_swap_on_new_weights": sum(a[0] == 200 and a[2] == new_fingerprint for a in after_swap),
            "latency_p50_ms": ms(pct(latencies, 0.5)), "latency_max_ms": ms(max(latencies, default=None)),
        },
        "health_max_ms": ms(max(answered, default=None)), "health_unanswered": len(health) - len(answered),
    }


def run(checkpoint: Path, workdir: Path, streams: int, tokens: int, new_requests: int,
        args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Serve a copy of `checkpoint` and replace its weights twice under `streams` streams of `tokens` tokens and
    `new_requests` new requests each time; `args` go to the server last (they win). The drain timeout is the
    default's 30 s, which the issue's server ran with (a retired engine ignores it: it finishes its streams)."""
    problems = Problems()
    live = workdir / "hot-reload" / "live"
    shutil.rmtree(live.parent, ignore_errors=True)
    live.mkdir(parents=True)
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        shutil.copy(checkpoint / f, live / f)
    atomic_source = perturbed(checkpoint, workdir / "hot-reload" / "atomic", seed=1)
    copied = perturbed(checkpoint, workdir / "hot-reload" / "copied", seed=2)
    rounds: dict[str, Any] = {}
    server_args = ["--watch", str(WATCH_S), "--threads", "0", "--window-shift", "0", "--drain-timeout", "30",
                   "--max-batch-size", str(streams + 16), "--max-waiting", "64", *args]
    with serving(live, workdir / "hot-reload-server.log", *server_args) as (base, proc), \
            httpx.Client(timeout=httpx.Timeout(600, connect=30)) as http:
        def atomically() -> None:  # as the trainer writes: weights, then config.json, each by a rename
            ck = load_checkpoint(atomic_source)
            save_checkpoint(live, ck.model, ck.tokenizer, training=ck.training)

        def plain_cp() -> None:
            subprocess.run(["cp", str(copied / WEIGHTS_FILE), str(copied / CONFIG_FILE), f"{live}/"], check=True)

        rounds["atomic"] = _round("atomic", base, proc, http, live, atomically, streams, tokens, new_requests,
                                  problems)
        if proc.poll() is None:
            rounds["plain_cp"] = _round("plain cp", base, proc, http, live, plain_cp, streams, tokens, new_requests,
                                        problems)
        reloads = None if proc.poll() is not None else http.get(f"{base}/info").json()["models"][0]["reloads"]
    crashed = sum(r["crashed"] for r in rounds.values())
    failed = sum(r["new_requests"]["failed"] + r["streams"] - r["streams_completed"] for r in rounds.values())
    return problems.figures(rounds=rounds, reloads=reloads, failed=failed, crashed=crashed,
                            server_args=server_args)
