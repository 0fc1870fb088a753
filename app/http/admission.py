"""Admission: a request to a route that takes an engine slot (generation and /tokenize) gets the slot once its body
has arrived, before it is parsed, validated or tokenised; or it gets its 429 (or, while loading or draining, its
503) at once.

In order, for each such request:
1. while the server is loading or draining: 503 with `Retry-After` and `Connection: close`; while it is full: 429
   with `Retry-After`. Nothing about the request is looked at, and its body is not read.
2. the body is read whole (bounded in size by `BodyLimitMiddleware` outside, in time by the connection's
   `body_timeout`, app/http/connection.py). A slow body holds a connection, never a slot: were the slot taken first, a
   few dozen clients sending half a body each would hold every slot and every other client would get 429.
3. the slot is reserved (`Engine.reserve`, or 429 if the server filled up meanwhile), and the body is replayed to
   the app.

The slot is held from there until the route submits the request (the request's state holds it for
`app.serving.deps.ReservationDep`) or the response ends, whichever is first; a /tokenize request never submits, so it
holds its slot until it has answered. Holding it matters under a burst: a check that only looked at the engine
would let every request of the burst through, since none of them has been submitted yet, and each would be parsed
and tokenised before being refused. The request also counts in `GenerationService.in_flight` until its response
has ended: what a drain waits for (app/__main__.py).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http.errors import Unavailable, client_gone_response, error_response
from model.engine import Engine, Overloaded

RESERVATION = "reservation"  # the key of the request's state that holds its slot
MODEL_HEADER = "x-folio-model"  # the request header naming the model to serve it (app/serving/models.py)
ADMITTED_PATHS = frozenset({"/generate", "/generate_stream", "/", "/v1/completions", "/tokenize", "/detokenize",
                            "/inspect"})
BODY_NAMES_MODEL = frozenset({"/v1/completions"})  # OpenAI's `model` field: the body says which model serves it


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, get_app: Callable[[], Any]) -> None:
        self.app = app
        self.get_app = get_app  # the FastAPI app, for its state: the service and the settings

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, e: Exception, retry_after: int) -> None:
        # rendered for each refusal: the body holds the request's ID
        response = error_response(Request(scope), e, retry_after)
        if response.status_code == 503:  # a client kept alive on a draining server reconnects (elsewhere)
            response.headers["connection"] = "close"
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in ADMITTED_PATHS):
            await self.app(scope, receive, send)
            return
        # the request metrics label by route template (the router sets it for requests that reach a route); these
        # routes have no path parameters
        scope["route"] = SimpleNamespace(path=scope["path"])
        app = self.get_app()
        service = app.state.service
        try:
            service.check_ready()
            engine = admitting_engine(app.state.models, scope)
            if engine is not None:
                engine.check_capacity()
            body = await read_body(receive)
            if body is None:  # the client went away (or its body timed out) before the whole body arrived
                await client_gone_response()(scope, receive, send)
                return
            service.check_ready()
            reservation = engine.reserve() if engine is not None else None
        except (Unavailable, Overloaded) as e:
            await self._refuse(scope, receive, send, e, app.state.settings.retry_after)
            return
        # the route finds the slot in its request's state (`app.serving.deps.ReservationDep`)
        scope.setdefault("state", {})[RESERVATION] = reservation
        service.in_flight += 1
        try:
            await self.app(scope, replay(body, receive), send)
        finally:
            service.in_flight -= 1
            if reservation is not None:
                reservation.release()  # a no-op once the request was submitted


def admitting_engine(models: Any, scope: Scope) -> Engine | None:
    """The engine a request's slot is held in (app/serving/models.py):
    that of the model its `X-Folio-Model` header names
    (else the default model's) if loaded. None where that is not known yet, or not loaded: the route holds its slot
    once it has the model's engine, before tokenising (`GenerationService.start_many`). An OpenAI request without
    the header is such a request when other models are served, since its body's `model` may name another: a full
    model must not refuse requests to the others."""
    name = dict(scope.get("headers") or []).get(MODEL_HEADER.encode(), b"").decode("latin-1") or None
    if name is None and scope["path"] in BODY_NAMES_MODEL and len(models.registry.names) > 1:
        return None
    loaded = {n: e for n, e, _ in models.registry.loaded()}
    return loaded.get(name if name is not None else models.registry.default)


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives `body` whole, then whatever `receive` gives (a disconnect, in the end)."""
    pending = True

    async def replayed() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
