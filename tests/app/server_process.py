"""`python -m app` as a subprocess on 127.0.0.1: start it, wait for /health, probe it as the kubelet does, stop it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
# window_shift 1: past the 64-token window every step re-prefills the whole window, so a 4096-token
# generation takes many seconds even on a fast machine (the drain and disconnect tests need slow ones);
# short header and body deadlines, so that the slow-client test sees them expire
SERVER_ARGS = ["--device", "cpu", "--threads", "1", "--log-level", "warning", "--max-new-tokens-limit", "4096",
               "--window-shift", "1", "--max-body-bytes", "16384", "--drain-timeout", "2", "--header-timeout", "2",
               "--body-timeout", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(checkpoint: Path, log: Path, *args: str, port: int = 0) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "app", "--checkpoint", str(checkpoint), "--host", "127.0.0.1",
           "--port", str(port), *SERVER_ARGS, *args]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_healthy(proc: subprocess.Popen, base: str, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode} during startup:\n{log.read_text()}")
        try:
            if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"server not healthy after {timeout} s:\n{log.read_text()}")


REFUSED = "refused"


def probe(client: httpx.Client, route: str) -> tuple[int, dict[str, Any]] | str:
    """GET `route`: (status, JSON body), or REFUSED when no HTTP answer came (connection refused, reset or closed),
    which the kubelet counts as a failed probe too."""
    try:
        r = client.get(route, timeout=5)
    except httpx.TransportError:
        return REFUSED
    return r.status_code, r.json()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def serving(checkpoint: Path, log: Path, *args: str) -> Iterator[str]:
    """A healthy server on a free port for the block (`spawn`'s arguments); its base URL. Stopped afterwards."""
    port = free_port()
    proc = spawn(checkpoint, log, *args, port=port)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)
