"""Models that change while the server runs (app/models.py, model/registry.py): checkpoints put into --models-dir
are served with --watch, a broken one is refused (and not loaded again until its files change) while the others
serve, an answer names the checkpoint that made it even when a reload swaps the weights meanwhile, and the
weights a reload or an unload retires leave memory (an engine object, and a real server's RSS under load).
Reload under load with the real trainer writing is a reliability section (bench/reliability/reload.py)."""

from __future__ import annotations

import gc
import hashlib
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

import app.models
from app.testing import serving
from bench.reliability.reload import StreamingClients, rss_mb
from model.testing import make_char_checkpoint
from tests.app.test_models_http import PROMPT, client, greedy, states


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The greedy answer of the seeded checkpoint of each seed, from a server that serves it alone."""
    out = {}
    for seed in (1, 2, 3):
        with client(checkpoint=make_char_checkpoint(tmp_path_factory.mktemp("alone") / f"s{seed}", seed=seed)) as c:
            out[seed] = greedy(c)["choices"][0]["text"]
    assert len(set(out.values())) == 3
    return out


def test_checkpoints_put_into_the_models_dir_are_served_and_a_broken_one_refused(
        tmp_path: Path, answers: dict[int, str], monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[str] = []
    load = app.models.load_checkpoint
    monkeypatch.setattr(app.models, "load_checkpoint", lambda path: (loads.append(Path(path).name), load(path))[1])
    root = tmp_path / "models"
    a = make_char_checkpoint(root / "a", seed=1)
    with client(checkpoint=a, models_dir=root, watch=0.05, max_loaded=2) as c:
        assert states(c) == {"a": "loaded"}
        make_char_checkpoint(tmp_path / "b", seed=2)
        shutil.copytree(tmp_path / "b", root / "b")  # config.json may land before the weights: it is not loaded yet
        wait_for(lambda: "b" in states(c), "b to be listed")
        assert states(c)["b"] == "unloaded" and greedy(c, "b")["choices"][0]["text"] == answers[2]
        broken = make_char_checkpoint(tmp_path / "staging" / "broken", seed=3)
        (broken / "model.safetensors").write_bytes(b"\0" * 64)  # torn weights
        shutil.move(broken, root / "broken")
        wait_for(lambda: "broken" in states(c), "broken to be listed")
        for _ in range(3):
            r = c.post("/v1/completions", json={"prompt": PROMPT, "model": "broken"})
            assert r.status_code == 503 and "could not be loaded" in r.json()["error"]["message"]
        assert loads.count("broken") == 1  # tried once, not at every request
        model = next(m for m in c.get("/v1/models").json()["data"] if m["id"] == "broken")
        assert model["state"] == "failed" and "model.safetensors" in model["error"]
        after_failure = states(c)
        assert greedy(c, "b")["choices"][0]["text"] == answers[2]  # the others serve
        assert greedy(c, "a")["choices"][0]["text"] == answers[1]
        assert after_failure["a"] == "loaded" or after_failure["b"] == "loaded"
        make_char_checkpoint(root / "broken", seed=3)  # mended: its files changed, so the next request loads it
        assert greedy(c, "broken")["choices"][0]["text"] == answers[3]
        assert loads.count("broken") == 2


def held(c: TestClient, send: Callable[[], Any]) -> tuple[threading.Event, threading.Thread, list[Any]]:
    """Run `send` in a thread with the default model's engine held at its next step: (gate, thread, [answer])."""
    engine = c.app.state.service.engine
    gate, entered = threading.Event(), threading.Event()
    engine.on_step = lambda reqs: (entered.set(), gate.wait(10))
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(send()))
    worker.start()
    assert entered.wait(10)
    engine.on_step = None  # the step already entered still waits for the gate
    return gate, worker, out


