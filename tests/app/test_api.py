"""The HTTP API in process, against the real app: `create_app(settings)` with its lifespan run by Starlette's
TestClient, a real checkpoint loaded from disk, the real engine thread. Every assertion is on status and body.

Disconnects are driven at the ASGI level (a `receive` that reports `http.disconnect` when the test says so),
which is what uvicorn does when a socket closes; `test_server.py` repeats the non-streaming case over TCP.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.main import create_app
from app.schemas import StreamResponse
from app.settings import Settings
from app.system import VERSION
from app.testing import assert_openai_error, assert_tgi_error, metric, parse_sse, strict_json
from model import kernels
from model.checkpoint import WEIGHTS_FILE, load_checkpoint
from model.files import sha256_file
from model.reference import generate_naive
from model.sampling_params import SamplingParams
from model.testing import CHARS, EMOJI_CJK, TRAINING, make_char_checkpoint

LIMIT = 256  # max_new_tokens_limit of the test apps
BODY_LIMIT = 16 * 1024
BASE = dict(device="cpu", threads=1, max_batch_size=4, max_waiting=8, max_new_tokens_limit=LIMIT,
            max_body_bytes=BODY_LIMIT)
PROMPT = "Hello there"


@pytest.fixture(scope="module")
def make_client(char_checkpoint: Path) -> Iterator[Callable[..., TestClient]]:
    """Factory: a started app (lifespan run) for the char checkpoint or another; all shut down at the end."""
    with ExitStack() as stack:
        def make(checkpoint: Path | None = None, **overrides: Any) -> TestClient:
            settings = Settings(checkpoint=checkpoint or char_checkpoint, **{**BASE, **overrides})
            return stack.enter_context(TestClient(create_app(settings)))

        yield make


@pytest.fixture(scope="module")
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()


@pytest.fixture(scope="module")
def reference(char_checkpoint: Path) -> Callable[..., tuple[list[int], str]]:
    """The naive reference loop on the same checkpoint: (token ids, decoded text)."""
    ck = load_checkpoint(char_checkpoint)

    def run(prompt: str, max_new_tokens: int, **params: Any) -> tuple[list[int], str]:
        p = SamplingParams(max_new_tokens=max_new_tokens, **params)
        ids = [t for t, _ in generate_naive(ck.model, ck.tokenizer.encode(prompt), p, n_vocab=ck.tokenizer.n_vocab)]
        return ids, ck.tokenizer.decode(ids)

    return run


def engine_of(client: TestClient):  # noqa: ANN201
    return client.app.state.service.engine


def generate(client: TestClient, inputs: str = PROMPT, route: str = "/generate", **parameters: Any) -> dict:
    r = client.post(route, json={"inputs": inputs, "parameters": parameters})
    assert r.status_code == 200, r.text
    return r.json()


def stream(client: TestClient, inputs: str = PROMPT, route: str = "/generate_stream", **parameters: Any) -> list:
    r = client.post(route, json={"inputs": inputs, "parameters": parameters})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return parse_sse(r.text)


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


# -- operational routes -------------------------------------------------------------------------------------


def test_health_is_ok_after_startup(client: TestClient) -> None:
    r = client.get("/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


PROBES = ("/health/startup", "/health/ready", "/health/live")


def test_probes_say_loading_before_the_lifespan_has_run(char_checkpoint: Path) -> None:
    """The app before its lifespan (checkpoint load, engine start, warmup) has run: no service yet."""
    loading = TestClient(create_app(Settings(checkpoint=char_checkpoint, **BASE)))  # no `with`: no lifespan
    for route in PROBES:
        r = loading.get(route)
        assert r.status_code == 503 and r.json()["status"] == "loading", (route, r.text)
    assert "still loading" in loading.get("/health/ready").json()["reason"]


def test_probes_after_startup_and_during_warmup(client: TestClient) -> None:
    r = client.get("/health/startup")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    r = client.get("/health/ready")
    assert (r.status_code, r.json()) == (200, {"status": "ok", "in_flight": 0, "capacity": 4 + 8})
    r = client.get("/health/live")
    assert r.status_code == 200 and r.json()["status"] in ("idle", "stepping"), r.text
    service = client.app.state.service
    service.ready = False  # the state between the engine's start and the end of its warmup
    try:
        for route in ("/health/startup", "/health/ready"):
            r = client.get(route)
            assert (r.status_code, r.json()["status"]) == (503, "loading"), (route, r.text)
        assert client.get("/health/live").status_code == 200  # the engine thread runs the warmup
    finally:
        service.ready = True


def test_live_fails_once_the_engine_thread_has_stopped(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    assert client.get("/health/live").status_code == 200
    engine_of(client).stop()
    r = client.get("/health/live")
    assert (r.status_code, r.json()) == (503, {"status": "unhealthy", "reason": "the engine thread is not running"})


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
    assert info["cpu_kernels"] == kernels.status() != "not loaded"  # "loaded", or why not
    linears = [m.weight.shape for m in ck.model.modules() if isinstance(m, torch.nn.Linear)]
    packed = sum(-(-out // 16) * 16 * n_in * 4 for out, n_in in linears)
    assert info["packed_weight_bytes"] == (packed if kernels.status() == "loaded" else 0)
    assert info["max_batch_size"] == 4 and info["max_new_tokens_limit"] == LIMIT
    assert info["training"] == TRAINING
    assert info["version"] == VERSION


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


def test_tokenize_gives_ids_texts_and_character_offsets(client: TestClient) -> None:
    r = client.post("/tokenize", json={"inputs": "Hi, you!"})
    assert r.status_code == 200
    assert r.json() == [{"id": CHARS.index(c), "text": c, "start": i, "stop": i + 1} for i, c in enumerate("Hi, you!")]


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


# -- /generate ------------------------------------------------------------------------------------------------


def test_greedy_generate_equals_the_naive_loop(client: TestClient, reference: Callable) -> None:
    ids, text = reference(PROMPT, 24)
    body = generate(client, max_new_tokens=24, details=True)
    assert body["generated_text"] == text
    assert [t["id"] for t in body["details"]["tokens"]] == ids
    assert body["details"]["finish_reason"] == "length" and body["details"]["generated_tokens"] == 24


def test_seeded_sampling_reproduces_and_reports_the_seed(client: TestClient, reference: Callable) -> None:
    a = generate(client, max_new_tokens=24, do_sample=True, seed=7, details=True)
    b = generate(client, max_new_tokens=24, do_sample=True, seed=7, details=True)
    other = generate(client, max_new_tokens=24, do_sample=True, seed=8)
    assert a["generated_text"] == b["generated_text"] == reference(PROMPT, 24, do_sample=True, seed=7)[1]
    assert other["generated_text"] != a["generated_text"]
    assert a["details"]["seed"] == 7


def test_unseeded_sampling_reports_a_seed_that_reproduces(client: TestClient) -> None:
    first = generate(client, max_new_tokens=24, do_sample=True, details=True)
    seed = first["details"]["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**63
    again = generate(client, max_new_tokens=24, do_sample=True, seed=seed)
    assert again["generated_text"] == first["generated_text"]


def test_temperature_zero_and_top_p_one_mean_greedy(client: TestClient, reference: Callable) -> None:
    greedy = reference(PROMPT, 16)[1]
    assert generate(client, max_new_tokens=16, temperature=0, do_sample=True, seed=3)["generated_text"] == greedy
    assert generate(client, max_new_tokens=16, top_p=1.0)["generated_text"] == greedy
    sampled = generate(client, max_new_tokens=16, do_sample=True, seed=3)["generated_text"]
    assert generate(client, max_new_tokens=16, do_sample=True, seed=3, top_p=1.0)["generated_text"] == sampled


def test_return_full_text_prepends_the_prompt(client: TestClient, reference: Callable) -> None:
    body = generate(client, max_new_tokens=8, return_full_text=True)
    assert body["generated_text"] == PROMPT + reference(PROMPT, 8)[1]


def test_details_tokens_logprobs_and_top_tokens(client: TestClient) -> None:
    d = generate(client, max_new_tokens=6, details=True, top_n_tokens=3, decoder_input_details=True)["details"]
    assert d["generated_tokens"] == len(d["tokens"]) == len(d["top_tokens"]) == 6
    for token, top in zip(d["tokens"], d["top_tokens"]):
        assert token["text"] == CHARS[token["id"]] and token["special"] is False
        assert token["logprob"] <= 0
        assert len(top) == 3 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["id"] == token["id"] and math.isclose(top[0]["logprob"], token["logprob"], rel_tol=1e-5)
        assert sum(math.exp(t["logprob"]) for t in top) <= 1 + 1e-5
    assert [(p["id"], p["text"]) for p in d["prefill"]] == [(CHARS.index(c), c) for c in PROMPT]


def test_stop_sequences_end_the_output_before_the_stop(client: TestClient, reference: Callable) -> None:
    greedy = reference(PROMPT, 32)[1]
    stop = greedy[12:14]
    expected = greedy[: greedy.index(stop)]
    body = generate(client, max_new_tokens=32, stop=["not in there", stop], details=True)
    assert body["generated_text"] == expected
    assert body["details"]["finish_reason"] == "stop_sequence"
    events = stream(client, max_new_tokens=32, stop=[stop])
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"] == expected


def test_truncate_keeps_the_last_prompt_tokens(client: TestClient, reference: Callable) -> None:
    prompt = "x" * 90 + "0123456789"  # longer than block_size 64
    body = generate(client, prompt, max_new_tokens=8, truncate=10, details=True, decoder_input_details=True)
    assert [p["text"] for p in body["details"]["prefill"]] == list("0123456789")
    assert body["generated_text"] == reference("0123456789", 8)[1]


# -- streaming ------------------------------------------------------------------------------------------------


def test_generate_stream_frames_one_event_per_token(client: TestClient) -> None:
    params = dict(max_new_tokens=12, do_sample=True, seed=5)
    events = stream(client, **params)
    assert [e["index"] for e in events] == list(range(1, 13))
    assert all(e.get("generated_text") is None and e.get("details") is None for e in events[:-1])
    last = events[-1]
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 12, "seed": 5,
                               "input_length": len(PROMPT)}
    text = "".join(e["token"]["text"] for e in events)
    assert text == last["generated_text"] == generate(client, **params)["generated_text"]
    assert all(e["token"]["logprob"] <= 0 for e in events)


def test_stream_events_are_exactly_the_documented_schema(client: TestClient) -> None:
    """Events are built as dicts on the hot path; each is exactly what the StreamResponse model would dump."""
    events = stream(client, max_new_tokens=5, top_n_tokens=3, return_full_text=True, seed=1, do_sample=True)
    assert len(events) == 5 and all(len(e["top_tokens"]) == 3 for e in events)
    for e in events:
        assert StreamResponse.model_validate(e).model_dump() == e
        assert list(e) == list(StreamResponse.model_fields)
    assert events[-1]["generated_text"].startswith(PROMPT)


def test_plain_token_events_are_exactly_the_documented_schema(client: TestClient) -> None:
    """Without alternatives every token but the last is formatted straight to bytes (app.tgi._token_sse)."""
    events = stream(client, max_new_tokens=6, seed=3, do_sample=True)
    assert len(events) == 6 and all(e["top_tokens"] == [] for e in events)
    for e in events:
        assert StreamResponse.model_validate(e).model_dump() == e
        assert list(e) == list(StreamResponse.model_fields)


@pytest.mark.parametrize("text", ["a", "", '"', "\\", "\n\t", "é€😀", "\u2028</script>", "\x00\x1f"])
@pytest.mark.parametrize("logprob", [-0.0, -1.5e-08, -12.345678901234567, float("-inf")])
def test_fast_token_event_bytes_equal_the_dict_path(text: str, logprob: float) -> None:
    from app.sse import sse
    from app.tgi import _stream_event, _token_sse
    from model.engine import TokenEvent

    for special in (False, True):
        ev = TokenEvent(id=7, text=text, logprob=logprob, special=special, index=3)
        assert _token_sse(ev, "prefix") == sse(_stream_event(ev, "prefix"))


def test_root_route_streams_or_answers_a_one_element_list(client: TestClient) -> None:
    payload = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "seed": 4, "do_sample": True, "details": True}}
    whole = client.post("/generate", json=payload).json()
    r = client.post("/", json={**payload, "stream": False})
    assert r.status_code == 200 and r.json() == [whole]
    r = client.post("/", json={**payload, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert len(events) == 6 and events[-1]["generated_text"] == whole["generated_text"]


# -- strict JSON: a model that computes NaN -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nan_client(char_checkpoint: Path) -> Iterator[TestClient]:
    """The app serving the char checkpoint with every weight of its (tied) embedding and LM head set to NaN after
    loading: every logit and log-probability is NaN (a checkpoint whose weights hold NaN, or a model that
    overflows)."""
    ck = load_checkpoint(char_checkpoint)
    with torch.no_grad():
        ck.model.lm_head.weight.fill_(float("nan"))
    with TestClient(create_app(Settings(checkpoint=char_checkpoint, **BASE), checkpoint=ck)) as client:
        yield client


def test_non_finite_numbers_are_written_as_null(nan_client: TestClient) -> None:
    """Every body and every event is strict JSON: a NaN log-probability is null (the hot byte-formatted path and
    the dict path alike), /v1/completions with logprobs is no 500, and the server keeps serving."""
    def post(route: str, body: dict) -> Any:
        r = nan_client.post(route, json=body)
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("text/event-stream"):
            return parse_sse(r.text)  # strict
        return strict_json(r.text)

    greedy = {"max_new_tokens": 4, "greedy": True}
    d = post("/generate", {"inputs": PROMPT, "parameters": {**greedy, "details": True, "top_n_tokens": 2}})["details"]
    assert [t["logprob"] for t in d["tokens"]] == [None] * 4
    assert [a["logprob"] for top in d["top_tokens"] for a in top] == [None] * 8
    for top_n in (0, 2):  # without alternatives the events are formatted straight to bytes (app.tgi._token_sse)
        events = post("/generate_stream", {"inputs": PROMPT, "parameters": {**greedy, "top_n_tokens": top_n}})
        assert [e["token"]["logprob"] for e in events] == [None] * 4
        assert [a["logprob"] for e in events for a in e["top_tokens"]] == [None] * 4 * top_n
    assert post("/", {"inputs": PROMPT, "parameters": {**greedy, "details": True}})[0]["details"]["tokens"][0][
        "logprob"] is None
    assert len(post("/", {"inputs": PROMPT, "parameters": greedy, "stream": True})) == 4
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    lp = post("/v1/completions", body)["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [None] * 4 and all(set(t.values()) == {None} for t in lp["top_logprobs"])
    chunks = post("/v1/completions", {**body, "stream": True})
    assert [c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks[1:-1]] == [[None]] * 4
    # sampling from NaN probabilities fails that request alone, in a well-formed error
    assert_tgi_error(nan_client.post("/generate", json={"inputs": PROMPT, "parameters": {"do_sample": True}}), 424,
                     "generation")
    events = parse_sse(nan_client.post("/generate_stream", json={"inputs": PROMPT,
                                                                 "parameters": {"do_sample": True}}).text)
    assert events[-1]["error_type"] == "generation"
    for route in ("/health", "/info", "/v1/models"):
        r = nan_client.get(route)
        assert r.status_code == 200 and strict_json(r.text)


def test_the_json_encoder_writes_null_for_every_non_finite_float() -> None:
    from app.responses import StrictJSONResponse, dumps
    from app.sse import sse

    data = {"a": [1.5, float("nan"), {"b": (float("inf"), -float("inf"))}], "c": "NaN", "d": -0.0}
    assert dumps(data) == '{"a":[1.5,null,{"b":[null,null]}],"c":"NaN","d":-0.0}'
    assert strict_json(StrictJSONResponse(data).body) == strict_json(dumps(data))
    assert sse(data) == f"data: {dumps(data)}\n\n".encode()


# -- UTF-8 with byte-level BPE ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe_client(make_client: Callable[..., TestClient], bpe_checkpoint: Path) -> TestClient:
    return make_client(bpe_checkpoint)


BPE_PROMPT = "emoji 😀 and 中文 ok"


def test_bpe_emoji_prompt_streams_whole_characters(bpe_client: TestClient) -> None:
    # the model cycles through F0 9F 98 80 E4 B8 AD: every character arrives split over 3 or 4 tokens
    body = generate(bpe_client, BPE_PROMPT, max_new_tokens=14, details=True)
    assert body["generated_text"] == EMOJI_CJK * 2
    assert body["details"]["finish_reason"] == "length"
    events = stream(bpe_client, BPE_PROMPT, max_new_tokens=14)
    texts = [e["token"]["text"] for e in events]
    assert len(events) == 14 and not any("\ufffd" in t for t in texts)
    assert [t for t in texts if t] == ["😀", "中", "😀", "中"]
    assert "".join(texts) == events[-1]["generated_text"] == EMOJI_CJK * 2
    chunks = parse_sse(bpe_client.post("/v1/completions", json={"prompt": BPE_PROMPT, "max_tokens": 14,
                                                                "temperature": 0, "stream": True}).text)
    pieces = [c["choices"][0]["text"] for c in chunks[:-1]]
    assert not any("\ufffd" in p for p in pieces) and "".join(pieces) == EMOJI_CJK * 2


def test_bpe_tokenize_offsets_count_characters(bpe_client: TestClient) -> None:
    tokens = bpe_client.post("/tokenize", json={"inputs": BPE_PROMPT}).json()
    assert tokens[0]["start"] == 0 and tokens[-1]["stop"] == len(BPE_PROMPT)
    assert all(a["stop"] == b["start"] for a, b in zip(tokens, tokens[1:]))
    for t in tokens:
        if "\ufffd" not in t["text"]:  # a token of whole characters covers exactly its text
            assert BPE_PROMPT[t["start"] : t["stop"]] == t["text"]


# -- OpenAI completions -------------------------------------------------------------------------------------------


def completion(client: TestClient, **body: Any) -> dict:
    r = client.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def completion_stream(client: TestClient, **body: Any) -> list:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "stream": True, **body})
    assert r.status_code == 200, r.text
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def test_completions_match_generate_greedy_and_seeded(client: TestClient) -> None:
    greedy = generate(client, max_new_tokens=10)["generated_text"]
    body = completion(client, max_tokens=10, temperature=0)
    assert body["choices"][0]["text"] == greedy
    sampled = generate(client, max_new_tokens=10, temperature=0.8, top_p=0.9, seed=11)["generated_text"]
    assert completion(client, max_tokens=10, temperature=0.8, top_p=0.9, seed=11)["choices"][0]["text"] == sampled
    # OpenAI samples at temperature 1 when none is given; TGI needs do_sample for that
    sampled = generate(client, max_new_tokens=10, do_sample=True, seed=12)["generated_text"]
    assert completion(client, max_tokens=10, seed=12)["choices"][0]["text"] == sampled


def test_completion_body_usage_and_finish_reasons(client: TestClient) -> None:
    body = completion(client, max_tokens=7, temperature=0, model="tiny-char")
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "tiny-char" and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert (choice["index"], choice["finish_reason"], choice["logprobs"]) == (0, "length", None)
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 7, "total_tokens": len(PROMPT) + 7}
    text = choice["text"]
    stopped = completion(client, max_tokens=7, temperature=0, stop=text[3:5])
    assert stopped["choices"][0]["text"] == text[: text.index(text[3:5])]
    assert stopped["choices"][0]["finish_reason"] == "stop"


def test_completion_logprobs_and_echo(client: TestClient) -> None:
    body = completion(client, max_tokens=5, temperature=0, logprobs=2, echo=True)
    choice = body["choices"][0]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) == len(PROMPT) + 5
    lp = choice["logprobs"]
    assert lp["tokens"] == list(choice["text"][len(PROMPT) :])
    assert lp["text_offset"] == list(range(len(PROMPT), len(PROMPT) + 5))
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 2 and logprob <= 0
        assert max(top, key=top.get) == token and math.isclose(top[token], logprob, rel_tol=1e-5)


def test_completion_stream_equals_the_whole_completion(client: TestClient) -> None:
    whole = completion(client, max_tokens=9, seed=21)["choices"][0]
    chunks = completion_stream(client, max_tokens=9, seed=21)
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    echoed = completion_stream(client, max_tokens=9, seed=21, echo=True)
    assert "".join(c["choices"][0]["text"] for c in echoed) == PROMPT + whole["text"]


def test_completion_stream_include_usage_ends_with_a_usage_chunk(client: TestClient) -> None:
    chunks = completion_stream(client, max_tokens=4, temperature=0, stream_options={"include_usage": True})
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 4,
                                   "total_tokens": len(PROMPT) + 4}


def test_completion_for_another_model_is_404(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "model": "gpt-4"})
    assert_openai_error(r, 404, "invalid_request_error", "model", "'gpt-4'", "'tiny-char'")


# -- validation: 422 with the field, the bound and the value --------------------------------------------------------

TGI_INVALID = [
    ({"temperature": -1}, "parameters.temperature", "greater than or equal to 0", "got -1"),
    ({"temperature": 101}, "parameters.temperature", "less than or equal to 100", "got 101"),
    ({"top_p": 0}, "parameters.top_p", "greater than 0", "got 0"),
    ({"top_p": 1.5}, "parameters.top_p", "less than or equal to 1", "got 1.5"),
    ({"top_k": -1}, "parameters.top_k", "greater than or equal to 0", "got -1"),
    ({"max_new_tokens": 0}, "parameters.max_new_tokens", "greater than or equal to 1", "got 0"),
    ({"max_new_tokens": LIMIT + 1}, "parameters.max_new_tokens", f"[1, {LIMIT}]", f"got {LIMIT + 1}"),
    ({"seed": -1}, "parameters.seed", "greater than or equal to 0", "got -1"),
    ({"seed": 2**63}, "parameters.seed", f"less than or equal to {2**63 - 1}", f"got {2**63}"),
    ({"repetition_penalty": 0}, "parameters.repetition_penalty", "greater than 0", "got 0"),
    ({"top_n_tokens": 21}, "parameters.top_n_tokens", "less than or equal to 20", "got 21"),
    ({"truncate": 0}, "parameters.truncate", "greater than or equal to 1", "got 0"),
    ({"truncate": 65}, "parameters.truncate", "[1, 64]", "got 65"),
    ({"best_of": 2}, "parameters.best_of", "less than or equal to 1", "got 2"),
    ({"temperature": "hot"}, "parameters.temperature", "valid number", "'hot'"),
    ({"max_new_tokens": 1.5}, "parameters.max_new_tokens", "valid integer", "1.5"),
    ({"stop": "###"}, "parameters.stop", "valid list", "'###'"),
    ({"details": "maybe"}, "parameters.details", "valid boolean", "'maybe'"),
    ({"typical_p": 0.5}, "parameters.typical_p", "not supported", "0.5"),
    ({"watermark": True}, "parameters.watermark", "not supported", "True"),
    ({"frequency_penalty": 0.5}, "parameters.frequency_penalty", "not supported", "0.5"),
    ({"stop": [""]}, "parameters.stop", "non-empty", "''"),
    ({"stop": ["x"] * 17}, "parameters.stop", "at most 16"),
    ({"stop": ["ok", "x" * 129]}, "parameters.stop", "at most 128 characters", "one of 129", "'xxxx"),
    ({"no_such_knob": 1}, "parameters.no_such_knob", "unknown field"),
]


@pytest.mark.parametrize("route", ["/generate", "/generate_stream", "/"])
@pytest.mark.parametrize(("parameters", "field", "needles"), [(p, f, n) for p, f, *n in TGI_INVALID],
                         ids=[f"{f}={json.dumps(p)[:30]}" for p, f, *_ in TGI_INVALID])
def test_tgi_bad_parameter_is_422_naming_field_bound_and_value(
    client: TestClient, route: str, parameters: dict, field: str, needles: list[str]
) -> None:
    r = client.post(route, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, **parameters}})
    assert_tgi_error(r, 422, "validation", f"{field}:", *needles)


RAW_BODIES = [
    ('{"inputs": "ab", "parameters": {"temperature": NaN}}', "parameters.temperature", "finite number"),
    ('{"inputs": "ab", "parameters": {"temperature": Infinity}}', "parameters.temperature", "finite number"),
    ('{"inputs": "ab", "parameters": {"top_p": -Infinity}}', "parameters.top_p", "finite number"),
    ('{"inputs": "ab", "parameters": {"max_new_tokens": 2,}}', "body", "not valid JSON"),
    ('{"inputs": "ab"', "body", "not valid JSON"),
    ('{"parameters": {}}', "inputs", "Field required"),
    ('{"inputs": 5}', "inputs", "valid string", "got 5"),
    ('{"inputs": "ab", "temperature": 0.5}', "temperature", "unknown field"),
    ('{"inputs": ""}', "inputs", "at least one token", "got 0"),
    ('{"inputs": "' + "a" * 65 + '"}', "inputs", "65 tokens", "context of 64", "truncate"),
    ('{"inputs": "h\\u00e9llo \\u2603"}', "inputs", "2 character(s)", "'é'", "'☃'"),
]


@pytest.mark.parametrize(("raw", "field", "needles"), [(r, f, n) for r, f, *n in RAW_BODIES],
                         ids=[r[:40] for r, *_ in RAW_BODIES])
def test_tgi_bad_body_is_422(client: TestClient, raw: str, field: str, needles: list[str]) -> None:
    for route in ("/generate", "/generate_stream"):
        r = client.post(route, content=raw, headers={"content-type": "application/json"})
        assert_tgi_error(r, 422, "validation", f"{field}:" if field != "body" else "body is", *needles)


UNPARSEABLE = [
    (b'{"inputs": "Hel\xfflo"}', "not UTF-8 (byte 0xff at offset 15)"),
    (b"[" * 5000 + b"]" * 5000, "nests arrays or objects too deeply"),
    (b'{"inputs": "ab", "parameters": {"seed": ' + b"9" * 5000 + b"}}", "Exceeds the limit (4300 digits)"),
]


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
@pytest.mark.parametrize(("raw", "needle"), UNPARSEABLE, ids=["invalid UTF-8", "deep nesting", "5000 digits"])
def test_body_json_cannot_decode_is_422_not_400(client: TestClient, route: str, raw: bytes, needle: str) -> None:
    """Where json.loads fails other than with a JSONDecodeError, FastAPI says 400 'There was an error parsing the
    body'; it is malformed JSON like any other."""
    r = client.post(route, content=raw, headers={"content-type": "application/json"})
    if route.startswith("/v1"):
        assert_openai_error(r, 422, "invalid_request_error", "body", "body is not valid JSON", needle)
    else:
        assert_tgi_error(r, 422, "validation", "body is not valid JSON", needle)


