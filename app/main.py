"""The app factory: `create_app(settings)` builds the FastAPI app; the lifespan loads the checkpoint,
starts the engine and warms it up. Nothing heavy happens at import time."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from starlette.concurrency import run_in_threadpool

from app import inspect_api, openai_api, system, tgi, tokenizer_api
from app import models as models_api
from app.admission import AdmissionMiddleware
from app.auth import ApiKeyMiddleware
from app.errors import install_error_handlers
from app.faults import FAULT_DECODE, FAULT_PREFILL, FAULT_STALL, fault_hook
from app.limits import BodyLimitMiddleware
from app.metrics import Metrics, RequestMetricsMiddleware
from app.models import CurrentEngine, ServedModels
from app.requestlog import RequestLogMiddleware
from app.responses import StrictJSONResponse
from app.schemas import CompletionRequest, GenerateParameters
from app.service import GenerationService
from app.settings import Settings
from model.checkpoint import Checkpoint, load_checkpoint
from model.engine import Engine
from model.quantize import quantize

log = logging.getLogger("folio")
# the request models whose fields' ranges a validation error names (app/errors.py), with their fields' prefixes
RANGED = (("parameters.", GenerateParameters), ("", CompletionRequest), ("", tokenizer_api.TokenizeRequest),
          ("", inspect_api.InspectRequest))


def build_engine(settings: Settings, checkpoint: Checkpoint) -> Engine:
    if settings.quantize != "none":
        log.info("quantizing %s to %s (%s bytes of weights)", checkpoint.path.name if checkpoint.path else "the model",
                 settings.quantize, f"{quantize(checkpoint.model, settings.quantize):,}")
    engine = Engine(checkpoint, settings.engine_config())
    if settings.fault_injection:
        log.warning("fault injection is on (a testing aid): prompts with %s or %s fail on purpose, with %s hang "
                    "the engine step", FAULT_PREFILL, FAULT_DECODE, FAULT_STALL)
        engine.fault_hook = fault_hook(checkpoint.tokenizer)
    return engine


def create_app(settings: Settings | None = None, *, checkpoint: Checkpoint | None = None,
               engine: Engine | None = None) -> FastAPI:
    """The service. Pass a loaded `checkpoint` (or a ready `engine`) to skip loading in the lifespan."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        serving = _serve_models(app, settings) if settings.several_models else \
            _serve_one(app, settings, checkpoint, engine)
        async with AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(serving)
            except Exception as e:  # the model cannot be served: `python -m app` says why and exits 2
                app.state.startup_error = e
                raise
            yield

    # /docs (Swagger UI) and /redoc load their scripts and styles from this server (fastapi-offline's copies under
    # /static-offline-docs), not from a CDN: they work on a machine without internet access
    app = FastAPIOffline(
        title="Folio",
        version=system.VERSION,
        summary="Text generation for small GPT models: TGI-native and OpenAI-compatible APIs.",
        lifespan=lifespan,
        default_response_class=StrictJSONResponse,
    )
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.service = None
    app.state.models = None
    app.state.startup_error = None  # why the lifespan could not start serving, if it could not
    install_error_handlers(app, RANGED)
    _install_routes(app)
    _install_middleware(app, settings)
    return app


def _install_routes(app: FastAPI) -> None:
    app.include_router(system.router)
    app.include_router(tgi.router)
    app.include_router(openai_api.router)
    app.include_router(tokenizer_api.router)
    app.include_router(models_api.router)
    app.include_router(inspect_api.router)
    app.mount("/static", StaticFiles(directory=system.PLAYGROUND.parent), name="static")  # the playground's files


def _install_middleware(app: FastAPI, settings: Settings) -> None:
    """From the innermost to the outermost (each `add_middleware` wraps what was added before)."""
    app.add_middleware(AdmissionMiddleware, get_app=lambda: app)  # innermost: CORS wraps its 429
    # the key before admission: a request without it is read no further, holds no slot and loads no model
    app.add_middleware(ApiKeyMiddleware, get_app=lambda: app)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"])
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetricsMiddleware, get_metrics=lambda: app.state.metrics)
    # outermost: the request's ID is on every answer, the 413s and 429s of the middlewares inside included
    app.add_middleware(RequestLogMiddleware, on_end=lambda record: app.state.metrics.vllm.observe(record))


@asynccontextmanager
async def _serve_one(app: FastAPI, settings: Settings, checkpoint: Checkpoint | None,
                     engine: Engine | None) -> AsyncIterator[None]:
    """The lifespan with one model: loaded (unless given), its engine built (unless given), started and warmed up
    before the server is ready."""
    ck = checkpoint
    if ck is None:
        ck = await run_in_threadpool(load_checkpoint, settings.checkpoint)
    eng = engine or await run_in_threadpool(build_engine, settings, ck)
    eng.start()
    metrics: Metrics = app.state.metrics
    metrics.bind(eng)
    service = GenerationService(eng, ck, settings, metrics)
    app.state.service = service
    await run_in_threadpool(eng.warmup)
    metrics.vllm.bind(eng, service.model_id)  # after the warm-up, which vLLM's token counters leave out
    service.ready = True
    dtype, kv = (str(t).removeprefix("torch.") for t in (eng.config.dtype, eng.runner.kv_dtype))
    log.info("serving %s on %s (%s weights, computed in %s, %s KV cache)", service.model_id, eng.config.device,
             dtype if service.quantization == "none" else service.quantization, dtype, kv)
    try:
        yield
    finally:
        service.draining = True
        await run_in_threadpool(eng.stop)


@asynccontextmanager
async def _serve_models(app: FastAPI, settings: Settings) -> AsyncIterator[None]:
    """The lifespan with the model registry (app/models.py): the default model loaded and warmed up before the
    server is ready, the others on first use."""
    metrics: Metrics = app.state.metrics
    models = ServedModels(settings, metrics, build_engine)
    await run_in_threadpool(models.start)
    service = models.default
    app.state.models, app.state.service = models, service
    current = CurrentEngine(service)  # the metrics read whichever engine serves the default model now
    metrics.bind(current)  # type: ignore[arg-type]
    metrics.vllm.bind(current, service.model_id)  # type: ignore[arg-type]
    log.info("serving %s (default %s)", ", ".join(models.registry.names), service.model_id)
    try:
        yield
    finally:
        models.set_draining()
        await run_in_threadpool(models.registry.stop)

