"""FastAPI dependencies as `Annotated` aliases: the service, the optional API key check, the engine slot
admission reserved for the request, and the request's record (app/requestlog.py)."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from app.admission import RESERVATION
from app.errors import Unauthorized, Unavailable
from app.models import MODEL_HEADER
from app.requestlog import RequestRecord, request_record
from app.service import GenerationService
from model.engine import Reservation


async def service_for(request: Request, model: str | None = None) -> GenerationService:
    """The service. With the model registry (app/models.py): the request's copy of the service of the model
    `model` names (OpenAI's field), else its `X-Folio-Model` header, else the default model's, that model loaded
    first if it is not."""
    service = getattr(request.app.state, "service", None)
    if service is None:
        raise Unavailable("the model is still loading")
    models = getattr(request.app.state, "models", None)
    if models is not None:
        return await models.service(model or request.headers.get(MODEL_HEADER))
    return service


async def get_service(request: Request) -> GenerationService:
    return await service_for(request)


def check_api_key(request: Request) -> None:
    key = request.app.state.settings.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    expected = key.get_secret_value().encode()
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")


def get_reservation(request: Request) -> Reservation | None:
    """The slot `AdmissionMiddleware` reserved for this request (None on a route it does not admit)."""
    return getattr(request.state, RESERVATION, None)


ServiceDep = Annotated[GenerationService, Depends(get_service)]
AuthDep = Annotated[None, Depends(check_api_key)]
ReservationDep = Annotated[Reservation | None, Depends(get_reservation)]
RecordDep = Annotated[RequestRecord | None, Depends(request_record)]
