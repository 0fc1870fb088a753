"""The API key (`--api-key`): which routes need it, and the check, made once per request before anything else.

`ApiKeyMiddleware` answers a request to a protected route without the key (`Authorization: Bearer <key>`) with
401 before its body is read, before admission holds a slot for it, and before the model it names is looked up or
loaded (app/serving/models.py): a client without the key can make the server do nothing but this comparison. The
routes left open (health, probes, /metrics, /info, /v1/models and /v1/models/{id}, /inspect/limits, a model's training
view, the playground's pages) describe the server and load no model (app/serving/models.py,
`ServedModels.if_loaded`).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from app.http.errors import Unauthorized, error_response

# (method, path) of every route behind the key; none has path parameters
PROTECTED = frozenset({
    ("POST", "/generate"), ("POST", "/generate_stream"), ("POST", "/"), ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
    ("POST", "/inspect"), ("POST", "/admin/reload"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/responses"), ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
})
PROTECTED_DOC = ", ".join(f"{m} {p}" for m, p in sorted(PROTECTED, key=lambda r: (r[1], r[0])))


def check_api_key(key: str | None, authorization: str, x_api_key: str = "") -> None:
    """Raise `Unauthorized` unless `authorization` (the header's value) is `Bearer <key>` or `x_api_key` (the
    `x-api-key` header Anthropic's clients send) is the key; nothing if `key` is None (no key set). Compared in
    constant time; whitespace around the token is ignored."""
    if key is None:
        return
    scheme, _, token = authorization.partition(" ")
    bearer = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
    if not bearer and not hmac.compare_digest(x_api_key.strip().encode(), key.encode()):
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')")


class ApiKeyMiddleware:
    """401 for a request to a `PROTECTED` route without the key; every other request passes untouched."""

    def __init__(self, app: ASGIApp, get_app: Callable[[], Any]) -> None:
        self.app = app
        self.get_app = get_app  # the FastAPI app, for its settings and its retry time

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.get_app()
        secret = app.state.settings.api_key
        if secret is None or scope["type"] != "http" or (scope["method"], scope["path"]) not in PROTECTED:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        try:
            check_api_key(secret.get_secret_value(), headers.get(b"authorization", b"").decode("latin-1"),
                          headers.get(b"x-api-key", b"").decode("latin-1"))
        except Unauthorized as e:
            scope["route"] = SimpleNamespace(path=scope["path"])  # the request metrics' label (no router ran)
            await error_response(Request(scope), e)(scope, receive, send)
            return
        await self.app(scope, receive, send)