WRONG_TYPES = [
    ("/generate", {"parameters": {"max_new_tokens": "4"}}, "parameters.max_new_tokens", "valid integer", "'4'"),
    ("/generate", {"parameters": {"max_new_tokens": 4.0}}, "parameters.max_new_tokens", "valid integer", "4.0"),
    ("/generate", {"parameters": {"seed": True}}, "parameters.seed", "valid integer", "True"),
    ("/generate", {"stream": "yes"}, "stream", "valid boolean", "'yes'"),
    ("/v1/completions", {"echo": 1}, "echo", "valid boolean", "got 1"),
    ("/v1/completions", {"max_tokens": "4"}, "max_tokens", "valid integer", "'4'"),
]


@pytest.mark.parametrize(("route", "fields", "field", "needles"), [(r, f, p, n) for r, f, p, *n in WRONG_TYPES],
                         ids=[f"{p}={json.dumps(f)[-12:]}" for _, f, p, *_ in WRONG_TYPES])
def test_values_of_another_json_type_are_422(client: TestClient, route: str, fields: dict, field: str,
                                             needles: list[str]) -> None:
    """No coercion: "4" or 4.0 is not an integer, 1 or "yes" not a boolean (as TGI and OpenAI answer)."""
    key = "prompt" if route.startswith("/v1") else "inputs"
    r = client.post(route, json={key: PROMPT, **fields})
    if route.startswith("/v1"):
        assert_openai_error(r, 422, "invalid_request_error", field, f"{field}:", *needles)
    else:
        assert_tgi_error(r, 422, "validation", f"{field}:", *needles)


