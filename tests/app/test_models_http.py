"""Several checkpoints in one server and hot reload
(app/serving/models.py): each model's answers equal a server
with that model alone, LRU unloading under --max-loaded (the default model loading again for requests that name
none), a model at capacity refusing nothing to the others, a 503 with Retry-After while a model loads, a broken
checkpoint refused while the others serve, and a reload that lets a running stream finish on the old weights
while new requests get the new. Reload under
load with the real trainer writing is a reliability section (bench/reliability/reload.py, tests/reliability)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from app.testing import metric, parse_sse
from model.testing import make_char_checkpoint

BASE: dict[str, Any] = dict(device="cpu", threads=1, max_batch_size=4, max_waiting=8)
PROMPT = "Hello there"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_char_checkpoint(root / name, seed=seed) for name, seed in (("a", 1), ("b", 2))}


def client(**settings: Any) -> TestClient:
    return TestClient(create_app(Settings(**{**BASE, **settings})))


def greedy(c: TestClient, model: str | None = None, prompt: str = PROMPT, n: int = 12) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, **({"model": model} if model else {})}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def alone(dirs: dict[str, Path]) -> dict[str, str]:
    """Each model's greedy answer from a server that serves it alone."""
    out = {}
    for name, path in dirs.items():
        with client(checkpoint=path) as c:
            out[name] = greedy(c)["choices"][0]["text"]
    assert out["a"] != out["b"]
    return out


def states(c: TestClient) -> dict[str, str]:
    return {m["id"]: m["state"] for m in c.get("/v1/models").json()["data"]}


def test_interleaved_requests_get_each_models_own_answer(dirs: dict[str, Path], alone: dict[str, str]) -> None:
    with client(checkpoint=dirs["a"], models=[str(dirs["b"])]) as c:
        assert states(c) == {"a": "loaded", "b": "unloaded"}  # the default at start, the others on first use
        for name in ("b", "a", "b", "a"):
            body = greedy(c, name)
            assert body["model"] == name and body["choices"][0]["text"] == alone[name]
        tgi = c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12}},
                     headers={"X-Folio-Model": "b"})
        assert tgi.json()["generated_text"] == alone["b"]
        assert tgi.headers["x-folio-checkpoint"] == greedy(c, "b")["system_fingerprint"] != greedy(c)[
            "system_fingerprint"]
        r = c.post("/v1/completions", json={"prompt": PROMPT, "model": "c"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model" and "['a', 'b']" in r.text
        r = c.post("/generate", json={"inputs": PROMPT}, headers={"X-Folio-Model": "c"})
        assert r.status_code == 404 and r.json()["error_type"] == "not_found"
        info = c.get("/info").json()
        assert [m["name"] for m in info["models"]] == ["a", "b"] and all(m["config_sha256"] for m in info["models"])


def test_concurrent_requests_to_several_models_each_get_their_models_answer(dirs: dict[str, Path],
                                                                            alone: dict[str, str]) -> None:
    with client(checkpoint=dirs["a"], models=[str(dirs["b"])]) as c:
        got: list[tuple[str, str, str]] = []

        def ask(name: str, api: str) -> None:
            if api == "openai":
                got.append((name, api, greedy(c, name)["choices"][0]["text"]))
            else:
                r = c.post("/generate_stream", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12}},
                           headers={"X-Folio-Model": name})
                got.append((name, api, "".join(e["token"]["text"] for e in parse_sse(r.text))))

        workers = [threading.Thread(target=ask, args=(name, api)) for _ in range(3) for name in ("a", "b")
                   for api in ("openai", "tgi")]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert len(got) == len(workers) and all(text == alone[name] for name, _, text in got), got


def test_least_recently_used_model_is_unloaded_beyond_max_loaded(dirs: dict[str, Path],
                                                                 alone: dict[str, str]) -> None:
    with client(checkpoint=dirs["a"], models=[str(dirs["b"])], max_loaded=1) as c:
        assert greedy(c, "b")["choices"][0]["text"] == alone["b"]
        assert states(c) == {"a": "unloaded", "b": "loaded"}
        assert greedy(c, "a")["choices"][0]["text"] == alone["a"]
        assert states(c) == {"a": "loaded", "b": "unloaded"}


