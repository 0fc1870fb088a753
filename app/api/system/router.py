"""Operational routes: /health and the three Kubernetes probes under it, /info, /metrics, and the playground page
at GET /.

`python -m app` listens while the model loads (app/__main__.py): /health and the startup and readiness probes say
"loading" (503, with `Retry-After`), liveness says the process is alive.

The probes (what each answers is what the kubelet acts on; deploy/kubernetes/ uses them):
- `/health/startup`: the model is loaded and warmed up; from then on 200, draining too (a failing startup probe
  restarts the container, and a draining server must be left to finish);
- `/health/ready`: send it new traffic: loaded, not draining, and not full (requests in flight below the
  capacity, `max_batch_size + max_waiting`: the engine's own figures, the ones /metrics exports);
- `/health/live`: every loaded model's engine thread is alive and no step has run longer than
  `--liveness-stall-seconds` (the reason names the model); while the model loads, 200 "loading" (the kubelet
  asks only once the startup probe has passed; anything else that asks learns that the process is alive).
A 503 says why in its body: `{"status": ..., "reason": ...}`. None of them touches the engine's lock, so a
wedged engine cannot hang the probes too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.http.admission import MODEL_HEADER
from app.http.responses import StrictJSONResponse
from app.serving.deps import described_service
from app.serving.models import without_paths
from app.serving.service import GenerationService

router = APIRouter(tags=["system"])
PLAYGROUND = Path(__file__).parents[2] / "static" / "playground.html"
VERSION = "0.1.0"
@router.get("/health", responses={503: {"description": "still loading, or draining after SIGTERM"}})
async def health(request: Request) -> StrictJSONResponse:
    """200 once the model is loaded and warmed up; 503 before that and while shutting down."""
    lifecycle = request.app.state.models.lifecycle
    if not lifecycle.ready:
        return _unavailable("loading", LOADING, request)
    if lifecycle.draining:
        return StrictJSONResponse({"status": "draining"}, status_code=503)
    return StrictJSONResponse({"status": "ok"})


def _loaded(request: Request) -> GenerationService | None:
    """The service once the model is loaded and warmed up, else None."""
    return request.app.state.service if request.app.state.models.ready else None


def _unavailable(status: str, reason: str, request: Request | None = None) -> StrictJSONResponse:
    """503 saying why; while loading (`request` given), with Retry-After as the generation routes' 503."""
    headers = {"Retry-After": str(request.app.state.settings.retry_after)} if request is not None else None
    return StrictJSONResponse({"status": status, "reason": reason}, status_code=503, headers=headers)


LOADING = "the model is still loading"


@router.get("/health/startup", responses={503: {"description": "the model is still loading"}})
async def health_startup(request: Request) -> StrictJSONResponse:
    """Kubernetes' startup probe: 200 once the model is loaded and warmed up, and from then on (draining too)."""
    if _loaded(request) is None:
        return _unavailable("loading", LOADING, request)
    return StrictJSONResponse({"status": "ok"})


@router.get("/health/ready", responses={503: {"description": "loading, draining, or full"}})
async def health_ready(request: Request) -> StrictJSONResponse:
    """Kubernetes' readiness probe: 200 when the server should get new requests: loaded, not draining, and with
    requests in flight below its capacity (`max_batch_size + max_waiting`); else 503 with the reason."""
    service = _loaded(request)
    if service is None:
        return _unavailable("loading", LOADING, request)
    if request.app.state.models.lifecycle.draining:
        return _unavailable("draining", "the server is shutting down and admits no new requests")
    engine = service.loaded_engine
    if engine is None:  # the default model was unloaded to make room (app/serving/models.py): the next request loads it
        return StrictJSONResponse({"status": "ok", "in_flight": 0,
                                   "capacity": service.settings.max_batch_size + service.settings.max_waiting})
    limits = engine.config
    in_flight, capacity = engine.stats.running + engine.stats.waiting, limits.max_batch_size + limits.max_waiting
    if in_flight >= capacity:
        return _unavailable("full", f"{in_flight} requests in flight, the capacity is {capacity} "
                            f"({limits.max_batch_size} running + {limits.max_waiting} waiting)")
    return StrictJSONResponse({"status": "ok", "in_flight": in_flight, "capacity": capacity})


