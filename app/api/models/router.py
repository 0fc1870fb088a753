"""The model registry over HTTP: the models served (`GET /v1/models`, OpenAI's list), reloading them
(`POST /admin/reload`, behind the API key), and a model's training run for the playground's live view
(`GET /models/{name}/training`, the page at `GET /training`). The registry itself is app/serving/models.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from app.api.protocol import error_docs
from app.http.limits import ThreadedBodyRoute
from app.serving.deps import described_service
from app.serving.models import served_models, without_paths
from model.checkpoint import CONFIG_FILE
from model.train.outputs import METRICS_FILE

router = APIRouter(tags=["Models"], route_class=ThreadedBodyRoute)


@router.get("/v1/models", tags=["OpenAI"])
async def models(request: Request) -> dict[str, Any]:
    """The models served, each with its state (app/serving/models.py; loads none)."""
    return {"object": "list", "data": [{"id": m["name"], "object": "model", "created": int(m["loaded_at"] or 0),
                                        "owned_by": "folio", **m} for m in served_models(request).describe()]}


class ReloadRequest(BaseModel):
    model: str | None = Field(None, description="the model to reload (default: every loaded one)")



@router.post("/admin/reload", responses=error_docs(401, 404, 422))
async def reload(body: ReloadRequest, request: Request) -> dict[str, Any]:
    """Swap in a checkpoint whose files changed (its config.json's hash tells), as `--watch` does: running requests
    finish on the old weights. A checkpoint that fails to load is refused and the old one keeps serving (the
    reason in the answer and in /info). Behind the API key (app/http/auth.py)."""
    models = served_models(request)
    names = [models.registry.slot_for(body.model)] if body.model else [n for n, _, _ in models.registry.loaded()]
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
    loss per evaluation) from the metrics.jsonl beside it (empty for a checkpoint without one). Open like /info:
    no paths, no prompts, and it loads no model (a model not loaded is described from its files)."""

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
