"""LoRA adapters over HTTP (app/serving/models.py, app/api/models/router.py): `--lora-modules` names them as models,
OpenAI's and Anthropic's `model` field and the X-Folio-Model header pick one, and its answers equal the merged model
served alone; `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` behind the API key, a mismatch a 400 naming
what differs while the server keeps serving, `--max-loras`, and a request running through an adapter that is
unloaded meanwhile finishing as it would have."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from model.checkpoint import load_checkpoint, save_checkpoint
from model.lora import batched as lora
from model.lora.adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from model.testing import make_char_checkpoint
from model.train.__main__ import main as train_main
from tests import REPO
from tests.conftest import make_peft_adapter

BASE: dict[str, Any] = dict(device="cpu", threads=1, max_batch_size=4, max_waiting=8)
KEY = {"Authorization": "Bearer secret"}
BUNDLED = REPO / "weights" / "shakespeare-char"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The base checkpoint, two PEFT adapters for its shape, one for a wider model, and each adapter merged into
    the base as a checkpoint of its own."""
    root = tmp_path_factory.mktemp("lora")
    out = {"base": make_char_checkpoint(root / "base", seed=1)}
    vocab = load_checkpoint(out["base"]).config.vocab_size
    out["one"] = make_peft_adapter(root / "one", vocab_size=vocab, r=4, alpha=16, seed=1)[0]
    out["two"] = make_peft_adapter(root / "two", vocab_size=vocab, r=8, alpha=32, seed=2, targets=("c_attn",))[0]
    out["wide"] = make_peft_adapter(root / "wide", vocab_size=vocab, n_embd=64, seed=3)[0]
    for name in ("one", "two"):
        ck = load_checkpoint(out["base"])
        lora.merge(ck.model, lora.load_adapter(out[name], ck.config))
        out[f"merged-{name}"] = save_checkpoint(root / f"merged-{name}", ck.model, ck.tokenizer)
    return out


def client(**settings: Any) -> TestClient:
    return TestClient(create_app(Settings(**{**BASE, **settings})))


def completion(c: TestClient, model: str | None = None, prompt: str = "Hello there", n: int = 16) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, **({"model": model} if model else {})}
    r = c.post("/v1/completions", json=body, headers=KEY)
    assert r.status_code == 200, r.text
    return r.json()


def text(c: TestClient, model: str | None = None) -> str:
    return completion(c, model)["choices"][0]["text"]


@pytest.fixture(scope="module")
def merged(dirs: dict[str, Path]) -> dict[str, str]:
    """The greedy answer of each merged model, and of the base, each served alone."""
    out = {}
    for name in ("base", "merged-one", "merged-two"):
        with client(checkpoint=dirs[name]) as c:
            out[name] = text(c)
    assert len(set(out.values())) == 3
    return out


