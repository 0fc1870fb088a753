"""Several models in one process: load on first use, LRU unloading, --max-loaded under concurrent loads (loads in
progress counted, a busy model never unloaded), a broken model alone failing, hot reload that finishes running
requests on the old weights however long they take, refuses a broken or torn new checkpoint (and retries it once
its files change) or one there is no memory for, and sends requests that find the old engine full to the new."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import GPTConfig
from model.engine import Engine, EngineConfig, memory_needed
from model.engine import engine as engine_module
from model.gpt import GPT
from model.registry import (
    FAILED,
    LOADED,
    LOADING,
    UNLOADED,
    ModelFailed,
    ModelLoading,
    ModelNotFound,
    ModelRegistry,
)
from model.sampling_params import SamplingParams
from model.tokenizer import CharTokenizer

CHARS = [chr(c) for c in range(32, 127)]


def write_model(directory: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=32, vocab_size=len(CHARS), n_layer=1, n_head=2, n_embd=16))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(6.0)
    return save_checkpoint(directory, model, CharTokenizer(CHARS), training={"seed": seed})


def loader(gate: threading.Event | None = None):
    def load(path: Path):
        if gate is not None:
            gate.wait(10)
        ck = load_checkpoint(path)
        return ck, Engine(ck, device="cpu", threads=1, max_batch_size=4).start()

    return load


def greedy(engine: Engine, n: int = 12) -> list[int]:
    return engine.generate([1, 2, 3], SamplingParams(max_new_tokens=n)).token_ids


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30.0))


@pytest.fixture
def models(tmp_path) -> dict[str, Path]:
    return {"a": write_model(tmp_path / "a", 1), "b": write_model(tmp_path / "b", 2)}


def test_models_load_on_first_use_and_the_least_recently_used_is_unloaded(models) -> None:
    reg = ModelRegistry(models, loader(), max_loaded=1)
    try:
        assert [i.state for i in reg.info()] == [UNLOADED, UNLOADED]
        name, a, _ = run(reg.acquire(None))
        assert name == "a" and greedy(a) == greedy(loader()(models["a"])[1])
        _, b, _ = run(reg.acquire("b"))
        assert greedy(b) == greedy(loader()(models["b"])[1])
        assert {i.name: i.state for i in reg.info()} == {"a": UNLOADED, "b": LOADED}
        deadline = time.monotonic() + 10
        while a.liveness(1.0)[0] and time.monotonic() < deadline:  # a drains, then its thread stops
            time.sleep(0.01)
        assert not a.liveness(1.0)[0]
        with pytest.raises(ModelNotFound, match="'c' is not served here"):
            run(reg.acquire("c"))
    finally:
        reg.stop()


def test_a_model_that_fails_to_load_fails_alone(models, tmp_path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    reg = ModelRegistry({**models, "broken": broken}, loader())
    try:
        with pytest.raises(Exception, match="could not be loaded"):
            run(reg.acquire("broken"))
        info = {i.name: i for i in reg.info()}
        assert info["broken"].state == FAILED and "not valid JSON" in info["broken"].error
        assert len(greedy(run(reg.acquire("a"))[1])) == 12
    finally:
        reg.stop()


def test_a_request_waits_for_loading_up_to_the_limit(models) -> None:
    """The load is held by a gate, so that neither outcome depends on how fast this machine loads: a request gives
    up after `load_wait` while the gate is shut, and one that waits longer gets the model once the gate opens."""
    gate = threading.Event()
    reg = ModelRegistry(models, loader(gate), load_wait=0.2)
    try:
        with pytest.raises(ModelLoading) as e:
            run(reg.acquire("a"))  # the gate is shut: 0.2 s pass whatever the machine's load
        assert e.value.retry_after >= 1 and reg.info()[0].state == LOADING
        reg.load_wait = 60.0  # a bound no loaded machine reaches, not a timing

        async def wait_then_open() -> str:
            waiting = asyncio.create_task(reg.acquire("a"))
            await asyncio.sleep(0)  # the request is waiting for the load when the gate opens
            assert not waiting.done()
            gate.set()
            return (await waiting)[0]

        assert asyncio.run(asyncio.wait_for(wait_then_open(), 120.0)) == "a"
        assert reg.info()[0].state == LOADED
    finally:
        gate.set()
        reg.stop()


def test_reload_swaps_weights_running_requests_finish_on_the_old_ones(models, tmp_path) -> None:
    reg = ModelRegistry(models, loader())
    try:
        _, old, _ = run(reg.acquire("a"))
        before = greedy(old, 30)
        assert reg.reload("a") is False  # nothing changed
        hold = threading.Event()
        old.fault_hook = lambda reqs: hold.wait(10)

        async def main():
            running = old.submit([1, 2, 3], SamplingParams(max_new_tokens=30))  # on the old weights
            write_model(models["a"], 3)  # the trainer writes a new checkpoint in place
            assert await asyncio.to_thread(reg.reload, "a") is True
            hold.set()
            return await running.collect()

        result = run(main())
        assert result.token_ids == before  # finished on the old weights
        _, new, _ = run(reg.acquire("a"))
        assert new is not old and greedy(new, 30) == greedy(loader()(models["a"])[1], 30) != before
        info = reg.info()[0]
        assert info.reloads == 1 and info.error is None and info.weights_sha256 == load_checkpoint(
            models["a"]).meta["weights_sha256"]
        # a broken checkpoint dropped in its place is refused; the loaded weights keep serving
        (models["a"] / "model.safetensors").write_bytes(b"garbage")
        (models["a"] / "config.json").write_text((models["a"] / "config.json").read_text() + " ")
        assert reg.reload("a") is False
        assert run(reg.acquire("a"))[1] is new and "reload refused" in reg.info()[0].error
    finally:
        reg.stop()


def test_a_model_unloaded_before_its_waiter_got_it_is_loaded_again(models) -> None:
    reg = ModelRegistry(models, loader(), max_loaded=2)
    loads, unloaded = [], []

    def loaded(info, checkpoint) -> None:  # another load makes room by unloading it, at once (once)
        ModelRegistry._loaded(info, checkpoint)
        loads.append(info.name)
        if not unloaded:
            unloaded.append(info.name)
            reg.unload(info.name)

    reg._loaded = loaded
    try:
        name, engine, _ = run(reg.acquire("b"))
        assert name == "b" and loads == ["b", "b"] and not engine.scheduler.stopping
        assert [i.state for i in reg.info()] == [UNLOADED, LOADED]
    finally:
        reg.stop()


def test_a_model_that_failed_to_load_is_not_loaded_again_until_its_files_change(models, tmp_path) -> None:
    calls: list[Path] = []
    load = loader()
    reg = ModelRegistry(models, lambda path: (calls.append(path), load(path))[1])
    (models["b"] / "model.safetensors").write_bytes(b"torn")
    try:
        for _ in range(3):
            with pytest.raises(ModelFailed, match="could not be loaded"):
                run(reg.acquire("b"))
        assert len(calls) == 1 and reg.info()[1].state == FAILED
        write_model(models["b"], 2)
        assert run(reg.acquire("b"))[0] == "b" and len(calls) == 2
    finally:
        reg.stop()


# -- the --max-loaded limit under concurrent loads -------------------------------------------------------------


class FakeEngine:
    """What the registry asks of an engine: whether anything uses it, and to drain and stop."""

    def __init__(self, name: str) -> None:
        self.name, self.busy, self.reserved, self.stopped = name, 0, 0, False

    def drain(self, timeout: float | None = None) -> bool:
        self.stopped = True
        return True

    def stop(self) -> None:
        self.stopped = True


class BlockingLoader:
    """A loader whose loads each wait for the test to let them finish; it records, at the start of each load, how
    many models the registry holds in memory or is loading (this one included)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: dict[str, threading.Event] = {}
        self.finish: dict[str, threading.Event] = {}
        self.in_memory: list[int] = []
        self.loading = 0
        self.reg: ModelRegistry | None = None

    def events(self, name: str) -> tuple[threading.Event, threading.Event]:
        with self.lock:
            return (self.started.setdefault(name, threading.Event()), self.finish.setdefault(name, threading.Event()))

    def __call__(self, path: Path):
        started, finish = self.events(path.name)
        assert self.reg is not None
        with self.lock:
            self.loading += 1
            self.in_memory.append(len(self.reg.loaded()) + self.loading)
        started.set()
        try:
            assert finish.wait(60), f"the test never let {path.name} finish loading"
        finally:
            with self.lock:
                self.loading -= 1
        return SimpleNamespace(meta={}, config_sha256=None), FakeEngine(path.name)


