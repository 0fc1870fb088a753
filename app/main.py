"""The app factory: `create_app(settings)` builds the FastAPI app and its model registry (app/serving/models.py); the
lifespan loads the default checkpoint, starts its engine and warms it up. Nothing heavy happens at import time."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from starlette.concurrency import run_in_threadpool

from app.api.anthropic.protocol import MessagesRequest
from app.api.anthropic.router import router as anthropic_routes
from app.api.inspect.protocol import InspectRequest
from app.api.inspect.router import router as inspect_routes
from app.api.models.router import router as models_routes
from app.api.openai.chat.protocol import ChatCompletionRequest
from app.api.openai.chat.router import router as chat_routes
from app.api.openai.completions.protocol import CompletionRequest
from app.api.openai.completions.router import router as completions_routes
from app.api.openai.responses.protocol import ResponsesRequest
from app.api.openai.responses.router import router as responses_routes
from app.api.system.router import PLAYGROUND, VERSION
from app.api.system.router import router as system_routes
from app.api.tgi.protocol import GenerateParameters
from app.api.tgi.router import router as tgi_routes
from app.api.tokenizer.protocol import TokenizeRequest
from app.api.tokenizer.router import router as tokenizer_routes
from app.faults import FAULT_DECODE, FAULT_PREFILL, FAULT_STALL, fault_hook
from app.http.admission import AdmissionMiddleware
from app.http.auth import ApiKeyMiddleware
from app.http.errors import install_error_handlers
from app.http.limits import BodyLimitMiddleware
from app.http.metrics import Metrics, RequestMetricsMiddleware
from app.http.requestlog import RequestLogMiddleware
from app.http.responses import StrictJSONResponse
from app.serving.models import CurrentEngine, ServedModels
from app.settings import Settings
from model import heap
from model.checkpoint import Checkpoint
from model.engine import Engine
from model.quantize import quantize

log = logging.getLogger("folio")
ROUTERS = (system_routes, tgi_routes, completions_routes, chat_routes, responses_routes, anthropic_routes,
           tokenizer_routes, models_routes, inspect_routes)
# the request models whose fields' ranges a validation error names (app/http/errors.py): their routes, and their
# fields' prefixes
TGI_ROUTES = ("/generate", "/generate_stream", "/", "/tokenize", "/inspect")
RANGED = ((TGI_ROUTES, "parameters.", GenerateParameters), (("/v1/completions",), "", CompletionRequest),
          (("/v1/chat/completions",), "", ChatCompletionRequest), (("/v1/messages",), "", MessagesRequest),
          (("/v1/responses",), "", ResponsesRequest),
          (("/tokenize",), "", TokenizeRequest),
          (("/inspect",), "", InspectRequest))


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
               engine: Engine | None = None, freeze_heap: bool = False) -> FastAPI:
    """The service. Pass a loaded `checkpoint` (or a ready `engine`) to skip loading in the lifespan. `freeze_heap`:
    the process is this server's own (`python -m app`), whose heap is frozen once the default model serves
    (model/heap.py); not a test's or an embedding program's, which build and drop apps."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(_serve(app))
            except Exception as e:  # the model cannot be served: `python -m app` says why and exits 2
                app.state.startup_error = e
                raise
            yield

    # /docs (Swagger UI) and /redoc load their scripts and styles from this server (fastapi-offline's copies under
    # /static-offline-docs), not from a CDN: they work on a machine without internet access
    app = FastAPIOffline(
        title="Folio",
        version=VERSION,
        summary="Text generation for small GPT models: TGI's, OpenAI's and Anthropic's APIs.",
        description="Back to the [playground](/) or the [training view](/training).",
        lifespan=lifespan,
        default_response_class=StrictJSONResponse,
    )
    app.state.settings = settings
    app.state.metrics = Metrics()
    # the registry serves every model, one checkpoint too: a registry of one
    models = ServedModels(settings, app.state.metrics, build_engine, checkpoint=checkpoint, engine=engine)
    app.state.models = models
    app.state.service = models.default  # the default model's service: ready once the lifespan has loaded it
    app.state.startup_error = None  # why the lifespan could not start serving, if it could not
    app.state.freeze_heap = freeze_heap
    install_error_handlers(app, RANGED)
    _install_routes(app)
    _install_middleware(app, settings)
    return app


def _install_routes(app: FastAPI) -> None:
    for router in ROUTERS:
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=PLAYGROUND.parent), name="static")  # the playground's files


def _install_middleware(app: FastAPI, settings: Settings) -> None:
    """From the innermost to the outermost (each `add_middleware` wraps what was added before)."""
    app.add_middleware(AdmissionMiddleware, get_app=lambda: app)  # innermost: CORS wraps its 429
    # the key before admission: a request without it is read no further, holds no slot and loads no model
    app.add_middleware(ApiKeyMiddleware, get_app=lambda: app)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id", "Request-Id"])
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetricsMiddleware, get_metrics=lambda: app.state.metrics)
    # outermost: the request's ID is on every answer, the 413s and 429s of the middlewares inside included
    app.add_middleware(RequestLogMiddleware, on_end=lambda record: app.state.metrics.vllm.observe(record))


@asynccontextmanager
async def _serve(app: FastAPI) -> AsyncIterator[None]:
    """The lifespan's serving: the default model loaded and warmed up before the server is ready, the others (with
    --models, --models-dir) on first use."""
    metrics: Metrics = app.state.metrics
    models: ServedModels = app.state.models
    await run_in_threadpool(models.start)
    service = models.default
    current = CurrentEngine(service)  # the metrics read whichever engine serves the default model now
    metrics.bind(current)  # type: ignore[arg-type]
    metrics.vllm.bind(current, service.model_id)  # type: ignore[arg-type]
    _log_serving(models)
    if app.state.freeze_heap:  # collections skip what start-up made (model/heap.py)
        frozen = await run_in_threadpool(heap.freeze)
        log.info("froze the %d objects of start-up: the garbage collector walks only what requests allocate", frozen)
    try:
        yield
    finally:
        models.set_draining()
        await run_in_threadpool(models.registry.stop)


def _log_serving(models: ServedModels) -> None:
    """Where and how the default model runs, and the other models served (no reference to its engine outlives
    this: the registry frees an engine a reload retires)."""
    service = models.default
    engine = service.engine
    dtype, kv = (str(t).removeprefix("torch.") for t in (engine.config.dtype, engine.runner.kv_dtype))
    others = [name for name in models.registry.names if name != service.model_id]
    log.info("serving %s on %s (%s weights, computed in %s, %s KV cache)%s", service.model_id, engine.config.device,
             dtype if service.quantization == "none" else service.quantization, dtype, kv,
             f"; also {', '.join(others)} (loaded on first use)" if others else "")
