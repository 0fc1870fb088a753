"""The request body's size limit (`--max-body-bytes`): a body over it is refused with 413 before the app reads
it whole, by its Content-Length or, without one (chunked), as it streams in. The time a body may take is the
HTTP layer's (app/protocol.py)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import error_body
from app.responses import StrictJSONResponse


class BodyLimitMiddleware:
    """Refuses request bodies over `max_bytes` with 413, by Content-Length or as the body streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _too_large(scope, receive, send, self.max_bytes, int(length))
            return
        seen = 0
        too_large = False

        async def limited_receive() -> Message:
            nonlocal seen, too_large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    too_large = True
                    raise _BodyTooLarge
            return message

        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if too_large and not started:
                return  # the app's answer to a body it could not read (FastAPI sends 400): the 413 replaces it
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, send_wrapper)
        except _BodyTooLarge:
            pass
        except Exception:
            if not (too_large and not started):
                raise
        if too_large and not started:
            await _too_large(scope, receive, send, self.max_bytes, seen)


class _BodyTooLarge(Exception):
    pass


async def _too_large(scope: Scope, receive: Receive, send: Send, limit: int, got: int) -> None:
    msg = f"request body is {got} bytes, more than the limit of {limit} bytes"
    body = error_body(scope.get("path", ""), 413, "payload_too_large", "invalid_request_error", msg, None)
    await StrictJSONResponse(body, status_code=413)(scope, receive, send)