def test_a_broken_checkpoint_is_refused_while_the_others_serve(dirs: dict[str, Path], alone: dict[str, str],
                                                                tmp_path: Path) -> None:
    root = tmp_path / "dir"
    root.mkdir()
    for name, path in dirs.items():
        (root / name).symlink_to(path)
    broken = make_char_checkpoint(root / "broken", seed=3)
    (broken / "model.safetensors").write_bytes(b"\0" * 64)  # torn weights
    with client(checkpoint=dirs["a"], models_dir=root) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "model": "broken"})
        assert r.status_code == 503 and "could not be loaded" in r.json()["error"]["message"]
        model = next(m for m in c.get("/v1/models").json()["data"] if m["id"] == "broken")
        assert model["state"] == "failed" and model["error"].startswith("model.safetensors is not a readable")
        # the open routes name the file, never where it is (before: the error's absolute path)
        for route, headers in (("/v1/models", {}), ("/info", {}), ("/info", {"X-Folio-Model": "broken"})):
            answer = c.get(route, headers=headers)
            assert "not a readable" in answer.text and str(tmp_path) not in answer.text, (route, answer.text)
        assert greedy(c, "b")["choices"][0]["text"] == alone["b"]
        assert greedy(c, "a")["choices"][0]["text"] == alone["a"]


@pytest.fixture
def reloadable(dirs: dict[str, Path], tmp_path: Path) -> Iterator[tuple[TestClient, Path]]:
    path = make_char_checkpoint(tmp_path / "live", seed=1)
    with client(checkpoint=path, watch=0, models=[str(dirs["b"])]) as c:
        yield c, path


def test_reload_finishes_running_streams_on_the_old_weights(reloadable: tuple[TestClient, Path],
                                                            alone: dict[str, str]) -> None:
    c, path = reloadable
    old = greedy(c)
    assert old["choices"][0]["text"] == alone["a"]  # seed 1, like model a
    long_body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
    want_long = "".join(ch["choices"][0]["text"] for ch in parse_sse(c.post("/v1/completions", json=long_body).text)
                        if ch != "[DONE]")
    engine = c.app.state.service.engine
    gate, entered = threading.Event(), threading.Event()
    engine.fault_hook = lambda reqs: (entered.set(), gate.wait(10))  # hold the stream mid-way
    streamed: list[str] = []
    worker = threading.Thread(target=lambda: streamed.append(c.post("/v1/completions", json=long_body).text))
    worker.start()
    assert entered.wait(10)
    make_char_checkpoint(path, seed=2)  # new weights (those of model b), written atomically
    r = c.post("/admin/reload", json={"model": "live"})
    assert r.status_code == 200 and r.json()["reloaded"] == {"live": True}
    engine.fault_hook = None
    gate.set()
    worker.join(30)
    text = "".join(ch["choices"][0]["text"] for ch in parse_sse(streamed[0]) if ch != "[DONE]")
    assert text == want_long  # the running stream finished on the old weights
    new = greedy(c)
    assert new["choices"][0]["text"] == alone["b"] and new["system_fingerprint"] != old["system_fingerprint"]
    assert metric(c.get("/metrics").text, "folio_model_reloads_total", model="live", result="ok") == 1


def test_a_checkpoint_that_fails_to_load_is_refused_and_the_old_one_serves(
        reloadable: tuple[TestClient, Path], alone: dict[str, str]) -> None:
    c, path = reloadable
    before = greedy(c)
    make_char_checkpoint(path, seed=2)
    (path / "model.safetensors").write_bytes(b"\0" * 64)  # the new config.json with torn weights
    r = c.post("/admin/reload", json={})
    assert r.status_code == 200 and r.json()["reloaded"]["live"] is False
    live = next(m for m in c.get("/info").json()["models"] if m["name"] == "live")
    assert live["state"] == "loaded" and "reload refused" in live["error"]
    after = greedy(c)
    assert after["choices"] == before["choices"] and after["system_fingerprint"] == before["system_fingerprint"]
    assert after["choices"][0]["text"] == alone["a"]
    assert metric(c.get("/metrics").text, "folio_model_reloads_total", model="live", result="refused") == 1


