"""The overload fast path: while the engine is at capacity, a generation request gets its 429 before its body is
read, parsed, validated or tokenised.

That work is most of what a refusal costs, and under a burst it is paid on the event loop while the admitted
requests generate. `Engine.submit` checks capacity again when the request is submitted, and that check is the
one that holds; this one only saves the work. A request refused here therefore gets 429 even if it is malformed
or unauthenticated: while the server is full, nothing about the request is looked at.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from app.engine import Overloaded
from app.errors import error_response

GENERATION_PATHS = frozenset({"/generate", "/generate_stream", "/", "/v1/completions"})


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, get_app: Callable[[], Any]) -> None:
        self.app = app
        self.get_app = get_app  # the FastAPI app, for its state: the service and the settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
            app = self.get_app()
            service = app.state.service
            if service is not None and service.ready and not service.draining:
                try:
                    service.engine.check_capacity()
                except Overloaded as e:
                    # the request metrics label by route template; these routes have no path parameters
                    scope["route"] = SimpleNamespace(path=scope["path"])
                    response = error_response(Request(scope), e, app.state.settings.retry_after)
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)

