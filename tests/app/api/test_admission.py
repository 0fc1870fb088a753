"""Admission: a body over the limit is 413, a full engine answers 429 before reading the request, a request
holds its slot while it is validated, and tokenizing takes a slot and runs off the event loop."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import pytest
from fastapi.testclient import TestClient

from app.serving.service import Lifecycle
from app.testing import assert_anthropic_error, assert_openai_error, assert_tgi_error, metric
from model.engine import Engine
from model.registry import ModelRegistry
from model.testing import CHARS
from tests.app.api.calls import BODY_LIMIT, PROMPT, engine_of


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_body_over_the_limit_is_413_by_length_and_when_chunked(client: TestClient, route: str) -> None:
    key = "prompt" if route.startswith("/v1") else "inputs"
    big = json.dumps({key: "a" * (BODY_LIMIT + 100)}).encode()
    headers = {"content-type": "application/json"}

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    for r in (client.post(route, content=big, headers=headers), client.post(route, content=chunks(), headers=headers)):
        needles = ("more than the limit", f"{BODY_LIMIT} bytes")
        if route.startswith("/v1"):
            assert_openai_error(r, 413, "invalid_request_error", None, *needles)
        else:
            assert_tgi_error(r, 413, "payload_too_large", *needles)


@contextmanager
def engine_held_full(client: TestClient) -> Iterator[None]:
    """Within the block, one request holds the engine's only slot (max_batch_size=1, max_waiting=0), stopped in
    its model step; on leaving, it is let go and must complete with 200."""
    engine = engine_of(client)
    entered, gate = threading.Event(), threading.Event()

    def hold(_: list) -> None:
        entered.set()
        gate.wait(10)

    engine.fault_hook = hold
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.post, "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
            assert entered.wait(10)
            yield
            gate.set()
            assert first.result(timeout=10).status_code == 200
    finally:
        engine.fault_hook = None
        gate.set()


def test_full_engine_answers_429_with_retry_after(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_batch_size=1, max_waiting=0, retry_after=3)
    with engine_held_full(client):
        for route, body in [("/generate", {"inputs": PROMPT}), ("/generate_stream", {"inputs": PROMPT}),
                            ("/v1/completions", {"prompt": PROMPT})]:
            r = client.post(route, json=body)
            assert r.headers["retry-after"] == "3"
            if route.startswith("/v1"):
                assert_openai_error(r, 429, "rate_limit_error", None, "at capacity", code="rate_limit_exceeded")
            else:
                assert_tgi_error(r, 429, "overloaded", "at capacity (1 running, 0 waiting)")
        assert metric(client.get("/metrics").text, "folio_rejected_requests_total") == 3


def test_a_full_engine_is_anthropics_529_overloaded_on_its_routes(make_client: Callable[..., TestClient]) -> None:
    """Anthropic answers a server too busy for anyone with 529 overloaded_error (its 429 is an account's rate limit):
    its SDK raises OverloadedError, which client code tells apart from RateLimitError."""
    client = make_client(max_batch_size=1, max_waiting=0, retry_after=3)
    claude = anthropic.Anthropic(base_url=str(client.base_url), api_key="x", http_client=client, max_retries=0)
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
    with engine_held_full(client):
        for route in ("/v1/messages", "/v1/messages/count_tokens"):
            r = client.post(route, json=body)
            assert_anthropic_error(r, 529, "overloaded_error", "at capacity")
            assert r.headers["retry-after"] == "3"
        with pytest.raises(anthropic.OverloadedError) as e:
            claude.messages.create(model="folio", **body)
        assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
        assert metric(client.get("/metrics").text, "folio_requests_total", route="/v1/messages", status="529") == 2


def test_a_full_engine_refuses_before_looking_at_the_request(make_client: Callable[..., TestClient]) -> None:
    """The admission fast path (app/http/admission.py): while the engine is full even a malformed request gets its 429,
    counted under its route; once there is room the same request is a 422 again."""
    client = make_client(max_batch_size=1, max_waiting=0)
    malformed = {"inputs": PROMPT, "parameters": {"max_new_tokens": -1}}
    with engine_held_full(client):
        assert_tgi_error(client.post("/generate", json=malformed), 429, "overloaded", "at capacity")
        r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert_openai_error(r, 429, "rate_limit_error", None, "at capacity", code="rate_limit_exceeded")
        text = client.get("/metrics").text
        assert metric(text, "folio_requests_total", route="/generate", status="429") == 1
        assert metric(text, "folio_requests_total", route="/v1/completions", status="429") == 1
    assert client.post("/generate", json=malformed).status_code == 422


def test_a_request_being_validated_holds_its_slot(make_client: Callable[..., TestClient]) -> None:
    """A burst is refused as it arrives: a request admitted but still being tokenised holds its slot, so the next
    one gets 429 before its body is read, though the engine has nothing queued yet; a request that fails
    validation gives its slot back."""
    client = make_client(max_batch_size=1, max_waiting=0)
    service = client.app.state.service
    tokenising, gate = threading.Event(), threading.Event()
    encode = service.encode

    async def slow_encode(text: str, *args: Any) -> list[int]:
        tokenising.set()
        await asyncio.get_running_loop().run_in_executor(None, gate.wait, 10)
        return await encode(text, *args)

    service.encode = slow_encode
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.post, "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
            assert tokenising.wait(10)
            assert engine_of(client).busy == 0  # nothing submitted yet
            assert_tgi_error(client.post("/generate", json={"inputs": PROMPT}), 429, "overloaded", "at capacity")
            gate.set()
            assert first.result(timeout=10).status_code == 200
    finally:
        service.encode = encode
        gate.set()
    for _ in range(3):  # 422s release their slots: the server is not left full
        assert client.post("/generate", json={"inputs": PROMPT, "parameters": {"top_k": -1}}).status_code == 422
    assert client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_tokenize_takes_a_slot_until_it_answers(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_batch_size=1, max_waiting=0)
    with engine_held_full(client):
        assert_tgi_error(client.post("/tokenize", json={"inputs": PROMPT}), 429, "overloaded", "at capacity")
    assert len(client.post("/tokenize", json={"inputs": PROMPT}).json()) == len(PROMPT)
    assert engine_of(client).reserved == 0
    assert metric(client.get("/metrics").text, "folio_reserved_slots") == 0


class GatedTokenizer:
    """A tokenizer whose `encode` and `decode_bytes` each wait for their gate on their first call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered = {name: threading.Event() for name in ("encode", "decode_bytes")}
        self.gates = {name: threading.Event() for name in ("encode", "decode_bytes")}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _wait(self, name: str) -> None:
        self.entered[name].set()
        self.gates[name].wait(30)

    def encode(self, text: str) -> list[int]:
        self._wait("encode")
        return self.inner.encode(text)

    def decode_bytes(self, ids: list[int]) -> bytes:
        self._wait("decode_bytes")
        return self.inner.decode_bytes(ids)


def test_tokenize_works_off_the_event_loop(client: TestClient) -> None:
    """Tokenising and writing the answer both take time proportional to the input: while each is held up, the
    event loop still answers /health (were either on the loop, /health would wait for it)."""
    service = client.app.state.service
    gated = service.tokenizer = GatedTokenizer(service.tokenizer)
    try:
        with ThreadPoolExecutor(2) as pool:
            answer = pool.submit(client.post, "/tokenize", json={"inputs": "Hi, you!"})
            for phase in ("encode", "decode_bytes"):
                assert gated.entered[phase].wait(30), phase
                assert pool.submit(client.get, "/health").result(timeout=30).status_code == 200
                assert not answer.done()
                gated.gates[phase].set()
            assert answer.result(timeout=30).json() == [{"id": CHARS.index(c), "text": c, "start": i, "stop": i + 1}
                                                        for i, c in enumerate("Hi, you!")]
    finally:
        for gate in gated.gates.values():
            gate.set()
        service.tokenizer = gated.inner


def test_readiness_model_and_slot_are_each_decided_once_per_request(
        make_client: Callable[..., TestClient], char_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the route, the number of prompts and samples, and whether a header or the body names the model:
    one readiness check, one registry lookup (the model and its engine) and one slot reservation per request."""
    c = make_client(models=[f"other={char_checkpoint}"])
    default = c.get("/v1/models").json()["data"][0]["id"]
    counts: Counter[str] = Counter()

    def count(owner: type, name: str) -> None:
        original = getattr(owner, name)
        if inspect.iscoroutinefunction(original):
            async def counted(*args: Any, **kwargs: Any) -> Any:
                counts[name] += 1
                return await original(*args, **kwargs)
        else:
            def counted(*args: Any, **kwargs: Any) -> Any:
                counts[name] += 1
                return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)

    for owner, name in ((Lifecycle, "check_ready"), (ModelRegistry, "acquire"), (Engine, "reserve")):
        count(owner, name)
    tgi = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
    cases = [
        ("/generate", tgi, {}),
        ("/generate", tgi, {"X-Folio-Model": "other"}),
        ("/generate_stream", tgi, {}),
        ("/", {**tgi, "stream": True}, {"X-Folio-Model": "other"}),
        ("/tokenize", {"inputs": PROMPT}, {}),
        ("/inspect", {"inputs": PROMPT}, {}),
        ("/v1/completions", {"prompt": [PROMPT, PROMPT], "n": 2, "max_tokens": 2}, {}),
        ("/v1/completions", {"model": "other", "prompt": PROMPT, "max_tokens": 2}, {"X-Folio-Model": default}),
        ("/v1/completions", {"model": "other", "prompt": PROMPT, "max_tokens": 2, "stream": True}, {}),
    ]
    for route, body, headers in cases:
        counts.clear()
        r = c.post(route, json=body, headers=headers)
        assert r.status_code == 200, (route, r.text)
        assert counts == {"check_ready": 1, "acquire": 1, "reserve": 1}, (route, body, headers, counts)
    counts.clear()  # a route admission does not hold: the dependency checks readiness, and holds no slot
    assert c.get("/tokenizer_info").status_code == 200
    assert counts == {"check_ready": 1, "acquire": 1}, counts
