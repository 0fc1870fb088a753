"""Request IDs and the access log (app/http/requestlog.py), against
real `python -m app` processes whose stderr the tests
read: the ID a client sends (if sane) or a new one, in the response header, the error body and every log line
about the request; one access line per request with its tokens and times; `--log-format json` (here through
FOLIO_LOG_FORMAT) making every line a JSON object; and never the prompt or the API key, even at trace level."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.__main__ import startup_settings
from app.testing import assert_openai_error, assert_tgi_error, parse_sse, serving

KEY = "KEYMARKER8642"
AUTH = {"Authorization": f"Bearer {KEY}"}
GENERATED_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def json_server(char_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A server writing JSON logs at info level (FOLIO_LOG_FORMAT=json), with a key and fault injection: (URL, log)."""
    log = tmp_path_factory.mktemp("json-log") / "server.log"
    args = ("--log-level", "info", "--api-key", KEY, "--fault-injection")
    with serving(char_checkpoint, log, *args, env={"FOLIO_LOG_FORMAT": "json"}) as (base, _):
        yield base, log


def records(log: Path) -> list[dict[str, Any]]:
    """Every whole line of a JSON log, each of which must be one JSON object (a last line without its newline is
    still being written: the server writes as the test reads)."""
    out = []
    text = log.read_text()
    for line in text[:text.rfind("\n") + 1].splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"a log line that is not JSON: {line!r}") from None
        assert isinstance(out[-1], dict), line
    return out


