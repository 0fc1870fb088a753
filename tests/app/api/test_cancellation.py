"""A request's streams live and die together (`GenerationService.results`): when one sample of a multi-sample request
fails, the others are cancelled at once rather than run to their end; and a client that hangs up before its body
has arrived gets 499 (`app.http.errors.client_gone_response`) without ever holding a slot."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from fastapi.testclient import TestClient

from app.testing import assert_openai_error, assert_tgi_error, http_scope
from tests.app.api.calls import LIMIT, PROMPT, engine_of, wait_until

SEED = 1234


@pytest.mark.parametrize(("route", "body"), [
    ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": LIMIT, "best_of": 2, "do_sample": True,
                                                    "seed": SEED}}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": LIMIT, "n": 2, "seed": SEED}),
], ids=["tgi-best_of", "openai-n"])
def test_a_failing_sample_cancels_its_siblings(client: TestClient, route: str, body: dict) -> None:
    engine = engine_of(client)
    cancelled, generated = engine.stats.cancelled_total, engine.stats.generated_tokens_total

    first: list = []

    def fault(reqs: list) -> None:
        time.sleep(0.005)  # LIMIT tokens would take well over a second
        req = reqs[0]
        if req.seed == SEED and not first:
            first.append(req)
        if req.seed == SEED + 1 and len(req.output) >= 2:  # the second sample fails after two tokens
            raise RuntimeError("injected fault")

    engine.fault_hook = fault
    try:
        r = client.post(route, json=body)
        # cancelled before the error was answered, not later by the poll that notices the client has gone
        assert first[0].cancelled
        assert wait_until(lambda: engine.busy == 0, 1.0)
    finally:
        engine.fault_hook = None
    if route.startswith("/v1/"):
        assert_openai_error(r, 424, "server_error", None, "injected fault")
    else:
        assert_tgi_error(r, 424, "generation", "injected fault")
    assert engine.stats.cancelled_total == cancelled + 1  # the first sample, stopped when its sibling failed
    assert 0 < engine.stats.generated_tokens_total - generated < LIMIT


async def _cut_short(app: object, path: str) -> int:
    """POST half a body to `path`, then hang up: the status answered."""
    body = json.dumps({"inputs": PROMPT}).encode()
    messages = [{"type": "http.request", "body": body[:5], "more_body": True}, {"type": "http.disconnect"}]
    status = 0

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    scope = http_scope("POST", path, len(body))
    await asyncio.wait_for(app(scope, receive, send), 5)  # type: ignore[operator]
    return status


@pytest.mark.parametrize("path", ["/generate", "/tokenize"])
def test_a_body_cut_short_is_499_and_holds_no_slot(client: TestClient, path: str) -> None:
    engine = engine_of(client)
    lifecycle = client.app.state.models.lifecycle
    cancelled = engine.stats.cancelled_total
    status = client.portal.call(lambda: _cut_short(client.app, path))
    assert status == 499
    assert (engine.reserved, engine.busy, lifecycle.in_flight) == (0, 0, 0)
    assert engine.stats.cancelled_total == cancelled  # nothing was submitted, so nothing was cancelled
