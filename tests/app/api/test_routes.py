"""The operational routes: health and the Kubernetes probes, /info, /v1/models, /tokenize, /metrics, the docs."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.api.system.router import VERSION
from app.main import create_app
from app.settings import Settings
from app.testing import assert_openai_error, metric
from model import kernels
from model.checkpoint import WEIGHTS_FILE, load_checkpoint
from model.files import sha256_file
from model.testing import CHARS, TRAINING
from tests.app.api.calls import BASE, LIMIT, engine_of, generate


def test_health_is_ok_after_startup(client: TestClient) -> None:
    r = client.get("/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


def test_probes_say_loading_before_the_lifespan_has_run(char_checkpoint: Path) -> None:
    """The app before its lifespan (checkpoint load, engine start, warmup) has run: no service yet. The process
    is alive; it is neither started nor ready, and says when to ask again."""
    loading = TestClient(create_app(Settings(checkpoint=char_checkpoint, **BASE)))  # no `with`: no lifespan
    for route in ("/health", "/health/startup", "/health/ready"):
        r = loading.get(route)
        assert r.status_code == 503 and r.json()["status"] == "loading", (route, r.text)
        assert r.headers["retry-after"] == "1" and "still loading" in r.json()["reason"]
    r = loading.get("/health/live")
    assert (r.status_code, r.json()) == (200, {"status": "loading"})


def test_probes_after_startup_and_during_warmup(client: TestClient) -> None:
    r = client.get("/health/startup")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    r = client.get("/health/ready")
    assert (r.status_code, r.json()) == (200, {"status": "ok", "in_flight": 0, "capacity": 4 + 8})
    r = client.get("/health/live")
    assert r.status_code == 200 and r.json()["status"] in ("idle", "stepping"), r.text
    lifecycle = client.app.state.models.lifecycle
    lifecycle.ready = False  # the state between the engine's start and the end of its warmup
    try:
        for route in ("/health/startup", "/health/ready"):
            r = client.get(route)
            assert (r.status_code, r.json()["status"]) == (503, "loading"), (route, r.text)
        assert client.get("/health/live").status_code == 200  # the engine thread runs the warmup
    finally:
        lifecycle.ready = True


def test_live_fails_once_the_engine_thread_has_stopped(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    assert client.get("/health/live").status_code == 200
    engine_of(client).stop()
    r = client.get("/health/live")
    reason = "model 'tiny-char': the engine thread is not running"
    assert (r.status_code, r.json()) == (503, {"status": "unhealthy", "reason": reason})


def test_info_describes_model_engine_and_training(client: TestClient, char_checkpoint: Path) -> None:
    r = client.get("/info")
    assert r.status_code == 200
    info = r.json()
    ck = load_checkpoint(char_checkpoint)
    assert info["model_id"] == "tiny-char"  # the directory name
    assert info["checkpoint_sha256"] == sha256_file(char_checkpoint / WEIGHTS_FILE)
    assert info["parameters"] == ck.model.num_params() > 0
    assert info["model_config"] == {"block_size": 64, "vocab_size": 96, "n_layer": 2, "n_head": 2, "n_embd": 32,
                                    "dropout": 0.0, "bias": True}
    assert info["tokenizer"] == {"kind": "char", "n_vocab": 96, "eos_token_id": None}
    assert (info["block_size"], info["device"], info["dtype"]) == (64, "cpu", "float32")
    assert info["cpu_kernels"] == kernels.status() != "not loaded"  # "loaded (variant)", or why not
    assert info["cuda_graphs"] == "not used on this device"  # on CUDA: "N captured in S s", or why none
    assert info["async_scheduling"] is False  # running ahead: on by default on CUDA only
    assert info["threads"] == client.app.state.service.engine.runner.threads >= 1
    linears = [m.weight.shape for m in ck.model.modules() if isinstance(m, torch.nn.Linear)]
    packed = sum(-(-out // 16) * 16 * n_in * 4 for out, n_in in linears)
    assert info["packed_weight_bytes"] == (packed if kernels.status().startswith("loaded") else 0)
    # fp32 weights: an fp32 cache (auto), keys and values of 2 layers x 4 rows x 64 positions x 32 values
    assert (info["kv_cache_dtype"], info["kv_cache_bytes"]) == ("float32", 2 * 2 * 4 * 64 * 32 * 4)
    assert info["max_batch_size"] == 4 and info["max_new_tokens_limit"] == LIMIT
    assert info["training"] == TRAINING
    assert info["version"] == VERSION


def test_async_scheduling_can_be_forced_on_and_answers_the_same(client: TestClient,
                                                               make_client: Callable[..., TestClient]) -> None:
    """`--async-scheduling on` runs decode steps ahead on the CPU too (/info says so); a seeded stream with a stop
    string and a greedy answer are the default server's, token for token."""
    ahead = make_client(async_scheduling="on")
    assert ahead.get("/info").json()["async_scheduling"] is True
    for parameters in ({"max_new_tokens": 40, "details": True},
                       {"max_new_tokens": 40, "details": True, "do_sample": True, "seed": 5, "stop": ["e "]}):
        body = {"inputs": "ROMEO:", "parameters": parameters}
        got, want = ahead.post("/generate", json=body), client.post("/generate", json=body)
        assert got.status_code == want.status_code == 200, got.text
        assert got.json() == want.json()