def five(tmp_path: Path) -> dict[str, Path]:
    return {name: tmp_path / name for name in "abcde"}


def test_max_loaded_holds_under_concurrent_loads(tmp_path) -> None:
    """Five requests at once for five models with --max-loaded 2: loads in progress count, so two loads begin and
    the other three wait; each then takes the place of an idle model. Every request gets its model."""
    load = BlockingLoader()
    reg = load.reg = ModelRegistry(five(tmp_path), load, max_loaded=2, load_wait=120)
    try:
        async def main() -> list[str]:
            requests = [asyncio.create_task(reg.acquire(name)) for name in "abcde"]
            while len([n for n in "abcde" if load.events(n)[0].is_set()]) < 2:
                await asyncio.sleep(0.01)
            begun = [n for n in "abcde" if load.events(n)[0].is_set()]
            assert len(begun) == 2, begun
            assert sum(i.state == LOADING for i in reg.info()) == 5  # three of them waiting for a place
            for name in "abcde":  # let each load finish as soon as it begins
                load.events(name)[1].set()
            return [(await r)[0] for r in requests]

        assert run_long(main()) == list("abcde")
        assert not [i for i in reg.info() if i.state == FAILED], reg.info()
        assert max(load.in_memory) == 2 and len(load.in_memory) >= 5, load.in_memory
        assert len(reg.loaded()) <= 2
    finally:
        for name in "abcde":
            load.events(name)[1].set()
        reg.stop()


