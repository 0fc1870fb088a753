"""Several checkpoints in one server: each has a name and an engine that is loaded on first use (or at start),
unloaded least-recently-used beyond a budget, and swapped without dropping a request when its files change.

- `acquire(name)` gives the engine to submit to (loading it first if needed, off the event loop, waiting up to
  `load_wait` seconds; `ModelLoading` with a retry time beyond that). A request keeps the engine it got: a reload
  or an unload lets that engine finish what it runs (`Engine.drain`) before it stops.
- Hot reload (`watch`, or `reload(name)`): a checkpoint whose `config.json` changed (the trainer writes it last,
  atomically, with the new weights' sha256) is loaded beside the old one and warmed up; then new requests go to
  it and the old engine drains. A checkpoint that fails to load is refused: the old one keeps serving, and the
  reason is kept (`ModelInfo.error`) and logged.
- One model failing to load affects no other; it is not tried again until its files change (a request to it is a
  fast `ModelFailed`, and evicts nothing to make room).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from model.checkpoint import CONFIG_FILE, Checkpoint
from model.engine import Engine
from model.sampling_params import preview

log = logging.getLogger("folio.registry")

UNLOADED, LOADING, LOADED, FAILED = "unloaded", "loading", "loaded", "failed"
RETIRE_COLLECTIONS = 20  # full garbage collections, 0.5 s apart, that a retired engine gets to be freed
Loader = Callable[[Path], tuple[Checkpoint, Engine]]  # load, build, start and warm up an engine


class ModelNotFound(LookupError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"model: the model {preview(name)} is not served here; the models are {known}")
        self.name = name
        self.field = "model"


class ModelLoading(RuntimeError):
    """The model is still loading after the wait a request may spend; try again after `retry_after` seconds."""

    def __init__(self, name: str, retry_after: int) -> None:
        super().__init__(f"model {name!r} is loading; try again in {retry_after} s")
        self.retry_after = retry_after


class ModelFailed(RuntimeError):
    """The model could not be loaded (the reason is in the message)."""


@dataclass
class ModelInfo:
    name: str
    path: Path
    state: str = UNLOADED
    config_sha256: str | None = None  # of the config.json the loaded engine came from
    weights_sha256: str | None = None
    loaded_at: float | None = None  # time.time() of the last (re)load
    last_used: float = 0.0
    reloads: int = 0
    refused_reloads: int = 0
    error: str | None = None  # why the last load or reload failed


@dataclass
class _Slot:
    info: ModelInfo
    engine: Engine | None = None
    checkpoint: Checkpoint | None = None
    loading: Future | None = None
    refused: str | None = None  # the config.json digest a reload refused (not retried until it changes)
    failed: tuple | None = None  # the files (`files_stamp`) a load failed on: not tried again until they change
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards the swap of engine and checkpoint
    reloading: threading.Lock = field(default_factory=threading.Lock)  # one reload at a time


def config_digest(directory: Path) -> str | None:
    try:
        return hashlib.sha256((directory / CONFIG_FILE).read_bytes()).hexdigest()
    except OSError:
        return None


def files_stamp(directory: Path) -> tuple:
    """The directory's files by name, size and modification time: a few stat calls, cheap enough for each request
    to a model that failed to load (its weights may be complete now, its config.json unchanged)."""
    try:
        return tuple(sorted((p.name, st.st_size, st.st_mtime_ns) for p in directory.iterdir()
                            if p.is_file() and (st := p.stat())))
    except OSError:
        return ()


def _known_broken(slot: _Slot) -> bool:
    """Whether the model failed to load from the files it has now."""
    return slot.failed is not None and slot.failed == files_stamp(slot.info.path)


class ModelRegistry:
    def __init__(self, models: dict[str, Path], load: Loader, *, max_loaded: int | None = None,
                 load_wait: float = 30.0, drain_timeout: float = 30.0) -> None:
        if not models:
            raise ValueError("a registry needs at least one model")
        self._slots = {name: _Slot(ModelInfo(name, Path(path))) for name, path in models.items()}
        self.default = next(iter(models))
        self._load = load
        self.max_loaded = max_loaded
        self.load_wait = load_wait
        self.drain_timeout = drain_timeout
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()

    # -- what is served --------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def paths(self) -> dict[str, Path]:
        return {name: slot.info.path for name, slot in self._slots.items()}

    def add(self, name: str, path: Path) -> bool:
        """Serve one more model (not loaded until first used); False if the name is taken."""
        with self._lock:
            if name in self._slots:
                return False
            # a new dict, not a change to the one the event loop may be iterating over
            self._slots = {**self._slots, name: _Slot(ModelInfo(name, Path(path)))}
        log.info("serving model %s from %s (loaded on first use)", name, path)
        return True

    def info(self) -> list[ModelInfo]:
        return [slot.info for slot in self._slots.values()]

    def loaded(self) -> list[tuple[str, Engine, Checkpoint]]:
        return [(n, s.engine, s.checkpoint) for n, s in self._slots.items() if s.engine and s.checkpoint]

    def slot_for(self, name: str | None) -> str:
        name = self.default if name is None else name
        if name not in self._slots:
            raise ModelNotFound(name, self.names)
        return name

    # -- getting an engine ------------------------------------------------------------------------------
    async def acquire(self, name: str | None = None) -> tuple[str, Engine, Checkpoint]:
        """The engine serving `name` (the default model if None), loading it first if needed."""
        name = self.slot_for(name)
        slot = self._slots[name]
        deadline = time.monotonic() + self.load_wait
        while True:
            slot.info.last_used = time.monotonic()
            engine, checkpoint = slot.engine, slot.checkpoint
            if engine is not None and checkpoint is not None:
                return name, engine, checkpoint
            if slot.info.state == FAILED and _known_broken(slot):
                raise ModelFailed(f"model {name!r} could not be loaded: {slot.info.error}")
            future = self._start_loading(name)  # again if another load unloaded it before this request got it
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), deadline - time.monotonic())
            except TimeoutError:
                raise ModelLoading(name, max(1, int(self.load_wait))) from None

    def load_now(self, name: str) -> None:
        """Load `name` and wait (startup); raises ModelFailed if it cannot be."""
        self._start_loading(name).result()
        if self._slots[name].engine is None:
            raise ModelFailed(f"model {name!r} could not be loaded: {self._slots[name].info.error}")

    def _start_loading(self, name: str) -> Future:
        slot = self._slots[name]
        with slot.lock:
            if slot.loading is None or slot.loading.done():
                if slot.engine is not None or _known_broken(slot):
                    done: Future = Future()
                    done.set_result(None)
                    return done
                slot.loading = Future()
                slot.info.state = LOADING
                threading.Thread(target=self._load_into, args=(name, slot.loading), name=f"folio-load-{name}",
                                 daemon=True).start()
            return slot.loading

    def _load_into(self, name: str, future: Future) -> None:
        slot = self._slots[name]
        stamp = files_stamp(slot.info.path)
        try:
            self._make_room(keep=name)
            digest = config_digest(slot.info.path)
            checkpoint, engine = self._load(slot.info.path)
            slot.checkpoint, slot.engine, slot.failed = checkpoint, engine, None
            self._loaded(slot.info, checkpoint, digest)
        except Exception as e:  # this model alone fails; the others serve
            log.error("model %s could not be loaded from %s: %s", name, slot.info.path, e)
            slot.info.state, slot.info.error, slot.failed = FAILED, str(e), stamp
        finally:
            future.set_result(None)

    @staticmethod
    def _loaded(info: ModelInfo, checkpoint: Checkpoint, digest: str | None) -> None:
        info.state, info.error, info.loaded_at = LOADED, None, time.time()
        info.config_sha256, info.weights_sha256 = digest, checkpoint.meta.get("weights_sha256")

    def _make_room(self, keep: str) -> None:
        """Unload least-recently-used models until loading `keep` stays within `max_loaded`."""
        if self.max_loaded is None:
            return
        with self._lock:
            loaded = sorted((s for n, s in self._slots.items() if s.engine is not None and n != keep),
                            key=lambda s: s.info.last_used)
            while len(loaded) >= self.max_loaded:
                self.unload(loaded.pop(0).info.name)

    def unload(self, name: str) -> None:
        """Stop serving `name` from memory: new requests load it again; running ones finish first."""
        slot = self._slots[name]
        with slot.lock:
            engine, slot.engine, slot.checkpoint = slot.engine, None, None
            slot.info.state = UNLOADED
        if engine is not None:
            log.info("unloading model %s", name)
            self._retire(engine)

    def _retire(self, engine: Engine) -> None:
        """Let `engine` finish what it runs, stop it, and free it. An engine sits in reference cycles (its
        scheduler's callback, each request's event sink) that reference counting never frees: left to the garbage
        collector's own schedule, old engines' weights stayed in memory reload after reload (a server's RSS grew by
        the weights twice over per reload, the packed copy included). So collect until it is gone (a response still
        being written may hold it a moment longer)."""
        gone = weakref.ref(engine)

        def retire(held: list[Engine]) -> None:
            held.pop().drain(self.drain_timeout)
            for _ in range(RETIRE_COLLECTIONS):
                gc.collect()
                if gone() is None:
                    return
                time.sleep(0.5)
            log.warning("a retired engine is still referenced; its memory is freed when the reference goes")

        threading.Thread(target=retire, args=([engine],), name="folio-retire", daemon=True).start()

    # -- hot reload -----------------------------------------------------------------------------------
    def reload(self, name: str) -> bool:
        """Load `name` again if its config.json changed since it was loaded; True if a new engine now serves it.
        A checkpoint that fails to load leaves the old engine serving (the reason: `ModelInfo.error`)."""
        slot = self._slots[self.slot_for(name)]
        with slot.reloading:
            digest = config_digest(slot.info.path)
            if slot.engine is None or digest is None or digest in (slot.info.config_sha256, slot.refused):
                return False
            try:
                checkpoint, engine = self._load(slot.info.path)
            except Exception as e:
                log.error("reload of %s refused, the loaded weights keep serving: %s", name, e)
                slot.info.error, slot.refused = f"reload refused: {e}", digest
                slot.info.refused_reloads += 1
                return False
            with slot.lock:
                old, slot.engine, slot.checkpoint = slot.engine, engine, checkpoint
                self._loaded(slot.info, checkpoint, digest)
                slot.info.reloads += 1
        log.info("model %s reloaded (weights %s)", name, (slot.info.weights_sha256 or "?")[:12])
        if old is not None:
            self._retire(old)
        return True

    def watch(self, interval: float, discover: Callable[[], dict[str, Path]] | None = None) -> None:
        """Check every loaded model's files every `interval` seconds (a background thread) and reload changed ones;
        serve the models `discover` finds (a models directory's new checkpoints) as well."""
        def loop() -> None:
            while not self._stop.wait(interval):
                for name, path in (discover() if discover else {}).items():
                    self.add(name, path)
                for name, slot in list(self._slots.items()):
                    if slot.engine is not None:
                        self.reload(name)

        self._watcher = threading.Thread(target=loop, name="folio-watch", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        for slot in self._slots.values():
            if slot.engine is not None:
                slot.engine.stop()