def access_line(log: Path, request_id: str, timeout: float = 15.0) -> dict[str, Any]:
    """The access line of `request_id`, once written (the server writes it as the response ends), and the only one."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [r for r in records(log) if r["logger"] == "folio.access" and r.get("request_id") == request_id]
        if lines or time.monotonic() > deadline:
            assert len(lines) == 1, (request_id, lines)
            return lines[0]
        time.sleep(0.05)


def test_a_sane_id_is_kept_any_other_replaced(json_server: tuple[str, Path]) -> None:
    base, log = json_server
    sent = ["trace-0123:abc/DEF+=~_.", "x" * 128, "has space", "x" * 129, "quote\"d", "caf\u00e9", None]
    got = []
    for request_id in sent:
        headers = {"X-Request-Id": request_id.encode("utf-8")} if request_id else {}
        r = httpx.get(f"{base}/info", headers=headers, timeout=30, trust_env=False)
        assert r.status_code == 200, r.text
        got.append(r.headers["x-request-id"])
    assert got[:2] == sent[:2]
    assert all(GENERATED_ID.fullmatch(g) for g in got[2:]), got
    assert len(set(got)) == len(got)
    for request_id in got:
        line = access_line(log, request_id)
        assert (line["method"], line["route"], line["status"], line["tokens_in"]) == ("GET", "/info", 200, None)


def test_one_access_line_per_generation_with_tokens_and_times(json_server: tuple[str, Path]) -> None:
    base, log = json_server
    prompt = "To be or not"
    with httpx.Client(base_url=base, headers=AUTH, timeout=60, trust_env=False) as client:
        r = client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 7}},
                        headers={"X-Request-Id": "whole-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "whole-1", r.text
        streamed = client.post("/generate_stream", json={"inputs": prompt, "parameters": {"max_new_tokens": 5}})
        assert len(parse_sse(streamed.text)) == 5
        openai = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "stream": True})
        assert parse_sse(openai.text)[-1] == "[DONE]"
    expected = [("whole-1", "/generate", 7), (streamed.headers["x-request-id"], "/generate_stream", 5),
                (openai.headers["x-request-id"], "/v1/completions", 3)]
    for request_id, route, tokens in expected:
        line = access_line(log, request_id)
        assert line["message"] == f"POST {route} 200" and line["level"] == "info", line
        assert (line["method"], line["route"], line["status"]) == ("POST", route, 200), line
        assert (line["tokens_in"], line["tokens_out"], line["finish"]) == (len(prompt), tokens, "length"), line
        assert 0 < line["ttft_ms"] <= line["total_ms"] and line["client"] == "127.0.0.1", line


def test_error_bodies_carry_the_id_of_their_access_line(json_server: tuple[str, Path]) -> None:
    base, log = json_server
    with httpx.Client(base_url=base, timeout=60, trust_env=False) as client:
        unauthorized = client.post("/generate", json={"inputs": "To be"})
        bad = client.post("/generate", headers={**AUTH, "X-Request-Id": "bad-temperature"},
                          json={"inputs": "To be", "parameters": {"temperature": -1}})
        openai_bad = client.post("/v1/completions", headers=AUTH, json={"prompt": "To be", "max_tokens": 0})
        missing = client.get("/no/such/route")
    assert_tgi_error(unauthorized, 401, "authentication")
    assert_tgi_error(bad, 422, "validation", "parameters.temperature")
    assert_openai_error(openai_bad, 400, "invalid_request_error", "max_tokens")
    assert bad.json()["request_id"] == "bad-temperature"
    for r, route in ((unauthorized, "/generate"), (bad, "/generate"), (openai_bad, "/v1/completions"),
                     (missing, "unmatched")):
        line = access_line(log, r.json()["request_id"])
        assert (line["route"], line["status"], line["tokens_in"], line["finish"]) == (route, r.status_code, None,
                                                                                      None), line


def test_the_engines_line_about_a_failed_request_carries_its_id(json_server: tuple[str, Path]) -> None:
    base, log = json_server
    r = httpx.post(f"{base}/generate", headers={**AUTH, "X-Request-Id": "faulty-1"}, timeout=60, trust_env=False,
                   json={"inputs": "<fault:decode>", "parameters": {"max_new_tokens": 5}})
    assert_tgi_error(r, 424, "generation", "injected fault")
    line = access_line(log, "faulty-1")
    assert (line["status"], line["tokens_in"], line["finish"]) == (424, len("<fault:decode>"), "error"), line
    engine = [rec for rec in records(log) if rec["logger"] == "folio.engine" and "failed" in rec["message"]]
    assert [rec.get("request_id") for rec in engine] == ["faulty-1"], engine


def test_every_line_is_json_uvicorns_too(json_server: tuple[str, Path]) -> None:
    _, log = json_server
    lines = records(log)
    assert {"time", "level", "logger", "message"} <= set(lines[0]), lines[0]
    assert any(r["logger"].startswith("uvicorn") for r in lines), [r["logger"] for r in lines]
    assert any(r["logger"] == "folio" and r["message"].startswith("serving ") for r in lines)


def test_a_bad_log_format_is_a_start_up_error() -> None:
    with pytest.raises(ValueError, match=r"--log-format \(FOLIO_LOG_FORMAT\).*'text' or 'json'.*got 'xml'"):
        startup_settings(["--log-format", "xml"])


def test_text_lines_and_never_the_prompt_or_the_key_even_at_trace(char_checkpoint: Path, tmp_path: Path) -> None:
    """Marked strings sent as the prompt, a stop string, OpenAI's `user`, the key and a wrong key: none of them in
    the log, of which there is plenty (uvicorn's trace lines: every ASGI message)."""
    prompt, stop, user, wrong = "PROMPTMARKER7319", "STOPMARKER" * 13, "USERMARKER2468", "WRONGKEYMARKER5555"
    log = tmp_path / "server.log"
    with serving(char_checkpoint, log, "--log-level", "trace", "--api-key", KEY) as (base, _):
        with httpx.Client(base_url=base, timeout=60, trust_env=False) as client:
            ok = client.post("/generate", headers={**AUTH, "X-Request-Id": "text-1"},
                             json={"inputs": prompt, "parameters": {"max_new_tokens": 4}})
            assert ok.status_code == 200, ok.text
            assert client.post("/v1/completions", headers=AUTH, json={"prompt": prompt, "user": user,
                                                                       "max_tokens": 2}).status_code == 200
            assert client.post("/generate", headers={"Authorization": f"Bearer {wrong}"},
                               json={"inputs": prompt}).status_code == 401
            too_long = client.post("/generate", headers=AUTH, json={"inputs": prompt, "parameters": {"stop": [stop]}})
            assert too_long.status_code == 422 and "STOPMARKER" in too_long.text  # echoed to the client only
    text = log.read_text()
    assert " TRACE uvicorn" in text and "ASGI [" in text, text[-2000:]  # trace level was on
    line = next(ln for ln in text.splitlines() if " folio.access: POST /generate 200 " in ln)
    expected = (r"\S+ \S+ INFO folio\.access: POST /generate 200 tokens_in=16 tokens_out=4 ttft_ms=[\d.]+ "
                r"total_ms=[\d.]+ finish=length client=127\.0\.0\.1 request_id=text-1")
    assert re.fullmatch(expected, line), line
    for marker in (prompt, "STOPMARKER", user, KEY, wrong, "MARKER"):
        assert marker not in text, marker


FORGED = "6.6.6.6 status=500 tokens_out=999 request_id=forged"


@pytest.mark.parametrize("trusted", [False, True], ids=["by-default", "forwarded-allow-ips"])
def test_a_forwarded_address_is_believed_only_from_trusted_proxies_and_quoted(char_checkpoint: Path, tmp_path: Path,
                                                                               trusted: bool) -> None:
    """uvicorn believes X-Forwarded-For from 127.0.0.1 unless told otherwise: any local process wrote the forged
    fields above into the text access log (before: `client=6.6.6.6 status=500 tokens_out=999 request_id=forged
    request_id=real-1`). Now the header counts only from --forwarded-allow-ips, and a value that is not one plain
    word is quoted."""
    log = tmp_path / "server.log"
    args = ("--log-level", "info", *(("--forwarded-allow-ips", "127.0.0.1") if trusted else ()))
    with serving(char_checkpoint, log, *args) as (base, _):
        r = httpx.post(f"{base}/generate", json={"inputs": "ab", "parameters": {"max_new_tokens": 2}}, timeout=60,
                       headers={"X-Forwarded-For": FORGED, "X-Request-Id": "real-1"}, trust_env=False)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 15
        while not (lines := [ln for ln in log.read_text().splitlines() if "request_id=real-1" in ln]):
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
    (line,) = lines
    client = f'client="{FORGED}"' if trusted else "client=127.0.0.1"
    assert line.endswith(f" finish=length {client} request_id=real-1"), line
    assert line.count("request_id=") == 1 + trusted  # the forged one only inside the quotes
