"""FastAPI dependencies as `Annotated` aliases: the service, the engine slot admission reserved for the request,
and the request's record (app/requestlog.py). The API key is checked before any of them (app/auth.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.admission import MODEL_HEADER, RESERVATION
from app.errors import Unavailable
from app.requestlog import RequestRecord, request_record
from app.service import GenerationService
from model.engine import Reservation
from model.registry import ModelNotFound


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


async def described_service(request: Request, name: str | None = None) -> tuple[str, GenerationService | None]:
    """For the open routes, which never load a model (app/auth.py): the name of the model `name` names (else the
    `X-Folio-Model` header, with the model registry), and its service if it is loaded now, else None. Without
    the registry, the one model (a 404 for another `name`; 503 while it loads)."""
    models = getattr(request.app.state, "models", None)
    if models is not None:
        return models.if_loaded(name or request.headers.get(MODEL_HEADER))
    service = await get_service(request)
    if name is not None and name != service.model_id:
        raise ModelNotFound(name, [service.model_id])
    return service.model_id, service


def get_reservation(request: Request) -> Reservation | None:
    """The slot `AdmissionMiddleware` reserved for this request (None on a route it does not admit)."""
    return getattr(request.state, RESERVATION, None)


ServiceDep = Annotated[GenerationService, Depends(get_service)]
ReservationDep = Annotated[Reservation | None, Depends(get_reservation)]
RecordDep = Annotated[RequestRecord | None, Depends(request_record)]
