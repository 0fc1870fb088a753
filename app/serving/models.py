"""Several checkpoints in one server, and hot reload: the model registry (model/registry.py) as the service sees it
(its routes: app/api/models/router.py). Every server runs it: one checkpoint is a registry of one entry;
`--models` and `--models-dir` name more, `--watch` reloads changed checkpoints (and serves those put into
`--models-dir`).

- Names: a checkpoint's directory name, or NAME=DIR. OpenAI's `model` field picks the model; TGI's routes (which
  have no such field) read the `X-Folio-Model` header; without either, the first model (`--checkpoint`) serves.
  An unknown name is a 404 listing the models; a model still loading after `--load-wait` seconds a 503 with
  `Retry-After`; one that cannot be loaded a 503 naming why (not tried again until its files change), while the
  others serve. With `--watch`, checkpoints put into `--models-dir` later are served too.
- Each model has one `GenerationService`; a request works with a copy pinned to the engine and checkpoint the
  registry gave it, so a reload (`--watch`, `POST /admin/reload`) lets running requests finish on the old weights
  (and name them) while new ones get the new, and an unload (`--max-loaded`) lets them finish too.
- Admission (app/http/admission.py) holds a request's slot in its own model's engine: one model at capacity refuses
  nothing to the others.
- LoRA adapters (model/lora.py): `--lora-modules NAME=DIR` and `POST /v1/load_lora_adapter` serve an adapter over a
  base model (the default one unless named) under a model name of its own, up to `--max-loras`; a request naming it
  runs on its base's engine, in the same batches, through the adapter. The adapter is checked against the base when
  it is loaded (a mismatch is a 422 naming what differs, and nothing changes); an engine a reload or a reload after
  an unload brings loads it again at its first request. Unloading (`POST /v1/unload_lora_adapter`) lets the
  requests running through it finish.
- `GET /v1/models` and `/info` list every model with its state (loaded, loading, unloaded, failed) and the
  sha256 of the checkpoint it serves; answers name it too (OpenAI's `system_fingerprint`, the
  `X-Folio-Checkpoint` header); /metrics counts reloads by model and result.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path, PureWindowsPath
from typing import Any, NamedTuple

from fastapi import Request
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from app.http.metrics import Metrics
from app.serving.service import GenerationService, Lifecycle
from app.settings import Settings
from model import devices
from model.chat_template import load_chat_template
from model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, Checkpoint, load_checkpoint, read_config
from model.config import GPTConfig
from model.engine import Engine, EngineConfig, EngineStats, memory_needed
from model.lora.adapter import ADAPTER_FILES
from model.lora.batched import LoraAdapter
from model.registry import ModelInfo, ModelNotFound, ModelRegistry, files_stamp
from model.sampling_params import ValidationError, preview

log = logging.getLogger("folio.models")


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


def lora_modules(settings: Settings) -> dict[str, Path]:
    """`--lora-modules`' adapters by name: each NAME=DIR."""
    out: dict[str, Path] = {}
    for spec in settings.lora_modules:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=DIR, got {spec!r}")
        if name in out:
            raise ValueError(f"--lora-modules names two adapters {name!r}")
        out[name] = Path(path)
    return out


class AdapterNotFound(ModelNotFound):
    """No adapter of that name is served (404)."""

    def __init__(self, name: str, known: list[str]) -> None:
        LookupError.__init__(self, f"lora_name: no LoRA adapter {preview(name)} is loaded; the adapters are {known}")
        self.name, self.field = name, "lora_name"


def checkpoint_dirs(directory: Path, served: dict[str, Path]) -> list[Path]:
    """The checkpoint directories (with a config.json) under `directory` that are not among `served`."""
    known = {p.resolve() for p in served.values()}
    return [p for p in sorted(directory.iterdir()) if (p / CONFIG_FILE).is_file() and p.resolve() not in known]


class AdapterFiles(NamedTuple):
    """A served adapter's base model, directory, and a short digest of its files as last read."""

    base: str
    directory: Path
    digest: str