def test_a_load_waits_for_a_place_until_a_loaded_model_is_idle(tmp_path) -> None:
    """A busy model is not unloaded to make room (its running requests would share memory with the new load): the
    load waits until it is idle, then takes its place."""
    load = BlockingLoader()
    reg = load.reg = ModelRegistry(five(tmp_path), load, max_loaded=1, load_wait=120)
    load.events("a")[1].set()
    load.events("b")[1].set()
    waiting = threading.Event()  # b's load logged that it waits for a place, or (wrongly) began
    load.started["b"] = waiting
    note = logging.Handler(logging.INFO)
    note.emit = lambda record: waiting.set() if "waits for a place" in record.getMessage() else None
    logger = logging.getLogger("folio.registry")
    level = logger.level
    logger.addHandler(note)
    logger.setLevel(logging.INFO)
    try:
        _, a, _ = run(reg.acquire("a"))
        a.busy = 1  # a request runs on it

        async def main() -> str:
            request = asyncio.create_task(reg.acquire("b"))
            assert await asyncio.to_thread(waiting.wait, 60)
            assert load.loading == 0 and not a.stopped and reg.loaded()[0][0] == "a"  # b's load has not begun
            a.busy = 0  # the request on a finished
            return (await request)[0]

        assert run_long(main()) == "b"
        assert a.stopped and [n for n, _, _ in reg.loaded()] == ["b"] and reg.info()[1].state == LOADED
    finally:
        logger.removeHandler(note)
        logger.setLevel(level)
        reg.stop()


def run_long(coro):
    """`run` with a bound no loaded machine reaches: these tests wait on events, never on the clock."""
    return asyncio.run(asyncio.wait_for(coro, 120.0))


# -- hot reload: torn files, long requests, memory -------------------------------------------------------------


def test_a_torn_copy_is_refused_then_loaded_once_its_files_are_complete(models, tmp_path) -> None:
    """`cp new/config.json new/model.safetensors DIR/` writes the files one after the other: a look in between finds
    the new config.json beside the old weights. That reload is refused (the old weights serve on) and tried again
    once the weights have changed too, though config.json has not changed since."""
    new = write_model(tmp_path / "new", 3)
    reg = ModelRegistry(models, loader())
    try:
        _, old, _ = run(reg.acquire("a"))
        before = greedy(old)
        (models["a"] / "config.json").write_bytes((new / "config.json").read_bytes())
        assert reg.reload("a") is False
        info = reg.info()[0]
        assert "reload refused" in info.error and "sha256" in info.error and info.refused_reloads == 1
        assert run(reg.acquire("a"))[1] is old and greedy(old) == before
        assert reg.reload("a") is False and reg.info()[0].refused_reloads == 1  # the same files: not tried again
        (models["a"] / "model.safetensors").write_bytes((new / "model.safetensors").read_bytes())
        assert reg.reload("a") is True
        _, engine, _ = run(reg.acquire("a"))
        assert greedy(engine) == greedy(loader()(new)[1]) != before and reg.info()[0].error is None
    finally:
        reg.stop()


