"""`python -m app`'s start-up checks, in process: every mistake in flags, `FOLIO_*` variables, device or address
is one `error:` line and exit code 2, returned before any checkpoint is loaded."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.__main__ import main, parse_args
from app.main import create_app
from app.settings import OTHER_VARIABLES, Settings
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
    "bad FOLIO_KV_CACHE_DTYPE": ({"FOLIO_KV_CACHE_DTYPE": "bf16"}, [], ["FOLIO_KV_CACHE_DTYPE", "got 'bf16'"]),
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
