"""Several checkpoints in one server, and hot reload, over HTTP: the model registry (model/registry.py) behind the
routes. Every server runs it: one checkpoint is a registry of one entry; `--models` and `--models-dir` name more,
`--watch` reloads changed checkpoints (and serves those put into `--models-dir`).

- Names: a checkpoint's directory name, or NAME=DIR. OpenAI's `model` field picks the model; TGI's routes (which
  have no such field) read the `X-Folio-Model` header; without either, the first model (`--checkpoint`) serves.
  An unknown name is a 404 listing the models; a model still loading after `--load-wait` seconds a 503 with
  `Retry-After`; one that cannot be loaded a 503 naming why (not tried again until its files change), while the
  others serve. With `--watch`, checkpoints put into `--models-dir` later are served too.
- Each model has one `GenerationService`; a request works with a copy pinned to the engine and checkpoint the
  registry gave it, so a reload (`--watch`, `POST /admin/reload`) lets running requests finish on the old weights
  (and name them) while new ones get the new, and an unload (`--max-loaded`) lets them finish too.
- Admission (app/admission.py) holds a request's slot in its own model's engine: one model at capacity refuses
  nothing to the others.
- `GET /v1/models` and `/info` list every model with its state (loaded, loading, unloaded, failed) and the
  sha256 of the checkpoint it serves; answers name it too (OpenAI's `system_fingerprint`, the
  `X-Folio-Checkpoint` header); /metrics counts reloads by model and result.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from app.deps import described_service
from app.limits import ThreadedBodyRoute
from app.metrics import Metrics
from app.schemas import error_docs
from app.service import GenerationService
from app.settings import Settings
from app.system import without_paths
from model import devices
from model.chat_template import load_chat_template
from model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, Checkpoint, load_checkpoint, read_config
from model.config import GPTConfig
from model.engine import Engine, EngineConfig, EngineStats, memory_needed
from model.registry import ModelInfo, ModelRegistry
from model.train.outputs import METRICS_FILE

log = logging.getLogger("folio.models")
router = APIRouter(tags=["Models"], route_class=ThreadedBodyRoute)


def model_paths(settings: Settings) -> dict[str, Path]:
    """Every model the settings name, first the default: `--checkpoint`, `--models`, then `--models-dir`'s."""
    out: dict[str, Path] = {}

    def add(spec: str, default_name: str | None = None) -> None:
        name, sep, path = spec.partition("=")
        if not sep or "/" in name:
            name, path = default_name or Path(spec).name, spec
        if name in out:
            raise ValueError(f"two models are named {name!r}; name them with NAME=DIR")
        out[name] = Path(path)

    add(str(settings.checkpoint), settings.model_id)
    for spec in settings.models:
        add(spec)
    if settings.models_dir is not None:
        if not settings.models_dir.is_dir():
            raise ValueError(f"--models-dir {settings.models_dir} is not a directory")
        for path in checkpoint_dirs(settings.models_dir, out):
            add(str(path))
    return out


def checkpoint_dirs(directory: Path, served: dict[str, Path]) -> list[Path]:
    """The checkpoint directories (with a config.json) under `directory` that are not among `served`."""
    known = {p.resolve() for p in served.values()}
    return [p for p in sorted(directory.iterdir()) if (p / CONFIG_FILE).is_file() and p.resolve() not in known]


