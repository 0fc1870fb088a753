"""FastAPI dependencies as `Annotated` aliases: the service, the engine slot admission reserved for the request,
and the request's record (app/http/requestlog.py). The API key is checked before any of them (app/http/auth.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.http.admission import MODEL_HEADER, RESERVATION
from app.http.errors import Unavailable
from app.http.requestlog import RequestRecord, request_record
from app.serving.service import GenerationService
from model.engine import Reservation


async def service_for(request: Request, model: str | None = None) -> GenerationService:
    """The request's copy of the service of the model `model` names (OpenAI's field), else its `X-Folio-Model`
    header, else the default model's (app/serving/models.py), that model loaded first if it is not. 503 while the server
    loads or drains."""
    request.app.state.service.check_ready()
    return await request.app.state.models.service(model or request.headers.get(MODEL_HEADER))


async def get_service(request: Request) -> GenerationService:
    return await service_for(request)


async def described_service(request: Request, name: str | None = None) -> tuple[str, GenerationService | None]:
    """For the open routes, which never load a model (app/http/auth.py): the name of the model `name` names (else the
    `X-Folio-Model` header), and its service if it is loaded now, else None. 503 until the default model is."""
    models = request.app.state.models
    if not models.ready:
        raise Unavailable("the model is still loading")
    return models.if_loaded(name or request.headers.get(MODEL_HEADER))


def get_reservation(request: Request) -> Reservation | None:
    """The slot `AdmissionMiddleware` reserved for this request (None on a route it does not admit)."""
    return getattr(request.state, RESERVATION, None)


ServiceDep = Annotated[GenerationService, Depends(get_service)]
ReservationDep = Annotated[Reservation | None, Depends(get_reservation)]
RecordDep = Annotated[RequestRecord | None, Depends(request_record)]