def test_info_shows_no_absolute_path(client: TestClient) -> None:
    """/info is open to anyone: the checkpoint is named by its directory, a path in the provenance by its last part,
    a path inside a message (the kernels' build error) likewise."""
    service = client.app.state.service
    meta, status = service.checkpoint.meta, service.engine.runner.cpu_kernels
    training = {"dataset": "input.txt", "source": "/home/someone/models/gpt2", "train_config": {
        "data": "/work/shared/data/tinyshakespeare/input.txt", "out": "/srv/folio/weights/run-7/", "bpe_dir": "",
        "resume_from": "C:\\Users\\someone\\ckpt", "tokenizer": "char", "lr": 0.002}}
    service.checkpoint.meta = {**meta, "training": training}
    service.engine.runner.cpu_kernels = "could not be built: /root/.cache/torch_extensions/folio/main.cpp:3: error"
    try:
        info = client.get("/info").json()
    finally:
        service.checkpoint.meta, service.engine.runner.cpu_kernels = meta, status

    def strings(v: Any) -> Iterator[str]:
        if isinstance(v, dict | list):
            for x in v.values() if isinstance(v, dict) else v:
                yield from strings(x)
        elif isinstance(v, str):
            yield v

    assert [v for v in strings(info) if re.search(r"(^|[\s(])(/|~/|[A-Za-z]:\\)\S", v)] == []
    assert info["checkpoint"] == "tiny-char"
    assert info["training"] == {"dataset": "input.txt", "source": "gpt2", "train_config": {
        "data": "input.txt", "out": "run-7", "bpe_dir": "", "resume_from": "ckpt", "tokenizer": "char", "lr": 0.002}}
    assert info["cpu_kernels"] == "could not be built: main.cpp:3: error"


def test_v1_models_lists_the_served_model(client: TestClient) -> None:
    r = client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and len(body["data"]) == 1
    model = body["data"][0]
    assert (model["id"], model["object"], model["owned_by"]) == ("tiny-char", "model", "folio")
    assert isinstance(model["created"], int) and model["created"] > 0


def test_a_model_is_retrieved_by_id_created_when_its_weights_were_written(client: TestClient,
                                                                          char_checkpoint: Path) -> None:
    """OpenAI's retrieve (`client.models.retrieve`): the list's entry; `created` is the weights file's time, which
    a reload does not change; an unknown id is the 404 naming the served models."""
    listed = client.get("/v1/models").json()["data"][0]
    r = client.get("/v1/models/tiny-char")
    assert r.status_code == 200 and r.json() == listed
    assert listed["created"] == int((char_checkpoint / WEIGHTS_FILE).stat().st_mtime)
    r = client.get("/v1/models/gpt-4o")
    assert_openai_error(r, 404, "invalid_request_error", "model", "'gpt-4o'", "tiny-char", code="model_not_found")


