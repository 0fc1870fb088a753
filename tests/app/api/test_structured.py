"""Structured output over HTTP: OpenAI's response_format and vLLM's structured_outputs (chat and completions), TGI's
parameters.grammar, Anthropic's output_config.format, and tool calls under their functions' schemas. Sampled at
temperature 1 from random weights (GPT-2's vocabulary), every answer parses and validates with `jsonschema`; every
bad constraint is a 400 (TGI: 422) in the route's error shape naming the field it came from, before anything is
generated."""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from app.testing import assert_anthropic_error, assert_openai_error, assert_tgi_error, parse_sse, parse_sse_events
from model.structured import compiler as compiler_module
from model.structured import default_compiler

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "member": {"type": "boolean"}},
          "required": ["name", "age", "member"], "additionalProperties": False}
SEEDS = range(4)
USER = [{"role": "user", "content": "Someone:"}]
SAMPLED = {"temperature": 1.0, "max_tokens": 40}


def ok(r: Any) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_json_schema_answers_validate(bpe_client: TestClient) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answers = set()
    for seed in SEEDS:
        choice = ok(bpe_client.post("/v1/chat/completions", json={"messages": USER, "response_format": fmt,
                                                                   "seed": seed, **SAMPLED}))["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
        answers.add(choice["message"]["content"])
    assert len(answers) == len(SEEDS)  # sampled, not one forced answer
    free = ok(bpe_client.post("/v1/chat/completions", json={"messages": USER, "seed": 0, **SAMPLED}))
    with pytest.raises(ValueError):  # the same request unconstrained is no JSON: the constraint did it
        json.loads(free["choices"][0]["message"]["content"])


def test_completions_structured_outputs_regex_choice_and_json(bpe_client: TestClient) -> None:
    pattern = r"[A-Z][a-z]{2,5} [0-9]{3}"
    for seed in SEEDS:
        body = {"prompt": "Call", "seed": seed, **SAMPLED}
        text = ok(bpe_client.post("/v1/completions", json={**body, "structured_outputs": {"regex": pattern}}))
        assert re.fullmatch(pattern, text["choices"][0]["text"]), text
        pick = ok(bpe_client.post("/v1/completions", json={**body, "structured_outputs": {"choice": ["yes", "no"]}}))
        assert pick["choices"][0]["text"] in ("yes", "no")
        obj = ok(bpe_client.post("/v1/completions", json={**body, "structured_outputs": {"json": json.dumps(PERSON)}}))
        jsonschema.validate(json.loads(obj["choices"][0]["text"]), PERSON)


def test_tgi_grammar_on_generate_and_its_stream(bpe_client: TestClient) -> None:
    params = {"max_new_tokens": 40, "do_sample": True, "temperature": 1.0, "seed": 3,
              "grammar": {"type": "json", "value": PERSON}}
    whole = ok(bpe_client.post("/generate", json={"inputs": "Someone:", "parameters": {**params, "details": True}}))
    jsonschema.validate(json.loads(whole["generated_text"]), PERSON)
    assert whole["details"]["finish_reason"] == "eos_token"  # TGI's name for a grammar that is done
    events = parse_sse(bpe_client.post("/generate_stream", json={"inputs": "Someone:", "parameters": params}).text)
    assert events[-1]["generated_text"] == whole["generated_text"] == "".join(e["token"]["text"] for e in events)
    regex = {**params, "grammar": {"type": "regex", "value": "[0-9]{2}-[a-z]{3}"}}
    assert re.fullmatch("[0-9]{2}-[a-z]{3}", ok(bpe_client.post("/generate", json={"inputs": "Code:",
                                                                                  "parameters": regex}))[
        "generated_text"])


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 3}, "days": {"type": "integer",
                                                                                          "minimum": 1,
                                                                                          "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_tool_calls_are_generated_under_the_functions_schema(bpe_client: TestClient) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    names = set()
    for seed in SEEDS:
        for choice in ({"type": "function", "function": {"name": "weather"}}, "required"):
            # random weights write multi-token characters: room for a whole call of the longest arguments
            body = {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": choice, "seed": seed, **SAMPLED,
                    "max_tokens": 100}
            answer = ok(bpe_client.post("/v1/chat/completions", json=body))["choices"][0]
            assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None, answer
            [call] = answer["message"]["tool_calls"]
            assert call["type"] == "function" and call["id"].startswith("call_")
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
            if choice != "required":
                assert name == "weather"
            names.add(name)
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": "required", "seed": 1, "stream": True, **SAMPLED,
            "max_tokens": 100}
    chunks = [c for c in parse_sse(bpe_client.post("/v1/chat/completions", json=body).text)[:-1]]
    calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert len(calls) == 1 and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(calls[0][0]["function"]["arguments"]), schemas["weather"])