def test_a_config_caught_mid_write_is_reloaded_once(models, tmp_path) -> None:
    """`cp` truncates config.json, then writes it: a look in between hashes an empty file, and the load that
    follows reads the whole new one. The reload records what the load read, so the next look finds nothing new
    (it had counted a second reload of the same files: CI saw 3 reloads for 2 replacements)."""
    new = write_model(tmp_path / "new", 3)
    load, copying = loader(), threading.Event()

    def load_as_cp_finishes(path: Path):
        if copying.is_set():
            (path / "config.json").write_bytes((new / "config.json").read_bytes())
        return load(path)

    reg = ModelRegistry(models, load_as_cp_finishes)
    try:
        run(reg.acquire("a"))
        copying.set()
        (models["a"] / "model.safetensors").write_bytes((new / "model.safetensors").read_bytes())
        (models["a"] / "config.json").write_bytes(b"")  # what the look sees
        assert reg.reload("a") is True
        info = reg.info()[0]
        assert info.reloads == 1 and info.config_sha256 == hashlib.sha256((new / "config.json").read_bytes()
                                                                          ).hexdigest()
        assert reg.reload("a") is False and reg.info()[0].reloads == 1
    finally:
        reg.stop()


def test_a_checkpoint_rolled_forward_to_its_pending_config_is_not_reloaded_again(models, tmp_path) -> None:
    """A save cut short between its renames leaves the new weights, config.next.json, and the old config.json: the
    load rolls forward to config.next.json (model/checkpoint.py), and the next look, which finds config.json as
    the load read it, has nothing to reload (recording config.next.json's digest reloaded it at every look)."""
    new = write_model(tmp_path / "new", 3)
    (models["a"] / "config.next.json").write_bytes((new / "config.json").read_bytes())
    (models["a"] / "model.safetensors").write_bytes((new / "model.safetensors").read_bytes())
    reg = ModelRegistry(models, loader())
    try:
        _, engine, _ = run(reg.acquire("a"))
        assert greedy(engine) == greedy(loader()(new)[1])  # rolled forward: the new weights serve
        assert reg.reload("a") is False and reg.reload("a") is False and reg.info()[0].reloads == 0
    finally:
        reg.stop()


def test_requests_on_retired_weights_finish_however_long_they_take(models, monkeypatch) -> None:
    """A reload's old engine finishes every request it runs before it stops, with no deadline: here its clock says
    an hour passes between two of its checks (a stream of thousands of tokens on a loaded machine), and the request
    still ends with all its tokens, on the old weights. The old engine stopped after `drain_timeout` (30 s) and cut
    its streams ("the engine stopped before this request finished")."""
    reg = ModelRegistry(models, loader())
    try:
        _, old, _ = run(reg.acquire("a"))
        want = greedy(old, 30)
        clock = [time.monotonic()]
        polls = threading.Semaphore(0)
        monkeypatch.setattr(engine_module, "time", SimpleNamespace(
            monotonic=lambda: clock.__setitem__(0, clock[0] + 3600) or clock[0],
            sleep=lambda s: (polls.release(), time.sleep(s))))
        hold = threading.Event()
        old.fault_hook = lambda reqs: hold.wait(60)
        out: list = []
        params = SamplingParams(max_new_tokens=30)
        running = threading.Thread(target=lambda: out.append(old.generate([1, 2, 3], params)))
        running.start()
        write_model(models["a"], 3)
        assert reg.reload("a") is True
        looks = 0  # until the drain has looked three times whether the request is done (or stopped the engine)
        while looks < 3 and not old.scheduler.stopping:
            looks += polls.acquire(timeout=0.1)
        hold.set()
        running.join(60)
        assert out and out[0].token_ids == want and out[0].finished.finish_reason == "length"
    finally:
        reg.stop()


