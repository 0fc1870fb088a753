"""Access: the API key guards generation and /tokenize, CORS headers go only to allowed origins."""

from __future__ import annotations

from collections.abc import Callable

from fastapi.testclient import TestClient

from app.testing import assert_anthropic_error, assert_openai_error, assert_tgi_error, parse_sse
from tests.app.api.calls import PROMPT


def test_api_key_guards_generation_routes_and_tokenize(make_client: Callable[..., TestClient]) -> None:
    client = make_client(api_key="s3cret")
    tgi = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
    anthropic = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"x-api-key": "wrong"}):
        for route in ("/generate", "/generate_stream", "/", "/tokenize"):
            r = client.post(route, json=tgi, headers=headers)
            assert_tgi_error(r, 401, "authentication", "Bearer <key>")
            assert r.headers["www-authenticate"] == "Bearer"
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=headers)
        assert_openai_error(r, 401, "authentication_error", None, "API key", code="invalid_api_key")
        r = client.post("/v1/messages", json=anthropic, headers=headers)
        assert_anthropic_error(r, 401, "authentication_error", "x-api-key")
    # Anthropic's clients send the key as x-api-key: accepted on every guarded route, as a bearer token is
    for ok_key in ({"x-api-key": "s3cret"}, {"Authorization": "Bearer s3cret"}):
        assert client.post("/v1/messages", json=anthropic, headers=ok_key).status_code == 200
        assert client.post("/generate", json=tgi, headers=ok_key).status_code == 200
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