def test_tokenize_rejects_unknown_characters(client: TestClient) -> None:
    r = client.post("/tokenize", json={"inputs": "naïve"})
    assert_tgi_error(r, 422, "validation", "inputs:", "'ï'")


def test_tokenize_over_its_limit_is_422_naming_it(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_tokenize_chars=16)
    assert len(client.post("/tokenize", json={"inputs": "a" * 16}).json()) == 16
    r = client.post("/tokenize", json={"inputs": "a" * 17})
    assert_tgi_error(r, 422, "validation", "inputs: must be at most 16 characters", "--max-tokenize-chars", "got 17")


def test_a_prompt_list_of_many_items_is_one_error(client: TestClient) -> None:
    """The list's length is checked before its items: a body of thousands of numbers is one 422 (before, pydantic
    reported every item, twice: seconds of work on the event loop and a 20x larger answer for a large body)."""
    r = client.post("/v1/completions", json={"prompt": [1] * 5000})
    message = assert_openai_error(r, 422, "invalid_request_error", "prompt", "exactly one string, not a list of 5000")
    assert message.count("prompt") == 1


OPENAI_INVALID = [
    ({"temperature": -1}, "temperature", "greater than or equal to 0", "got -1"),
    ({"temperature": 2.5}, "temperature", "less than or equal to 2", "got 2.5"),
    ({"top_p": 0}, "top_p", "greater than 0", "got 0"),
    ({"top_p": 1.5}, "top_p", "less than or equal to 1", "got 1.5"),
    ({"top_k": -1}, "top_k", "greater than or equal to 0", "got -1"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1", "got 0"),
    ({"max_tokens": LIMIT + 1}, "max_tokens", f"[1, {LIMIT}]", f"got {LIMIT + 1}"),
    ({"seed": -1}, "seed", "greater than or equal to 0", "got -1"),
    ({"n": 2}, "n", "less than or equal to 1", "got 2"),
    ({"logprobs": 6}, "logprobs", "less than or equal to 5", "got 6"),
    ({"presence_penalty": 0.5}, "presence_penalty", "less than or equal to 0", "got 0.5"),
    ({"max_tokens": "many"}, "max_tokens", "valid integer", "'many'"),
    ({"stop": ""}, "stop", "non-empty", "''"),
    ({"stop": ["a"] * 17}, "stop", "at most 16", "got 17"),
    ({"stop": "x" * 129}, "stop", "at most 128 characters", "one of 129", "'xxxx"),
    ({"stop": ["ok", "y" * 129]}, "stop", "at most 128 characters", "one of 129", "'yyyy"),
    ({"prompt": ["a", "b"]}, "prompt", "exactly one string, not a list of 2", "got ['a', 'b']"),
    ({"prompt": ""}, "prompt", "at least one token", "got 0"),
    ({"prompt": "a" * 65}, "prompt", "65 tokens", "context of 64"),
    ({"prompt": "naïve"}, "prompt", "'ï'"),
    ({"typical_p": 0.5}, "typical_p", "unknown field"),
]


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("fields", "param", "needles"), [(b, p, n) for b, p, *n in OPENAI_INVALID],
                         ids=[f"{p}={json.dumps(b)[:30]}" for b, p, *_ in OPENAI_INVALID])
