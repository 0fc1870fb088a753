"""Request IDs, the access log, and the log format.

Every HTTP request gets an ID: the client's `X-Request-Id` when it is sane (1 to 128 characters out of letters,
digits and `._~:+/=-`: UUIDs, nginx's `$request_id`, tracing IDs), else a new one (32 hex digits, as nginx makes).
The ID comes back in the `X-Request-Id` response header (and `request-id`, Anthropic's name for it, which the
anthropic SDK reads), and in the `request_id` field of JSON error bodies
(app/http/errors.py), and is on every log line written while the request is handled: `RequestIdFilter` reads it from
the request's context, so a log call needs no argument for it (the engine thread's lines about a request are
written in the context of its submitter, `Request.caller` in model/engine/request.py).

When the response has ended, one access-log line (logger `folio.access`): method, route (the route's template,
never the path the client sent, nor its query string), status, tokens in (the prompt the model saw) and out, time
to first token and total time from the request's arrival, how the generation ended, and the client's address.
Never a body (the prompt) or a header (the API key). Probes and scrapes (`/health*`, `/metrics`) that succeed are
logged at debug level: a kubelet and a Prometheus call every few seconds.

`--log-format json` (FOLIO_LOG_FORMAT): every line, the server's, uvicorn's and Python warnings alike, is one JSON
object with `time`, `level`, `logger`, `message`, `request_id` when there is one, and an access line's fields.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from model.engine import TokenEvent, end_of

HEADER = "X-Request-Id"
SAFE_ID = re.compile(r"[A-Za-z0-9._~:+/=-]{1,128}")
RECORD = "record"  # the key of the request's state that holds its `RequestRecord`
QUIET_ROUTES = frozenset({"/health", "/health/startup", "/health/ready", "/health/live", "/metrics"})
PLAIN_VALUE = re.compile(r"[A-Za-z0-9._~:+/\[\]-]+")  # a text log's value written unquoted (IPv6 too)
TRACE = 5  # uvicorn's trace level: each ASGI message (bodies and headers as placeholders)
access_log = logging.getLogger("folio.access")


@dataclass
class RequestRecord:
    """What one request did, filled in as it runs (the generation routes record their tokens, app/serving/service.py,
    finding it in the request's state: `request_record`, `app.serving.deps.RecordDep`)."""

    id: str
    method: str
    client: str | None = None
    start: float = field(default_factory=time.perf_counter)
    route: str = "unmatched"
    status: int = 0  # 0 until the response starts
    prompt_tokens: int | None = None  # set when the request is submitted to the engine
    generated_tokens: int = 0
    first_token_at: float | None = None  # perf_counter time the engine made the first token
    finish_reason: str | None = None  # the engine's (length, eos_token, stop_sequence), or "error"
    end: float | None = None

    def saw(self, events: Iterable[object]) -> None:
        """Account for a batch of the engine's events for this request."""
        for ev in events:
            if isinstance(ev, TokenEvent):
                self.generated_tokens += 1
                if self.first_token_at is None:
                    self.first_token_at = ev.created
            if end := end_of(ev):
                self.finish_reason = end.finish_reason

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else max(0.0, self.first_token_at - self.start)

    @property
    def total(self) -> float:
        return (self.end if self.end is not None else time.perf_counter()) - self.start

    @property
    def outcome(self) -> str | None:
        """How its generation ended: the finish reason, "error", or "cancelled" (the client went away, or the
        server stopped it); None for a request that generated nothing."""
        if self.prompt_tokens is None:
            return None
        return self.finish_reason or "cancelled"

    def access_fields(self) -> dict[str, Any]:
        ttft = self.ttft
        return {"method": self.method, "route": self.route, "status": self.status, "tokens_in": self.prompt_tokens,
                "tokens_out": self.generated_tokens if self.prompt_tokens is not None else None,
                "ttft_ms": None if ttft is None else round(ttft * 1000, 1), "total_ms": round(self.total * 1000, 1),
                "finish": self.outcome, "client": self.client}


# the request being handled; deliberately left set when it ends (each request runs in a task of its own), so that
# the 500 answer to an unexpected error and uvicorn's log of it, both written outside the middleware, carry the ID
current_request: ContextVar[RequestRecord | None] = ContextVar("folio_request", default=None)


def request_record(request: Request) -> RequestRecord | None:
    """The request's record (None for a request that did not come through `RequestLogMiddleware`)."""
    return getattr(request.state, RECORD, None)


def current_request_id() -> str | None:
    record = current_request.get()
    return None if record is None else record.id


def request_id(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id if it is sane, else a new ID."""
    for name, value in headers:
        if name == b"x-request-id":
            sent = value.decode("latin-1")
            if SAFE_ID.fullmatch(sent):
                return sent
            break
    return secrets.token_hex(16)


class RequestLogMiddleware:
    """Outermost: gives each HTTP request its record and ID, adds the response header, writes the access line and
    hands the finished record to `on_end` (the vLLM-named metrics, app/http/vllm_metrics.py)."""

    def __init__(self, app: ASGIApp, on_end: Callable[[RequestRecord], None] | None = None) -> None:
        self.app = app
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        record = RequestRecord(request_id(scope.get("headers") or ()), scope["method"],
                               client=client[0] if client else None)
        current_request.set(record)
        scope.setdefault("state", {})[RECORD] = record  # the routes find it in the request's state
        # the anthropic SDK reads Anthropic's `request-id` (its `_request_id`, an error's `request_id`)
        headers = [(b"x-request-id", record.id.encode()), (b"request-id", record.id.encode())]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), *headers]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            record.end = time.perf_counter()
            record.status = record.status or 500  # no response yet: the error handler outside answers 500
            record.route = getattr(scope.get("route"), "path", None) or "unmatched"
            level = logging.DEBUG if record.route in QUIET_ROUTES and record.status < 500 else logging.INFO
            if access_log.isEnabledFor(level):
                access_log.log(level, "%s %s %d", record.method, record.route, record.status,
                               extra={"access": record.access_fields()})
            if self.on_end is not None:
                self.on_end(record)


# -- the log format -------------------------------------------------------------------------------------------


class RequestIdFilter(logging.Filter):
    """Puts the ID of the request being handled (if any) on every record as `request_id`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request_id()
        return True


class TextFormatter(logging.Formatter):
    """`<time> <LEVEL> <logger>: <message> key=value ...`: an access line's fields (those it has), then the
    request ID of a line about a request; a value that is not one plain word is quoted (`_plain`)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        pairs = {k: v for k, v in getattr(record, "access", {}).items() if v is not None and k not in
                 ("method", "route", "status")}  # those three are the message
        if getattr(record, "request_id", None):
            pairs["request_id"] = record.request_id
        return " ".join([super().formatMessage(record), *(f"{k}={_plain(v)}" for k, v in pairs.items())])


def _plain(value: object) -> str:
    """A text line's value as it is when it is one plain word (numbers, addresses, IDs), else quoted as a JSON
    string: a value with a space or an `=` (a forwarded client address is whatever a proxy passed on) must not
    read as more fields."""
    text = str(value)
    return text if PLAIN_VALUE.fullmatch(text) else json.dumps(text)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, request_id, an access line's
    fields, and a traceback as `exception`."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        if getattr(record, "request_id", None):
            out["request_id"] = record.request_id
        out.update(getattr(record, "access", {}))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str) -> None:
    """Every logger (Folio's, uvicorn's, the engine's) and Python's warnings to stderr through one handler, in
    `log_format` ("text" or "json"), at `level` (a level name: info, debug, trace, ...)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    logging.addLevelName(TRACE, "TRACE")  # uvicorn's level below debug (it adds the name only once it runs)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(TRACE if level.lower() == "trace" else level.upper())
    logging.captureWarnings(True)  # a warning printed as it is would be a line that is not JSON