def test_the_default_model_unloaded_to_make_room_serves_requests_that_name_no_model(
        dirs: dict[str, Path], alone: dict[str, str]) -> None:
    with client(checkpoint=dirs["a"], models=[str(dirs["b"])], max_loaded=1) as c:
        greedy(c, "b")
        assert states(c) == {"a": "unloaded", "b": "loaded"}
        # the probes and /metrics answer without loading it, and say it is idle
        assert c.get("/health/ready").status_code == 200 and c.get("/health/live").status_code == 200
        assert metric(c.get("/metrics").text, "folio_running_batch_size") == 0
        assert states(c) == {"a": "unloaded", "b": "loaded"}
        # a request that names no model is the default model's: it loads it again (before: 503 until one named it)
        r = c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12}})
        assert r.status_code == 200 and r.json()["generated_text"] == alone["a"]
        assert states(c) == {"a": "loaded", "b": "unloaded"}
        greedy(c, "b")
        assert greedy(c)["choices"][0]["text"] == alone["a"] and states(c)["a"] == "loaded"


def test_a_model_at_capacity_refuses_nothing_to_the_others(dirs: dict[str, Path], alone: dict[str, str]) -> None:
    """Admission holds a request's slot in its own model's engine: a long stream to b must not fill a."""
    with client(checkpoint=dirs["a"], models=[str(dirs["b"])], max_batch_size=1, max_waiting=0) as c:
        greedy(c, "b")
        engine_b = next(e for n, e, _ in c.app.state.models.registry.loaded() if n == "b")
        gate, entered = threading.Event(), threading.Event()
        engine_b.fault_hook = lambda reqs: (entered.set(), gate.wait(10))
        body = {"prompt": PROMPT, "model": "b", "max_tokens": 5, "stream": True}
        worker = threading.Thread(target=lambda: c.post("/v1/completions", json=body))
        worker.start()
        try:
            assert entered.wait(10)
            assert greedy(c, "a")["choices"][0]["text"] == alone["a"]  # was 429: b's request held a's slot
            r = c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12}})
            assert r.status_code == 200 and r.json()["generated_text"] == alone["a"]
            full = c.post("/v1/completions", json={"prompt": PROMPT, "model": "b", "max_tokens": 5})
            assert full.status_code == 429  # b itself is full
            full = c.post("/generate", json={"inputs": PROMPT}, headers={"X-Folio-Model": "b"})
            assert full.status_code == 429
        finally:
            engine_b.fault_hook = None
            gate.set()
            worker.join(30)
        assert c.app.state.service.engine.reserved == engine_b.reserved == 0


