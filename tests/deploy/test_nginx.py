"""The shipped nginx configuration, `docker/nginx.conf`, run by Debian's nginx on 127.0.0.1 in front of two
real `python -m app` servers (a tiny random checkpoint, one thread each).

The file is used as shipped except for two substitutions: the upstream server line between the
`# BEGIN/END upstream servers` markers becomes one line per replica (its parameters kept) and `listen 8080`
becomes a free local port. The test's own wrapper around it (`http { include ...; }`) holds only what the
official nginx image's nginx.conf holds: process settings, paths, and a log format naming the request's ID and
the upstream that answered it. Skipped, with the reason, where no nginx binary is installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from app.settings import Settings
from app.testing import free_port, launch, stop, wait_healthy
from model.checkpoint import save_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.tokenizer import CharTokenizer
from tests import REPO

NGINX_CONF = REPO / "docker" / "nginx.conf"
BEGIN, END = "# BEGIN upstream servers", "# END upstream servers"
SHIPPED_LISTEN = "listen 8080;"
STARTUP_TIMEOUT = 120.0
BODY = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": 8, "do_sample": True, "seed": 1}}


def find_nginx() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                          if os.access(p, os.X_OK)), None)


def render(conf: str, upstreams: list[str], port: int) -> str:
    """The shipped file with the replicas' addresses and a local listen port, and nothing else changed."""
    head, rest = conf.split(BEGIN)
    block, tail = rest.split(END)
    lines = block.split("\n")
    servers = [i for i, ln in enumerate(lines) if ln.strip().startswith("server ")]
    assert len(servers) == 1, f"expected one server line between the markers, got {len(servers)}"
    line = lines[servers[0]]
    lines[servers[0]] = "\n".join(re.sub(r"server \S+", f"server {addr}", line, count=1) for addr in upstreams)
    assert conf.count(SHIPPED_LISTEN) == 1, f"expected one '{SHIPPED_LISTEN}' in {NGINX_CONF}"
    return (head + BEGIN + "\n".join(lines) + END + tail).replace(SHIPPED_LISTEN, f"listen 127.0.0.1:{port};")


def wrapper(prefix: Path, site: Path) -> str:
    """The main configuration around the site file: what the nginx image's own nginx.conf provides."""
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers need the temp dirs under pytest's 0700 tmp
    temp = "".join(f"    {kind}_temp_path {prefix}/{kind}_temp;\n"
                   for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (
        f"{user}worker_processes 1;\npid {prefix}/nginx.pid;\nerror_log {prefix}/error.log info;\n"
        "events { worker_connections 256; }\n"
        "http {\n"
        "    log_format upstreams '$folio_request_id $request_method $uri $status \"$upstream_addr\" "
        "\"$upstream_status\"';\n"
        f"    access_log {prefix}/access.log upstreams;\n{temp}"
        f"    include {site};\n"
        "}\n"
    )


def metric(base: str, name: str, **labels: str) -> float:
    """The sum of a replica's /metrics samples `name` with these labels (0 where none exists yet)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def served(base: str, route: str) -> float:
    return metric(base, "folio_requests_total", route=route, status="200")


def first_event(lines: Iterator[str]) -> dict:
    for line in lines:
        if line.startswith("data:"):
            return json.loads(line.removeprefix("data:"))
    raise AssertionError("the stream ended without an event")


def rest_of_stream(lines: Iterator[str]) -> list[dict]:
    return [json.loads(ln.removeprefix("data:")) for ln in lines if ln.startswith("data:")]


class Replica:
    """`python -m app` configured by FOLIO_* variables alone, as the container runs it."""

    def __init__(self, checkpoint: Path, log: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.addr = f"127.0.0.1:{self.port}"
        env = {"OMP_NUM_THREADS": "1", "FOLIO_CHECKPOINT": str(checkpoint), "FOLIO_HOST": "127.0.0.1",
               "FOLIO_PORT": str(self.port), "FOLIO_THREADS": "1", "FOLIO_DRAIN_TIMEOUT": "1",
               "FOLIO_LOG_LEVEL": "warning"}
        self.log = log
        self.proc = launch([sys.executable, "-m", "app"], log, env=env, cwd=REPO)

    def wait_healthy(self, deadline: float) -> None:
        wait_healthy(self.proc, self.base, self.log, timeout=max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        stop(self.proc)


class Proxy:
    def __init__(self, nginx: str, prefix: Path, upstreams: list[str]) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.prefix = prefix
        site = prefix / "folio.conf"
        site.write_text(render(NGINX_CONF.read_text(), upstreams, self.port))
        main = prefix / "nginx.conf"
        main.write_text(wrapper(prefix, site))
        cmd = [nginx, "-p", str(prefix), "-c", str(main), "-e", str(prefix / "error.log")]
        check = subprocess.run([*cmd, "-t"], capture_output=True, text=True)
        assert check.returncode == 0, f"nginx -t refuses the shipped config:\n{check.stderr}"
        self.proc = subprocess.Popen([*cmd, "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while True:
            assert self.proc.poll() is None, f"nginx exited: {self.proc.stderr.read().decode()}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                break
            assert time.monotonic() < deadline, "nginx is not listening after 10 s"
            time.sleep(0.05)

    def access_log(self) -> list[str]:
        return (self.prefix / "access.log").read_text().splitlines()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def nginx() -> str:
    path = find_nginx()
    if path is None:
        pytest.skip("no nginx binary (Debian: apt-get install nginx; .ci/run installs it)")
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random char-level GPT: fast enough for thousands of tokens a second on one thread."""
    chars = sorted({chr(c) for c in range(32, 127)} | {"\n"})
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=len(chars), n_layer=1, n_head=2, n_embd=32)).eval()
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", model, CharTokenizer(chars),
                           training={"note": "random weights for the nginx test"})