def test_tokenize_gives_ids_texts_and_character_offsets(client: TestClient) -> None:
    r = client.post("/tokenize", json={"inputs": "Hi, you!"})
    assert r.status_code == 200
    assert r.json() == [{"id": CHARS.index(c), "text": c, "start": i, "stop": i + 1} for i, c in enumerate("Hi, you!")]


def test_tokenizer_info_lists_a_character_vocabulary_and_none_for_bpe(client: TestClient,
                                                                       bpe_client: TestClient) -> None:
    """The playground marks the prompt's characters outside `characters` before it sends the prompt."""
    info = client.get("/tokenizer_info").json()
    assert info["characters"] == "".join(CHARS) and info["vocab_size"] == len(CHARS)
    assert bpe_client.get("/tokenizer_info").json()["characters"] is None  # byte-level BPE encodes any text


def test_metrics_exposes_every_folio_series(client: TestClient) -> None:
    generate(client, max_new_tokens=3)
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f.type for f in text_string_to_metric_families(r.text)}
    for name, kind in [("folio_requests", "counter"), ("folio_queue_depth", "gauge"),
                       ("folio_running_batch_size", "gauge"), ("folio_time_to_first_token_seconds", "histogram"),
                       ("folio_inter_token_latency_seconds", "histogram"), ("folio_generated_tokens", "counter"),
                       ("folio_cancelled_requests", "counter"), ("folio_rejected_requests", "counter")]:
        assert families.get(name) == kind, (name, families.get(name))
    assert metric(r.text, "folio_requests_total", route="/generate", status="200") >= 1
    assert metric(r.text, "folio_generated_tokens_total") >= 3
    assert metric(r.text, "folio_time_to_first_token_seconds_count") >= 1
    assert metric(r.text, "folio_inter_token_latency_seconds_count") >= 2
    assert metric(r.text, "folio_queue_depth") == 0 and metric(r.text, "folio_running_batch_size") == 0


def test_docs_openapi_and_playground_are_served(client: TestClient) -> None:
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    spec = client.get("/openapi.json")
    assert spec.status_code == 200
    assert spec.json()["info"]["title"] == "Folio"
    assert {"/generate", "/generate_stream", "/tokenize", "/v1/completions", "/v1/models"} <= set(spec.json()["paths"])
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_everything_from_this_server(client: TestClient, page: str) -> None:
    """Swagger UI and ReDoc work offline: the page names only same-origin URLs (no CDN), and each answers."""
    html = client.get(page)
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    urls = re.findall(r"""(?:src|href|url|spec-url)\s*[=:]\s*["']([^"']+)["']""", html.text)
    assert urls and all(u.startswith("/") and not u.startswith("//") for u in urls), urls
    assert "/openapi.json" in urls and any(u.endswith(".js") for u in urls)
    types = {".js": "javascript", ".css": "text/css", ".png": "image/png", ".json": "application/json"}
    for url in urls:
        r = client.get(url)
        assert r.status_code == 200 and len(r.content) > 1000, url
        assert types[Path(url).suffix] in r.headers["content-type"], (url, r.headers["content-type"])


def test_an_unexpected_error_is_a_500_that_closes_the_connection(char_checkpoint: Path) -> None:
    """A bug in a route: 500 in the family's error body, the request ID under which the log has the traceback,
    and `Connection: close` (the server drops the connection after it, so a keep-alive client must not reuse it)."""
    app = create_app(Settings(checkpoint=char_checkpoint, **BASE))

    async def broken() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/v1/broken", broken, methods=["GET"])  # an OpenAI path: its error body
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/v1/broken")
        assert r.status_code == 500 and r.headers["connection"] == "close"
        request_id = r.headers["x-request-id"]
        assert r.json()["error"]["type"] == "server_error" and request_id in r.json()["error"]["message"]
        assert "a bug" not in r.text  # the traceback is the log's, not the client's
        assert c.get("/health").status_code == 200