class ServedModels:
    """The registry and one `GenerationService` per model name."""

    def __init__(self, settings: Settings, metrics: Metrics, build: Callable[[Settings, Checkpoint], Engine], *,
                 checkpoint: Checkpoint | None = None, engine: Engine | None = None) -> None:
        """`checkpoint` (or a ready `engine` with it) serve the default model's first load instead of its files
        (tests inject them; a reload reads the files)."""
        self.settings, self.metrics = settings, metrics
        self._skipped: set[Path] = set()  # directories `discover` found under a name already taken (logged once)
        self.lifecycle = Lifecycle()  # ready once the default model is loaded and warm (`start`)
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
        self.adapters: dict[str, tuple[str, Path]] = {}  # LoRA adapters served: name -> (base model, directory)
        self._adapters_lock = threading.Lock()  # adding, removing, and loading one into an engine
        self._adapter_stamps: dict[str, tuple] = {}  # each adapter's files as last read (`refresh_adapters`)

    # -- LoRA adapters ----------------------------------------------------------------------------------
    def add_adapter(self, name: str, path: Path, base: str, engine: Engine) -> LoraAdapter:
        """Serve the adapter at `path` as model `name` over model `base`, whose engine now is `engine` (blocking: it
        reads the files). ValidationError naming the field: the name taken, --max-loras reached, or the adapter
        not fitting the base (what differs)."""
        with self._adapters_lock:
            if name in self.adapters or name in self.registry.names:
                raise ValidationError("lora_name", f"a model or adapter named {preview(name)} is served already; "
                                                   "unload it first or pick another name")
            if len(self.adapters) >= self.settings.max_loras:
                raise ValidationError("lora_name", f"{len(self.adapters)} adapters are served, the most --max-loras "
                                                   f"allows ({self.settings.max_loras}); unload one first")
            try:
                stamp = files_stamp(path, ADAPTER_FILES)  # before reading: a change while it reads is seen later
                adapter = engine.load_adapter(name, path)
            except ValueError as e:  # what the files hold (or lack), with the client's path cut short
                why = str(e).replace(str(path), preview(str(path)))
                raise ValidationError("lora_path", f"cannot serve it over the model {base!r}: {why}") from None
            self.adapters[name] = (base, path)
            self._adapter_stamps[name] = stamp
        log.info("serving LoRA adapter %s (rank %d, %s) over %s", name, adapter.rank, ", ".join(adapter.targets),
                 base)
        return adapter

    def adapter_on(self, name: str, engine: Engine) -> LoraAdapter:
        """Adapter `name` as loaded in `engine` (its base's engine now), loaded there first if this engine has
        not got it (a reload or an unload brought a new one): blocking. AdapterNotFound once it was unloaded."""
        with self._adapters_lock:
            if name not in self.adapters:
                raise AdapterNotFound(name, list(self.adapters))
            return engine.adapters.get(name) or engine.load_adapter(name, self.adapters[name][1])

    def remove_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (AdapterNotFound if it is not): new requests cannot name it; those running
        through it finish (they hold it)."""
        with self._adapters_lock:
            if self.adapters.pop(name, None) is None:
                raise AdapterNotFound(name, list(self.adapters))
            self._adapter_stamps.pop(name, None)
            for _, engine, _ in self.registry.loaded():
                if name in engine.adapters:
                    engine.unload_adapter(name)
        log.info("unloaded LoRA adapter %s", name)

    def refresh_adapters(self) -> None:
        """With --watch: read again each adapter whose files changed (a training run wrote a new checkpoint of it)
        into the engines that serve it; requests running through the old factors finish with them, new ones get
        the new. Files that cannot be read or do not fit (half written: a trainer writes the weights, then the
        config) keep the old adapter serving, and are tried again when they change again."""
        with self._adapters_lock:
            served = dict(self.adapters)
        for name, (_, path) in served.items():
            stamp = files_stamp(path, ADAPTER_FILES)
            if stamp == self._adapter_stamps.get(name, stamp):
                continue
            self._adapter_stamps[name] = stamp
            for _, engine, _ in self.registry.loaded():
                if name not in engine.adapters:
                    continue
                try:
                    engine.reload_adapter(name, path)
                    log.info("reloaded LoRA adapter %s from %s", name, path)
                except (ValueError, KeyError) as e:
                    log.warning("LoRA adapter %s changed but cannot be reloaded (the old one serves on): %s", name, e)

    def adapter_files(self, name: str) -> AdapterFiles | None:
        """Adapter `name`'s base model, directory, and a short digest of its files as last read (it changes when a
        training run writes the adapter again); None if no adapter of that name is served."""
        with self._adapters_lock:
            if name not in self.adapters:
                return None
            base, path = self.adapters[name]
            stamp = self._adapter_stamps.get(name, ())
        return AdapterFiles(base, path, hashlib.sha256(repr(stamp).encode()).hexdigest()[:16])

    def describe_adapters(self) -> list[dict[str, Any]]:
        """The adapters as /v1/models lists them (vLLM's `parent`, the base model; `root`, the directory's name)."""
        with self._adapters_lock:
            return [{"name": name, "parent": base, "root": path.name, "state": "loaded"}
                    for name, (base, path) in self.adapters.items()]

    def shared(self, name: str) -> GenerationService:
        """Model `name`'s service, made on first use (`--watch` adds the models put into --models-dir)."""
        service = self.services.get(name)
        if service is None:
            service = self.services.setdefault(
                name, GenerationService(self.registry, name, self.settings, self.metrics, self.lifecycle))
        return service

    @property
    def default(self) -> GenerationService:
        return self.shared(self.registry.default)

    @property
    def ready(self) -> bool:
        return self.lifecycle.ready

    def if_loaded(self, name: str | None) -> tuple[str, GenerationService | None]:
        """Model `name`'s name (the default's if None) and a request's copy of its service if it is loaded now,
        else None: never loads (the open routes, app/http/auth.py). An unknown name is a ModelNotFound (404)."""
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
        self.lifecycle.draining = True

    def start(self) -> None:
        """Load the default model now (a broken one fails the start-up) and start watching if asked."""
        self.registry.load_now(self.registry.default)
        engine = next(e for n, e, _ in self.registry.loaded() if n == self.registry.default)
        for name, path in lora_modules(self.settings).items():  # one that does not fit fails the start-up
            try:
                self.add_adapter(name, path, self.registry.default, engine)
            except ValidationError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e}") from None
        self.lifecycle.ready = True
        if self.settings.watch:
            self.registry.watch(self.settings.watch, self.discover, self.refresh_adapters)

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


def served_models(request: Request) -> ServedModels:
    return request.app.state.models


# an absolute path inside a string: POSIX (/a/b, ~/a) or Windows (C:\\a, \\\\host\\share), up to a space or quote
_ABSOLUTE_PATH = re.compile(r"""(?<![\w.~/\\:-])(?:~?/|[A-Za-z]:[\\/]|\\\\)[^\s'"`<>|,;()]+""")


def without_paths(value: Any) -> Any:
    """`value` (JSON-like) with every absolute path in its strings cut to its last part, a file or directory name:
    /info is open to anyone who can reach the server and must not map the machine's file system."""
    if isinstance(value, str):
        return _ABSOLUTE_PATH.sub(lambda m: PureWindowsPath(m.group().rstrip("/\\")).name, value)
    if isinstance(value, dict):
        return {k: without_paths(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [without_paths(v) for v in value]
    return value