def test_adapters_are_models_whose_answers_equal_the_merged_model(dirs, merged) -> None:
    with client(checkpoint=dirs["base"], model_id="base",
                lora_modules=[f"one={dirs['one']}", f"two={dirs['two']}"]) as c:
        listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert listed["one"]["parent"] == "base" and listed["two"]["root"] == "two"
        assert c.get("/v1/models/one").json() == listed["one"]  # OpenAI's retrieve
        assert listed["one"]["created"] == int((dirs["one"] / "adapter_model.safetensors").stat().st_mtime)
        assert text(c, "one") == merged["merged-one"] and text(c, "two") == merged["merged-two"]
        assert text(c) == text(c, "base") == merged["base"]
        assert completion(c, "two")["model"] == "two"
        # TGI's route picks it by the header, Anthropic's Messages by its model field
        r = c.post("/generate", headers={"X-Folio-Model": "one"},
                   json={"inputs": "Hello there", "parameters": {"max_new_tokens": 16}})
        assert r.status_code == 200 and r.json()["generated_text"] == merged["merged-one"]
        r = c.post("/v1/messages", json={"model": "two", "max_tokens": 8, "temperature": 0,
                                         "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "two"

        # each adapter's answers carry a fingerprint of their own, which /info (its base's, with the adapter) names
        prints = {m: completion(c, m)["system_fingerprint"] for m in ("base", "one", "two")}
        assert len(set(prints.values())) == 3 and prints["base"] == c.get("/info").json()["model_sha"][:16]
        r = c.post("/generate", headers={"X-Folio-Model": "one"}, json={"inputs": "Hi", "parameters": {}})
        assert r.headers["X-Folio-Checkpoint"] == prints["one"]
        info = c.get("/info", headers={"X-Folio-Model": "one"}).json()
        assert info["model_id"] == "one" and info["model_sha"] == c.get("/info").json()["model_sha"]
        assert info["adapter"] == {"base_model": "base", "directory": "one", "fingerprint": prints["one"]}
        assert c.get("/info").json()["adapter"] is None


def test_load_and_unload_over_http(dirs, merged) -> None:
    with client(checkpoint=dirs["base"], enable_lora=True, max_loras=1, api_key="secret") as c:
        load = {"lora_name": "one", "lora_path": str(dirs["one"])}
        assert c.post("/v1/load_lora_adapter", json=load).status_code == 401
        r = c.post("/v1/load_lora_adapter", json={**load, "lora_path": str(dirs["wide"])}, headers=KEY)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "lora_path"
        assert "lora_A (4, 64) and lora_B (192, 4); a base of n_embd 32 needs lora_A (4, 32) and lora_B (96, 4)" \
            in r.text
        assert text(c) == merged["base"]  # still serving
        r = c.post("/v1/load_lora_adapter", json=load, headers=KEY)
        assert r.status_code == 200, r.text
        assert r.json()["rank"] == 4 and r.json()["targets"] == ["attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                  "mlp.c_proj"]
        assert text(c, "one") == merged["merged-one"]
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": str(dirs["two"])}, headers=KEY)
        assert r.status_code == 400 and "the most --max-loras allows (1)" in r.text
        r = c.post("/v1/load_lora_adapter", json={**load, "lora_path": str(dirs["two"])}, headers=KEY)
        assert r.status_code == 400 and "served already" in r.text
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "one"}, headers=KEY).status_code == 200
        assert "one" not in {m["id"] for m in c.get("/v1/models").json()["data"]}
        r = c.post("/v1/completions", json={"model": "one", "prompt": "Hi", "max_tokens": 2}, headers=KEY)
        assert r.status_code == 404
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "one"}, headers=KEY)
        assert r.status_code == 404 and "no LoRA adapter 'one' is loaded" in r.text
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": str(dirs["two"])}, headers=KEY)
        assert r.status_code == 200 and text(c, "two") == merged["merged-two"]


def test_a_path_that_cannot_be_an_adapter_is_a_short_400(dirs, merged, tmp_path) -> None:
    """A path no file system takes (a name over 255 bytes) and a long one that does not exist: 400s naming
    lora_path, the path cut short in the message; the server goes on serving."""
    with client(checkpoint=dirs["base"], enable_lora=True) as c:
        for path in ("/" + "a" * 300, "/".join(["b" * 200] * 20), str(tmp_path / "nothing")):
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
            assert len(r.text) < 600 and "cannot serve it over the model" in r.text, r.text
        assert text(c) == merged["base"]  # still serving


def test_adapters_off_refuse_a_load(dirs) -> None:
    with client(checkpoint=dirs["base"]) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "one", "lora_path": str(dirs["one"])})
        assert r.status_code == 400 and "--enable-lora" in r.text


def test_a_request_running_through_an_unloaded_adapter_finishes(dirs, merged) -> None:
    with client(checkpoint=dirs["base"], lora_modules=[f"one={dirs['one']}"]) as c:
        engine = c.app.state.models.registry.loaded()[0][1]
        started, go = threading.Event(), threading.Event()

        def hold(reqs) -> None:  # the request's first model step waits until the adapter is unloaded
            started.set()
            assert go.wait(10)

        engine.fault_hook = hold
        answer: list[str] = []
        worker = threading.Thread(target=lambda: answer.append(text(c, "one")))
        worker.start()
        assert started.wait(10)
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "one"}).status_code == 200
        go.set()
        worker.join(10)
        engine.fault_hook = None
        assert answer == [merged["merged-one"]]