def test_a_model_still_loading_after_the_wait_is_a_503_with_retry_after(
        dirs: dict[str, Path], alone: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    import app.main

    gate = threading.Event()
    build = app.main.build_engine

    def slow_build(settings: Settings, checkpoint: Any) -> Any:
        if checkpoint.path.name == "b":
            assert gate.wait(30)
        return build(settings, checkpoint)

    monkeypatch.setattr(app.main, "build_engine", slow_build)
    with client(checkpoint=dirs["a"], models=[str(dirs["b"])], load_wait=0.2) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "model": "b"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "is loading" in r.text
        assert states(c) == {"a": "loaded", "b": "loading"}
        assert greedy(c, "a")["choices"][0]["text"] == alone["a"]  # the others serve meanwhile
        gate.set()
        assert greedy(c, "b")["choices"][0]["text"] == alone["b"]


def test_without_the_key_no_model_is_loaded_and_the_open_routes_load_none(dirs: dict[str, Path],
                                                                          alone: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """The key is checked before the model a request names is looked up (before: a 401 came after b was loaded,
    evicting a under --max-loaded); /info, /inspect/limits and a model's training view describe a model that is
    not loaded without loading it."""
    run = make_char_checkpoint(tmp_path / "run", seed=3)
    (run / "metrics.jsonl").write_text('{"step": 10, "train_loss": 2.5}\n')
    with client(checkpoint=dirs["a"], models=[str(dirs["b"]), str(run)], api_key="k", max_loaded=1) as c:
        bad = [{}, {"Authorization": "Bearer wrong"}]
        for headers in bad:
            r = c.post("/v1/completions", json={"prompt": PROMPT, "model": "b"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            for route in ("/generate", "/generate_stream", "/tokenize", "/inspect"):
                r = c.post(route, json={"inputs": PROMPT}, headers={**headers, "X-Folio-Model": "b"})
                assert r.status_code == 401 and r.json()["error_type"] == "authentication", (route, r.text)
            r = c.get("/tokenizer_info", headers={**headers, "X-Folio-Model": "b"})
            assert r.status_code == 401
        assert states(c) == {"a": "loaded", "b": "unloaded", "run": "unloaded"}
        info = c.get("/info", headers={"X-Folio-Model": "b"}).json()
        assert (info["model_id"], info["state"]) == ("b", "unloaded") and "parameters" not in info
        assert [m["name"] for m in info["models"]] == ["a", "b", "run"]
        assert c.get("/inspect/limits", headers={"X-Folio-Model": "b"}).json()["model"] is None
        training = c.get("/models/run/training").json()
        stored = json.loads((run / "config.json").read_text())["training"]
        assert training["fingerprint"] is None and training["training"] == stored
        assert training["metrics"] == [{"step": 10, "train_loss": 2.5}]
        assert c.get("/models/nope/training").status_code == 404
        assert states(c) == {"a": "loaded", "b": "unloaded", "run": "unloaded"}
        key = {"Authorization": "Bearer k"}
        r = c.post("/v1/completions", json={"prompt": PROMPT, "model": "b", "max_tokens": 12, "temperature": 0},
                   headers=key)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone["b"]
        assert states(c) == {"a": "unloaded", "b": "loaded", "run": "unloaded"}
        info = c.get("/info", headers={"X-Folio-Model": "b"}).json()
        assert info["model_id"] == "b" and info["parameters"] > 0
        assert c.get("/inspect/limits", headers={"X-Folio-Model": "b"}).json()["model"]["n_vocab"] == 96
        assert c.get("/models/b/training").json()["fingerprint"] == r.json()["system_fingerprint"]


def test_a_server_of_one_checkpoint_reloads_it(tmp_path: Path, alone: dict[str, str]) -> None:
    """One checkpoint, no --watch, --models or --models-dir: POST /admin/reload swaps in its changed weights as for
    any server (a server of one checkpoint ran without the registry and answered 409)."""
    path = make_char_checkpoint(tmp_path / "one", seed=1)
    with client(checkpoint=path) as c:
        assert greedy(c)["choices"][0]["text"] == alone["a"]
        assert c.post("/admin/reload", json={}).json()["reloaded"] == {"one": False}  # its files unchanged
        make_char_checkpoint(path, seed=2)  # new weights (those of model b), written atomically
        r = c.post("/admin/reload", json={})
        assert r.status_code == 200 and r.json()["reloaded"] == {"one": True}, r.text
        assert greedy(c)["choices"][0]["text"] == alone["b"]
        for body, needle in (({"model": ""}, "model: "), ({"model": "one", "force": True}, "unknown fields include "
                                                                                             "['force']")):
            r = c.post("/admin/reload", json=body)  # no name is not every name; no field it does not know
            assert r.status_code == 422 and needle in r.json()["error"], r.text


def test_tokenize_and_detokenize_use_the_tokenizer_of_the_model_named(tmp_path: Path) -> None:
    """vLLM's `model` field (or the X-Folio-Model header) picks whose tokenizer answers; an unknown model is a 404,
    never another model's ids."""
    a = make_char_checkpoint(tmp_path / "a", chars=list("abc "))
    b = make_char_checkpoint(tmp_path / "b", chars=list(" cba"))
    with client(checkpoint=a, models=[str(b)]) as c:
        ids = {name: c.post("/tokenize", json={"prompt": "abc", "model": name}).json()["tokens"] for name in "ab"}
        assert ids == {"a": [0, 1, 2], "b": [3, 2, 1]}
        assert c.post("/tokenize", json={"prompt": "abc"}, headers={"X-Folio-Model": "b"}).json()["tokens"] == [3, 2, 1]
        assert c.post("/detokenize", json={"tokens": [0, 1], "model": "b"}).json() == {"prompt": " c"}
        for route, body in (("/tokenize", {"prompt": "abc", "model": "nope"}),
                            ("/detokenize", {"tokens": [0], "model": "nope"})):
            r = c.post(route, json=body)
            assert r.status_code == 404 and "nope" in r.text, r.text
