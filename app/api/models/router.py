"""The model registry over HTTP: the models served (`GET /v1/models`, OpenAI's list, LoRA adapters among them),
reloading them (`POST /admin/reload`, behind the API key), loading and unloading LoRA adapters
(`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`: vLLM's shapes, behind the API key), and a model's
training run for the playground's live view (`GET /models/{name}/training`, the page at `GET /training`). The
registry itself is app/serving/models.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from app.api.openai.protocol import ERRORS as OPENAI_ERRORS
from app.api.protocol import StrictModel, error_docs
from app.http.limits import ThreadedBodyRoute
from app.serving.deps import described_service
from app.serving.models import served_models, without_paths
from model.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from model.lora.adapter import ADAPTER_WEIGHTS_FILE, adapter_provenance
from model.registry import ModelNotFound
from model.sampling_params import ValidationError
from model.train.outputs import METRICS_FILE

router = APIRouter(tags=["Models"], route_class=ThreadedBodyRoute)


def model_cards(request: Request) -> list[dict[str, Any]]:
    """The models served and the LoRA adapters, as OpenAI's model objects (with Folio's state); `created` is when
    the weights file was written (the model's own creation, the same across reloads), else 0."""
    models = served_models(request)
    paths = models.registry.paths()
    cards = []
    for m in models.describe():
        path = paths.get(m["name"])
        created = written(path / WEIGHTS_FILE) if path is not None else 0
        cards.append({"id": m["name"], "object": "model", "created": created, "owned_by": "folio", **m})
    for adapter in models.describe_adapters():
        files = models.adapter_files(adapter["name"])
        created = written(files.directory / ADAPTER_WEIGHTS_FILE) if files is not None else 0
        cards.append({"id": adapter["name"], "object": "model", "created": created, "owned_by": "folio", **adapter})
    return cards


def written(path: Path) -> int:
    try:
        return int(path.stat().st_mtime)
    except OSError:
        return 0


@router.get("/v1/models", tags=["OpenAI"])
async def models(request: Request) -> dict[str, Any]:
    """The models served, each with its state (app/serving/models.py; loads none)."""
    return {"object": "list", "data": await run_in_threadpool(model_cards, request)}


@router.get("/v1/models/{model_id:path}", tags=["OpenAI"], responses=OPENAI_ERRORS)
async def model(model_id: str, request: Request) -> dict[str, Any]:
    """One model or adapter of the list (OpenAI's retrieve), or 404 naming those served."""
    cards = await run_in_threadpool(model_cards, request)
    for card in cards:
        if card["id"] == model_id:
            return card
    raise ModelNotFound(model_id, [card["id"] for card in cards])


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str = Field(..., min_length=1, max_length=128, pattern=r"^[^\s/]+$",
                           description="the model name requests will use for the adapter")
    lora_path: str = Field(..., min_length=1, max_length=4096,
                           description="the adapter's directory on the server (PEFT's adapter_config.json and "
                                       "adapter_model.safetensors)")
    base_model_name: str | None = Field(None, max_length=256, description="the served model it adapts (default: "
                                        "the default model)")


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str = Field(..., min_length=1, max_length=128, description="the adapter to unload")


@router.post("/v1/load_lora_adapter", responses=OPENAI_ERRORS)
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> dict[str, Any]:
    """Serve a LoRA adapter (vLLM's route) as a model of its own over its base model: checked against the base
    first (a 400 naming what differs, and nothing changes), at most --max-loras. Behind the API key."""
    models = served_models(request)
    if not request.app.state.settings.lora_enabled:
        raise ValidationError("lora_name", "LoRA adapters are off on this server; start it with --enable-lora or "
                                           "--lora-modules")
    base, engine, _ = await models.registry.acquire(body.base_model_name)
    adapter = await run_in_threadpool(models.add_adapter, body.lora_name, Path(body.lora_path), base, engine)
    return {"lora_name": body.lora_name, "base_model_name": base, "rank": adapter.rank,
            "scaling": adapter.scaling, "targets": adapter.targets}


@router.post("/v1/unload_lora_adapter", responses=OPENAI_ERRORS)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> dict[str, Any]:
    """Stop serving a LoRA adapter (vLLM's route): new requests naming it get a 404; those running through it
    finish. Behind the API key."""
    await run_in_threadpool(served_models(request).remove_adapter, body.lora_name)
    return {"lora_name": body.lora_name, "unloaded": True}


class ReloadRequest(StrictModel):
    model: str | None = Field(None, min_length=1, description="the model to reload (default: every loaded one)")



@router.post("/admin/reload", responses=error_docs(401, 404, 422))
async def reload(body: ReloadRequest, request: Request) -> dict[str, Any]:
    """Swap in a checkpoint whose files changed (its config.json's hash tells), as `--watch` does: running requests
    finish on the old weights. A checkpoint that fails to load is refused and the old one keeps serving (the
    reason in the answer and in /info). Behind the API key (app/http/auth.py)."""
    models = served_models(request)
    names = [models.registry.slot_for(body.model)] if body.model is not None else [
        n for n, _, _ in models.registry.loaded()]
    started = time.perf_counter()
    reloaded = {name: await run_in_threadpool(models.registry.reload, name) for name in names}
    return {"reloaded": reloaded, "seconds": round(time.perf_counter() - started, 3), "models": models.describe()}


METRICS_TAIL_BYTES = 1 << 20  # of a run's metrics.jsonl sent to the training view (its last rows)
TRAINING_PAGE = Path(__file__).parents[2] / "static" / "training.html"


def _metrics_tail(path: Path) -> list[dict[str, Any]]:
    """The last rows of a run's metrics.jsonl (at most METRICS_TAIL_BYTES of it; a torn last line is skipped)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - METRICS_TAIL_BYTES))
            lines = f.read().decode("utf-8", errors="replace").splitlines()[1 if size > METRICS_TAIL_BYTES else 0:]
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


@router.get("/models/{name}/training", responses=error_docs(404, 503))
async def training(name: str, request: Request) -> dict[str, Any]:
    """A served model's training run, for the playground's live view: the checkpoint's provenance, which weights
    serve it now (null while it is not loaded), and the run's metrics (train loss per log interval, train/val
    loss per evaluation) from the metrics.jsonl beside it (empty for a checkpoint without one). A LoRA adapter's
    are its own: the provenance its training run wrote into its weights file, the metrics beside it, its base
    model, and a digest of its files for the weights. Open like /info: no paths, no prompts, and it loads no model
    (a model not loaded is described from its files)."""

    adapter = served_models(request).adapter_files(name)
    if adapter is not None:  # a LoRA adapter: its own run, from its directory (a LoRA training run's output)
        base, path, digest = adapter
        training = (await run_in_threadpool(adapter_provenance, path)).get("training") or {}
        rows = await run_in_threadpool(_metrics_tail, path / METRICS_FILE)
        return {"model": name, "base_model": base, "fingerprint": digest, "training": without_paths(training),
                "metrics": rows}
    name, service = await described_service(request, name)
    if service is not None:
        path, training, fingerprint = service.checkpoint.path, service.checkpoint.training, service.fingerprint
    else:
        path = served_models(request).registry.paths()[name]
        training, fingerprint = await run_in_threadpool(_stored_training, path), None
    rows = await run_in_threadpool(_metrics_tail, path / METRICS_FILE) if path else []
    return {"model": name, "fingerprint": fingerprint, "training": without_paths(training), "metrics": rows}


def _stored_training(directory: Path) -> dict[str, Any]:
    """The training provenance in a checkpoint's config.json ({} if it cannot be read): a model not loaded."""
    try:
        training = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8")).get("training")
    except (OSError, ValueError, AttributeError):
        return {}
    return training if isinstance(training, dict) else {}


@router.get("/training", response_class=HTMLResponse, include_in_schema=False)
async def training_page() -> HTMLResponse:
    return HTMLResponse(TRAINING_PAGE.read_text(encoding="utf-8"))