def test_a_request_that_finds_the_engine_full_while_new_weights_load_waits_for_them(models) -> None:
    """While a reload loads, a request goes to the old engine if it has a free batch slot, and otherwise waits for
    the new weights: in the old engine it would wait behind requests that may run for minutes (4 of 30 new requests
    waited 28 s behind 1,500-token streams in the bench's hot_reload section)."""
    gate, calls, load = threading.Event(), [], loader()

    def reload_waits(path: Path):
        calls.append(path)
        if len(calls) > 1:
            assert gate.wait(60), "the test never let the reload finish"
        return load(path)

    reg = ModelRegistry(models, reload_waits, load_wait=60)
    running: list[threading.Thread] = []
    try:
        _, old, _ = run(reg.acquire("a"))
        hold = threading.Event()
        old.fault_hook = lambda reqs: hold.wait(60)
        results: list = []

        def occupy(n: int) -> None:  # n more requests running on the old engine (4 slots)
            for _ in range(n):
                running.append(threading.Thread(target=lambda: results.append(
                    old.generate([1, 2, 3], SamplingParams(max_new_tokens=5)))))
                running[-1].start()
            while old.busy < len(running):
                time.sleep(0.01)

        occupy(3)
        write_model(models["a"], 3)
        reloading = threading.Thread(target=reg.reload, args=("a",))
        reloading.start()
        while len(calls) < 2:
            time.sleep(0.01)

        async def main() -> Engine:
            free = asyncio.create_task(reg.acquire("a"))
            await asyncio.sleep(0)
            assert free.done() and free.result()[1] is old  # a slot is free in the old engine: at once
            await asyncio.to_thread(occupy, 1)
            full = asyncio.create_task(reg.acquire("a"))
            await asyncio.sleep(0)
            assert not full.done()  # no slot free: it waits for the new weights
            gate.set()
            return (await full)[1]

        new = run_long(main())
        assert new is not old and greedy(new) == greedy(load(models["a"])[1])
        hold.set()
        reloading.join(60)
        for t in running:
            t.join(60)
        assert len(results) == 4 and all(len(r.token_ids) == 5 for r in results)  # the old ones finished
    finally:
        gate.set()
        reg.stop()


def test_a_reload_is_refused_while_memory_is_short_and_tried_again_when_it_is_not(models) -> None:
    memory = {"needed": 300 * 2**20, "available": 200 * 2**20}
    reg = ModelRegistry(models, loader(), memory=lambda path: (memory["needed"], memory["available"]))
    try:
        _, old, _ = run(reg.acquire("a"))
        write_model(models["a"], 3)
        assert reg.reload("a") is False and reg.reload("a") is False
        info = reg.info()[0]
        assert info.error == (
            "reload refused: loading the new weights of a beside the engine serving it needs about 315MB (weights, "
            "their packed copy and the KV cache), and 210MB of memory is available; it is tried again at each look "
            "(--watch, POST /admin/reload) until memory frees up (fewer loaded models: --max-loaded; a smaller "
            "--max-batch-size)")
        assert info.refused_reloads == 1 and run(reg.acquire("a"))[1] is old  # counted once for the same files
        memory["available"] = 400 * 2**20  # the files unchanged, memory freed
        assert reg.reload("a") is True and run(reg.acquire("a"))[1] is not old and reg.info()[0].error is None
    finally:
        reg.stop()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp16"])
@pytest.mark.parametrize("draft", [False, True])
def test_the_memory_a_reload_checks_is_what_the_engine_takes(models, kv_cache_dtype: str, draft: bool) -> None:
    """`memory_needed`, known before loading, against what the engine then holds: its weights, their packed
    copy (the CPU kernels) and its KV cache, and those of its draft model where it speculates with one. At least
    that, and not far above: the packed copy is estimated as large as all the weights (this tiny model's embeddings
    and layer norms are a tenth of them; GPT-2's are unpacked wpe and norms, 1%)."""
    ck = load_checkpoint(models["a"])
    config = EngineConfig(device="cpu", threads=1, max_batch_size=4, kv_cache_dtype=kv_cache_dtype,
                          speculative_model=str(models["a"]) if draft else None, draft_token_cost=0.0)
    engine = Engine(ck, config)
    runners = [engine.runner] + ([engine.draft_runner] if draft else [])
    held = sum(sum(p.numel() * p.element_size() for p in r.model.parameters()) + r.packed_bytes + r.kv_cache_bytes
               for r in runners if r is not None)
    estimate = memory_needed(ck.config, (models["a"] / "model.safetensors").stat().st_size, config)
    assert held <= estimate <= 1.15 * held, (held, estimate)
