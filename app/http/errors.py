"""Domain errors to HTTP: one table, one body shape per API family.

TGI routes answer `{"error": message, "error_type": kind}`; OpenAI routes (`/v1/*`) answer
`{"error": {"message", "type", "param", "code"}}` (`code` OpenAI's string where it has one for the error, such as
`context_length_exceeded` or `model_not_found`, else null); Anthropic's Messages routes (`/v1/messages*`) answer
`{"type": "error", "error": {"type", "message"}}`, the type from the status as Anthropic names it. An invalid
request is TGI's 422 on TGI's routes and 400 on /v1/, as OpenAI, Anthropic and vLLM answer it. All carry
the request's ID as `request_id` (app/http/requestlog.py; null for an answer of the HTTP layer,
app/http/connection.py, to a request that never reached the app).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import annotated_types as at
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.http.requestlog import HEADER, current_request_id
from app.http.responses import StrictJSONResponse
from model.engine import EngineError, EngineStopped, GenerationError, Overloaded
from model.inspection import InspectError, InspectTooLarge
from model.registry import ModelFailed, ModelLoading, ModelNotFound
from model.sampling_params import ContextTooLong, ValidationError, preview
from model.tokenizer import TokenizerError


class Unavailable(Exception):
    """The model is not loaded yet, or the server is draining."""


class Unauthorized(Exception):
    """Missing or wrong API key."""


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its generation was cancelled (answered 499, a status
    nobody reads: nginx's 'client closed request', for the logs and metrics)."""


T = TypeVar("T")

# exception type -> (HTTP status, TGI error_type, OpenAI error type); an invalid request's 422 is 400 on /v1/
# (`family_status`)
ERROR_TABLE: dict[type[Exception], tuple[int, str, str]] = {
    ValidationError: (422, "validation", "invalid_request_error"),
    InspectTooLarge: (413, "payload_too_large", "invalid_request_error"),  # before its base class, InspectError
    InspectError: (422, "validation", "invalid_request_error"),
    TokenizerError: (422, "validation", "invalid_request_error"),
    Overloaded: (429, "overloaded", "rate_limit_error"),
    GenerationError: (424, "generation", "server_error"),
    EngineStopped: (503, "unavailable", "server_error"),
    Unavailable: (503, "unavailable", "server_error"),
    Unauthorized: (401, "authentication", "authentication_error"),
    ModelNotFound: (404, "not_found", "invalid_request_error"),
    ModelLoading: (503, "unavailable", "server_error"),
    ModelFailed: (503, "unavailable", "server_error"),
}


# exception type -> OpenAI's error code, the string clients test (LangChain and LiteLLM spot a prompt over the
# context by `context_length_exceeded`); null for the others, as OpenAI's own invalid requests mostly are
OPENAI_CODES: dict[type[Exception], str] = {
    ContextTooLong: "context_length_exceeded",
    ModelNotFound: "model_not_found",
    Unauthorized: "invalid_api_key",
    Overloaded: "rate_limit_exceeded",
}


def _by_type(table: dict[type[Exception], T], exc: Exception | type[Exception]) -> T | None:
    """The entry of the first of `table`'s exception types that `exc` (an exception, or an exception type) is."""
    cls = exc if isinstance(exc, type) else type(exc)
    return next((v for k, v in table.items() if issubclass(cls, k)), None)


def error_kind(exc: Exception | type[Exception]) -> tuple[int, str, str] | None:
    """(HTTP status, TGI error_type, OpenAI error type) of a domain error; None for any other exception."""
    return _by_type(ERROR_TABLE, exc)


def openai_code(exc: Exception | type[Exception]) -> str | None:
    """OpenAI's `code` for an error (OPENAI_CODES); None (null) for the others."""
    return _by_type(OPENAI_CODES, exc)


# HTTP status -> Anthropic's error type (its API's errors page); any other status is an api_error
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                   413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
                   503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_OVERLOADED = 529  # Anthropic's status for a server too busy for anyone (its 429 is an account's rate limit)
ANTHROPIC_PATHS = "/v1/messages"  # the prefix of Anthropic's routes