def test_openai_bad_parameter_is_422_with_param(
    client: TestClient, streaming: bool, fields: dict, param: str, needles: list[str]
) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": streaming, **fields})
    assert_openai_error(r, 422, "invalid_request_error", param, f"{param}:", *needles)


def test_openai_raw_nan_missing_prompt_and_malformed_json_are_422(client: TestClient) -> None:
    for raw, param, needle in [('{"prompt": "ab", "temperature": NaN}', "temperature", "finite number"),
                               ('{"prompt": "ab", "top_p": Infinity}', "top_p", "finite number"),
                               ('{"max_tokens": 3}', "prompt", "Field required"),
                               ('{"prompt": "ab",', "body", "not valid JSON")]:
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_openai_error(r, 422, "invalid_request_error", param, needle)


def post_raw(client: TestClient, route: str, body: Any) -> Any:
    """POST `body` as JSON written with ASCII escapes: a lone surrogate goes out as the 6 characters \\ud800, as a
    client in another language would send it (httpx's own encoder cannot write it at all)."""
    return client.post(route, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


LONE_SURROGATES = [
    ("/generate", {"inputs": "hi \ud800", "parameters": {"return_full_text": True}}, "inputs"),
    ("/generate", {"inputs": "hi", "parameters": {"stop": ["ok", "\udfff"]}}, "parameters.stop"),
    ("/generate_stream", {"inputs": "\ud800 hi", "parameters": {"return_full_text": True}}, "inputs"),
    ("/", {"inputs": "x\ud83d", "stream": True}, "inputs"),
    ("/tokenize", {"inputs": "\udc00"}, "inputs"),
    ("/v1/completions", {"prompt": "hi \ud800", "echo": True}, "prompt"),
    ("/v1/completions", {"prompt": ["hi \ud800"], "echo": True, "stream": True}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": "\ud800"}, "stop"),
    ("/v1/completions", {"prompt": "hi", "user": "\ud800"}, "user"),
    ("/v1/completions", {"prompt": "hi", "model": "\ud800"}, "model"),
]


@pytest.mark.parametrize(("route", "body", "field"), LONE_SURROGATES,
                         ids=[f"{r}-{f}-{i}" for i, (r, _, f) in enumerate(LONE_SURROGATES)])
def test_a_lone_surrogate_in_any_string_is_422_naming_the_field(bpe_client: TestClient, route: str, body: dict,
                                                                field: str) -> None:
    """JSON's \\ud800 escape decodes to a lone surrogate, which no UTF-8 text can hold: on a BPE model it used to
    give a plain-text 500 (echoing the prompt), a stream cut off mid-way, or tokens of U+FFFD."""
    r = post_raw(bpe_client, route, body)
    needles = (f"{field}:", "lone surrogate", "valid Unicode")
    if route.startswith("/v1"):
        assert_openai_error(r, 422, "invalid_request_error", field, *needles)
    else:
        assert_tgi_error(r, 422, "validation", *needles)


def test_a_surrogate_pair_is_one_character(bpe_client: TestClient) -> None:
    parameters = {"max_new_tokens": 7, "return_full_text": True}
    r = post_raw(bpe_client, "/generate", {"inputs": "emoji \ud83d\ude00", "parameters": parameters})
    assert r.status_code == 200
    assert r.json() == generate(bpe_client, "emoji 😀", **parameters)
    assert r.json()["generated_text"].startswith("emoji 😀")


def test_top_n_tokens_beyond_the_vocabulary_is_422_naming_its_size(make_client: Callable[..., TestClient],
                                                                  tmp_path: Path) -> None:
    """A model of 4 characters has 4 alternatives to report, not 5 (torch's top-k failed: a 424)."""
    client = make_client(make_char_checkpoint(tmp_path / "four-chars", chars=["\n", " ", "a", "b"]))
    details = generate(client, "ab", max_new_tokens=3, details=True, top_n_tokens=4)["details"]
    assert [len(top) for top in details["top_tokens"]] == [4, 4, 4]
    for route in ("/generate", "/generate_stream", "/"):
        r = client.post(route, json={"inputs": "ab", "parameters": {"top_n_tokens": 5}})
        assert_tgi_error(r, 422, "validation", "parameters.top_n_tokens:", "vocabulary size, 4", "got 5")
    for streaming in (False, True):
        r = client.post("/v1/completions", json={"prompt": "ab", "logprobs": 5, "stream": streaming})
        assert_openai_error(r, 422, "invalid_request_error", "logprobs", "logprobs:", "vocabulary size, 4", "got 5")
    logprobs = completion(client, prompt="ab", max_tokens=2, logprobs=4)["choices"][0]["logprobs"]
    assert [len(top) for top in logprobs["top_logprobs"]] == [4, 4]


LARGE_VALUES = [
    ("/generate", {"inputs": "hi", "parameters": {"stop": ["x"] * 3000}}, "parameters.stop", "(3000 items)"),
    ("/generate", {"inputs": ["a"] * 3000}, "inputs", "(3000 items)"),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 10**4000}}, "parameters.max_new_tokens",
     "(4001 digits)"),
    ("/generate", {"inputs": "hi", "parameters": {"stop": [1] * 3000}}, "parameters.stop", "(3000 items)"),
    ("/v1/completions", {"prompt": [1] * 3000}, "prompt", "(3000 items)"),
    ("/v1/completions", {"prompt": "hi", "stop": [1] * 3000}, "stop", "at most 16 stop strings, got 3000"),
    ("/generate", {"inputs": "hi", "parameters": {"z" * 12000: 1}}, "parameters.zzzz", "unknown field"),
    ("/generate", {"inputs": "hi", "parameters": {"stop": ["y" * 12000]}}, "parameters.stop", "(12000 characters)"),
    ("/generate", {"inputs": "hi", "parameters": {"truncate": 10**4000}}, "parameters.truncate", "(4001 digits)"),
    ("/tokenize", {"inputs": "".join(map(chr, range(256, 2256)))}, "inputs", "2000 character(s) outside"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(1000)}}, "logit_bias",
     "(1000 items)"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**4000}, "max_tokens", "(4001 digits)"),
    ("/v1/completions", {"prompt": "hi", "stop": "s" * 12000}, "stop", "(12000 characters)"),
    ("/v1/completions", {"prompt": "hi", "model": "m" * 12000}, "model", "(12000 characters)"),
]