def test_an_adapter_rewritten_by_a_training_run_is_served_anew_without_a_failed_request(dirs, merged,
                                                                                           tmp_path: Path) -> None:
    """With --watch: a training run writes a new checkpoint of a served adapter (the weights, then the config, each
    replaced whole, as model/train writes them; in between the pair does not fit together). Requests keep getting
    answers all along, each the old adapter's or the new one's, and then the new one's."""
    live = tmp_path / "live"
    shutil.copytree(dirs["one"], live)
    with client(checkpoint=dirs["base"], model_id="base", lora_modules=[f"live={live}"], watch=0.1) as c:
        assert text(c, "live") == merged["merged-one"]
        answers: list[str] = []
        stop = threading.Event()

        def ask() -> None:
            while not stop.is_set():
                answers.append(text(c, "live"))

        asking = threading.Thread(target=ask)
        asking.start()
        try:
            for name in (ADAPTER_WEIGHTS_FILE, ADAPTER_CONFIG_FILE):  # a new rank and targets: half-written, no fit
                shutil.copy(dirs["two"] / name, tmp_path / name)
                os.replace(tmp_path / name, live / name)
                time.sleep(0.5)  # let the watcher see the half-written pair (it must keep the old adapter)
            deadline = time.monotonic() + 60
            while text(c, "live") != merged["merged-two"]:
                assert time.monotonic() < deadline, "the rewritten adapter was never served"
                time.sleep(0.1)
        finally:
            stop.set()
            asking.join()
        assert answers and set(answers) <= {merged["merged-one"], merged["merged-two"]}
        assert text(c, "base") == merged["base"]


def test_the_training_view_shows_an_adapters_own_run(tmp_path: Path) -> None:
    """A LoRA training run over the bundled model (model.train --lora, 20 steps) writes the adapter and its
    metrics.jsonl; served with --lora-modules, /models/{adapter}/training answers with that run (its provenance, its
    base, every metrics row), not a 404, and /v1/models lists it for the page's picker. Its fingerprint follows the
    adapter's files: a new checkpoint of the adapter (as the run writes it) changes it."""
    text = tmp_path / "new.txt"
    text.write_text("the cat sat on the mat. a dog ran to the park.\n" * 400)
    out = tmp_path / "adapter"
    assert train_main(["--data", str(text), "--out", str(out), "--init-from", str(BUNDLED), "--lora",
                       "--lora-rank", "4", "--max-iters", "20", "--batch-size", "4", "--eval-interval", "10",
                       "--eval-iters", "2", "--log-interval", "5", "--warmup-iters", "5", "--device", "cpu",
                       "--no-progress", "--threads", "1"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    with client(checkpoint=BUNDLED, model_id="base", lora_modules=[f"cats={out}"], watch=0.1) as c:
        assert "cats" in {m["id"] for m in c.get("/v1/models").json()["data"]}
        r = c.get("/models/cats/training")
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["model"] == "cats" and got["base_model"] == "base" and got["metrics"] == rows
        training = got["training"]
        assert training["steps"] == 20 and training["train_config"]["lora_rank"] == 4, training
        assert training["base"]["source"] == "shakespeare-char" and training["dataset"] == "new.txt"
        assert str(tmp_path) not in r.text  # no paths, as /info
        first = got["fingerprint"]
        assert first and c.get("/models/cats/training").json()["fingerprint"] == first
        weights = out / ADAPTER_WEIGHTS_FILE
        shutil.copy(weights, tmp_path / "w")
        os.replace(tmp_path / "w", weights)  # a new checkpoint of the adapter: its files' stamp changes
        deadline = time.monotonic() + 30
        while c.get("/models/cats/training").json()["fingerprint"] == first:
            assert time.monotonic() < deadline, "the fingerprint never followed the adapter's new files"
            time.sleep(0.1)
