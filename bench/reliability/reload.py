"""Section `reload`: reload under load. A server with `--watch` on the directory `python -m model.train` writes to,
while streaming clients keep it busy: every request must complete (0 failed), later answers must come from newer
weights (the `X-Folio-Checkpoint` header), and memory must stay level as old engines are released. The swap
latency is the time from the trainer's new config.json (its mtime) to /info reporting that checkpoint."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from app.testing import parse_sse, serving
from bench.reliability.harness import Problems, rss_kib
from bench.reliability.training import TRAIN_ARGS, _trainer, training_text

WATCH_S = 0.2


def rss_mb(pid: int) -> float:
    return rss_kib(pid) / 1024


class StreamingClients:
    """Streaming clients in a loop until stopped: what they were served, what failed, which weights answered."""

    def __init__(self, base: str, http: httpx.Client, n: int) -> None:
        self.base, self.http = base, http
        self.served, self.failed, self.checkpoints = 0, Problems(), set()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                with self.http.stream("POST", f"{self.base}/generate_stream", json={
                        "inputs": "ROMEO:", "parameters": {"max_new_tokens": 16}}) as r:
                    body = r.read().decode()
                    if r.status_code != 200 or parse_sse(body)[-1].get("generated_text") is None:
                        self.failed.add(f"{r.status_code}: {body[-200:]}")
                        continue
                    self.served += 1
                    self.checkpoints.add(r.headers["x-folio-checkpoint"])
            except Exception as e:  # a dropped connection is a failure like any other
                self.failed.add(f"{type(e).__name__}: {e}")

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def _swap_latencies(base: str, http: httpx.Client, config: Path, done: threading.Event) -> list[float]:
    """For each new config.json: seconds from its mtime until /info reports it."""
    out: list[float] = []
    seen = None
    while not done.is_set():
        try:
            data, mtime = config.read_bytes(), config.stat().st_mtime
        except OSError:
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest != seen:
            served = lambda: http.get(f"{base}/info").json()["models"][0]["config_sha256"]  # noqa: E731
            deadline = time.monotonic() + 30
            while served() != digest and time.monotonic() < deadline:
                time.sleep(0.02)
            if seen is not None:
                out.append(time.time() - mtime)
            seen = digest
        time.sleep(0.02)
    return out


def run(workdir: Path, clients: int, iters: int) -> dict[str, Any]:
    out_dir, problems = workdir / "reload-run", Problems()
    text = training_text(workdir)
    base_args = ["--data", str(text), "--out", str(out_dir), *TRAIN_ARGS]
    if _trainer([*base_args, "--max-iters", "20"], workdir / "reload-train.log").wait(300) != 0:
        return {"problems": ["the first training run failed"], "problem_count": 1}
    with serving(out_dir, workdir / "reload-server.log", "--watch", str(WATCH_S)) as (base, proc), \
            httpx.Client(timeout=60) as http:
        rss_before = rss_mb(proc.pid)
        load = StreamingClients(base, http, clients)
        trainer_done, latencies = threading.Event(), []
        monitor = threading.Thread(target=lambda: latencies.extend(
            _swap_latencies(base, http, out_dir / "config.json", trainer_done)))
        monitor.start()
        trained = _trainer(["--resume", "--out", str(out_dir), "--max-iters", str(iters)],
                           workdir / "reload-train.log").wait(600)
        time.sleep(1.0)  # the last checkpoint swapped in, and served for a moment
        trainer_done.set()
        monitor.join(60)
        load.join()
        last = http.post(f"{base}/generate", json={"inputs": "ROMEO:"}).headers["x-folio-checkpoint"]
        rss_after = rss_mb(proc.pid)
        reloads = http.get(f"{base}/info").json()["models"][0]["reloads"]
    if trained != 0:
        problems.add(f"the resumed training run exited {trained}")
    for message in load.failed:
        problems.add(message)
    problems.count += load.failed.count - len(load.failed)
    if reloads < 1 or len(load.checkpoints) < 2 or last not in load.checkpoints:
        problems.add(f"expected answers from several checkpoints, got {len(load.checkpoints)} ({reloads} reloads)")
    if rss_after > rss_before * 1.5 + 50:
        problems.add(f"memory grew from {rss_before:.0f} to {rss_after:.0f} MB across {reloads} reloads")
    return problems.figures(
        served=load.served, failed=load.failed.count, reloads=reloads, checkpoints_answering=len(load.checkpoints),
        swap_latency_s={"max": round(max(latencies), 3), "mean": round(sum(latencies) / len(latencies), 3)}
        if latencies else None, rss_mb={"before": round(rss_before), "after": round(rss_after)})
