"""Testing aids for the HTTP server, shared by `tests/` and `bench/` (as `torch.testing` is by torch's own tests):
a server process on 127.0.0.1 (started, waited for, probed, stopped), and readers for what comes over the wire
(server-sent events, strict JSON, Prometheus text, the TGI and OpenAI error bodies).

Nothing here runs at import time or imports the model: a benchmark that only needs a port and an SSE parser
pays for neither. Failures raise `ServerError` or `AssertionError` (never pytest's own exceptions), so a
benchmark can catch them and a test reports them as failures.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# where `python -m app` must start to import this copy of the app (the directory above the package)
APP_ROOT = Path(__file__).resolve().parents[1]
# window_shift 1: past the 64-token window every step re-prefills the whole window, so a 4096-token
# generation takes many seconds even on a fast machine (the drain and disconnect tests need slow ones);
# short header and body deadlines, so that the slow-client test sees them expire
SERVER_ARGS = ["--device", "cpu", "--threads", "1", "--log-level", "warning", "--max-new-tokens-limit", "4096",
               "--window-shift", "1", "--max-body-bytes", "16384", "--drain-timeout", "2", "--header-timeout", "2",
               "--body-timeout", "2"]
REFUSED = "refused"


class ServerError(RuntimeError):
    """A server process that exited or stayed unhealthy while starting; the message ends with its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: list[str], log: Path, *, env: dict[str, str] | None = None, cwd: Path = APP_ROOT,
           new_session: bool = False, echo_command: bool = False) -> subprocess.Popen:
    """Start `cmd` with stdout and stderr in `log` and `env` over this process's environment. `new_session`: the
    process leads a process group of its own, which `stop(..., group=True)` signals whole (for servers that run
    work in child processes). `echo_command`: the log starts with `$ cmd`, for a person reading it."""
    with open(log, "wb") as out:
        if echo_command:
            out.write(f"$ {shlex.join(cmd)}\n".encode())
            out.flush()
        return subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=new_session)


def spawn(checkpoint: Path, log: Path, *args: str, port: int = 0, env: dict[str, str] | None = None
          ) -> subprocess.Popen:
    """`python -m app` on 127.0.0.1:`port` serving `checkpoint` with `SERVER_ARGS`, then `args` (which win), with
    `env` over this process's environment."""
    cmd = [sys.executable, "-m", "app", "--checkpoint", str(checkpoint), "--host", "127.0.0.1",
           "--port", str(port), *SERVER_ARGS, *args]
    return launch(cmd, log, env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})})


def log_tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def wait_healthy(proc: subprocess.Popen, base: str, log: Path, timeout: float = 90.0) -> None:
    """Poll GET `base`/health until it answers 200; `ServerError` if the process exits or `timeout` s pass first
    (the process is left running: the caller stops it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"server exited with {proc.returncode} during startup:\n{log_tail(log)}")
        try:
            # trust_env=False: no proxy stands between a client and 127.0.0.1
            if httpx.get(f"{base}/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise ServerError(f"server not healthy after {timeout} s:\n{log_tail(log)}")


def stop(proc: subprocess.Popen, *, group: bool = False, grace: float = 15.0) -> None:
    """SIGTERM (to the whole process group with `group`), then SIGKILL if it has not exited within `grace` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            if group:
                os.killpg(proc.pid, sig)
            elif proc.poll() is None:
                proc.send_signal(sig)
            else:
                return
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def serving(checkpoint: Path, log: Path, *args: str, env: dict[str, str] | None = None
            ) -> Iterator[tuple[str, subprocess.Popen]]:
    """A healthy `spawn`ed server on a free port for the block: (base URL, process). Stopped afterwards."""
    port = free_port()
    proc = spawn(checkpoint, log, *args, port=port, env=env)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop(proc)


def probe(client: httpx.Client, route: str) -> tuple[int, dict[str, Any]] | str:
    """GET `route`: (status, JSON body), or REFUSED when no HTTP answer came (connection refused, reset or closed),
    which the kubelet counts as a failed probe too."""
    try:
        r = client.get(route, timeout=5)
    except httpx.TransportError:
        return REFUSED
    return r.status_code, r.json()


