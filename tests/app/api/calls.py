"""What the API tests send and share: the test apps' limits, and requests that must succeed (a 200, its body
parsed), each route's way."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from app.testing import parse_sse

LIMIT = 256  # max_new_tokens_limit of the test apps
BODY_LIMIT = 16 * 1024
# n and best_of up to 4 on a batch of 4: beyond the default share of one request (half the batch)
BASE = dict(device="cpu", threads=1, max_batch_size=4, max_waiting=8, max_new_tokens_limit=LIMIT,
            max_body_bytes=BODY_LIMIT, max_sequences_per_request=4)
PROMPT = "Hello there"


def engine_of(client: TestClient):  # noqa: ANN201
    return client.app.state.service.engine


def generate(client: TestClient, inputs: str = PROMPT, route: str = "/generate", **parameters: Any) -> dict:
    r = client.post(route, json={"inputs": inputs, "parameters": parameters})
    assert r.status_code == 200, r.text
    return r.json()


def stream(client: TestClient, inputs: str = PROMPT, route: str = "/generate_stream", **parameters: Any) -> list:
    r = client.post(route, json={"inputs": inputs, "parameters": parameters})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return parse_sse(r.text)


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()



def completion(client: TestClient, **body: Any) -> dict:
    r = client.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def completion_stream(client: TestClient, **body: Any) -> list:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "stream": True, **body})
    assert r.status_code == 200, r.text
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]



def post_raw(client: TestClient, route: str, body: Any) -> Any:
    """POST `body` as JSON written with ASCII escapes: a lone surrogate goes out as the 6 characters \\ud800, as a
    client in another language would send it (httpx's own encoder cannot write it at all)."""
    return client.post(route, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
