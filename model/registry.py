"""Several checkpoints in one server: each has a name and an engine that is loaded on first use (or at start),
at most `max_loaded` at once, and swapped without dropping a request when its files change.

- `acquire(name)` gives the engine to submit to (loading it first if needed, off the event loop, waiting up to
  `load_wait` seconds; `ModelLoading` with a retry time beyond that). A request keeps the engine it got: a reload
  or an unload lets that engine finish everything it runs, however long (each request is bounded by its own
  max_new_tokens), before it stops (`Engine.drain`).
- `max_loaded`: a model takes a place when its load begins, so loads in progress count. A load that finds every
  place taken unloads the least recently used idle model (nothing running, queued, reserved, or waiting for its
  own load), or waits until one is idle; the limit holds under any interleaving of requests.
- Hot reload (`watch`, or `reload(name)`): a checkpoint whose `config.json` changed (the trainer writes it last,
  atomically, with the new weights' sha256) is loaded beside the old one and warmed up, if the memory left allows
  a second engine (`memory`); then new requests go to it and the old engine drains. A checkpoint that fails to
  load (torn: a `cp` in progress writes config.json and the weights one after the other) is refused: the old one
  keeps serving, the reason is kept (`ModelInfo.error`) and logged, and it is tried again once the checkpoint's
  files change (`files_stamp`), or at the next look if memory was short.
- One model failing to load affects no other; it is not tried again until its files change (a request to it is a
  fast `ModelFailed`, and evicts nothing to make room).
- Chat templates: `chat_template(checkpoint)` is the template a request to a model renders its conversation with,
  resolved from the checkpoint the request got (so a reload brings its template): the checkpoint's own, else the
  server's `--chat-template` (`chat_template=` here), else the default (model/chat_template.py).
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

from model import heap
from model.chat_template import ChatTemplate, resolve_chat_template
from model.checkpoint import CONFIG_FILE, NEXT_CONFIG_FILE, WEIGHTS_FILE, Checkpoint
from model.config import si
from model.engine import Engine
from model.sampling_params import preview
from model.tokenizer import BPE_FILE

log = logging.getLogger("folio.registry")

UNLOADED, LOADING, LOADED, FAILED = "unloaded", "loading", "loaded", "failed"
RETIRE_COLLECTIONS = 20  # full garbage collections, 0.5 s apart, that a retired engine gets to be freed
ROOM_POLL_S = 0.05  # how often a load waiting for a place looks for an idle model (engines do not say when)
CHECKPOINT_FILES = (CONFIG_FILE, NEXT_CONFIG_FILE, WEIGHTS_FILE, BPE_FILE)  # what a load reads
Loader = Callable[[Path], tuple[Checkpoint, Engine]]  # load, build, start and warm up an engine
# the bytes loading the checkpoint at a path will take, and the bytes available for it (on its device)
Memory = Callable[[Path], tuple[int, int]]


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


class ShortOfMemory(RuntimeError):
    """A reload refused for want of memory for a second engine beside the one serving (tried again later)."""


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
    refused: tuple | None = None  # the files (`files_stamp`) a reload was refused on: not tried until they change
    short_of_memory: tuple | None = None  # the files a reload last lacked memory for (logged once for them)
    failed: tuple | None = None  # the files (`files_stamp`) a load failed on: not tried again until they change
    waiters: int = 0  # requests waiting in `acquire` for this model's load: it is not idle until they have it
    incoming: Future | None = None  # while a reload loads new weights: done once they serve, or were refused
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards the swap of engine and checkpoint
    reloading: threading.Lock = field(default_factory=threading.Lock)  # one reload at a time


def config_digest(directory: Path) -> str | None:
    try:
        return hashlib.sha256((directory / CONFIG_FILE).read_bytes()).hexdigest()
    except OSError:
        return None


def files_stamp(directory: Path, names: tuple[str, ...] = CHECKPOINT_FILES) -> tuple:
    """The checkpoint's files (`names`: CHECKPOINT_FILES, or an adapter's) by name, size and modification time: a
    few stat calls, cheap enough for each request to a model that failed to load (its weights may be complete now,
    its config.json unchanged). Other files (a trainer's metrics.jsonl, loss.png) change without changing it."""
    out = []
    for name in names:
        try:
            st = (directory / name).stat()
        except OSError:
            continue
        out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _known_broken(slot: _Slot) -> bool:
    """Whether the model failed to load from the files it has now."""
    return slot.failed is not None and slot.failed == files_stamp(slot.info.path)


class ModelRegistry:
    def __init__(self, models: dict[str, Path], load: Loader, *, max_loaded: int | None = None,
                 load_wait: float = 30.0, memory: Memory | None = None,
                 chat_template: ChatTemplate | None = None) -> None:
        if not models:
            raise ValueError("a registry needs at least one model")
        self._slots = {name: _Slot(ModelInfo(name, Path(path))) for name, path in models.items()}
        self.default = next(iter(models))
        self._load = load
        self._memory = memory
        self.max_loaded = max_loaded
        self.load_wait = load_wait
        self.fallback_chat_template = chat_template  # --chat-template: for checkpoints that carry none
        self._lock = threading.RLock()  # guards the slots' dict and the places
        self._room = threading.Condition(self._lock)  # a place given back
        self._places: set[str] = set()  # the models loaded or loading, at most max_loaded
        self._retiring: weakref.WeakSet[Engine] = weakref.WeakSet()  # retired engines still finishing their work
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

    def chat_template(self, checkpoint: Checkpoint) -> ChatTemplate:
        """The chat template for a request served from `checkpoint`: the one it carries, else --chat-template, else
        the default."""
        return resolve_chat_template(checkpoint.chat_template, self.fallback_chat_template)

    def slot_for(self, name: str | None) -> str:
        name = self.default if name is None else name
        if name not in self._slots:
            raise ModelNotFound(name, self.names)
        return name

    # -- getting an engine ------------------------------------------------------------------------------
    async def acquire(self, name: str | None = None) -> tuple[str, Engine, Checkpoint]:
        """The engine serving `name` (the default model if None), loading it first if needed. While new weights
        load for it (a reload) and its engine has no free batch slot, the request waits for them (up to
        `load_wait`): in the old engine it would wait behind requests that may run for minutes."""
        name = self.slot_for(name)
        slot = self._slots[name]
        deadline = time.monotonic() + self.load_wait
        while True:
            slot.info.last_used = time.monotonic()
            engine, checkpoint, incoming = slot.engine, slot.checkpoint, slot.incoming
            if engine is not None and checkpoint is not None:
                if incoming is None or engine.busy + engine.reserved < engine.config.max_batch_size:
                    return name, engine, checkpoint
                try:
                    await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(incoming)), deadline - time.monotonic())
                except TimeoutError:
                    return name, engine, checkpoint  # the old weights serve it, once a slot frees
                continue
            if slot.info.state == FAILED and _known_broken(slot):
                raise ModelFailed(f"model {name!r} could not be loaded: {slot.info.error}")
            slot.waiters += 1  # before the load can end: a load wanting a place must not unload it from under us
            try:
                future = self._start_loading(name)  # again if another load unloaded it before this request got it
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), deadline - time.monotonic())
            except TimeoutError:
                raise ModelLoading(name, max(1, int(self.load_wait))) from None
            finally:
                slot.waiters -= 1

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
            self._take_place(name)
            try:
                checkpoint, engine = self._load(slot.info.path)
            except BaseException:
                self._give_place(name)
                raise
            with slot.lock:
                slot.checkpoint, slot.engine, slot.failed = checkpoint, engine, None
            self._loaded(slot.info, checkpoint)
            heap.refreeze()  # a server's heap stays frozen with the new model in it (model/heap.py)
        except Exception as e:  # this model alone fails; the others serve
            log.error("model %s could not be loaded from %s: %s", name, slot.info.path, e)
            slot.info.state, slot.info.error, slot.failed = FAILED, str(e), stamp
        finally:
            future.set_result(None)

    @staticmethod
    def _loaded(info: ModelInfo, checkpoint: Checkpoint) -> None:
        info.state, info.error, info.loaded_at = LOADED, None, time.time()
        # the digest of config.json as the load read it (`Checkpoint.config_sha256`), not one taken before the load:
        # that may have caught a plain `cp` mid-write, and made the next look reload the same files again
        info.config_sha256, info.weights_sha256 = checkpoint.config_sha256, checkpoint.meta.get("weights_sha256")

    # -- the places (max_loaded) ------------------------------------------------------------------------
    def _take_place(self, name: str) -> None:
        """A place for `name`, before its load begins: a free one, or an idle model's (unloaded for it), or the
        first to come free. Raises ModelFailed if the registry stops meanwhile."""
        waited = False
        with self._room:
            while True:
                if self._stop.is_set():
                    raise ModelFailed("the server is stopping")
                if self.max_loaded is None or len(self._places) < self.max_loaded:
                    self._places.add(name)
                    return
                idle = self._least_recently_used_idle()
                if idle is not None:
                    log.info("unloading model %s (idle) to load %s within --max-loaded %d", idle, name,
                             self.max_loaded)
                    self.unload(idle)
                    continue
                if not waited:
                    log.info("model %s waits for a place: the %d loaded or loading (%s) are all busy", name,
                             self.max_loaded, ", ".join(sorted(self._places)))
                    waited = True
                self._room.wait(ROOM_POLL_S)

    def _give_place(self, name: str) -> None:
        with self._room:
            self._places.discard(name)
            self._room.notify_all()

    def _least_recently_used_idle(self) -> str | None:
        """The loaded model used least recently that nothing uses: no request running, queued or holding a slot in
        its engine, none waiting for its load to finish (those are about to use it)."""
        idle = [s for n, s in self._slots.items() if n in self._places and s.engine is not None and s.waiters == 0
                and not s.engine.busy and not s.engine.reserved]
        return min(idle, key=lambda s: s.info.last_used).info.name if idle else None

    def unload(self, name: str) -> None:
        """Stop serving `name` from memory: new requests load it again; running ones finish first."""
        slot = self._slots[name]
        with slot.lock:
            engine, slot.engine, slot.checkpoint = slot.engine, None, None
            slot.info.state = UNLOADED
        if engine is not None:  # (a model still loading keeps its place: its load gives it back if it fails)
            self._give_place(name)
            log.info("unloading model %s", name)
            self._retire(engine)

    def _retire(self, engine: Engine) -> None:
        """Let `engine` finish what it runs, stop it, and free it. An engine sits in reference cycles (its
        scheduler's callback, each request's event sink) that reference counting never frees: left to the garbage
        collector's own schedule, old engines' weights stayed in memory reload after reload (a server's RSS grew by
        the weights twice over per reload, the packed copy included). So collect until it is gone (a response still
        being written may hold it a moment longer)."""
        gone = weakref.ref(engine)
        self._retiring.add(engine)

        def retire(held: list[Engine]) -> None:
            held.pop().drain()  # no deadline: what runs on the old weights finishes on them
            with heap.thawed():  # a frozen engine is never collected
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
        A checkpoint that fails to load leaves the old engine serving (the reason: `ModelInfo.error`), and is not
        tried again until its files change; one there is not memory for beside the old, at every call."""
        slot = self._slots[self.slot_for(name)]
        with slot.reloading:
            digest = config_digest(slot.info.path)
            if slot.engine is None or digest is None or digest == slot.info.config_sha256:
                return False
            stamp = files_stamp(slot.info.path)
            if stamp == slot.refused:
                return False
            slot.incoming = Future()
            try:
                return self._swap_in(name, slot, stamp)
            finally:
                incoming, slot.incoming = slot.incoming, None
                incoming.set_result(None)

    def _swap_in(self, name: str, slot: _Slot, stamp: tuple) -> bool:
        """Load the slot's checkpoint beside its engine, swap it in and retire the old one; False where the reload
        was refused (the reason in `ModelInfo.error`)."""
        try:
            self._check_memory(name, slot.info.path)
            checkpoint, engine = self._load(slot.info.path)
        except ShortOfMemory as e:
            slot.info.error = f"reload refused: {e}"
            if slot.short_of_memory != stamp:
                log.error("reload of %s refused, the loaded weights keep serving: %s", name, e)
                slot.info.refused_reloads += 1
                slot.short_of_memory = stamp
            return False
        except Exception as e:
            log.error("reload of %s refused, the loaded weights keep serving: %s", name, e)
            slot.info.error, slot.refused = f"reload refused: {e}", stamp
            slot.info.refused_reloads += 1
            return False
        with slot.lock:
            old = slot.engine
            if old is not None:  # (unloaded meanwhile: its place is given back, so the new engine goes too)
                slot.engine, slot.checkpoint = engine, checkpoint
                self._loaded(slot.info, checkpoint)
                slot.info.reloads += 1
                slot.refused = slot.short_of_memory = None
        self._retire(old if old is not None else engine)
        if old is None:
            return False
        log.info("model %s reloaded (weights %s)", name, (slot.info.weights_sha256 or "?")[:12])
        return True

    def _check_memory(self, name: str, path: Path) -> None:
        """ShortOfMemory unless the memory left holds another engine for the checkpoint at `path`."""
        if self._memory is None:
            return
        needed, available = self._memory(path)
        if needed > available:
            raise ShortOfMemory(
                f"loading the new weights of {name} beside the engine serving it needs about {si(needed)}B "
                f"(weights, their packed copy and the KV cache), and {si(available)}B of memory is available; "
                "it is tried again at each look (--watch, POST /admin/reload) until memory frees up (fewer loaded "
                "models: --max-loaded; a smaller --max-batch-size)"
            )

    def watch(self, interval: float, discover: Callable[[], dict[str, Path]] | None = None,
              also: Callable[[], None] | None = None) -> None:
        """Check every loaded model's files every `interval` seconds (a background thread) and reload changed ones;
        serve the models `discover` finds (a models directory's new checkpoints) as well, and run `also` (the
        service's adapters' own check) each time."""
        def loop() -> None:
            while not self._stop.wait(interval):
                for name, path in (discover() if discover else {}).items():
                    self.add(name, path)
                for name, slot in list(self._slots.items()):
                    if slot.engine is not None:
                        self.reload(name)
                if also is not None:
                    also()

        self._watcher = threading.Thread(target=loop, name="folio-watch", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """Stop every engine: those serving, and those a reload or an unload retired that still finish requests."""
        self._stop.set()
        with self._room:
            self._room.notify_all()
        for engine in [*(slot.engine for slot in self._slots.values()), *list(self._retiring)]:
            if engine is not None:
                engine.stop()