def test_an_answer_names_the_checkpoint_that_made_it_across_a_reload(tmp_path: Path,
                                                                     answers: dict[int, str]) -> None:
    path = make_char_checkpoint(tmp_path / "live", seed=1)
    with client(checkpoint=path, watch=3600) as c:  # the registry on, reloads by /admin/reload only
        old = c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12}})
        assert old.json()["generated_text"] == answers[1]
        gate, worker, out = held(c, lambda: c.post("/generate", json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": 12}}))
        make_char_checkpoint(path, seed=2)
        assert c.post("/admin/reload", json={}).json()["reloaded"] == {"live": True}
        gate.set()
        worker.join(30)
        [running] = out
        # the request running across the reload: the old weights' answer, and it says so
        assert running.json()["generated_text"] == answers[1]
        assert running.headers["x-folio-checkpoint"] == old.headers["x-folio-checkpoint"]
        new = c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12}})
        assert new.json()["generated_text"] == answers[2]
        assert new.headers["x-folio-checkpoint"] != old.headers["x-folio-checkpoint"]
        info = next(m for m in c.get("/info").json()["models"] if m["name"] == "live")
        assert info["weights_sha256"].startswith(new.headers["x-folio-checkpoint"]) and info["reloads"] == 1


def test_the_engine_a_reload_or_an_unload_retires_is_freed(tmp_path: Path) -> None:
    """Without the garbage collector's own runs (disabled here), only what the registry does frees it."""
    a, b = make_char_checkpoint(tmp_path / "a", seed=1), make_char_checkpoint(tmp_path / "b", seed=2)
    gc.disable()
    try:
        with client(checkpoint=a, models=[str(b)], max_loaded=1) as c:
            greedy(c)
            retired = weakref.ref(c.app.state.service.engine)
            make_char_checkpoint(a, seed=3)
            assert c.post("/admin/reload", json={"model": "a"}).json()["reloaded"] == {"a": True}
            greedy(c)
            wait_for(lambda: retired() is None, "the engine the reload retired to be freed")
            unloaded = weakref.ref(c.app.state.service.engine)
            greedy(c, "b")  # --max-loaded 1: a is unloaded
            wait_for(lambda: unloaded() is None, "the engine the unload retired to be freed")
    finally:
        gc.enable()


@pytest.mark.slow
def test_memory_stays_level_across_reloads_under_load(tmp_path: Path) -> None:
    """A real server with --watch, streaming clients throughout, a 48 MB checkpoint re-saved five times: every
    request completes, the newest weights answer last, and the RSS stays within a few copies of the weights of
    where it started (each old engine kept would add the weights twice: their packed copy too). Figures printed."""
    live = make_char_checkpoint(tmp_path / "live", seed=0, n_layer=4, n_embd=512)
    weights_mb = (live / "model.safetensors").stat().st_size / 2**20
    with serving(live, tmp_path / "server.log", "--watch", "0.2") as (base, proc), httpx.Client(timeout=60) as http:
        load = StreamingClients(base, http, 3)
        try:
            wait_for(lambda: load.served >= 3, "the first answers")
            before = rss_mb(proc.pid)
            for seed in range(1, 6):
                make_char_checkpoint(live, seed=seed, n_layer=4, n_embd=512)
                digest = hashlib.sha256((live / "config.json").read_bytes()).hexdigest()
                wait_for(lambda d=digest: http.get(f"{base}/info").json()["models"][0]["config_sha256"] == d,
                         f"reload {seed}", timeout=60)
            served = load.served
            wait_for(lambda: load.served >= served + 3, "answers from the last weights")
        finally:
            load.join()
        time.sleep(2)  # the last retired engine drained and collected (RETIRE_COLLECTIONS runs 0.5 s apart)
        after = rss_mb(proc.pid)
        last = http.post(f"{base}/generate", json={"inputs": PROMPT}).headers["x-folio-checkpoint"]
    print(f"weights {weights_mb:.0f} MB; RSS {before:.0f} -> {after:.0f} MB over 5 reloads; served {load.served}, "
          f"failed {load.failed.count}, {len(load.checkpoints)} checkpoints answered")
    assert load.failed.count == 0, list(load.failed)
    assert len(load.checkpoints) >= 2 and last in load.checkpoints
    assert after - before < 3 * weights_mb
