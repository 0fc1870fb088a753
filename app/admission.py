"""The overload fast path: a generation request either gets a slot in the engine before its body is read, parsed,
validated or tokenised, or it gets its 429 at once.

The slot is held (`Engine.reserve`) from here until the route submits the request (`current_reservation`, read
by `GenerationService.submit`) or the response ends, whichever is first. Holding it matters under a burst:
a check that only looked at the engine would let every request of the burst through, since none of them has
been submitted yet, and each would be parsed and tokenised on the event loop before being refused. A request
refused here gets 429 even if it is malformed or unauthenticated: while the server is full, nothing about the
request is looked at.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from types import SimpleNamespace
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import error_response
from model.engine import Overloaded, Reservation

# the slot held for the request being handled (in the route's task: FastAPI runs async routes and streams in it)
current_reservation: ContextVar[Reservation | None] = ContextVar("folio_reservation", default=None)

GENERATION_PATHS = frozenset({"/generate", "/generate_stream", "/", "/v1/completions"})


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, get_app: Callable[[], Any]) -> None:
        self.app = app
        self.get_app = get_app  # the FastAPI app, for its state: the service and the settings
        # the 429 for each (route, message), rendered once by the error table: a burst sends the same bytes
        self._refusals: dict[tuple[str, str, int], tuple[int, list[tuple[bytes, bytes]], bytes]] = {}

    async def _refuse(self, scope: Scope, send: Send, e: Overloaded, retry_after: int) -> None:
        key = (scope["path"], str(e), retry_after)
        if key not in self._refusals:
            response = error_response(Request(scope), e, retry_after)
            self._refusals[key] = (response.status_code, response.raw_headers, bytes(response.body))
        status, headers, body = self._refusals[key]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
            app = self.get_app()
            service = app.state.service
            if service is not None and service.ready and not service.draining:
                try:
                    reservation = service.engine.reserve()
                except Overloaded as e:
                    # the request metrics label by route template; these routes have no path parameters
                    scope["route"] = SimpleNamespace(path=scope["path"])
                    await self._refuse(scope, send, e, app.state.settings.retry_after)
                    return
                token = current_reservation.set(reservation)
                try:
                    await self.app(scope, receive, send)
                finally:
                    current_reservation.reset(token)
                    reservation.release()  # a no-op once the request was submitted
                return
        await self.app(scope, receive, send)

