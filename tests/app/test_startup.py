"""`python -m app`'s start-up checks, in process: every mistake in flags, `FOLIO_*` variables, device or address
is one `error:` line and exit code 2, returned before any checkpoint is loaded; then the port opens while the
engine is built and warmed up (503 with Retry-After until ready, exit 2 if it cannot be built, a signal
meanwhile ends the server at once)."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from app.__main__ import main, make_server, parse_args, startup_settings
from app.main import create_app
from app.settings import OTHER_VARIABLES, Settings
from app.testing import REFUSED, assert_openai_error, assert_tgi_error, free_port, probe
from model.chat_template import ChatTemplate
from model.checkpoint import load_checkpoint
from tests import REPO


@pytest.fixture(autouse=True)
def no_folio_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the FOLIO_* variables it is about, and no others."""
    for name in list(os.environ):
        if name.upper().startswith("FOLIO_"):
            monkeypatch.delenv(name)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run `main(argv)`: it must exit 2 having printed exactly one line, `error: ...`, which is returned."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals exit from inside parse_args
        code = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]


# (FOLIO_* variables, flags, fragments the error line must hold)
BAD_STARTS = {
    "empty API key in the environment": ({"FOLIO_API_KEY": ""}, [], ["--api-key (FOLIO_API_KEY)", "empty"]),
    "blank API key in the environment": ({"FOLIO_API_KEY": " \t "}, [], ["FOLIO_API_KEY", "empty"]),
    "empty --api-key": ({}, ["--api-key", ""], ["--api-key", "empty"]),
    "misspelled FOLIO_API_KEY": ({"FOLIO_APIKEY": "s3cret"}, [], ["FOLIO_APIKEY", "did you mean FOLIO_API_KEY?"]),
    "misspelled, lower case": ({"folio_treads": "1"}, [], ["folio_treads", "did you mean FOLIO_THREADS?"]),
    "unknown FOLIO_ variable": ({"FOLIO_XYZZY": "1"}, [], ["FOLIO_XYZZY", "not a Folio setting"]),
    "bad --log-level": ({}, ["--log-level", "bogus"], ["--log-level", "'debug'", "got 'bogus'"]),
    "bad FOLIO_LOG_LEVEL": ({"FOLIO_LOG_LEVEL": "loud"}, [], ["FOLIO_LOG_LEVEL", "got 'loud'"]),
    "origin with a path": ({"FOLIO_CORS_ORIGINS": "https://a.example/"}, [], ["'https://a.example/' is not an origin"]),
    "origin list not JSON": ({"FOLIO_CORS_ORIGINS": '["https://a.example",'}, [], ["not a JSON list"]),
    "port out of range": ({}, ["--port", "99999"], ["--port (FOLIO_PORT)", "65535", "got '99999'"]),
    "number not a number": ({"FOLIO_MAX_WAITING": "lots"}, [], ["--max-waiting (FOLIO_MAX_WAITING)", "integer"]),
    "more threads than cores": ({}, ["--threads", "100000"], ["--threads", "cores", "got 100000"]),
    "infinite drain timeout": ({}, ["--drain-timeout", "inf"], ["--drain-timeout", "86400"]),
    "NaN drain timeout": ({}, ["--drain-timeout", "nan"], ["--drain-timeout"]),
    "default above the limit": ({}, ["--max-new-tokens-default", "5000"],
                                ["--max-new-tokens-default (5000)", "--max-new-tokens-limit (4096)"]),
    "not a device": ({}, ["--device", "gpu0"], ["--device gpu0: not a device name", "cuda:N"]),
    "a device type it does not serve on": ({}, ["--device", "mps"], ["--device mps"]),
    "a CUDA device it lacks": ({}, ["--device", "cuda:99"], ["--device cuda:99"]),
    "unknown flag": ({}, ["--max-batches", "4"], ["--max-batches", "python -m app --help"]),
    "bad bool variable": ({"FOLIO_FAULT_INJECTION": "maybe"}, [], ["FOLIO_FAULT_INJECTION"]),
    "bad --kv-cache-dtype": ({}, ["--kv-cache-dtype", "int4"], ["--kv-cache-dtype", "'fp16'", "got 'int4'"]),
    "chat template that does not compile": ({}, ["--chat-template", "{% for m in messages %}"],
                                            ["--chat-template (FOLIO_CHAT_TEMPLATE)", "does not compile",
                                             "syntax error at line 1"]),
    "chat template file that is not there": ({"FOLIO_CHAT_TEMPLATE": "templates/chat.jinja"}, [],
                                             ["FOLIO_CHAT_TEMPLATE", "no file 'templates/chat.jinja' found"]),
    "bad FOLIO_KV_CACHE_DTYPE": ({"FOLIO_KV_CACHE_DTYPE": "bf16"}, [], ["FOLIO_KV_CACHE_DTYPE", "got 'bf16'"]),
    "a draft model it lacks": ({}, ["--speculative-model", "gpt2"], ["--speculative-model", "'[ngram]'",
                                                                      "got 'gpt2'"]),
    "too many speculative tokens": ({}, ["--num-speculative-tokens", "17"], ["--num-speculative-tokens", "16"]),
    "n-gram sizes the wrong way round": ({}, ["--ngram-prompt-lookup-min", "5"],
                                         ["--ngram-prompt-lookup-min (5)", "--ngram-prompt-lookup-max (4)"]),
}


