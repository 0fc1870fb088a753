"""Admission: a request to a route that takes an engine slot (generation and /tokenize) gets the slot once its body
has arrived, before it is parsed, validated or tokenised; or it gets its 429 (or, while loading or draining, its
503) at once.

In order, for each such request:
1. while the server is loading or draining: 503 with `Retry-After` and `Connection: close`; while it is full: 429
   with `Retry-After`. Nothing about the request is looked at, and its body is not read. This is the request's
   one readiness check: a drain that starts while its body arrives waits for it (it counts in `in_flight`).
2. the body is read whole (bounded in size by `BodyLimitMiddleware` outside, in time by the connection's
   `body_timeout`, app/http/connection.py). A slow body holds a connection, never a slot: were the slot taken first, a
   few dozen clients sending half a body each would hold every slot and every other client would get 429.
3. the slot is reserved (`Engine.reserve`, or 429 if the server filled up meanwhile), and the body is replayed to
   the app.

The slot is held from there until the route submits the request (the request's state holds it, in `Admitted`, for
`app.serving.deps.request_service`) or the response ends, whichever is first; a /tokenize request never submits, so it
holds its slot until it has answered. Holding it matters under a burst: a check that only looked at the engine
would let every request of the burst through, since none of them has been submitted yet, and each would be parsed
and tokenised before being refused. The request also counts in `Lifecycle.in_flight` (app/serving/service.py) until its
response has ended: what a drain waits for (app/__main__.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http.errors import Unavailable, client_gone_response, error_response
from model.engine import Engine, Overloaded, Reservation

ADMITTED = "admitted"  # the key of the request's state that holds what admission decided (`Admitted`)
MODEL_HEADER = "x-folio-model"  # the request header naming the model to serve it (app/serving/models.py)
ADMITTED_PATHS = frozenset({"/generate", "/generate_stream", "/", "/v1/completions", "/v1/chat/completions",
                            "/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize",
                            "/inspect"})
# OpenAI's `model` field: the body says which model serves it
BODY_NAMES_MODEL = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                              "/v1/messages/count_tokens"})


@dataclass
class Admitted:
    """What admission did for a request: the slot it reserved, if it knew the model's engine before the body."""

    reservation: Reservation | None = None

    def slot_in(self, engine: Engine) -> Reservation:
        """The request's slot in `engine`, the engine of the model that serves it: the one reserved here, or (where
        admission could not know that engine, or reserved in another: a body naming another model, a reload
        meanwhile) one reserved now, 429 if it is full."""
        if self.reservation is not None and self.reservation.owner is not engine:
            self.reservation.release()
            self.reservation = None
        if self.reservation is None:
            self.reservation = engine.reserve()
        return self.reservation


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
        lifecycle = app.state.models.lifecycle
        try:
            lifecycle.check_ready()
            engine = admitting_engine(app.state.models, scope)
            if engine is not None:
                engine.check_capacity()
        except (Unavailable, Overloaded) as e:
            await self._refuse(scope, receive, send, e, app.state.settings.retry_after)
            return
        admitted = Admitted()
        lifecycle.in_flight += 1
        try:
            body = await read_body(receive)
            if body is None:  # the client went away (or its body timed out) before the whole body arrived
                await client_gone_response()(scope, receive, send)
                return
            if engine is not None:
                try:
                    admitted.reservation = engine.reserve()
                except Overloaded as e:  # the server filled up while the body arrived
                    await self._refuse(scope, receive, send, e, app.state.settings.retry_after)
                    return
            scope.setdefault("state", {})[ADMITTED] = admitted  # for `app.serving.deps.request_service`
            await self.app(scope, replay(body, receive), send)
        finally:
            lifecycle.in_flight -= 1
            if admitted.reservation is not None:
                admitted.reservation.release()  # a no-op once the request was submitted


def admitting_engine(models: Any, scope: Scope) -> Engine | None:
    """The engine a request's slot is held in (app/serving/models.py): that of the model its `X-Folio-Model` header
    names (else the default model's) if loaded. None where that is not known yet, or not loaded: the route's
    dependency holds the slot once it has the model's engine, before tokenising (`Admitted.slot_in`). An OpenAI
    request is such a request when other models are served, whatever its header says, since its body's `model` may
    name another: a full model must not refuse requests to the others, and a slot is reserved once."""
    if scope["path"] in BODY_NAMES_MODEL and len(models.registry.names) > 1:
        return None
    name = dict(scope.get("headers") or []).get(MODEL_HEADER.encode(), b"").decode("latin-1") or None
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
