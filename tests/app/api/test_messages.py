"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): the conversation through the chat
template, answered exactly as /v1/chat/completions answers the same conversation (the system prompt as its
system turn), in Anthropic's shapes: a message with one text block and its stop_reason, the event sequence of a
stream, count_tokens, and its error body for every bad request."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.testing import assert_anthropic_error, parse_sse_events

MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]


def post(client: TestClient, route: str = "/v1/messages", **body: Any) -> Any:
    return client.post(route, json={"messages": MESSAGES, **body})


def chat_text(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "Be"}, *MESSAGES],
                                                  **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("max_tokens", [10, 60])
def test_a_message_equals_the_chat_completion_of_the_same_conversation(client: TestClient, max_tokens: int) -> None:
    """Greedy (the Messages API has no seed): the same text, usage and stop reason as chat's."""
    r = post(client, system="Be", max_tokens=max_tokens, temperature=0)
    assert r.status_code == 200, r.text
    got = r.json()
    want = chat_text(client, max_tokens=max_tokens, temperature=0)
    assert got["content"] == [{"type": "text", "text": want["choices"][0]["message"]["content"]}]
    assert (got["type"], got["role"], got["id"][:4]) == ("message", "assistant", "msg_")
    assert got["usage"] == {"input_tokens": want["usage"]["prompt_tokens"],
                            "output_tokens": want["usage"]["completion_tokens"]}
    assert got["stop_reason"] == {"length": "max_tokens", "stop": "end_turn"}[want["choices"][0]["finish_reason"]]


def test_a_stop_sequence_is_named_in_the_answer(client: TestClient) -> None:
    whole = post(client, max_tokens=30, temperature=0).json()["content"][0]["text"]
    stop = whole[3:5]
    got = post(client, max_tokens=30, temperature=0, stop_sequences=[stop]).json()
    assert (got["stop_reason"], got["stop_sequence"]) == ("stop_sequence", stop)
    assert got["content"][0]["text"] == whole[: whole.index(stop)]


def test_the_stream_is_anthropics_event_sequence_with_the_same_text(client: TestClient) -> None:
    whole = post(client, system="Be", max_tokens=8, temperature=0).json()
    r = post(client, system="Be", max_tokens=8, temperature=0, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse_events(r.text)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == []
    assert start["usage"] == {"input_tokens": whole["usage"]["input_tokens"], "output_tokens": 0}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == whole["content"][0]["text"]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": whole["stop_reason"], "stop_sequence": None}
    assert delta["usage"] == {"output_tokens": whole["usage"]["output_tokens"]}


def test_count_tokens_counts_what_messages_sends(client: TestClient) -> None:
    counted = post(client, "/v1/messages/count_tokens", system="Be").json()
    assert counted == {"input_tokens": post(client, system="Be", max_tokens=1).json()["usage"]["input_tokens"]}


def test_the_sdks_other_fields_are_accepted_and_change_nothing(client: TestClient) -> None:
    """What the anthropic SDK's create and count_tokens may send that means nothing here."""
    cache = {"cache_control": {"type": "ephemeral"}}
    extras = {**cache, "diagnostics": {}, "service_tier": "auto", "metadata": {"user_id": "u"}, "speed": "standard"}
    plain = post(client, max_tokens=8, temperature=0).json()
    assert post(client, max_tokens=8, temperature=0, **extras).json()["content"] == plain["content"]
    counted = post(client, "/v1/messages/count_tokens", **cache).json()
    assert counted == {"input_tokens": plain["usage"]["input_tokens"]}


@pytest.mark.parametrize(("body", "status", "kind", "needle"), [
    ({"messages": MESSAGES}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 5, "temperature": 1.5}, 400, "invalid_request_error", "[0, 1]"),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 5}, 400, "invalid_request_error",
     "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5}, 400,
     "invalid_request_error", "messages[0].content[0].type"),
    ({"messages": [], "max_tokens": 5}, 400, "invalid_request_error", "messages"),
    ({"messages": MESSAGES, "max_tokens": 5, "tools": [{"name": "f"}]}, 400, "invalid_request_error", "tools"),
    ({"messages": MESSAGES, "max_tokens": 5, "model": "claude-opus"}, 404, "not_found_error", "claude-opus"),
    ({"messages": MESSAGES, "max_tokens": 100_000}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 5, "output_config": {"format": "json"}}, 400, "invalid_request_error",
     "output_config.format: must be an object"),
    # a character the model does not know: named where the client wrote it, the system prompt or the messages
    ({"messages": MESSAGES, "max_tokens": 5, "system": "Bé"}, 400, "invalid_request_error",
     "system: text has 1 character(s) outside this model's vocabulary: 'é'"),
    ({"messages": [{"role": "user", "content": "ü"}], "max_tokens": 5, "system": "Be"}, 400,
     "invalid_request_error", "messages: text has 1 character(s) outside this model's vocabulary: 'ü'"),
])
def test_bad_requests_get_anthropics_error_body(client: TestClient, body: dict, status: int, kind: str,
                                                needle: str) -> None:
    assert_anthropic_error(client.post("/v1/messages", json=body), status, kind, needle)