@pytest.mark.parametrize("case", list(BAD_STARTS))
def test_startup_mistake_is_one_error_line_and_exit_2(
    case: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    env, argv, fragments = BAD_STARTS[case]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # a checkpoint that does not exist: a start that got past the checks would fail on it with another line
    line = refused(["--checkpoint", str(tmp_path / "none"), "--port", "0", *argv], capsys)
    for fragment in fragments:
        assert fragment in line, line
    assert "cannot serve" not in line


def test_the_api_key_is_never_echoed(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FOLIO_APIKEY", "hunter2-secret")  # refused as unknown: the message names it, not its value
    assert "hunter2" not in refused([], capsys)


def test_a_port_in_use_is_refused_before_loading(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = refused(["--checkpoint", str(tmp_path / "none"), "--port", str(port)], capsys)
    assert f"--port {port}: cannot listen there" in line


def test_folio_variables_that_are_not_options_are_allowed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for name in OTHER_VARIABLES:
        monkeypatch.setenv(name, "0")
    # it gets past every check to the checkpoint, which is missing
    assert main(["--checkpoint", str(tmp_path / "none"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot serve {tmp_path / 'none'}: checkpoint directory not found"), err


def test_every_folio_variable_in_the_repository_is_known() -> None:
    """Each FOLIO_* name the code, Docker files and docs use is an option's or in OTHER_VARIABLES, so that a
    new one cannot be added without the server's start-up check knowing it."""
    files = [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("docker/*"), *REPO.glob("*/*.py"),
             *REPO.glob("bench/*/*.py"), *REPO.glob("weights/*/README.md")]
    assert REPO / "docs" / "configuration.md" in files  # the manual's pages name variables too
    text = "\n".join(f.read_text(encoding="utf-8") for f in files if f.is_file())
    macros = set(re.findall(r"\b(FOLIO_[A-Z0-9_]+)\(", text))  # C++ in model/kernels.py, not variables
    used = set(re.findall(r"\bFOLIO_[A-Z0-9_]*[A-Z0-9]\b", text)) - macros
    options = {f"FOLIO_{name.upper()}" for name in Settings.model_fields}
    assert "FOLIO_KERNEL_DIR" in used and "FOLIO_API_KEY" in used  # the scan finds what is there
    assert sorted(used - options - set(OTHER_VARIABLES)) == []


@pytest.mark.parametrize("value, origins", [
    ("*", ["*"]),
    ("https://a.example, https://b.example:8443", ["https://a.example", "https://b.example:8443"]),
    ('["https://a.example", "http://localhost:3000"]', ["https://a.example", "http://localhost:3000"]),
    ("", []),
])
def test_cors_origins_from_the_environment(value: str, origins: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FOLIO_CORS_ORIGINS", value)
    assert Settings().cors_origins == origins


def test_cors_origins_flag_takes_words_and_commas() -> None:
    args = parse_args(["--cors-origins", "https://a.example,https://b.example", "https://c.example"])
    assert Settings(**args).cors_origins == ["https://a.example", "https://b.example", "https://c.example"]


def test_api_key_surrounding_whitespace_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FOLIO_API_KEY", " s3cret\n")  # as `FOLIO_API_KEY=$(cat keyfile)` may leave it
    assert Settings().api_key.get_secret_value() == "s3cret"


def test_star_origin_allows_any_origin(char_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FOLIO_CORS_ORIGINS", "*")
    settings = Settings(checkpoint=char_checkpoint, device="cpu", threads=1)
    with TestClient(create_app(settings)) as client:
        r = client.get("/health", headers={"Origin": "https://anywhere.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


@pytest.fixture
def held_build(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """`build_engine` held until the event is set (a start that builds the CPU kernels takes minutes)."""
    import app.main

    gate, build = threading.Event(), app.main.build_engine

    def held(settings: Settings, checkpoint: Any) -> Any:
        assert gate.wait(60)
        return build(settings, checkpoint)

    monkeypatch.setattr(app.main, "build_engine", held)
    yield gate
    gate.set()


def test_the_port_opens_while_the_model_loads_and_answers_503_until_ready(char_checkpoint: Path,
                                                                            held_build: threading.Event) -> None:
    """Before: uvicorn opened the port only once the lifespan (load, build, warm-up) had ended, so the documented
    503 while loading was never seen, only refused connections. Now every route answers meanwhile: loading (503 with
    Retry-After) where it needs the model, alive on /health/live."""
    port = free_port()
    settings = startup_settings(["--checkpoint", str(char_checkpoint), "--port", str(port), "--device", "cpu",
                                 "--threads", "1", "--log-level", "warning"])
    server = make_server(settings, create_app(settings, checkpoint=load_checkpoint(char_checkpoint)))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=30) as client:
            deadline = time.monotonic() + 60
            while probe(client, "/health") == REFUSED:
                assert time.monotonic() < deadline and thread.is_alive()
                time.sleep(0.02)
            for route in ("/health", "/health/startup", "/health/ready"):
                r = client.get(route)
                assert (r.status_code, r.json()["status"], r.headers["retry-after"]) == (503, "loading", "1"), route
            assert (client.get("/health/live").status_code, client.get("/health/live").json()) == (
                200, {"status": "loading"})
            r = client.post("/generate", json={"inputs": "ab"})
            assert_tgi_error(r, 503, "unavailable", "still loading")
            assert r.headers["retry-after"] == "1"
            r = client.post("/v1/completions", json={"prompt": "ab"})
            assert_openai_error(r, 503, "server_error", None, "still loading")
            assert client.get("/info").status_code == 503
            held_build.set()
            while client.get("/health").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            r = client.post("/generate", json={"inputs": "ab", "parameters": {"max_new_tokens": 3}})
            assert r.status_code == 200 and len(r.json()["generated_text"]) == 3
    finally:
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()


def test_a_model_that_cannot_be_built_after_the_port_opened_exits_2(
        char_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import app.main

    def broken(settings: Settings, checkpoint: Any) -> Any:
        raise RuntimeError("no memory for the KV cache")

    monkeypatch.setattr(app.main, "build_engine", broken)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # main() puts its own handler there
    monkeypatch.setattr(root, "level", root.level)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # and no-op ones for these
    try:
        code = main(["--checkpoint", str(char_checkpoint), "--port", str(free_port()), "--device", "cpu",
                     "--threads", "1", "--log-level", "warning"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    want = f"error: cannot serve {char_checkpoint}: model 'tiny-char' could not be loaded: no memory for the KV cache"
    assert code == 2 and last == want, last


def test_a_signal_while_the_model_loads_ends_the_server_without_waiting_for_the_load(
        char_checkpoint: Path, held_build: threading.Event) -> None:
    port = free_port()
    settings = startup_settings(["--checkpoint", str(char_checkpoint), "--port", str(port), "--device", "cpu",
                                 "--threads", "1", "--log-level", "warning"])
    app = create_app(settings, checkpoint=load_checkpoint(char_checkpoint))
    server = make_server(settings, app)
    thread = threading.Thread(target=server.run)
    thread.start()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=30) as client:
        deadline = time.monotonic() + 60
        while probe(client, "/health") == REFUSED:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
    server.handle_exit(signal.SIGTERM, None)
    thread.join(45)  # the build is held for 60 s
    assert not thread.is_alive() and not held_build.is_set()
    assert server.started and app.state.startup_error is None  # stopped, not failed: exit code 0


def test_chat_template_setting_reaches_the_registry(char_checkpoint: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """--chat-template FILE and FOLIO_CHAT_TEMPLATE with the text: the registry holds the template for checkpoints
    that carry none (it is not loaded here: create_app loads in its lifespan)."""
    text = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(text, encoding="utf-8")
    registry = create_app(Settings(checkpoint=char_checkpoint, chat_template=str(path))).state.models.registry
    assert registry.fallback_chat_template == ChatTemplate(text, f"--chat-template {path}")
    monkeypatch.setenv("FOLIO_CHAT_TEMPLATE", text)
    registry = create_app(Settings(checkpoint=char_checkpoint)).state.models.registry
    assert registry.fallback_chat_template == ChatTemplate(text, "--chat-template")
    monkeypatch.delenv("FOLIO_CHAT_TEMPLATE")
    assert create_app(Settings(checkpoint=char_checkpoint)).state.models.registry.fallback_chat_template is None