@pytest.fixture(scope="module")
def replicas(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    logs = tmp_path_factory.mktemp("replica-logs")
    started = [Replica(checkpoint, logs / f"replica{i}.log") for i in range(2)]
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for r in started:
            r.wait_healthy(deadline)
        yield started
    finally:
        for r in started:
            r.stop()


@pytest.fixture(scope="module")
def proxy(nginx: str, replicas: list[Replica], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    p = Proxy(nginx, tmp_path_factory.mktemp("nginx"), [r.addr for r in replicas])
    try:
        yield p
    finally:
        p.stop()


# -- the tests; the last one kills a replica ----------------------------------------------------------


def test_render_changes_only_addresses_and_port() -> None:
    conf = NGINX_CONF.read_text()
    rendered = render(conf, ["127.0.0.1:1", "127.0.0.1:2"], 9)
    assert "server 127.0.0.1:1 max_fails=1 fail_timeout=10s;" in rendered
    assert "server 127.0.0.1:2 max_fails=1 fail_timeout=10s;" in rendered
    assert "listen 127.0.0.1:9;" in rendered
    changed = set(rendered.splitlines()) - set(conf.splitlines())
    assert all(ln.strip().startswith(("server 127.0.0.1:", "listen 127.0.0.1:")) for ln in changed), changed


def test_body_limit_matches_the_server(proxy: Proxy, replicas: list[Replica]) -> None:
    """client_max_body_size is the servers' default --max-body-bytes: a body of exactly that size reaches a
    replica (which answers it), one byte more is refused by nginx itself with 413."""
    limit = Settings().max_body_bytes
    size = re.search(r"client_max_body_size (\d+)([km]?);", NGINX_CONF.read_text())
    assert size, "no client_max_body_size in docker/nginx.conf"
    assert int(size[1]) * {"": 1, "k": 1024, "m": 1024**2}[size[2]] == limit
    seen = sum(metric(r.base, "folio_requests_total", route="/generate") for r in replicas)
    headers = {"Content-Type": "application/json"}
    at_limit = httpx.post(f"{proxy.base}/generate", content=b"x" * limit, headers=headers, timeout=60)
    assert at_limit.status_code != 413 and at_limit.headers["content-type"] == "application/json", at_limit.text
    over = httpx.post(f"{proxy.base}/generate", content=b"x" * (limit + 1), headers=headers, timeout=60)
    assert over.status_code == 413 and "nginx" in over.text
    # only the first reached a replica
    assert sum(metric(r.base, "folio_requests_total", route="/generate") for r in replicas) == seen + 1


def test_one_request_id_at_the_proxy_and_the_replica(proxy: Proxy, replicas: list[Replica]) -> None:
    """The client's sane X-Request-Id, else one nginx makes, goes to the replica, which answers with it: the
    proxy's log line and the response name the request alike."""
    before = len(proxy.access_log())
    answers = [httpx.post(f"{proxy.base}/generate", json=BODY, headers=headers, timeout=60)
               for headers in ({"X-Request-Id": "client-id-1"}, {}, {"X-Request-Id": "not sane"})]
    assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
    ids = [r.headers["x-request-id"] for r in answers]
    assert ids[0] == "client-id-1" and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids[1:]), ids
    assert [line.split(" ", 1)[0] for line in proxy.access_log()[before:]] == ids


def test_concurrent_streams_are_spread_over_both_replicas(proxy: Proxy, replicas: list[Replica]) -> None:
    """Four streams opened one after another and held open: least_conn sends each to the replica with fewer
    open streams, so each replica runs two at once (its engine's running batch) and serves two."""
    before = [served(r.base, "/generate_stream") for r in replicas]
    body = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": 4000, "do_sample": True, "seed": 1}}
    with httpx.Client(base_url=proxy.base, timeout=60) as client, contextlib.ExitStack() as streams:
        readers = []  # kept referenced: a dropped line iterator closes its stream
        for _ in range(4):
            response = streams.enter_context(client.stream("POST", "/generate_stream", json=body))
            assert response.status_code == 200
            readers.append(response.iter_lines())
            first_event(readers[-1])  # this stream is running before the next one is opened
        running = [metric(r.base, "folio_running_batch_size") + metric(r.base, "folio_queue_depth")
                   for r in replicas]
        assert running == [2, 2]
    # closing the streams cancels them; each replica counts its two once they have ended
    deadline = time.monotonic() + 30
    while [served(r.base, "/generate_stream") - b for r, b in zip(replicas, before)] != [2, 2]:
        assert time.monotonic() < deadline, [served(r.base, "/generate_stream") for r in replicas]
        time.sleep(0.2)
    addrs = [ln.split('"')[1] for ln in proxy.access_log() if "/generate_stream" in ln]
    assert sorted(addrs[-4:]) == sorted([replicas[0].addr] * 2 + [replicas[1].addr] * 2)


def test_least_conn_avoids_the_busy_replica(proxy: Proxy, replicas: list[Replica]) -> None:
    """While one replica holds a long stream, every new request goes to the other (round robin would send
    every other one to the busy replica)."""
    before = [served(r.base, "/generate") for r in replicas]
    body = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": 4000, "do_sample": True, "seed": 3}}
    with httpx.Client(base_url=proxy.base, timeout=60) as client, \
            client.stream("POST", "/generate_stream", json=body) as stream:
        reader = stream.iter_lines()
        first_event(reader)
        busy = [metric(r.base, "folio_running_batch_size") for r in replicas]
        assert sorted(busy) == [0, 1], busy
        statuses = [client.post("/generate", json=BODY).status_code for _ in range(4)]
        assert statuses == [200] * 4
    served_now = [served(r.base, "/generate") - b for r, b in zip(replicas, before)]
    assert served_now == [0 if b else 4 for b in busy], (busy, served_now)


def test_sse_is_not_buffered(proxy: Proxy, replicas: list[Replica]) -> None:
    """Server-sent events pass through nginx as they are generated, not when the response is complete: when
    the first event reaches the client the replica has generated only a small part of the tokens (~40 of
    3000 here, most of them during the /metrics request that counts them), and the body arrives in many
    small reads spread over the generation (~2000 here; a response held back whole would come in a few
    reads of up to 64 KB)."""
    n = 3000
    body = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": n, "do_sample": True, "seed": 2}}
    generated_before = sum(metric(r.base, "folio_generated_tokens_total") for r in replicas)
    with httpx.Client(base_url=proxy.base, timeout=60) as client, \
            client.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        t0 = time.perf_counter()
        reads = response.iter_bytes()
        first = next(reads)
        t_first = time.perf_counter() - t0
        generated_then = sum(metric(r.base, "folio_generated_tokens_total") for r in replicas) - generated_before
        chunks = [first, *reads]
        t_end = time.perf_counter() - t0
    events = [json.loads(ev.removeprefix(b"data:")) for ev in b"".join(chunks).split(b"\n\n") if ev]
    assert len(events) == n and events[-1]["details"]["generated_tokens"] == n
    assert first.startswith(b"data:") and events[0]["generated_text"] is None
    assert generated_then < n / 10, f"{generated_then} of {n} tokens generated when the first event arrived"
    assert len(chunks) > n / 30, f"{n} events arrived in only {len(chunks)} reads"
    assert t_first < t_end / 10, (t_first, t_end)


def test_a_killed_replica_is_routed_around(proxy: Proxy, replicas: list[Replica]) -> None:
    """SIGKILL the replica that is generating a (non-streamed) request: the client still gets its answer,
    from the other replica (the POST is passed on: proxy_next_upstream ... non_idempotent), and every later
    request succeeds, a stream included."""
    n = 3000
    body = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": n, "do_sample": True, "seed": 4, "details": True}}
    log_before = len(proxy.access_log())
    with httpx.Client(base_url=proxy.base, timeout=120) as client, ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(client.post, "/generate", json=body)
        deadline = time.monotonic() + 30
        while not (busy := [r for r in replicas if metric(r.base, "folio_running_batch_size") == 1]):
            assert time.monotonic() < deadline and not in_flight.done(), "the request never started"
            time.sleep(0.01)
        dead = busy[0]
        live = next(r for r in replicas if r is not dead)
        dead.proc.send_signal(signal.SIGKILL)
        dead.proc.wait(timeout=10)
        response = in_flight.result(timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["details"]["generated_tokens"] == n
        before = served(live.base, "/generate")
        statuses = [client.post("/generate", json=BODY).status_code for _ in range(6)]
        with client.stream("POST", "/generate_stream", json=BODY) as stream:
            assert stream.status_code == 200
            events = rest_of_stream(stream.iter_lines())
    assert statuses == [200] * 6 and served(live.base, "/generate") - before == 6
    assert len(events) == 8 and events[-1]["generated_text"]
    entries = proxy.access_log()[log_before:]
    assert f'"{dead.addr}, {live.addr}" "502, 200"' in entries[0], entries
    assert all(ln.endswith(f'"{live.addr}" "200"') for ln in entries[1:]), entries
