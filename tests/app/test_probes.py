"""The Kubernetes probes against a real `python -m app` process, as the kubelet sees them (deploy/kubernetes/):
startup fails until the model is loaded and warmed up, readiness fails while the server is full or draining,
liveness fails while an engine step hangs (`<fault:stall>`, app/faults.py) and recovers when it ends. The drain
is checked in the SIGTERM test of tests/app/test_server.py.

A connection refused is what the kubelet counts as a failed probe too: `python -m app` opens its port once its
settings and checkpoint are checked, before the engine is built and warmed up (503 "loading" meanwhile:
tests/app/test_startup.py holds a load open to check every route then), and closes it moments after SIGTERM.
The 503 bodies of those states are checked in process (tests/app/api/test_routes.py)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.faults import FAULT_STALL
from app.testing import REFUSED, free_port, metric, probe, spawn, stop

LONG = {"max_new_tokens": 4096}  # many seconds with the test servers' --window-shift 1


def wait_for(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll `check` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.02)
    raise AssertionError(f"not reached in {timeout} s: {what}")


@pytest.fixture(scope="module")
def probed(char_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list]]:
    """A server with room for one request (so one long stream fills it), fault injection on and a 1 s stall limit,
    and what /health/startup answered from the moment the process was spawned until its first 200."""
    port, log = free_port(), tmp_path_factory.mktemp("probes") / "server.log"
    base = f"http://127.0.0.1:{port}"
    proc = spawn(char_checkpoint, log, "--max-batch-size", "1", "--max-waiting", "0", "--fault-injection",
                 "--liveness-stall-seconds", "1", port=port)
    seen: list = []
    try:
        with httpx.Client(base_url=base) as client:
            deadline = time.monotonic() + 90
            while (answer := probe(client, "/health/startup")) == REFUSED or answer[0] != 200:
                seen.append(answer)
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
            # and what the server had done by then: the warmup generation's tokens
            seen += [answer, metric(client.get("/metrics").text, "folio_generated_tokens_total")]
        yield base, seen
    finally:
        stop(proc)


def test_startup_fails_until_the_model_is_loaded_and_warmed_up(probed: tuple[str, list]) -> None:
    base, seen = probed
    *before, first_ok, warmup_tokens = seen
    assert first_ok == (200, {"status": "ok"})
    assert all(s == REFUSED or (s[0], s[1]["status"]) == (503, "loading") for s in before), before
    assert warmup_tokens >= 1  # the warmup generation had run when startup first said 200
    with httpx.Client(base_url=base) as client:
        assert probe(client, "/health/ready") == (200, {"status": "ok", "in_flight": 0, "capacity": 1})


def test_ready_fails_while_the_server_is_full(probed: tuple[str, list]) -> None:
    base, _ = probed
    with httpx.Client(base_url=base) as client:
        with httpx.stream("POST", f"{base}/generate_stream", json={"inputs": "Hi", "parameters": LONG},
                          timeout=30) as stream:
            chunks = stream.iter_bytes()  # held: a dropped iterator closes the response (the server then cancels)
            next(chunks)  # the first event: the request holds the only batch slot
            status, body = probe(client, "/health/ready")
            assert (status, body["status"]) == (503, "full"), body
            assert body["reason"] == "1 requests in flight, the capacity is 1 (1 running + 0 waiting)"
            assert probe(client, "/health/startup")[0] == 200 and probe(client, "/health/live")[0] == 200
            # what readiness predicts: a new request now is refused
            assert client.post("/generate", json={"inputs": "Hi"}).status_code == 429
        # the stream is closed: the server cancels it and is ready again
        wait_for(lambda: probe(client, "/health/ready")[0] == 200, "ready again after the stream was closed")


def test_live_fails_while_an_engine_step_hangs_and_recovers(probed: tuple[str, list]) -> None:
    base, _ = probed
    port = int(base.rsplit(":", 1)[1])
    body = f'{{"inputs": "x {FAULT_STALL}", "parameters": {{"max_new_tokens": 4}}}}'.encode()
    with httpx.Client(base_url=base) as client:
        wait_for(lambda: probe(client, "/health/ready")[0] == 200, "an idle server")
        # a raw socket, so that the test can hang up without waiting for the answer
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            status, answer = wait_for(lambda: (s := probe(client, "/health/live")) != REFUSED and s[0] == 503 and s,
                                      "live failing while the step hangs")
            assert answer["status"] == "unhealthy", answer
            assert answer["reason"].startswith("model 'tiny-char': the engine's current step began"), answer
            assert answer["reason"].endswith("s ago (limit 1 s)"), answer
            assert probe(client, "/health/startup")[0] == 200  # it is still started: only liveness restarts it
        # the client hung up: the request is cancelled, the step ends, the engine steps (and idles) again
        wait_for(lambda: probe(client, "/health/live")[0] == 200, "live again after the stall ended")
        assert client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