def test_tgis_json_object_with_a_value_is_that_schema(bpe_client: TestClient) -> None:
    """huggingface_hub's chat_completion sends a JSON schema as TGI's {type: json_object, value: schema}: the
    schema is kept, not dropped for any JSON."""
    for seed in SEEDS:
        body = {"messages": USER, "response_format": {"type": "json_object", "value": PERSON}, "seed": seed,
                **SAMPLED}
        choice = ok(bpe_client.post("/v1/chat/completions", json=body))["choices"][0]
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_anthropic_output_config_format(bpe_client: TestClient) -> None:
    body = {"messages": USER, "max_tokens": 40, "temperature": 1.0,
            "output_config": {"format": {"type": "json_schema", "schema": PERSON}}}
    answer = ok(bpe_client.post("/v1/messages", json=body))
    jsonschema.validate(json.loads(answer["content"][0]["text"]), PERSON)
    assert answer["stop_reason"] == "end_turn"
    events = parse_sse_events(bpe_client.post("/v1/messages", json={**body, "stream": True}).text)
    assert events[-1][0] == "message_stop"


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
HUGE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "both constrain"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", ""),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": CYCLE}}},
     "response_format.json_schema.schema", ""),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}],
      "tool_choice": "required"}, "tools", ""),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "'nope'"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]", ""),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "weather"}},
     "tool_choice.function.name", "got None"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ["weather"]}}},
     "tool_choice.function.name", "['weather']"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters", "[1]"),
    ({"response_format": "json"}, "response_format", ""),
    ({"structured_outputs": {"json": False}}, "structured_outputs.json", "got False"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "chat template"),
    ({"response_format": {"type": "text", "schema": PERSON}}, "response_format.schema", "not a field"),
    ({"response_format": {"type": "json_object", "value": [1]}}, "response_format.value", "[1]"),
    ({"response_format": {"type": ["json_object"]}}, "response_format.type", "['json_object']"),
])
def test_bad_constraints_are_400_naming_their_field(bpe_client: TestClient, body: dict, param: str,
                                                    needle: str) -> None:
    r = bpe_client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body})
    assert_openai_error(r, 400, "invalid_request_error", param, *([needle] if needle else []))
    assert len(r.text) < 2000  # a short preview, never the schema echoed back


def test_a_schema_of_10000_properties_is_refused_before_compiling(make_client: Callable[..., TestClient],
                                                                  bpe_checkpoint: Path) -> None:
    """Past the body limit of the test apps (413 there): a server that takes 1 MB bodies refuses it by its size."""
    big = make_client(bpe_checkpoint, max_body_bytes=2**20)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": HUGE}}
    r = big.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "response_format": fmt})
    assert_openai_error(r, 400, "invalid_request_error", "response_format.json_schema.schema", "5000")
    assert len(r.text) < 2000
    assert big.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).status_code == 200


def test_a_schema_the_vocabulary_cannot_produce_is_refused_before_generating(
        make_client: Callable[..., TestClient], repo: Path) -> None:
    """The bundled model's vocabulary (Shakespeare's characters) has no braces: no JSON at all, in every API's
    shape."""
    client = make_client(repo / "weights" / "shakespeare-char")
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    r = client.post("/v1/chat/completions", json={"messages": USER, "response_format": fmt})
    assert_openai_error(r, 400, "invalid_request_error", "response_format.json_schema.schema", "vocabulary")
    r = client.post("/generate", json={"inputs": "a", "parameters": {"grammar": {"type": "json", "value": PERSON}}})
    assert_tgi_error(r, 422, "validation", "parameters.grammar.value", "vocabulary")
    r = client.post("/v1/messages", json={"messages": USER, "max_tokens": 4, "output_config": {
        "format": {"type": "json_schema", "schema": PERSON}}})
    assert_anthropic_error(r, 400, "invalid_request_error", "output_config.format", "vocabulary")
    assert client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_a_compile_that_hangs_stalls_nobody_and_ends_as_a_400(bpe_client: TestClient,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A schema whose compile never ends (held here) holds neither the event loop nor the engine thread: a stream
    submitted meanwhile runs to its last token while the compile is still held, and the constrained request gets
    its 400 when the compile's time bound passes."""
    release = threading.Event()
    real_build = compiler_module.build

    def held_build(spec: Any, tokenizer: Any) -> Any:
        release.wait(120)
        return real_build(spec, tokenizer)

    monkeypatch.setattr(compiler_module, "build", held_build)
    monkeypatch.setattr(default_compiler(), "timeout_s", 3.0)
    schema = {**PERSON, "title": f"held {uuid.uuid4().hex}"}  # a spec no other test compiled (no cached answer)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(bpe_client.post, "/v1/chat/completions",
                               json={"messages": USER, "response_format": fmt, "max_tokens": 4})
            body = {"inputs": "Meanwhile", "parameters": {"max_new_tokens": 30, "details": True}}
            events = parse_sse(bpe_client.post("/generate_stream", json=body).text)
            assert not release.is_set() and events[-1]["details"]["generated_tokens"] == 30
            assert len(events) == 30
            r = held.result(timeout=120)
        assert_openai_error(r, 400, "invalid_request_error", "response_format.json_schema.schema", "longer than")
    finally:
        release.set()


@pytest.mark.parametrize("constraint", [{"structured_outputs": {"regex": ""}},
                                        {"structured_outputs": {"choice": [""]}}], ids=["regex", "choice"])
def test_a_constraint_only_the_empty_output_satisfies_is_an_empty_answer(client: TestClient,
                                                                         constraint: dict) -> None:
    """A character vocabulary has no EOS: nothing may be generated, and that is the answer (200, empty text,
    finish_reason stop), whole or streamed, not a server error."""
    r = client.post("/v1/completions", json={"prompt": "A", "max_tokens": 5, **constraint})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], r.json()["usage"]["completion_tokens"]) == ("", "stop", 0)
    r = client.post("/v1/completions", json={"prompt": "A", "max_tokens": 5, "stream": True, **constraint})
    events = parse_sse(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), r.text
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == ""
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "stop"
    tgi = client.post("/generate", json={"inputs": "A", "parameters": {"max_new_tokens": 5, "details": True,
                                                                      "grammar": {"type": "regex", "value": ""}}})
    assert tgi.status_code == 200 and tgi.json()["generated_text"] == "", tgi.text
