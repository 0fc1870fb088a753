"""What a request body may cost. Its size (`--max-body-bytes`): a body over it is refused with 413 before the app
reads it whole, by its Content-Length or, without one (chunked), as it streams in. The time it may take to arrive
is the connection's (app/http/connection.py). The work of reading
it: a JSON body beyond a few KB is parsed and validated
in a worker thread (`ThreadedBodyRoute`), not on the event loop, and the request models bound that work by its shape
(app/api/protocol.py, `StrictModel`): a 2 MB body of 150,000 unknown fields held the event loop for 2-3 s, and /health
waited as long."""

from __future__ import annotations

import email.message
import json
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http.errors import error_body
from app.http.responses import StrictJSONResponse


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


# bodies up to this size are parsed on the event loop by FastAPI (well under a millisecond, less than the hand-off to
# a worker thread and back costs: the common request), larger ones in a worker thread
INLINE_PARSE_BYTES = 16 * 1024


class ThreadedBodyRoute(APIRoute):
    """A route whose JSON body, if larger than INLINE_PARSE_BYTES, is parsed and validated into its request model
    in a worker thread, one body at a time; FastAPI then takes the model as it is (it validates a model instance in
    microseconds) and answers errors as its own: a body that is not JSON is a `RequestValidationError`
    (`json_invalid`) or a 400 caused by the parser's error (app/http/errors.py makes both 422), a body that does not fit
    the model the model's errors at `body...`. Bodies of another content type are left to FastAPI, which parses
    nothing for them."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        field = self.body_field
        if field is None or self._embed_body_fields:  # no body, or several parts of it (none of Folio's routes)
            return handler

        async def threaded(request: Request) -> Response:
            body = await request.body()  # kept by the request for FastAPI's handler
            if len(body) > INLINE_PARSE_BYTES and _is_json(request.headers.get("content-type")):
                # Starlette's cache of the parsed body, which FastAPI's handler reads (`Request.json`)
                request._json = await anyio.to_thread.run_sync(_parse_and_validate, field, body, limiter=_parsing())
            return await handler(request)

        return threaded


_PARSER: list[anyio.CapacityLimiter] = []


def _parsing() -> anyio.CapacityLimiter:
    """One body parsed at a time: each parse holds the GIL for most of its time, and several at once took turns
    with the event loop for it (four 2 MB bodies at once held /health for ~0.2 s, one at a time ~0.05 s)."""
    if not _PARSER:
        _PARSER.append(anyio.CapacityLimiter(1))
    return _PARSER[0]


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI would parse a body of this content type as JSON (application/json, application/*+json)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _parse_and_validate(field: Any, body: bytes) -> Any:
    """`body` parsed and validated into the route's request model (a worker thread's work); the errors FastAPI
    would raise for it on the event loop otherwise."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}]) from e
    except (ValueError, RecursionError) as e:  # not UTF-8, an integer over 4300 digits, nesting too deep
        raise HTTPException(400, "There was an error parsing the body") from e
    value, errors = field.validate(data, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors)
    return value