def family_status(path: str, status: int) -> int:
    """`status` as the API family of `path` says it: an invalid request is 400 on /v1/ (OpenAI's, Anthropic's and
    vLLM's, whose SDKs raise BadRequestError for it), TGI's 422 elsewhere; a full server (429) is 529 on Anthropic's
    routes, which its SDK raises as OverloadedError (a 429 there is RateLimitError: an account over its limits)."""
    if status == 422 and path.startswith("/v1/"):
        return 400
    if status == 429 and path.startswith(ANTHROPIC_PATHS):
        return ANTHROPIC_OVERLOADED
    return status


def error_body(path: str, status: int, kind: str, oa_type: str, message: str, param: str | None,
               code: str | None = None) -> dict[str, Any]:
    """The error body of the API family `path` belongs to (Anthropic's under /v1/messages, OpenAI's under the
    rest of /v1/, with `code`, TGI's elsewhere)."""
    if path.startswith(ANTHROPIC_PATHS):
        error = {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}
        return {"type": "error", "error": error, "request_id": current_request_id()}
    if path.startswith("/v1/"):
        error = {"message": message, "type": oa_type, "param": param, "code": code}
        return {"error": error, "request_id": current_request_id()}
    return {"error": message, "error_type": kind, "request_id": current_request_id()}


def exception_body(path: str, exc: Exception) -> tuple[int, dict[str, Any]]:
    """(status, body) for a domain error: a response's, or the last event of a stream that failed."""
    found = error_kind(exc)
    if found is None:
        raise exc
    status, kind, oa_type = found
    status = family_status(path, status)
    return status, error_body(path, status, kind, oa_type, str(exc), getattr(exc, "field", None), openai_code(exc))


def error_response(request: Request, exc: Exception, retry_after: int = 1) -> StrictJSONResponse:
    status, body = exception_body(request.url.path, exc)
    retry_after = getattr(exc, "retry_after", retry_after)  # a model still loading says how long it may take
    headers = {"Retry-After": str(retry_after)} if status in (429, 503, ANTHROPIC_OVERLOADED) else None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return StrictJSONResponse(body, status_code=status, headers=headers)


def client_gone_response() -> Response:
    """The answer to a client that went away (`ClientGone`, or a body cut short before admission): 499."""
    return Response(status_code=499)


def allowed_ranges(models: Iterable[tuple[Iterable[str], str, type[BaseModel]]]) -> dict[tuple[str, str], str]:
    """(route, 'parameters.temperature') -> '[0, 100]', from the Field constraints of request models, each given
    with the routes that take it and the prefix of its fields' names in an error's location (`(("/generate", ...),
    "parameters.", GenerateParameters)`): two APIs may bound a field of one name differently (`max_tokens`)."""
    out: dict[tuple[str, str], str] = {}
    for paths, prefix, model in models:
        for name, f in model.model_fields.items():
            lo = hi = None
            lo_b, hi_b = "[", "]"
            for m in f.metadata:
                if isinstance(m, at.Ge):
                    lo = m.ge
                elif isinstance(m, at.Gt):
                    lo, lo_b = m.gt, "("
                elif isinstance(m, at.Le):
                    hi = m.le
                elif isinstance(m, at.Lt):
                    hi, hi_b = m.lt, ")"
            if lo is not None or hi is not None:
                for path in paths:
                    out[path, prefix + name] = f"{lo_b}{'-inf' if lo is None else lo}, " \
                                               f"{'inf' if hi is None else hi}{hi_b}"
    return out


MAX_ERRORS_SHOWN = 3  # of a request's validation errors (a list of a million wrong items has a million)
MAX_NAME_CHARS = 40  # of a field name echoed back (an unknown key can be any string)


def _name(part: object) -> str:
    """One part of a field's location, as echoed back: short, and valid Unicode (a lone surrogate escaped)."""
    name = str(part)
    if len(name) > MAX_NAME_CHARS:
        name = name[: MAX_NAME_CHARS - 3] + "..."
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _describe(err: dict[str, Any], ranges: dict[str, str]) -> tuple[str, str]:
    """(the field, the message) of one validation error; `ranges`: the route's fields' ranges, by field."""
    loc = [_name(p) for p in err.get("loc", ()) if p != "body"]
    field = ".".join(loc) or "body"
    msg = err.get("msg", "invalid value")
    ctx = err.get("ctx") or {}
    if err.get("type") == "json_invalid":
        return "body", f"body is not valid JSON: {ctx.get('error', msg)}"
    if err.get("type") == "extra_forbidden":
        return field, f"{field}: unknown field"
    if err.get("type") == "too_many_fields":  # the message counts them; a preview would sort them all
        return field, f"{field}: {msg}"
    shown = preview(err.get("input"))
    allowed = ranges.get(field)
    where = f" (allowed: {allowed})" if allowed and err.get("type", "").endswith(("than", "than_equal")) else ""
    return field, f"{field}: {msg}{where}, got {shown}"