# -- what comes over the wire ---------------------------------------------------------------------------------


def http_scope(method: str, path: str, content_length: int) -> dict[str, Any]:
    """The ASGI scope uvicorn would give the app for a JSON request to `path`, for a test that drives the app
    message by message (a client that hangs up mid-body or mid-answer)."""
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                    (b"content-length", str(content_length).encode())],
        "client": ("127.0.0.1", 50000), "server": ("testserver", 80), "state": {},
    }


def _not_json(constant: str) -> Any:
    raise AssertionError(f"{constant} is not JSON (JSON has no NaN or infinities)")


def strict_json(text: str | bytes) -> Any:
    """`json.loads`, refusing the NaN / Infinity / -Infinity that Python's json module reads and writes but strict
    parsers (JavaScript's JSON.parse, Go, Rust) refuse."""
    return json.loads(text, parse_constant=_not_json)


def parse_sse(body: str) -> list[Any]:
    """Events of an SSE body, checking the framing: every event is exactly `data: <payload>\\n\\n`.

    JSON payloads come back parsed (strict JSON); OpenAI's terminator comes back as the string "[DONE]"."""
    assert body.endswith("\n\n"), f"SSE body does not end an event: {body[-80:]!r}"
    events = []
    for chunk in body[:-2].split("\n\n"):
        assert chunk.startswith("data: ") and "\n" not in chunk, f"not one 'data: ' line: {chunk!r}"
        payload = chunk.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else strict_json(payload))
    return events


def parse_sse_events(body: str) -> list[tuple[str, Any]]:
    """(name, parsed JSON) of each event of a stream of named events (Anthropic's), checking the framing: every event
    is exactly `event: <name>\ndata: <json>\n\n`."""
    assert body.endswith("\n\n"), f"SSE body does not end an event: {body[-80:]!r}"
    events = []
    for chunk in body[:-2].split("\n\n"):
        lines = chunk.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), chunk
        events.append((lines[0].removeprefix("event: "), strict_json(lines[1].removeprefix("data: "))))
    return events


def metric(metrics_text: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus exposition (sample name as exposed, e.g. `..._total`)."""
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name}{labels or ''} in /metrics")


def assert_request_id(response: Any, body: dict[str, Any]) -> None:
    """An error body's `request_id` is the response's `X-Request-Id` (both absent: an answer of the HTTP layer to a
    request that never reached the app)."""
    assert body["request_id"] == response.headers.get("x-request-id"), (body, response.headers)


def assert_tgi_error(response: Any, status: int, error_type: str, *needles: str) -> str:
    """TGI's error body `{"error": message, "error_type": kind, "request_id"}`, with every needle in the message."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error", "error_type", "request_id"}, body
    assert_request_id(response, body)
    assert body["error_type"] == error_type, body
    for needle in needles:
        assert needle in body["error"], (needle, body["error"])
    return body["error"]


def assert_anthropic_error(response: Any, status: int, error_type: str, *needles: str) -> str:
    """Anthropic's error body `{"type": "error", "error": {"type", "message"}, "request_id"}`."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"type", "error", "request_id"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == error_type, body
    assert_request_id(response, body)
    for needle in needles:
        assert needle in body["error"]["message"], (needle, body["error"]["message"])
    return body["error"]["message"]


def assert_openai_error(response: Any, status: int, error_type: str, param: str | None, *needles: str,
                        code: str | None = None) -> str:
    """OpenAI's error body `{"error": {"message", "type", "param", "code"}, "request_id"}`, its `code` OpenAI's
    string or null."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error", "request_id"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert_request_id(response, body)
    err = body["error"]
    assert (err["type"], err["param"], err["code"]) == (error_type, param, code), err
    for needle in needles:
        assert needle in err["message"], (needle, err["message"])
    return err["message"]