@router.get("/health/live", responses={503: {"description": "the engine thread is dead or stuck in a step"}})
async def health_live(request: Request) -> StrictJSONResponse:
    """Kubernetes' liveness probe: 200 while the engine thread is alive and stepping (idle, or within
    `--liveness-stall-seconds` of its current step's start); 503 with the reason when it is dead or stuck."""
    service = _loaded(request)
    if service is None:  # the process is alive; the startup probe tells whether it is ready
        return StrictJSONResponse({"status": "loading"})
    states = []
    for name, engine, _ in request.app.state.models.registry.loaded():  # every model loaded now (app/serving/models.py)
        alive, why = engine.liveness(service.settings.liveness_stall_seconds)
        if not alive:
            return _unavailable("unhealthy", f"model {name!r}: {why}")
        states.append(why)
    return StrictJSONResponse({"status": "stepping" if "stepping" in states else "idle"})


@router.get("/info")
async def info(request: Request) -> dict[str, Any]:
    """The model, the engine's limits and the training provenance. No absolute paths: the checkpoint is named by
    its directory, and a path in the provenance (the training data, the output directory) by its last part.
    With several models (the `X-Folio-Model` header picks one), a model not loaded is not loaded for this: its
    name, state and the list of models only. A LoRA adapter's name describes its base model, with `adapter`: the
    base, the adapter's directory, and the fingerprint its answers carry."""
    asked = request.headers.get(MODEL_HEADER)
    adapter = request.app.state.models.adapter_files(asked) if asked else None
    name, service = await described_service(request, adapter.base if adapter else None)  # an adapter: its base's
    if service is None:
        models = request.app.state.models.describe()
        return {"model_id": name, "state": next(m["state"] for m in models if m["name"] == name), "models": models,
                "version": VERSION, "router": "folio"}
    if adapter is not None:
        service = service.through(asked, None, adapter.digest)  # its name and fingerprint (describing runs nothing)
    ck, engine, cfg = service.checkpoint, service.engine, service.checkpoint.config
    runner, limits = engine.runner, engine.config
    tok = ck.tokenizer
    return without_paths({
        "model_id": service.model_id,
        "adapter": None if adapter is None else {"base_model": adapter.base, "directory": adapter.directory.name,
                                                 "fingerprint": service.fingerprint},
        "model_sha": ck.meta.get("weights_sha256"),
        "checkpoint": ck.path.name if ck.path else None,
        "checkpoint_sha256": ck.meta.get("weights_sha256"),
        "parameters": cfg.num_params(),
        "model_config": cfg.to_dict(),
        "tokenizer": {"kind": tok.to_config()["kind"], "n_vocab": tok.n_vocab, "eos_token_id": tok.eos_id},
        "block_size": cfg.block_size,
        "max_input_tokens": cfg.block_size,
        "max_total_tokens": cfg.block_size + service.settings.max_new_tokens_limit,
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "cpu_kernels": runner.cpu_kernels,  # "loaded (avx512)", or why not
        "cuda_graphs": runner.cuda_graphs,  # "N captured in S s", or why none (--enforce-eager)
        "async_scheduling": engine.config.async_scheduling,  # decode steps run ahead (--async-scheduling)
        "threads": runner.threads,  # CPU threads (--threads, else by the model's size); 0 on a GPU
        "quantization": service.quantization,
        "packed_weight_bytes": runner.packed_bytes,  # the kernels' second copy of the linear weights
        "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),  # --kv-cache-dtype, "auto" resolved
        "kv_cache_bytes": runner.kv_cache_bytes,  # keys and values of every layer and batch row
        "max_batch_size": limits.max_batch_size,
        "max_concurrent_requests": limits.max_batch_size + limits.max_waiting,
        "max_waiting": limits.max_waiting,
        "max_sequences_per_request": service.settings.sequences_per_request,  # prompts x n, best_of (422 beyond)
        "prefill_chunk": limits.prefill_chunk,
        "window_shift": limits.window_shift,
        "max_new_tokens_limit": service.settings.max_new_tokens_limit,
        "training": ck.training,
        "models": request.app.state.models.describe(),
        "version": VERSION,
        "router": "folio",
    })


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text exposition", "content": {"text/plain": {}}}})
async def metrics(request: Request) -> Response:
    """Prometheus metrics: requests by route and status, queue depth, running batch, tokens, latencies."""
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(PLAYGROUND.read_text(encoding="utf-8"))