class ServedModels:
    """The registry and one `GenerationService` per model name."""

    def __init__(self, settings: Settings, metrics: Metrics, build: Callable[[Settings, Checkpoint], Engine], *,
                 checkpoint: Checkpoint | None = None, engine: Engine | None = None) -> None:
        """`checkpoint` (or a ready `engine` with it) serve the default model's first load instead of its files
        (tests inject them; a reload reads the files)."""
        self.settings, self.metrics = settings, metrics
        self._skipped: set[Path] = set()  # directories `discover` found under a name already taken (logged once)
        self.ready = False  # the default model loaded and warmed up (`start`)
        injected = [(checkpoint, engine)] if checkpoint is not None or engine is not None else []

        def load(path: Path) -> tuple[Checkpoint, Engine]:
            given_checkpoint, given_engine = injected.pop() if injected and path == default_path else (None, None)
            loaded = given_checkpoint or load_checkpoint(path)
            built = (given_engine or build(settings, loaded)).start()
            built.warmup()
            return loaded, built

        paths = model_paths(settings)
        default_path = next(iter(paths.values()))
        self.registry = ModelRegistry(paths, load, max_loaded=settings.max_loaded,
                                      load_wait=settings.load_wait, memory=lambda path: engine_memory(settings, path),
                                      chat_template=load_chat_template(settings.chat_template))
        self.services: dict[str, GenerationService] = {}
        metrics.registry.register(ReloadCollector(self.registry))

    def shared(self, name: str) -> GenerationService:
        """Model `name`'s service, made on first use (`--watch` adds the models put into --models-dir)."""
        service = self.services.get(name)
        if service is None:
            service = GenerationService(self.registry, name, self.settings, self.metrics)
            service.ready = self.ready
            service = self.services.setdefault(name, service)
        return service

    @property
    def default(self) -> GenerationService:
        return self.shared(self.registry.default)

    async def service(self, name: str | None) -> GenerationService:
        """A request's copy of model `name`'s service (the default's if None), pinned to the engine and checkpoint
        that serve it now, loading it first if needed (or the registry's error: 404, 503)."""
        name, engine, checkpoint = await self.registry.acquire(name)
        return self.shared(name).pinned(engine, checkpoint)

    def if_loaded(self, name: str | None) -> tuple[str, GenerationService | None]:
        """Model `name`'s name (the default's if None) and a request's copy of its service if it is loaded now,
        else None: never loads (the open routes, app/auth.py). An unknown name is a ModelNotFound (404)."""
        name = self.registry.slot_for(name)
        for loaded, engine, checkpoint in self.registry.loaded():
            if loaded == name:
                return name, self.shared(name).pinned(engine, checkpoint)
        return name, None

    def discover(self) -> dict[str, Path]:
        """The checkpoint directories put into `--models-dir` since it was last looked at, by name (`--watch`)."""
        if self.settings.models_dir is None:
            return {}
        try:
            found = checkpoint_dirs(self.settings.models_dir, self.registry.paths())
        except OSError as e:
            log.warning("cannot look into --models-dir %s: %s", self.settings.models_dir, e)
            return {}
        taken = set(self.registry.names)
        for path in (p for p in found if p.name in taken and p not in self._skipped):
            self._skipped.add(path)
            log.warning("not serving %s: a model is named %r already", path, path.name)
        return {p.name: p for p in found if p.name not in taken}

    def set_draining(self) -> None:
        for service in self.services.values():
            service.draining = True

    def start(self) -> None:
        """Load the default model now (a broken one fails the start-up) and start watching if asked."""
        self.registry.load_now(self.registry.default)
        self.ready = True
        for service in self.services.values():
            service.ready = True
        if self.settings.watch:
            self.registry.watch(self.settings.watch, self.discover)

    def describe(self) -> list[dict[str, Any]]:
        return [describe(info) for info in self.registry.info()]


def engine_memory(settings: Settings, path: Path) -> tuple[int, int]:
    """The bytes an engine built as `settings` say for the checkpoint at `path` will take (from its config.json and
    the size of its weights, before loading them), and the bytes available on its device."""
    meta = read_config(path)
    engine = settings.engine_config()
    needed = memory_needed(GPTConfig.from_dict(meta["model"]), (path / WEIGHTS_FILE).stat().st_size, engine,
                           quantized=meta.get("quantization", "none") != "none" or settings.quantize != "none")
    return needed, devices.free_memory(engine.device)


def describe(info: ModelInfo) -> dict[str, Any]:
    """A model as /v1/models and /info show it: no absolute path (its directory by name, and a path in the error
    of a failed load by its last part): both are open routes."""

    out = {k: v for k, v in asdict(info).items() if k not in ("path", "last_used")}
    out["checkpoint"], out["error"] = info.path.name, without_paths(info.error)
    return out


class CurrentEngine:
    """The engine /metrics reads for a model: whichever serves it now (across reloads). While the model is
    unloaded, an idle engine: nothing running or waiting, the counters where its last engine left them."""

    def __init__(self, service: GenerationService) -> None:
        self._service = service
        self._last_stats = EngineStats()

    def __getattr__(self, name: str) -> Any:
        engine = self._service.loaded_engine
        if engine is not None:
            self._last_stats = engine.stats  # the scheduler's small stats object, not the engine
            return getattr(engine, name)
        idle = {"stats": replace(self._last_stats, running=0, waiting=0), "reserved": 0,
                "config": EngineConfig(max_batch_size=self._service.settings.max_batch_size)}
        return idle[name]


class ReloadCollector(Collector):
    """`folio_model_reloads_total{model, result}`: reloads done (`ok`) and refused (`refused`) per model."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("folio_model_reloads", "checkpoint reloads by model and result",
                                     labels=["model", "result"])
        for info in self.registry.info():
            family.add_metric([info.name, "ok"], info.reloads)
            family.add_metric([info.name, "refused"], info.refused_reloads)
        yield family


class ReloadRequest(BaseModel):
    model: str | None = Field(None, description="the model to reload (default: every loaded one)")


def served_models(request: Request) -> ServedModels:
    return request.app.state.models


@router.post("/admin/reload", responses=error_docs(401, 404, 422))
async def reload(body: ReloadRequest, request: Request) -> dict[str, Any]:
    """Swap in a checkpoint whose files changed (its config.json's hash tells), as `--watch` does: running requests
    finish on the old weights. A checkpoint that fails to load is refused and the old one keeps serving (the
    reason in the answer and in /info). Behind the API key (app/auth.py)."""
    models = served_models(request)
    names = [models.registry.slot_for(body.model)] if body.model else [n for n, _, _ in models.registry.loaded()]
    started = time.perf_counter()
    reloaded = {name: await run_in_threadpool(models.registry.reload, name) for name in names}
    return {"reloaded": reloaded, "seconds": round(time.perf_counter() - started, 3), "models": models.describe()}


METRICS_TAIL_BYTES = 1 << 20  # of a run's metrics.jsonl sent to the training view (its last rows)
TRAINING_PAGE = Path(__file__).parent / "static" / "training.html"


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
