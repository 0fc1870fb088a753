"""FastAPI dependencies as `Annotated` aliases: the request's service, with its engine slot, and its record
(app/http/requestlog.py). The API key is checked before any of them (app/http/auth.py).

Each request's readiness, model and slot are decided once: readiness by admission (app/http/admission.py), or,
on a route admission does not hold, by `request_service`; the model by `request_service`, from OpenAI's `model`
field, else the `X-Folio-Model` header, else the default (a LoRA adapter's name: its base model, through the
adapter); the slot by admission in the engine it already knew, or
by `request_service` in the model's engine once it is known (before tokenising: a full engine refuses at once).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from app.http.admission import ADMITTED, MODEL_HEADER, Admitted
from app.http.errors import Unavailable
from app.http.requestlog import RequestRecord, request_record
from app.serving.service import GenerationService


async def request_service(request: Request, model: str | None = None) -> GenerationService:
    """The request's copy of the service of the model `model` names (OpenAI's field), else its `X-Folio-Model`
    header, else the default model's (app/serving/models.py), that model loaded first if it is not, pinned to the
    engine and checkpoint that serve it now and holding the request's slot in that engine (a route admission holds).
    Called once per request: by `ServiceDep`, or by a route whose body names the model."""
    models = request.app.state.models
    admitted: Admitted | None = getattr(request.state, ADMITTED, None)
    if admitted is None:
        models.lifecycle.check_ready()
    asked = model or request.headers.get(MODEL_HEADER)
    served = models.adapters.get(asked) if asked else None  # a LoRA adapter: its base's engine serves it
    name, engine, checkpoint = await models.registry.acquire(served[0] if served else asked)
    slot = None if admitted is None else admitted.slot_in(engine)
    service = models.shared(name).pinned(engine, checkpoint, slot)
    if served:
        adapter = engine.adapters.get(asked) or await run_in_threadpool(models.adapter_on, asked, engine)
        files = models.adapter_files(asked)
        service = service.through(asked, adapter, files.digest if files is not None else "")
    return service


async def get_service(request: Request) -> GenerationService:
    return await request_service(request)


async def described_service(request: Request, name: str | None = None) -> tuple[str, GenerationService | None]:
    """For the open routes, which never load a model (app/http/auth.py): the name of the model `name` names (else
    the `X-Folio-Model` header), and its service if it is loaded now, else None. 503 until the default model is."""
    models = request.app.state.models
    if not models.ready:
        raise Unavailable("the model is still loading")
    return models.if_loaded(name or request.headers.get(MODEL_HEADER))


ServiceDep = Annotated[GenerationService, Depends(get_service)]
RecordDep = Annotated[RequestRecord | None, Depends(request_record)]