@pytest.mark.parametrize(("route", "body", "field", "needle"), LARGE_VALUES,
                         ids=[f"{r}-{f}-{i}" for i, (r, _, f, _) in enumerate(LARGE_VALUES)])
def test_errors_echo_a_short_preview_of_a_large_value(client: TestClient, route: str, body: dict, field: str,
                                                      needle: str) -> None:
    """An error names the field and shows a preview of the value (about 80 characters, saying how long it was),
    never the value: a 5 MB list used to come back whole."""
    r = post_raw(client, route, body)
    assert r.status_code in (404, 422), r.text[:200]
    assert len(r.content) < 700, r.text[:200]
    message = r.json()["error"]["message"] if route.startswith("/v1") else r.json()["error"]
    assert message.startswith(field) and needle in message, message


# -- 413, 429, 424, 503, 401, CORS ----------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_body_over_the_limit_is_413_by_length_and_when_chunked(client: TestClient, route: str) -> None:
    key = "prompt" if route.startswith("/v1") else "inputs"
    big = json.dumps({key: "a" * (BODY_LIMIT + 100)}).encode()
    headers = {"content-type": "application/json"}

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    for r in (client.post(route, content=big, headers=headers), client.post(route, content=chunks(), headers=headers)):
        needles = ("more than the limit", f"{BODY_LIMIT} bytes")
        if route.startswith("/v1"):
            assert_openai_error(r, 413, "invalid_request_error", None, *needles)
        else:
            assert_tgi_error(r, 413, "payload_too_large", *needles)


