"""OpenAI's Responses API (POST /v1/responses), stateless: `input` and `instructions` answered as chat answers the
same conversation (greedy and seeded, token for token), in the response object's shape and the stream's event
sequence; text.format constrains the output; what needs stored state is refused, naming the field."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from app.testing import assert_openai_error, parse_sse_events

INPUT = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]


def respond(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(client: TestClient, messages: list, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={"messages": messages, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 9}])
def test_a_response_equals_chat_over_the_same_conversation(client: TestClient, sampling: dict) -> None:
    got = respond(client, input=INPUT, instructions="Be", max_output_tokens=10, **sampling)
    want = chat(client, [{"role": "system", "content": "Be"}, {"role": "user", "content": "Hi"}], max_tokens=10,
                **sampling)
    [item] = got["output"]
    assert (got["object"], got["id"][:5], item["type"], item["role"]) == ("response", "resp_", "message", "assistant")
    assert item["content"][0]["type"] == "output_text"
    assert item["content"][0]["text"] == want["choices"][0]["message"]["content"]
    assert got["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
    assert got["usage"]["output_tokens"] == want["usage"]["completion_tokens"]
    finished = want["choices"][0]["finish_reason"]
    assert (got["status"], got["incomplete_details"]) == (("incomplete", {"reason": "max_output_tokens"})
                                                          if finished == "length" else ("completed", None))
    assert got["store"] is False


def test_a_string_input_is_one_user_message_and_developer_is_system(client: TestClient) -> None:
    plain = respond(client, input="Hi", max_output_tokens=6, temperature=0)
    parts = respond(client, input=INPUT, max_output_tokens=6, temperature=0)
    assert plain["output"][0]["content"] == parts["output"][0]["content"]
    dev = respond(client, input=[{"role": "developer", "content": "Be"}, *INPUT], max_output_tokens=6,
                  temperature=0)
    sys = respond(client, input=INPUT, instructions="Be", max_output_tokens=6, temperature=0)
    assert dev["output"][0]["content"] == sys["output"][0]["content"]


def test_the_stream_is_the_responses_event_sequence(client: TestClient) -> None:
    whole = respond(client, input="Hi", max_output_tokens=8, temperature=0)
    r = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 8, "temperature": 0, "stream": True})
    events = parse_sse_events(r.text)
    names = [n for n, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            f"response.{whole['status']}"]
    assert names[-4:] == tail and set(names[4:-4]) == {"response.output_text.delta"}
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(d["type"] == n for n, d in events)
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"] == events[-4][1]["text"]
    final = events[-1][1]["response"]
    assert final["usage"] == whole["usage"] and final["output"][0]["content"] == whole["output"][0]["content"]


def test_text_format_json_schema_constrains_the_output(bpe_client: TestClient) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    for seed in range(3):
        got = respond(bpe_client, input="Answer:", text=fmt, temperature=1.0, seed=seed, max_output_tokens=30)
        jsonschema.validate(json.loads(got["output"][0]["content"][0]["text"]), schema)


SDK_EXTRAS = {"include": ["reasoning.encrypted_content"], "service_tier": "auto", "max_tool_calls": 2,
              "prompt_cache_key": "k", "safety_identifier": "u", "stream_options": {"include_obfuscation": False},
              "background": False, "conversation": None, "prompt": None, "top_logprobs": 0, "store": False,
              "metadata": {"run": "7"}, "reasoning": {"effort": "low"}, "parallel_tool_calls": True}


def test_the_sdks_other_fields_are_accepted_and_change_nothing(client: TestClient) -> None:
    """What the openai SDK's create may send that means nothing here, each as a client would fill it in."""
    plain = respond(client, input="Hi", max_output_tokens=8, temperature=0)["output"]
    assert respond(client, input="Hi", max_output_tokens=8, temperature=0, **SDK_EXTRAS)["output"][0]["content"] \
        == plain[0]["content"]


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"input": "Hi", "store": True}, "store", "stateless"),
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id", "input"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "'robot'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "input_image"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "item_reference"),
    ({"input": "Hi", "background": True}, "background", "in the request"),
    ({"input": "Hi", "conversation": "conv_1"}, "conversation", "keeps nothing"),
    ({"input": "Hi", "prompt": {"id": "pmpt_1"}}, "prompt", "keeps nothing"),
    ({"input": "Hi", "top_logprobs": 3}, "top_logprobs", "chat completions"),
    ({"input": "Hi", "instructions": "Bé"}, "instructions", "outside this model's vocabulary: 'é'"),
    ({"input": "Hü", "instructions": "Be"}, "input", "outside this model's vocabulary: 'ü'"),
    ({"input": "Hi", "max_output_tokens": 100_000}, "max_output_tokens", "[1, 256]"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {"type": "banana"}}}}, "text.format.schema",
     "banana"),
    ({"input": "Hi", "text": {"format": "json"}}, "text.format", "must be an object"),
    ({"input": "Hi", "text": {"format": [1]}}, "text.format", "got [1]"),
])
def test_bad_requests_are_400_naming_the_field(client: TestClient, body: dict, param: str, needle: str) -> None:
    r = client.post("/v1/responses", json=body)
    assert_openai_error(r, 400, "invalid_request_error", param, *([needle] if needle else []))
