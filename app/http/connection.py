"""The HTTP/1.1 connection below the app: uvicorn's httptools protocol with the bounds it lacks.

uvicorn 0.54 with httptools 0.9 (llhttp) bounds nothing about a request before the app sees it: a connection that
sends nothing, or a header byte now and then, stays open for ever (uvicorn's only timer is the keep-alive one, armed
after a response); httptools gathers a header value or a URL of any length and any number of headers; and nothing
bounds the time a body may take. `FolioHttpProtocol` adds, for every request on a connection:

- its head (request line and headers) must arrive within `header_timeout` seconds of the connection opening, or of
  the request's first byte on a kept-alive connection: else 408 if part of it came, and the connection is closed;
- its head may hold at most `max_header_bytes` bytes and `MAX_HEADERS` headers: else 431, and the connection is
  closed;
- its body must arrive within `body_timeout` seconds of its head: else 408 if no response has started (else the
  connection is just closed), and the app sees the client as gone.

The number of open connections is bounded as uvicorn's `limit_concurrency` bounds it (`--max-connections`: a request
on a connection beyond it, or beyond as many requests running, gets 503 and the connection is closed), but the 503
is the API's JSON error, with `Retry-After`, not uvicorn's plain-text "Service Unavailable" (`_too_many`). A request
httptools cannot parse (a malformed request line, header or chunk) gets 400 in the same JSON shape, not uvicorn's
plain text "Invalid HTTP request received.", and the connection is closed.

Each of these counts in `folio_connections_closed_total{reason}`. At shutdown, a connection whose request is still
arriving is closed at once rather than waited for (see `shutdown`). The idle time between kept-alive requests stays
uvicorn's `timeout_keep_alive`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from app.http.errors import error_body
from app.settings import Settings

MAX_HEADERS = 100  # as Python's http.client and http.server

HEADER_TIMEOUT, BODY_TIMEOUT, HEAD_TOO_LARGE = "header_timeout", "body_timeout", "head_too_large"
MALFORMED = "malformed"
TOO_MANY_CONNECTIONS = "too_many_connections"


class FolioHttpProtocol(HttpToolsProtocol):
    """Made per connection by uvicorn; configured by subclassing (`protocol_class`)."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_header_bytes: int = 16 * 1024
    retry_after: int = 1
    on_closed: Callable[[str], None] = staticmethod(lambda reason: None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the connection limit is checked here (`on_headers_complete`), not by uvicorn, to answer it in JSON
        self.max_connections, self.limit_concurrency = self.limit_concurrency, None
        self._deadline: asyncio.TimerHandle | None = None
        self._in_head = True  # between a request's first byte (or the connection's start) and its last header
        self._head_bytes = 0
        self._headers = 0
        self._too_many_headers = False

    # -- deadlines --------------------------------------------------------------------------------------------
    def _arm(self, seconds: float, reason: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, reason)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, reason: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        self.on_closed(reason)
        if reason == HEADER_TIMEOUT:
            if self._head_bytes:
                self._answer(408, f"the request's headers did not arrive within {self.header_timeout:g} s")
            else:
                self.transport.close()  # a connection that never sent a byte gets no answer
            return
        if self.cycle is None:
            self.transport.close()
            return
        self._abandon(408, f"the request body did not arrive within {self.body_timeout:g} s of its headers")

    def _abandon(self, status: int, message: str) -> None:
        """End the request whose body is arriving: the app's pending `receive` returns http.disconnect, and whatever
        it sends later goes nowhere; the client gets `status` in its route's error shape, unless its response has
        begun, and the connection is closed."""
        cycle = self.cycle
        assert cycle is not None
        cycle.disconnected = True
        cycle.message_event.set()
        if cycle.response_started:
            self.transport.close()
        else:
            self._answer(status, message, self.scope.get("path", ""))

    def _answer(self, status: int, message: str, path: str = "") -> None:
        """Write a whole error response (the API family's body shape) and close the connection."""
        kind = {400: "bad_request", 408: "timeout", 431: "headers_too_large"}[status]
        body = json.dumps(error_body(path, status, kind, "invalid_request_error", message, None)).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                 b"\r\nconnection: close\r\n\r\n", body]
        self.transport.write(b"".join(head))
        self.transport.close()

    # -- the connection ---------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout, HEADER_TIMEOUT)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            room = self.max_header_bytes - self._head_bytes
            if len(data) > room:
                # feed what fits; the rest is more head (too large) or already the body
                self.data_received(data[:room])
                if not self.transport.is_closing():
                    if self._in_head:
                        self._too_large(f"the request line and headers are over {self.max_header_bytes} bytes")
                    else:
                        self.data_received(data[room:])
                return
            self._head_bytes += len(data)
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what httptools cannot parse, which includes a parse `on_header` stopped. The path is
        the request's where its head was parsed (a malformed chunk of its body), so the body has its API's shape."""
        if self._too_many_headers:
            self._too_large(f"the request has more than {MAX_HEADERS} headers")
            return
        self._disarm()
        self.on_closed(MALFORMED)
        message = "malformed HTTP/1.1 request: its request line, headers or chunked body could not be parsed"
        if self._in_head or self.cycle is None:
            self._answer(400, message)
        else:
            self._abandon(400, message)

    def _too_large(self, message: str) -> None:
        self._disarm()
        self.on_closed(HEAD_TOO_LARGE)
        self._answer(431, message)

    def shutdown(self) -> None:
        """Called by uvicorn at shutdown: beside closing idle connections (uvicorn's), close one whose request
        is still arriving: it cannot be served any more, and waiting for it would hold the exit for up to
        `body_timeout`. A request whose body has arrived is let finish."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and cycle.more_body and not cycle.response_started:
            self.transport.close()
            return
        super().shutdown()

    # -- parser callbacks -------------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # a kept-alive connection's next request: its head's deadline starts now
            self._arm(self.header_timeout, HEADER_TIMEOUT)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers += 1
        if self._headers > MAX_HEADERS:
            # an exception in a callback stops httptools' parse; uvicorn then calls send_400_response
            self._too_many_headers = True
            raise ValueError("too many headers")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.body_timeout, BODY_TIMEOUT)  # disarmed by on_message_complete, at once if there is no body
        limit = self.max_connections
        if limit is None or (len(self.connections) < limit and len(self.tasks) < limit):
            super().on_headers_complete()
            return
        # uvicorn's test, which then answers with its plain-text 503: this request goes to `_too_many` instead
        self.on_closed(TOO_MANY_CONNECTIONS)
        app, self.app = self.app, self._too_many
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    async def _too_many(self, scope: Any, receive: Any, send: Any) -> None:
        """The answer to a request beyond `--max-connections`: 503 in the body shape of its API family, with
        Retry-After, and the connection closed."""
        message = (f"the server has {len(self.connections)} connections open, at its limit of "
                   f"{self.max_connections} (--max-connections); try again")
        self.logger.warning(message)  # as uvicorn's own refusal is logged
        body = json.dumps(error_body(scope["path"], 503, "unavailable", "server_error", message, None)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"retry-after", str(self.retry_after).encode()), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head, self._head_bytes, self._headers = True, 0, 0
        super().on_message_complete()


def protocol_class(settings: Settings, on_closed: Callable[[str], None]) -> type[FolioHttpProtocol]:
    """`FolioHttpProtocol` with the server's limits, for `uvicorn.Config(http=...)`; `on_closed(reason)` is called
    for each connection answered and closed by a limit."""
    return type("FolioHttpProtocol", (FolioHttpProtocol,), {
        "header_timeout": settings.header_timeout, "body_timeout": settings.body_timeout,
        "max_header_bytes": settings.max_header_bytes, "retry_after": settings.retry_after,
        "on_closed": staticmethod(on_closed),
    })