@contextmanager
def engine_held_full(client: TestClient) -> Iterator[None]:
    """Within the block, one request holds the engine's only slot (max_batch_size=1, max_waiting=0), stopped in
    its model step; on leaving, it is let go and must complete with 200."""
    engine = engine_of(client)
    entered, gate = threading.Event(), threading.Event()

    def hold(_: list) -> None:
        entered.set()
        gate.wait(10)

    engine.on_step = hold
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.post, "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
            assert entered.wait(10)
            yield
            gate.set()
            assert first.result(timeout=10).status_code == 200
    finally:
        engine.on_step = None
        gate.set()


def test_full_engine_answers_429_with_retry_after(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_batch_size=1, max_waiting=0, retry_after=3)
    with engine_held_full(client):
        for route, body in [("/generate", {"inputs": PROMPT}), ("/generate_stream", {"inputs": PROMPT}),
                            ("/v1/completions", {"prompt": PROMPT})]:
            r = client.post(route, json=body)
            assert r.headers["retry-after"] == "3"
            if route.startswith("/v1"):
                assert_openai_error(r, 429, "rate_limit_error", None, "at capacity")
            else:
                assert_tgi_error(r, 429, "overloaded", "at capacity (1 running, 0 waiting)")
        assert metric(client.get("/metrics").text, "folio_rejected_requests_total") == 3


