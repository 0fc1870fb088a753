"""Every generation route keeps its request's record (app/http/requestlog.py) up to date: the record reaches the service
through the request's state (`request_record`, `app.serving.deps.RecordDep`), not a context variable, so the routes that
pass it on by hand (TGI's root route streaming, OpenAI's whole answers, /inspect's generation) are checked here
through the access line each request ends with."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from tests.app.api.calls import PROMPT


@pytest.mark.parametrize(("route", "body", "tokens_out"), [
    ("/", {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 4}}, 4),
    ("/", {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}, 3),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 5}, 5),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 2, "seed": 1}, 4),  # both choices' tokens
    ("/inspect", {"inputs": PROMPT, "parameters": {"max_new_tokens": 6}}, 6),
], ids=["tgi-root-stream", "tgi-root", "openai-whole", "openai-n", "inspect-generation"])
def test_the_access_line_counts_the_requests_tokens(client: TestClient, caplog: pytest.LogCaptureFixture, route: str,
                                                    body: dict, tokens_out: int) -> None:
    caplog.set_level(logging.INFO, logger="folio.access")
    r = client.post(route, json=body)
    assert r.status_code == 200, r.text
    [fields] = [rec.access for rec in caplog.records if rec.name == "folio.access"]  # this request's, the only one
    assert (fields["method"], fields["route"], fields["status"]) == ("POST", route, 200)
    assert (fields["tokens_in"], fields["tokens_out"], fields["finish"]) == (len(PROMPT), tokens_out, "length")
    assert 0 < fields["ttft_ms"] <= fields["total_ms"]
