"""Several models in one process: load on first use, LRU unloading, a broken model alone failing, hot reload that
finishes running requests on the old weights and refuses a broken new checkpoint."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import GPTConfig
from model.engine import Engine
from model.gpt import GPT
from model.registry import FAILED, LOADED, LOADING, UNLOADED, ModelFailed, ModelLoading, ModelNotFound, ModelRegistry
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
        old.on_step = lambda reqs: hold.wait(10)

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

    def loaded(info, checkpoint, digest) -> None:  # another load makes room by unloading it, at once (once)
        ModelRegistry._loaded(info, checkpoint, digest)
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