def _unparseable(cause: BaseException) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return f"it is not UTF-8 (byte 0x{cause.object[cause.start]:02x} at offset {cause.start})"
    if isinstance(cause, RecursionError):
        return "it nests arrays or objects too deeply"
    return str(cause).split(";")[0]  # e.g. "Exceeds the limit (4300 digits) for integer string conversion: ..."


def install_error_handlers(app: FastAPI, ranged: Iterable[tuple[Iterable[str], str, type[BaseModel]]]) -> None:
    """One handler per kind of error. A validation error of a field of the request models `ranged` (with their
    routes and fields' prefixes, as `allowed_ranges` takes them) names the range the field allows."""
    ranges = allowed_ranges(ranged)
    retry_after = lambda request: request.app.state.settings.retry_after  # noqa: E731

    async def domain(request: Request, exc: Exception) -> StrictJSONResponse:
        return error_response(request, exc, retry_after(request))

    for cls in (ValidationError, InspectError, TokenizerError, EngineError, Unavailable, Unauthorized, ModelNotFound,
                ModelLoading, ModelFailed):
        app.add_exception_handler(cls, domain)

    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return client_gone_response()

    app.add_exception_handler(ClientGone, client_gone)

    async def validation(request: Request, exc: RequestValidationError) -> StrictJSONResponse:
        errors = exc.errors()
        path = request.url.path
        mine = {field: allowed for (route, field), allowed in ranges.items() if route == path}
        described = [_describe(e, mine) for e in errors[:MAX_ERRORS_SHOWN]]
        message = "; ".join(m for _, m in described)
        kind = request.headers.get("content-type", "")
        if isinstance(errors[0].get("input") if errors else None, bytes) and "json" not in kind.lower():
            # FastAPI reads a body as JSON only when its Content-Type says so: say that, not what the bytes are not
            message = f"body: send it as JSON, with Content-Type: application/json (got {preview(kind or None)})"
        if len(errors) > MAX_ERRORS_SHOWN:
            message += f"; and {len(errors) - MAX_ERRORS_SHOWN} more error(s)"
        param = described[0][0] if described else None
        status = family_status(path, 422)
        body = error_body(path, status, "validation", "invalid_request_error", message, param)
        return StrictJSONResponse(body, status_code=status)

    app.add_exception_handler(RequestValidationError, validation)

    async def http_error(request: Request, exc: StarletteHTTPException) -> StrictJSONResponse:
        if exc.status_code == 400 and isinstance(exc.__cause__, (ValueError, RecursionError)):
            # FastAPI answers 400 "There was an error parsing the body" when json.loads fails other than with a
            # JSONDecodeError: bytes that are not UTF-8, an integer over Python's 4300-digit limit, nesting
            # deeper than the recursion limit. That is malformed JSON like any other: 422 (400 on /v1/), saying why.
            message = f"body is not valid JSON: {_unparseable(exc.__cause__)}"
            status = family_status(request.url.path, 422)
            return StrictJSONResponse(error_body(request.url.path, status, "validation", "invalid_request_error",
                                                 message, "body"), status_code=status)
        kind = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(exc.status_code, "http")
        body = error_body(request.url.path, exc.status_code, kind, "invalid_request_error", str(exc.detail), None)
        return StrictJSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    app.add_exception_handler(StarletteHTTPException, http_error)

    async def internal(request: Request, exc: Exception) -> StrictJSONResponse:
        """An error nothing expected (a bug): 500, and the ID under which the log shows its traceback. With
        `Connection: close`: the server closes the connection after it (Starlette re-raises the error for the
        server to log, and uvicorn then drops the connection), so a keep-alive client must not send its next
        request on it."""
        request_id = current_request_id()
        message = f"internal server error; the server's log has its traceback under request_id {request_id}"
        body = error_body(request.url.path, 500, "internal", "server_error", message, None)
        headers = {"connection": "close", **({HEADER: request_id} if request_id else {})}
        return StrictJSONResponse(body, status_code=500, headers=headers)

    app.add_exception_handler(Exception, internal)