def test_a_full_engine_refuses_before_looking_at_the_request(make_client: Callable[..., TestClient]) -> None:
    """The admission fast path (app/admission.py): while the engine is full even a malformed request gets its 429,
    counted under its route; once there is room the same request is a 422 again."""
    client = make_client(max_batch_size=1, max_waiting=0)
    malformed = {"inputs": PROMPT, "parameters": {"max_new_tokens": -1}}
    with engine_held_full(client):
        assert_tgi_error(client.post("/generate", json=malformed), 429, "overloaded", "at capacity")
        r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert_openai_error(r, 429, "rate_limit_error", None, "at capacity")
        text = client.get("/metrics").text
        assert metric(text, "folio_requests_total", route="/generate", status="429") == 1
        assert metric(text, "folio_requests_total", route="/v1/completions", status="429") == 1
    assert client.post("/generate", json=malformed).status_code == 422


def test_a_request_being_validated_holds_its_slot(make_client: Callable[..., TestClient]) -> None:
    """A burst is refused as it arrives: a request admitted but still being tokenised holds its slot, so the next
    one gets 429 before its body is read, though the engine has nothing queued yet; a request that fails
    validation gives its slot back."""
    client = make_client(max_batch_size=1, max_waiting=0)
    service = client.app.state.service
    tokenising, gate = threading.Event(), threading.Event()
    encode = service.encode

    async def slow_encode(text: str, field: str = "inputs") -> list[int]:
        tokenising.set()
        await asyncio.get_running_loop().run_in_executor(None, gate.wait, 10)
        return await encode(text, field)

    service.encode = slow_encode
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.post, "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
            assert tokenising.wait(10)
            assert engine_of(client).busy == 0  # nothing submitted yet
            assert_tgi_error(client.post("/generate", json={"inputs": PROMPT}), 429, "overloaded", "at capacity")
            gate.set()
            assert first.result(timeout=10).status_code == 200
    finally:
        service.encode = encode
        gate.set()
    for _ in range(3):  # 422s release their slots: the server is not left full
        assert client.post("/generate", json={"inputs": PROMPT, "parameters": {"top_k": -1}}).status_code == 422
    assert client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_tokenize_takes_a_slot_until_it_answers(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_batch_size=1, max_waiting=0)
    with engine_held_full(client):
        assert_tgi_error(client.post("/tokenize", json={"inputs": PROMPT}), 429, "overloaded", "at capacity")
    assert len(client.post("/tokenize", json={"inputs": PROMPT}).json()) == len(PROMPT)
    assert engine_of(client).reserved == 0
    assert metric(client.get("/metrics").text, "folio_reserved_slots") == 0


