"""Failures: a generation that fails is a 424 (a final error event on a stream) while the others succeed, a
draining server answers 503, and a client that hangs up cancels its generation."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.testing import assert_openai_error, assert_tgi_error, http_scope, metric, parse_sse
from tests.app.api.calls import LIMIT, PROMPT, engine_of, generate, wait_until


def test_generation_failure_is_424_while_other_requests_succeed(client: TestClient, reference: Callable) -> None:
    engine = engine_of(client)
    tok = client.app.state.service.tokenizer
    in_decode, in_prefill = tok.encode("boom"), tok.encode("bang")

    def fault(reqs: list) -> None:
        req = reqs[0]
        if (req.prompt == in_decode and len(req.output) >= 2) or req.prompt == in_prefill:
            raise RuntimeError("injected fault")

    failed_before = metric(client.get("/metrics").text, "folio_failed_requests_total")
    engine.fault_hook = fault
    try:
        with ThreadPoolExecutor(4) as pool:
            good = [pool.submit(generate, client, p, max_new_tokens=12) for p in ("alpha", "beta")]
            bad = pool.submit(client.post, "/generate", json={"inputs": "boom", "parameters": {"max_new_tokens": 12}})
            bad_prefill = pool.submit(client.post, "/generate", json={"inputs": "bang"})
            assert_tgi_error(bad.result(), 424, "generation", "generation failed: injected fault")
            assert_tgi_error(bad_prefill.result(), 424, "generation", "during prefill: injected fault")
            assert [f.result()["generated_text"] for f in good] == [reference(p, 12)[1] for p in ("alpha", "beta")]
        r = client.post("/v1/completions", json={"prompt": "boom", "max_tokens": 12})
        assert_openai_error(r, 424, "server_error", None, "injected fault")
        r = client.post("/generate_stream", json={"inputs": "boom", "parameters": {"max_new_tokens": 12}})
        events = parse_sse(r.text)
        assert [e["index"] for e in events[:-1]] == [1, 2]
        assert events[-1] == {"error": "generation failed: injected fault", "error_type": "generation",
                              "request_id": r.headers["x-request-id"]}
        r = client.post("/v1/completions", json={"prompt": "boom", "stream": True})
        chunks = parse_sse(r.text)
        assert chunks[-2] == {"error": {"message": "generation failed: injected fault", "type": "server_error",
                                        "param": None, "code": None}, "request_id": r.headers["x-request-id"]}
        assert chunks[-1] == "[DONE]"
    finally:
        engine.fault_hook = None
    assert generate(client, "boom", max_new_tokens=4)["generated_text"] == reference("boom", 4)[1]
    assert metric(client.get("/metrics").text, "folio_failed_requests_total") == failed_before + 5


def test_draining_answers_503(client: TestClient) -> None:
    lifecycle = client.app.state.models.lifecycle
    lifecycle.draining = True
    try:
        r = client.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "draining"})
        r = client.get("/health/ready")
        assert (r.status_code, r.json()["status"]) == (503, "draining") and "shutting down" in r.json()["reason"]
        assert client.get("/health/startup").status_code == 200  # a draining server is not restarted
        assert client.get("/health/live").status_code == 200
        for route in ("/generate", "/generate_stream", "/", "/tokenize"):
            r = client.post(route, json={"inputs": PROMPT})
            assert_tgi_error(r, 503, "unavailable", "shutting down")
            assert (r.headers["retry-after"], r.headers["connection"]) == ("1", "close")
        r = client.post("/v1/completions", json={"prompt": PROMPT})
        assert_openai_error(r, 503, "server_error", None, "shutting down")
        assert r.headers["retry-after"] == "1"
        assert client.get("/metrics").status_code == 200
    finally:
        lifecycle.draining = False
    assert client.get("/health").status_code == 200
    assert client.get("/health/ready").status_code == 200


async def asgi_call(app: Any, path: str, payload: dict, *, hang_up: Callable[[bytes], bool]) -> tuple[int, bytes]:
    """POST `payload` to `path` straight through ASGI, as uvicorn would; the client hangs up (the next `receive`
    says `http.disconnect`) once `hang_up(body so far)` is true, or after 0.3 s without a response."""
    body = json.dumps(payload).encode()
    gone = asyncio.Event()
    sent = False
    status, received = 0, bytearray()

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            received.extend(message.get("body", b""))
            if hang_up(bytes(received)):
                gone.set()

    scope = http_scope("POST", path, len(body))
    asyncio.get_running_loop().call_later(0.3, gone.set)  # a non-streaming client gives up waiting
    await app(scope, receive, send)
    return status, bytes(received)


@pytest.mark.parametrize(("route", "payload", "hang_up"), [
    ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": LIMIT}}, lambda b: b.count(b"\n\n") >= 2),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": LIMIT, "stream": True}, lambda b: b.count(b"\n\n") >= 2),
    ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": LIMIT}}, lambda b: False),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": LIMIT}, lambda b: False),
], ids=["tgi-stream", "openai-stream", "tgi-whole", "openai-whole"])
def test_client_disconnect_cancels_the_generation(client: TestClient, route: str, payload: dict,
                                                 hang_up: Callable[[bytes], bool]) -> None:
    engine = engine_of(client)
    before, tokens_before = engine.stats.cancelled_total, engine.stats.generated_tokens_total
    metrics_before = metric(client.get("/metrics").text, "folio_cancelled_requests_total")
    engine.fault_hook = lambda _: time.sleep(0.005)  # LIMIT tokens now take well over a second
    try:
        started = time.monotonic()
        status, body = client.portal.call(lambda: asgi_call(client.app, route, payload, hang_up=hang_up))
        assert time.monotonic() - started < 2.0
        assert wait_until(lambda: engine.stats.cancelled_total == before + 1 and engine.busy == 0, 1.0)
    finally:
        engine.fault_hook = None
    streaming = route == "/generate_stream" or payload.get("stream")
    assert status == (200 if streaming else 499)
    if streaming:
        assert len(parse_sse(body[: body.rindex(b"\n\n") + 2].decode())) >= 2
    assert 0 < engine.stats.generated_tokens_total - tokens_before < LIMIT
    assert metric(client.get("/metrics").text, "folio_cancelled_requests_total") == metrics_before + 1
