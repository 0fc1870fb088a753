"""FastAPI dependencies as `Annotated` aliases: the service, and the optional API key check."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from app.errors import Unauthorized, Unavailable
from app.service import GenerationService


def get_service(request: Request) -> GenerationService:
    service = getattr(request.app.state, "service", None)
    if service is None:
        raise Unavailable("the model is still loading")
    return service


def check_api_key(request: Request) -> None:
    key = request.app.state.settings.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    expected = key.get_secret_value().encode()
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")


ServiceDep = Annotated[GenerationService, Depends(get_service)]
AuthDep = Annotated[None, Depends(check_api_key)]
