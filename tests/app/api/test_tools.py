"""Tool calls through every API that offers tools: chat completions, Anthropic's Messages, OpenAI's Responses. Each
API's call (a `tool_calls` entry, a `tool_use` block, a `function_call` item) is generated under the function's
schema and validates with `jsonschema`; the same greedy request through the three APIs makes the same call (they
render one conversation, so one prompt); a conversation holding earlier calls and their results renders, through a
template that prints them, to the same prompt and the same greedy answer whichever API carried it; streams carry
the call in each API's events; every bad tool, choice or history item is a 422 naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pydantic_core
import pytest
from fastapi.testclient import TestClient

from app.api.anthropic.protocol import MessagesRequest
from app.api.openai.responses.protocol import ResponsesRequest
from app.testing import assert_anthropic_error, assert_openai_error, parse_sse, parse_sse_events

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 3},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
               "additionalProperties": False}
SCHEMAS = {"weather": WEATHER_SCHEMA, "time": TIME_SCHEMA}
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "description": f"the {n}", "parameters": s}}
              for n, s in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": n, "description": f"the {n}", "input_schema": s} for n, s in SCHEMAS.items()]
RESPONSES_TOOLS = [{"type": "function", "name": n, "description": f"the {n}", "parameters": s}
                   for n, s in SCHEMAS.items()]
USER = [{"role": "user", "content": "Weather:"}]
GREEDY = {"temperature": 0}
BUDGET = 100  # random weights write multi-token characters: room for a whole call of the longest arguments


def ok(r: Any) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()


def chat_answer(client: TestClient, choice: Any, **body: Any) -> dict[str, Any]:
    return ok(client.post("/v1/chat/completions", json={"messages": USER, "tools": CHAT_TOOLS, "tool_choice": choice,
                                                        "max_tokens": BUDGET, **GREEDY, **body}))


def chat_call(client: TestClient, choice: Any, **body: Any) -> tuple[str, dict[str, Any]]:
    answer = chat_answer(client, choice, **body)
    [call] = answer["choices"][0]["message"]["tool_calls"]
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def messages_call(client: TestClient, choice: dict[str, Any], **body: Any) -> dict[str, Any]:
    return ok(client.post("/v1/messages", json={"messages": USER, "tools": ANTHROPIC_TOOLS, "tool_choice": choice,
                                                "max_tokens": BUDGET, **GREEDY, **body}))


def responses_call(client: TestClient, choice: Any, **body: Any) -> dict[str, Any]:
    return ok(client.post("/v1/responses", json={"input": USER, "tools": RESPONSES_TOOLS, "tool_choice": choice,
                                                 "max_output_tokens": BUDGET, **GREEDY, **body}))


@pytest.mark.parametrize(("chat", "anthropic", "responses"), [
    ("required", {"type": "any"}, "required"),
    ({"type": "function", "function": {"name": "weather"}}, {"type": "tool", "name": "weather"},
     {"type": "function", "name": "weather"}),
    ({"type": "function", "function": {"name": "time"}}, {"type": "tool", "name": "time"},
     {"type": "function", "name": "time"}),
])
def test_the_three_apis_make_the_same_call_under_its_schema(bpe_client: TestClient, chat: Any, anthropic: Any,
                                                            responses: Any) -> None:
    name, arguments = chat_call(bpe_client, chat)
    jsonschema.validate(arguments, SCHEMAS[name])

    message = messages_call(bpe_client, anthropic)
    [block] = message["content"]
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None, message
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
    assert (block["name"], block["input"]) == (name, arguments)

    response = responses_call(bpe_client, responses)
    [item] = response["output"]
    assert response["status"] == "completed" and item["type"] == "function_call", response
    assert item["status"] == "completed" and item["call_id"].startswith("call_") and item["id"].startswith("fc_")
    assert (item["name"], json.loads(item["arguments"])) == (name, arguments)
    assert response["tools"] == RESPONSES_TOOLS and response["tool_choice"] == responses
    if "name" in anthropic:
        assert name == anthropic["name"]


def test_messages_streams_the_call_as_a_tool_use_block(bpe_client: TestClient) -> None:
    whole = messages_call(bpe_client, {"type": "tool", "name": "weather"})
    events = parse_sse_events(bpe_client.post("/v1/messages", json={
        "messages": USER, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "weather"},
        "max_tokens": BUDGET, "stream": True, **GREEDY}).text)
    assert [name for name, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                            "content_block_stop", "message_delta", "message_stop"]
    start, delta = events[2][1]["content_block"], events[3][1]["delta"]
    assert (start["type"], start["name"], start["input"]) == ("tool_use", "weather", {})
    assert delta["type"] == "input_json_delta" and json.loads(delta["partial_json"]) == whole["content"][0]["input"]
    assert events[5][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[5][1]["usage"] == {"output_tokens": whole["usage"]["output_tokens"]}


def test_responses_streams_the_call_as_a_function_call_item(bpe_client: TestClient) -> None:
    whole = responses_call(bpe_client, "required")
    events = parse_sse_events(bpe_client.post("/v1/responses", json={
        "input": USER, "tools": RESPONSES_TOOLS, "tool_choice": "required", "max_output_tokens": BUDGET,
        "stream": True, **GREEDY}).text)
    assert [name for name, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    added, done = events[2][1]["item"], events[5][1]["item"]
    assert (added["arguments"], added["status"], done["status"]) == ("", "in_progress", "completed")
    assert added["id"] == done["id"] == events[3][1]["item_id"] == events[4][1]["item_id"]
    assert events[3][1]["delta"] == events[4][1]["arguments"] == done["arguments"]
    want = whole["output"][0]
    assert (done["name"], json.loads(done["arguments"])) == (want["name"], json.loads(want["arguments"]))
    assert events[-1][1]["response"]["output"] == [done]


def test_a_call_cut_short_is_what_there_is_of_it_with_the_budgets_reason(bpe_client: TestClient) -> None:
    """As OpenAI and Anthropic answer a call that max_tokens cut: the call with its arguments cut short (a prefix of
    the whole call's, greedy), and the budget's reason, in each API's shape, whole and streamed."""
    named = {"type": "function", "function": {"name": "weather"}}
    whole = chat_answer(bpe_client, named)
    arguments = whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    cut = whole["usage"]["completion_tokens"] - 2
    choice = chat_answer(bpe_client, named, max_tokens=cut)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None, choice
    [call] = choice["message"]["tool_calls"]
    partial = call["function"]["arguments"]
    assert call["function"]["name"] == "weather" and arguments.startswith(partial) and partial != arguments

    chunks = [c for c in parse_sse(bpe_client.post("/v1/chat/completions", json={
        "messages": USER, "tools": CHAT_TOOLS, "tool_choice": named, "max_tokens": cut, "stream": True,
        **GREEDY}).text) if c != "[DONE]"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert chunks[-2]["choices"][0]["delta"]["tool_calls"][0]["function"] == call["function"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[-2:]] == [None, "length"]
    assert chunks[-1]["choices"][0]["delta"] == {}

    message = messages_call(bpe_client, {"type": "tool", "name": "weather"}, max_tokens=cut)
    [block] = message["content"]
    assert message["stop_reason"] == "max_tokens" and block["type"] == "tool_use" and block["name"] == "weather"
    assert block["input"] == pydantic_core.from_json(partial, allow_partial="trailing-strings")
    events = parse_sse_events(bpe_client.post("/v1/messages", json={
        "messages": USER, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "weather"},
        "max_tokens": cut, "stream": True, **GREEDY}).text)
    assert [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"] == [partial]
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"

    response = responses_call(bpe_client, {"type": "function", "name": "weather"}, max_output_tokens=cut)
    [item] = response["output"]
    assert response["status"] == "incomplete" and (item["type"], item["status"]) == ("function_call", "incomplete")
    assert item["arguments"] == partial
    events = parse_sse_events(bpe_client.post("/v1/responses", json={
        "input": USER, "tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "weather"},
        "max_output_tokens": cut, "stream": True, **GREEDY}).text)
    assert events[-1][0] == "response.incomplete" and events[-1][1]["response"]["output"][0]["arguments"] == partial


def test_a_required_call_cut_before_its_name_is_no_call(bpe_client: TestClient) -> None:
    """tool_choice required generates {"name": ..., "arguments": ...}: cut before the name is whole, there is no
    call to give (and that wrapper is never shown as text); cut after it, the call with its arguments cut short."""
    choice = chat_answer(bpe_client, "required", max_tokens=2)["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": None} and choice["finish_reason"] == "length"
    message = messages_call(bpe_client, {"type": "any"}, max_tokens=2)
    assert message["content"] == [] and message["stop_reason"] == "max_tokens"
    response = responses_call(bpe_client, "required", max_output_tokens=2)
    assert response["output"] == [] and response["status"] == "incomplete"
    whole = chat_answer(bpe_client, "required")
    name = whole["choices"][0]["message"]["tool_calls"][0]["function"]["name"]
    cut = chat_answer(bpe_client, "required", max_tokens=whole["usage"]["completion_tokens"] - 2)
    [call] = cut["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == name and call["function"]["arguments"].startswith("{")
    assert "arguments" not in call["function"]["arguments"] and cut["choices"][0]["finish_reason"] == "length"


def test_tool_choice_none_answers_in_text(bpe_client: TestClient) -> None:
    message = messages_call(bpe_client, {"type": "none"}, max_tokens=5)
    assert message["content"][0]["type"] == "text" and message["stop_reason"] == "max_tokens"
    response = responses_call(bpe_client, "none", max_output_tokens=5)
    assert response["output"][0]["type"] == "message"


# prints the tools, each turn's tool calls and the call a tool turn answers: the prompt shows every converted field
TOOL_TEMPLATE = (
    "{% for t in tools or [] %}{{ t.function.name }}={{ t.function.description }} {% endfor %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %} CALL {{ c.id }} {{ c.function.name }} {{ c.function.arguments }}{% endfor %}"
    "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
ARGS = {"city": "Oslo", "days": 2}
CHAT_HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": json.dumps(ARGS)}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Rain"},
    {"role": "user", "content": "And?"},
]
ANTHROPIC_HISTORY = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "weather", "input": ARGS}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": [{"type": "text",
                                                                                              "text": "Rain"}]},
                                 {"type": "text", "text": "And?"}]},
]
RESPONSES_HISTORY = [
    {"role": "user", "content": "Weather?"},
    {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": json.dumps(ARGS)},
    {"type": "function_call_output", "call_id": "call_1", "output": "Rain"},
    {"role": "user", "content": [{"type": "input_text", "text": "And?"}]},
]


def test_histories_convert_to_chat_completions_turns() -> None:
    messages = MessagesRequest(messages=ANTHROPIC_HISTORY, system="Be brief.", max_tokens=1).conversation()
    assert messages == CHAT_HISTORY
    responses = ResponsesRequest(input=RESPONSES_HISTORY, instructions="Be brief.").messages()
    assert [{**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
            for m in responses] == CHAT_HISTORY


@pytest.fixture(scope="module")
def tool_client(make_client: Callable[..., TestClient], bpe_checkpoint: Path) -> TestClient:
    return make_client(bpe_checkpoint, chat_template=TOOL_TEMPLATE)


def test_a_history_with_calls_prompts_the_same_through_every_api(tool_client: TestClient) -> None:
    """tool_choice auto (a template that reads the tools): the same prompt, token for token, and the same greedy
    text from each API's shape of one conversation."""
    tokens = ok(tool_client.post("/tokenize", json={"messages": CHAT_HISTORY, "tools": CHAT_TOOLS}))
    prompt = tool_client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "CALL call_1 weather {" in prompt and "FOR call_1" in prompt and "weather=the weather" in prompt
    assert "Rain" in prompt
    chat = ok(tool_client.post("/v1/chat/completions", json={"messages": CHAT_HISTORY, "tools": CHAT_TOOLS,
                                                             "max_tokens": 8, **GREEDY}))
    assert chat["usage"]["prompt_tokens"] == tokens["count"]
    counted = ok(tool_client.post("/v1/messages/count_tokens", json={
        "messages": ANTHROPIC_HISTORY, "system": "Be brief.", "tools": ANTHROPIC_TOOLS}))
    assert counted == {"input_tokens": tokens["count"]}
    message = ok(tool_client.post("/v1/messages", json={"messages": ANTHROPIC_HISTORY, "system": "Be brief.",
                                                        "tools": ANTHROPIC_TOOLS, "max_tokens": 8, **GREEDY}))
    response = ok(tool_client.post("/v1/responses", json={"input": RESPONSES_HISTORY, "instructions": "Be brief.",
                                                          "tools": RESPONSES_TOOLS, "max_output_tokens": 8,
                                                          **GREEDY}))
    text = chat["choices"][0]["message"]["content"]
    assert message["content"] == [{"type": "text", "text": text}]
    assert response["output"][0]["content"][0]["text"] == text
    assert message["usage"]["input_tokens"] == response["usage"]["input_tokens"] == tokens["count"]


def test_auto_needs_a_template_that_reads_the_tools(bpe_client: TestClient) -> None:
    r = bpe_client.post("/v1/messages", json={"messages": USER, "tools": ANTHROPIC_TOOLS, "max_tokens": 5})
    assert_anthropic_error(r, 400, "invalid_request_error", "tool_choice", "chat template")
    r = bpe_client.post("/v1/responses", json={"input": USER, "tools": RESPONSES_TOOLS})
    assert_openai_error(r, 400, "invalid_request_error", "tool_choice", "chat template")


ANY = {"type": "any"}


@pytest.mark.parametrize(("body", "needles"), [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}], "tool_choice": ANY},
     ("tools[0].type", "web_search_20250305")),
    ({"tools": [{"name": "f"}], "tool_choice": ANY}, ("tools[0].input_schema", "required")),
    ({"tools": [{"name": "f", "input_schema": [1]}], "tool_choice": ANY}, ("tools[0].input_schema", "[1]")),
    ({"tools": [*ANTHROPIC_TOOLS, ANTHROPIC_TOOLS[0]], "tool_choice": ANY}, ("tools[2].name", "weather")),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "sometimes"}}, ("tool_choice.type", "sometimes")),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": ["any"]}}, ("tool_choice.type", "['any']")),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, ("tool_choice.name", "nope")),
    ({"tools": [{"name": "f", "input_schema": {"type": "banana"}}], "tool_choice": ANY}, ("tools",)),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": ANY, "output_config": {"format": {"type": "json_schema",
                                                                                  "schema": TIME_SCHEMA}}},
     ("output_config", "both constrain")),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]},
     ("messages[0].content[0].type", "tool_use")),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": "{}"}]}]},
     ("messages[0].content[0].input", "'{}'")),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 7}]}]},
     ("messages[0].content[0].tool_use_id", "7")),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x",
                                                 "content": [{"type": "image"}]}]}]},
     ("messages[0].content[0].content[0].type", "image")),
    ({"system": [{"type": "text", "text": 5}]}, ("system[0].text", "5")),
    ({"messages": [{"role": "user", "content": 5}]}, ("messages[0].content", "5")),
])
def test_bad_messages_tools_are_400_naming_the_field(bpe_client: TestClient, body: dict, needles: tuple) -> None:
    r = bpe_client.post("/v1/messages", json={"messages": USER, "max_tokens": 5, **body})
    assert_anthropic_error(r, 400, "invalid_request_error", *needles)


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tools[0].type", "web_search"),
    ({"tools": [{"type": "function", "name": ""}], "tool_choice": "required"}, "tools[0].name", "''"),
    ({"tools": [{"type": "function", "name": "f", "strict": "yes"}], "tool_choice": "required"}, "tools[0].strict",
     "yes"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice.type", "file_search"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name", "nope"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": "required",
      "text": {"format": {"type": "json_schema", "name": "t", "schema": TIME_SCHEMA}}}, "text", "both constrain"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "None"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input[0].output[0].type", "input_image"),
])
def test_bad_responses_tools_are_400_naming_the_field(bpe_client: TestClient, body: dict, param: str,
                                                      needle: str) -> None:
    r = bpe_client.post("/v1/responses", json={"input": USER, **body})
    assert_openai_error(r, 400, "invalid_request_error", param, needle)