class GatedTokenizer:
    """A tokenizer whose `encode` and `decode_bytes` each wait for their gate on their first call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered = {name: threading.Event() for name in ("encode", "decode_bytes")}
        self.gates = {name: threading.Event() for name in ("encode", "decode_bytes")}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _wait(self, name: str) -> None:
        self.entered[name].set()
        self.gates[name].wait(30)

    def encode(self, text: str) -> list[int]:
        self._wait("encode")
        return self.inner.encode(text)

    def decode_bytes(self, ids: list[int]) -> bytes:
        self._wait("decode_bytes")
        return self.inner.decode_bytes(ids)


def test_tokenize_works_off_the_event_loop(client: TestClient) -> None:
    """Tokenising and writing the answer both take time proportional to the input: while each is held up, the
    event loop still answers /health (were either on the loop, /health would wait for it)."""
    service = client.app.state.service
    gated = service.tokenizer = GatedTokenizer(service.tokenizer)
    try:
        with ThreadPoolExecutor(2) as pool:
            answer = pool.submit(client.post, "/tokenize", json={"inputs": "Hi, you!"})
            for phase in ("encode", "decode_bytes"):
                assert gated.entered[phase].wait(30), phase
                assert pool.submit(client.get, "/health").result(timeout=30).status_code == 200
                assert not answer.done()
                gated.gates[phase].set()
            assert answer.result(timeout=30).json() == [{"id": CHARS.index(c), "text": c, "start": i, "stop": i + 1}
                                                        for i, c in enumerate("Hi, you!")]
    finally:
        for gate in gated.gates.values():
            gate.set()
        service.tokenizer = gated.inner


def test_generation_failure_is_424_while_other_requests_succeed(client: TestClient, reference: Callable) -> None:
    engine = engine_of(client)
    tok = client.app.state.service.tokenizer
    in_decode, in_prefill = tok.encode("boom"), tok.encode("bang")

    def fault(reqs: list) -> None:
        req = reqs[0]
        if (req.prompt == in_decode and len(req.output) >= 2) or req.prompt == in_prefill:
            raise RuntimeError("injected fault")

    failed_before = metric(client.get("/metrics").text, "folio_failed_requests_total")
    engine.on_step = fault
    try:
        with ThreadPoolExecutor(4) as pool:
            good = [pool.submit(generate, client, p, max_new_tokens=12) for p in ("alpha", "beta")]
            bad = pool.submit(client.post, "/generate", json={"inputs": "boom", "parameters": {"max_new_tokens": 12}})
            bad_prefill = pool.submit(client.post, "/generate", json={"inputs": "bang"})
            assert_tgi_error(bad.result(), 424, "generation", "generation failed: injected fault")
            assert_tgi_error(bad_prefill.result(), 424, "generation", "during prefill: injected fault")
            assert [f.result()["generated_text"] for f in good] == [reference(p, 12)[1] for p in ("alpha", "beta")]
        r = client.post("/v1/completions", json={"prompt": "boom", "max_tokens": 12})
        assert_openai_error(r, 424, "server_error", None, "injected fault")
        events = stream(client, "boom", max_new_tokens=12)
        assert [e["index"] for e in events[:-1]] == [1, 2]
        assert events[-1] == {"error": "generation failed: injected fault", "error_type": "generation"}
        chunks = parse_sse(client.post("/v1/completions", json={"prompt": "boom", "stream": True}).text)
        assert chunks[-2] == {"error": {"message": "generation failed: injected fault", "type": "server_error",
                                        "param": None, "code": 424}} and chunks[-1] == "[DONE]"
    finally:
        engine.on_step = None
    assert generate(client, "boom", max_new_tokens=4)["generated_text"] == reference("boom", 4)[1]
    assert metric(client.get("/metrics").text, "folio_failed_requests_total") == failed_before + 5


def test_draining_answers_503(client: TestClient) -> None:
    service = client.app.state.service
    service.draining = True
    try:
        r = client.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "draining"})
        r = client.get("/health/ready")
        assert (r.status_code, r.json()["status"]) == (503, "draining") and "shutting down" in r.json()["reason"]
        assert client.get("/health/startup").status_code == 200  # a draining server is not restarted
        assert client.get("/health/live").status_code == 200
        for route in ("/generate", "/generate_stream", "/", "/tokenize"):
            r = client.post(route, json={"inputs": PROMPT})
            assert_tgi_error(r, 503, "unavailable", "shutting down")
            assert (r.headers["retry-after"], r.headers["connection"]) == ("1", "close")
        r = client.post("/v1/completions", json={"prompt": PROMPT})
        assert_openai_error(r, 503, "server_error", None, "shutting down")
        assert r.headers["retry-after"] == "1"
        assert client.get("/metrics").status_code == 200
    finally:
        service.draining = False
    assert client.get("/health").status_code == 200
    assert client.get("/health/ready").status_code == 200


def test_api_key_guards_generation_routes_and_tokenize(make_client: Callable[..., TestClient]) -> None:
    client = make_client(api_key="s3cret")
    tgi = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        for route in ("/generate", "/generate_stream", "/", "/tokenize"):
            r = client.post(route, json=tgi, headers=headers)
            assert_tgi_error(r, 401, "authentication", "Bearer <key>")
            assert r.headers["www-authenticate"] == "Bearer"
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=headers)
        assert_openai_error(r, 401, "authentication_error", None, "API key")
    ok = {"Authorization": "Bearer s3cret"}
    assert client.post("/generate", json=tgi, headers=ok).status_code == 200
    assert len(parse_sse(client.post("/generate_stream", json=tgi, headers=ok).text)) == 2
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=ok).status_code == 200
    assert len(client.post("/tokenize", json={"inputs": PROMPT}, headers=ok).json()) == len(PROMPT)
    for route in ("/health", "/metrics"):
        assert client.get(route).status_code == 200


def test_cors_headers_only_for_allowed_origins(make_client: Callable[..., TestClient], client: TestClient) -> None:
    cors = make_client(cors_origins=["https://app.example"])
    r = cors.get("/health", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = cors.options("/generate", headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                                           "Access-Control-Request-Headers": "content-type,authorization"})
    assert r.status_code == 200 and "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = cors.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}},
                  headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in cors.get("/health", headers={"Origin": "https://evil.example"}).headers
    assert "access-control-allow-origin" not in client.get("/health", headers={"Origin": "https://app.example"}).headers


# -- disconnects ------------------------------------------------------------------------------------------------------


async def asgi_call(app: Any, path: str, payload: dict, *, hang_up: Callable[[bytes], bool]) -> tuple[int, bytes]:
    """POST `payload` to `path` straight through ASGI, as uvicorn would; the client hangs up (the next `receive`
    says `http.disconnect`) once `hang_up(body so far)` is true, or after 0.3 s without a response."""
    body = json.dumps(payload).encode()
    gone = asyncio.Event()
    sent = False
    status, received = 0, bytearray()

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            received.extend(message.get("body", b""))
            if hang_up(bytes(received)):
                gone.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000), "server": ("testserver", 80), "state": {},
    }
    asyncio.get_running_loop().call_later(0.3, gone.set)  # a non-streaming client gives up waiting
    await app(scope, receive, send)
    return status, bytes(received)


@pytest.mark.parametrize(("route", "payload", "hang_up"), [
    ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": LIMIT}}, lambda b: b.count(b"\n\n") >= 2),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": LIMIT, "stream": True}, lambda b: b.count(b"\n\n") >= 2),
    ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": LIMIT}}, lambda b: False),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": LIMIT}, lambda b: False),
], ids=["tgi-stream", "openai-stream", "tgi-whole", "openai-whole"])
def test_client_disconnect_cancels_the_generation(client: TestClient, route: str, payload: dict,
                                                 hang_up: Callable[[bytes], bool]) -> None:
    engine = engine_of(client)
    before, tokens_before = engine.stats.cancelled_total, engine.stats.generated_tokens_total
    metrics_before = metric(client.get("/metrics").text, "folio_cancelled_requests_total")
    engine.on_step = lambda _: time.sleep(0.005)  # LIMIT tokens now take well over a second
    try:
        started = time.monotonic()
        status, body = client.portal.call(lambda: asgi_call(client.app, route, payload, hang_up=hang_up))
        assert time.monotonic() - started < 2.0
        assert wait_until(lambda: engine.stats.cancelled_total == before + 1 and engine.busy == 0, 1.0)
    finally:
        engine.on_step = None
    streaming = route == "/generate_stream" or payload.get("stream")
    assert status == (200 if streaming else 499)
    if streaming:
        assert len(parse_sse(body[: body.rindex(b"\n\n") + 2].decode())) >= 2
    assert 0 < engine.stats.generated_tokens_total - tokens_before < LIMIT
    assert metric(client.get("/metrics").text, "folio_cancelled_requests_total") == metrics_before + 1
