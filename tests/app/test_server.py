"""End to end: `python -m app` as a real process on 127.0.0.1, driven by the clients people use (Hugging Face's
InferenceClient, the OpenAI SDK, plain httpx), plus startup failures and the SIGTERM drain."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from langchain_openai import ChatOpenAI
from openai.types import ErrorObject
from pydantic import BaseModel

from app.testing import REFUSED, metric, parse_sse, probe, serving, spawn
from model.chat_template import DEFAULT_TEMPLATE
from model.checkpoint import WEIGHTS_FILE

PROMPT = "Hello there"


def post_generate(base: str, inputs: str = PROMPT, **parameters: Any) -> dict:
    r = httpx.post(f"{base}/generate", json={"inputs": inputs, "parameters": parameters}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


SAMPLED = dict(max_new_tokens=12, do_sample=True, seed=5, temperature=0.8)


def test_inference_client_matches_generate(server: str) -> None:
    expected = post_generate(server, **SAMPLED, details=True)
    client = InferenceClient(model=server, timeout=30)
    assert client.text_generation(PROMPT, **SAMPLED) == expected["generated_text"]
    out = client.text_generation(PROMPT, **SAMPLED, details=True)
    assert out.generated_text == expected["generated_text"]
    assert (out.details.seed, out.details.finish_reason, out.details.generated_tokens) == (5, "length", 12)
    assert [t.id for t in out.details.tokens] == [t["id"] for t in expected["details"]["tokens"]]
    assert "".join(client.text_generation(PROMPT, **SAMPLED, stream=True)) == expected["generated_text"]
    events = list(client.text_generation(PROMPT, **SAMPLED, stream=True, details=True))
    assert [e.index for e in events] == list(range(1, 13))
    assert "".join(e.token.text for e in events) == events[-1].generated_text == expected["generated_text"]
    assert events[-1].details.seed == 5


def test_inference_client_stop_sequences(server: str) -> None:
    greedy = post_generate(server, max_new_tokens=24)["generated_text"]
    stop = greedy[10:12]
    expected = post_generate(server, max_new_tokens=24, stop=[stop], details=True)
    assert expected["generated_text"] == greedy[: greedy.index(stop)]
    assert expected["details"]["finish_reason"] == "stop_sequence"
    client = InferenceClient(model=server, timeout=30)
    out = client.text_generation(PROMPT, max_new_tokens=24, stop=[stop], details=True)
    assert (out.generated_text, out.details.finish_reason) == (expected["generated_text"], "stop_sequence")
    streamed = "".join(client.text_generation(PROMPT, max_new_tokens=24, stop=[stop], stream=True))
    assert streamed == expected["generated_text"]


def test_openai_sdk_matches_generate(server: str) -> None:
    expected = post_generate(server, **SAMPLED)["generated_text"]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=30)
    model = client.models.list().data[0].id
    assert model == "tiny-char"
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=12, seed=5, temperature=0.8)
    whole = client.completions.create(**kwargs)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens == len(PROMPT)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.total_tokens == len(PROMPT) + 12
    greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert greedy.choices[0].text == post_generate(server, max_new_tokens=12)["generated_text"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=-1)
    assert (e.value.body["param"], e.value.code) == ("temperature", None)
    with pytest.raises(openai.BadRequestError) as e:  # the code that clients' context-overflow handling reads
        client.completions.create(model=model, prompt=PROMPT * 40, max_tokens=2)
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    assert ErrorObject.model_validate(e.value.body).code == "context_length_exceeded"  # the SDK's own type


def test_openai_sdk_chat_equals_a_completion_of_the_rendered_conversation(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=30)
    messages = [{"role": "system", "content": "Be"}, {"role": "user", "content": "Hi"}]
    prompt = DEFAULT_TEMPLATE.render(messages)
    kwargs = dict(model="tiny-char", max_tokens=10, seed=5, temperature=0.8)
    expected = client.completions.create(prompt=prompt, **kwargs).choices[0].text
    whole = client.chat.completions.create(messages=messages, **kwargs)
    assert (whole.choices[0].message.role, whole.choices[0].message.content) == ("assistant", expected)
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == 10
    with client.chat.completions.stream(messages=messages, **kwargs) as stream:  # the SDK's stream helper
        assert "".join(e.delta for e in stream if e.type == "content.delta") == expected
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    counted = httpx.post(f"{server}/tokenize", json={"messages": messages}, timeout=30).json()
    assert counted["count"] == whole.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-char", messages=[{"role": "robot", "content": "x"}])
    assert e.value.body["param"] == "messages[0].role"


class Verdict(BaseModel):
    ok: bool


def test_openai_sdk_parse_and_responses(server: str) -> None:
    """The SDK's structured `parse` (a pydantic model as the response format) and the Responses API, sampled from
    random weights: the answer still parses into the model."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=30)
    for seed in range(3):
        parsed = client.chat.completions.parse(model="tiny-char", messages=[{"role": "user", "content": "Ok?"}],
                                               response_format=Verdict, max_tokens=40, seed=seed)
        assert isinstance(parsed.choices[0].message.parsed, Verdict)
    response = client.responses.create(model="tiny-char", input="Hi", instructions="Be", max_output_tokens=8,
                                       temperature=0)
    expected = client.chat.completions.create(model="tiny-char", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be"}, {"role": "user", "content": "Hi"}]).choices[0].message.content
    assert response.output_text == expected and response.status in ("completed", "incomplete")
    raw = client.responses.with_raw_response.create(model="tiny-char", input="Hi", max_output_tokens=8).http_response
    openai.types.responses.Response.model_validate(raw.json())  # every field the SDK's type requires is there
    with client.responses.stream(model="tiny-char", input="Hi", instructions="Be", max_output_tokens=8,
                                 temperature=0) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == expected
    parsed = client.responses.parse(model="tiny-char", input="Ok?", text_format=Verdict, max_output_tokens=40)
    assert isinstance(parsed.output_parsed, Verdict)


def test_inference_client_and_langchain_chat(server: str) -> None:
    """huggingface_hub's chat_completion and LangChain's ChatOpenAI (with with_structured_output) against /v1."""
    messages = [{"role": "user", "content": "Hi"}]
    expected = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=30).chat.completions.create(
        model="tiny-char", messages=messages, max_tokens=8, temperature=0).choices[0].message.content
    hf = InferenceClient(base_url=f"{server}/v1", timeout=30)  # names no model unless told ("dummy": a 404)
    kwargs = dict(model="tiny-char", max_tokens=8, temperature=0)
    assert hf.chat_completion(messages, **kwargs).choices[0].message.content == expected
    assert "".join(c.choices[0].delta.content or "" for c in hf.chat_completion(messages, stream=True,
                                                                                   **kwargs)) == expected
    closed = {**Verdict.model_json_schema(), "additionalProperties": False}
    schema = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": closed}}
    for seed in range(3):  # sent as TGI's {type: json_object, value: schema}
        answer = hf.chat_completion(messages, model="tiny-char", max_tokens=40, seed=seed, response_format=schema)
        assert isinstance(Verdict.model_validate_json(answer.choices[0].message.content), Verdict)
    llm = ChatOpenAI(base_url=f"{server}/v1", api_key="x", model="tiny-char", max_tokens=8, temperature=0,
                     max_retries=0, timeout=30)
    assert llm.invoke("Hi").content == expected
    roomy = ChatOpenAI(base_url=f"{server}/v1", api_key="x", model="tiny-char", max_tokens=40, max_retries=0,
                       timeout=30)
    verdict = roomy.with_structured_output(Verdict).invoke("Ok?")  # sampled: response_format json_schema
    assert isinstance(verdict, Verdict)


def test_anthropic_sdk_messages_equal_chat_completions(server: str) -> None:
    """A client written for Claude, pointed at Folio: create, stream (the SDK's event accumulator) and count."""
    client = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0, timeout=30)
    chat = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "Hi"}]
    expected = chat.chat.completions.create(model="tiny-char", max_tokens=12, temperature=0,
                                            messages=[{"role": "system", "content": "Be"}, *messages])
    # the SDK no longer has sampling arguments (Claude's newest models fix them); older clients send temperature
    kwargs = dict(model="tiny-char", system="Be", messages=messages, max_tokens=12, extra_body={"temperature": 0})
    got = client.messages.create(**kwargs)
    assert [b.text for b in got.content] == [expected.choices[0].message.content]
    assert got._request_id and len(got._request_id) == 32  # Anthropic's request-id header
    assert (got.usage.input_tokens, got.usage.output_tokens) == (expected.usage.prompt_tokens,
                                                                 expected.usage.completion_tokens)
    with client.messages.stream(**kwargs) as stream:
        assert "".join(stream.text_stream) == expected.choices[0].message.content
        final = stream.get_final_message()
    assert final.stop_reason == got.stop_reason and final.usage.output_tokens == got.usage.output_tokens
    counted = client.messages.count_tokens(model="tiny-char", system="Be", messages=messages)
    assert counted.input_tokens == got.usage.input_tokens
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**{**kwargs, "model": "claude-opus-4"})
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**{**kwargs, "extra_body": {"temperature": 2}})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.request_id == e.value.body["request_id"]


ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}


def test_sdks_call_tools_through_messages_and_responses(server: str) -> None:
    """Each SDK's own types read the call, whole and streamed (the anthropic SDK's accumulator parses the streamed
    input_json_delta; the openai SDK's Responses stream its function-call events), and the greedy call is the one
    chat completions makes."""
    chat = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=30)
    expected = chat.chat.completions.create(
        model="tiny-char", messages=[{"role": "user", "content": "Zone?"}], max_tokens=60, temperature=0,
        tools=[{"type": "function", "function": {"name": "time", "parameters": ZONE}}],
        tool_choice="required").choices[0].message.tool_calls[0].function
    with chat.chat.completions.stream(
            model="tiny-char", messages=[{"role": "user", "content": "Zone?"}], max_tokens=60, temperature=0,
            tools=[{"type": "function", "function": {"name": "time", "parameters": ZONE}}],
            tool_choice="required") as stream:
        done = [e.arguments for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion().choices[0]
    assert done == [expected.arguments] and final.message.content is None and final.finish_reason == "tool_calls"
    claude = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0, timeout=30)
    kwargs = dict(model="tiny-char", messages=[{"role": "user", "content": "Zone?"}], max_tokens=60,
                  tools=[{"name": "time", "input_schema": ZONE}], tool_choice={"type": "any"},
                  extra_body={"temperature": 0})
    got = claude.messages.create(**kwargs)
    [block] = got.content
    assert isinstance(block, anthropic.types.ToolUseBlock) and got.stop_reason == "tool_use"
    assert (block.name, block.input) == (expected.name, json.loads(expected.arguments))
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", block.name, block.input)]
    tools = [{"type": "function", "name": "time", "parameters": ZONE}]
    response = chat.responses.create(model="tiny-char", input="Zone?", tools=tools, tool_choice="required",
                                     max_output_tokens=60, temperature=0)
    [call] = response.output
    assert isinstance(call, openai.types.responses.ResponseFunctionToolCall)
    assert (call.name, json.loads(call.arguments)) == (expected.name, json.loads(expected.arguments))
    with chat.responses.stream(model="tiny-char", input="Zone?", tools=tools, tool_choice="required",
                               max_output_tokens=60, temperature=0) as stream:
        done = [e for e in stream if e.type == "response.function_call_arguments.done"]
        streamed = stream.get_final_response()
    assert [e.arguments for e in done] == [call.arguments] == [streamed.output[0].arguments]


def test_chunked_body_over_the_limit_is_413(server: str) -> None:
    big = json.dumps({"inputs": "a" * 20_000}).encode()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    for content in (big, chunks()):
        r = httpx.post(f"{server}/generate", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert r.json()["error_type"] == "payload_too_large" and "16384 bytes" in r.json()["error"]


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def connect(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(data)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(60)  # a hang detector: the server's deadlines are 2 s (SERVER_ARGS)
    out = b""
    with sock:
        while chunk := sock.recv(65536):
            out += chunk
    return out


def closed_count(base: str, reason: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    try:
        return metric(text, "folio_connections_closed_total", reason=reason)
    except AssertionError:  # not counted yet
        return 0.0


def test_slow_clients_hold_no_slot_and_are_cut_at_their_deadlines(server: str) -> None:
    """Slowloris: more connections than the server has slots send their headers and half a body, others part of
    their headers or nothing; meanwhile other clients are served (before the fix, a slot was taken as soon as the
    headers were in, and everyone else got 429). Each slow connection gets 408 at its deadline (a silent close if
    it sent nothing), and nothing stays reserved."""
    port = port_of(server)
    capacity = httpx.get(f"{server}/info").json()["max_concurrent_requests"]
    before = {r: closed_count(server, r) for r in ("header_timeout", "body_timeout")}
    body = json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}).encode()
    head = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    half_bodies = [connect(port, head + body[: len(body) // 2]) for _ in range(capacity + 20)]
    half_heads = [connect(port, head[: len(head) // 2]) for _ in range(20)]
    silent = [connect(port, b"") for _ in range(10)]
    time.sleep(0.2)  # let the server read what they sent (before the fix, the half bodies then held every slot)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: httpx.post(f"{server}/generate", json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": 4, "do_sample": True, "seed": i}}, timeout=30),
            range(16)))
        assert [r.status_code for r in answers] == [200] * 16, [r.text for r in answers if r.status_code != 200]
        assert all(len(r.json()["generated_text"]) == 4 for r in answers)
        assert httpx.get(f"{server}/health").status_code == 200
        closed = list(pool.map(read_until_closed, half_bodies + half_heads + silent))
    for raw in closed[: len(half_bodies)]:
        assert raw.startswith(b"HTTP/1.1 408 ") and b"connection: close" in raw, raw[:200]
        assert json.loads(raw.split(b"\r\n\r\n", 1)[1]) == {
            "error": "the request body did not arrive within 2 s of its headers", "error_type": "timeout",
            "request_id": None}  # answered by the HTTP layer: the request never reached the app, nor got an ID
    for raw in closed[len(half_bodies) : -len(silent)]:
        assert raw.startswith(b"HTTP/1.1 408 ") and b"headers did not arrive within 2 s" in raw, raw[:200]
    assert closed[-len(silent) :] == [b""] * len(silent)
    text = httpx.get(f"{server}/metrics").text
    assert metric(text, "folio_reserved_slots") == 0
    assert metric(text, "folio_running_batch_size") == 0 and metric(text, "folio_queue_depth") == 0
    assert closed_count(server, "body_timeout") == before["body_timeout"] + len(half_bodies)
    assert closed_count(server, "header_timeout") == before["header_timeout"] + len(half_heads) + len(silent)
    assert httpx.post(f"{server}/generate", json={"inputs": PROMPT}, timeout=30).status_code == 200


def test_the_server_freezes_its_heap_and_shows_the_collectors_pauses(server: str, char_checkpoint: Path,
                                                                    tmp_path: Path) -> None:
    """--gc-freeze (the default) leaves start-up's objects out of the collector's reach; /metrics shows that and
    each generation's pauses (model/heap.py); --no-gc-freeze leaves the heap as Python has it."""
    text = httpx.get(f"{server}/metrics", timeout=10).text
    assert metric(text, "folio_gc_frozen_objects") > 10_000
    assert metric(text, "folio_gc_pause_seconds_count", generation="0") > 0  # the server watches its pauses
    with serving(char_checkpoint, tmp_path / "server.log", "--no-gc-freeze") as (base, _):
        text = httpx.get(f"{base}/metrics", timeout=10).text
        assert metric(text, "folio_gc_frozen_objects") == 0
        assert metric(text, "folio_gc_pause_seconds_count", generation="0") > 0


def test_connections_beyond_the_limit_get_the_apis_json_503(char_checkpoint: Path, tmp_path: Path) -> None:
    """--max-connections open connections that send nothing: every request on another gets 503 in its API's
    error shape with Retry-After (before: uvicorn's plain-text "Service Unavailable", without Retry-After)."""
    with serving(char_checkpoint, tmp_path / "server.log", "--max-connections", "4") as (base, _):
        idle = [connect(port_of(base), b"") for _ in range(4)]
        time.sleep(0.2)  # the server has accepted them
        with httpx.Client(base_url=base, trust_env=False) as client:
            r = client.get("/health")
            assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
            assert r.json()["error_type"] == "unavailable" and "--max-connections" in r.json()["error"]
            r = client.post("/v1/completions", json={"prompt": PROMPT})
            assert r.status_code == 503 and r.headers["content-type"] == "application/json"
            assert r.json()["error"]["type"] == "server_error" and "at its limit of 4" in r.json()["error"]["message"]
        for sock in idle:
            sock.close()
        time.sleep(0.2)
        assert httpx.get(f"{base}/health", trust_env=False).status_code == 200
        assert closed_count(base, "too_many_connections") == 2


@pytest.mark.parametrize(("headers", "needle"), [
    ([(b"X-Big", b"a" * 20_000)], b"over 16384 bytes"),
    ([(b"X-%d" % i, b"1") for i in range(101)], b"more than 100 headers"),
])
def test_a_request_head_too_large_is_431(server: str, headers: list, needle: bytes) -> None:
    lines = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    raw = read_until_closed(connect(port_of(server), b"GET /health HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n"))
    assert raw.startswith(b"HTTP/1.1 431 ") and needle in raw, raw[:300]
    assert httpx.get(f"{server}/health").status_code == 200


@pytest.mark.parametrize(("raw", "body"), [
    (b"NOT AN HTTP REQUEST\r\n\r\n", {"error_type": "bad_request"}),  # no path parsed: TGI's shape
    (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", {"error_type": "bad_request"}),
    # a chunk size that is not hex, after the head of an OpenAI route: that API's shape
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
     {"error": {"type": "invalid_request_error", "param": None, "code": None}}),
])
def test_a_request_http_cannot_parse_is_a_json_400(server: str, raw: bytes, body: dict) -> None:
    """What httptools cannot parse gets 400 in the API's JSON error shape (uvicorn answered it in plain text), the
    connection closed, counted as malformed; nothing is left reserved, and the server serves on."""
    before = closed_count(server, "malformed")
    answer = read_until_closed(connect(port_of(server), raw))
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head, answer[:300]
    got = json.loads(payload)
    assert "malformed HTTP/1.1 request" in json.dumps(got) and got["request_id"] is None, got
    for key, value in body.items():
        assert got[key] == value if not isinstance(value, dict) else {k: got[key][k] for k in value} == value, got
    assert closed_count(server, "malformed") == before + 1
    assert metric(httpx.get(f"{server}/metrics").text, "folio_reserved_slots") == 0
    assert httpx.post(f"{server}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}},
                      timeout=30).status_code == 200


def test_client_timeout_cancels_a_whole_generation(server: str) -> None:
    before = metric(httpx.get(f"{server}/metrics").text, "folio_cancelled_requests_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4096}},
                   timeout=httpx.Timeout(5.0, read=0.5))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        text = httpx.get(f"{server}/metrics").text
        cancelled, running = metric(text, "folio_cancelled_requests_total"), metric(text, "folio_running_batch_size")
        if cancelled == before + 1 and running == 0:
            break
        time.sleep(0.05)
    assert metric(text, "folio_cancelled_requests_total") == before + 1
    assert metric(text, "folio_running_batch_size") == 0 and metric(text, "folio_queue_depth") == 0


def test_bad_checkpoint_exits_2_with_one_error_line(char_checkpoint: Path, tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt"
    shutil.copytree(char_checkpoint, corrupt)
    (corrupt / WEIGHTS_FILE).write_bytes(b"\x00\x01 this is not a safetensors file")
    cases = {"missing": (tmp_path / "no-such-dir", "checkpoint directory not found"),
             "corrupt": (corrupt, "not a readable safetensors file")}
    procs = {name: spawn(path, tmp_path / f"{name}.log") for name, (path, _) in cases.items()}  # start both at once
    for name, proc in procs.items():
        assert proc.wait(120) == 2, name
        lines = (tmp_path / f"{name}.log").read_text().strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"error: cannot serve {cases[name][0]}") and cases[name][1] in lines[0], lines


def start_streams(base: str, lengths: tuple[int, ...]) -> tuple[list[threading.Thread], dict[int, list]]:
    """One sampled stream per length, each read in a thread of its own until it ends: the threads and, once each
    has ended, its events. Returns once every stream has sent its first event."""
    results: dict[int, list] = {}
    streaming = [threading.Event() for _ in lengths]

    def consume(i: int, max_new_tokens: int) -> None:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": max_new_tokens, "do_sample": True, "seed": i}}
        raw = b""
        with httpx.stream("POST", f"{base}/generate_stream", json=body, timeout=60) as r:
            for chunk in r.iter_bytes():
                raw += chunk
                if b"\n\n" in raw:
                    streaming[i].set()
        results[i] = parse_sse(raw.decode())

    threads = [threading.Thread(target=consume, args=(i, n)) for i, n in enumerate(lengths)]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in streaming), "streams did not start"
    return threads, results


def probes_until_refused(client: httpx.Client) -> list[tuple]:
    """(/health, /health/ready, /health/startup) answers until the port closes (or 1000 rounds)."""
    seen: list[tuple] = []
    while (not seen or REFUSED not in seen[-1]) and len(seen) < 1000:
        seen.append(tuple(probe(client, route) for route in ("/health", "/health/ready", "/health/startup")))
    return seen


def test_sigterm_drains_streams_then_exits_0(char_checkpoint: Path, tmp_path: Path) -> None:
    drain = 2.0
    log = tmp_path / "server.log"
    with serving(char_checkpoint, log, "--drain-timeout", str(drain)) as (base, proc):
        lengths = (4096, 4096, 4096, 150)
        threads, results = start_streams(base, lengths)
        with httpx.Client(base_url=base) as client:  # its keep-alive connection is open before the signal
            assert probe(client, "/health/ready")[0] == 200
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert_draining(base)  # the listener stays open during the drain
            seen = probes_until_refused(client)
        # the signal is handled within moments: from then on /health and readiness fail (503 "draining" while the
        # port is open, refused once uvicorn has closed it), while a started server stays started (and the
        # kubelet stops the startup and liveness probes of a deleted pod anyway)
        draining = {"status": "draining", "reason": "the server is shutting down and admits no new requests"}
        first = next(i for i, s in enumerate(seen) if s[0] == REFUSED or s[0][0] != 200)
        for health, ready, startup in seen[first:]:
            assert health in (REFUSED, (503, {"status": "draining"})), seen
            assert ready in (REFUSED, (503, draining)), seen
            assert startup in (REFUSED, (200, {"status": "ok"})), seen
        assert proc.wait(30) == 0, log.read_text()
        assert time.monotonic() - signalled < drain + 5
        for t in threads:
            t.join(10)
        # every stream ends properly: the short one usually completes within the drain, the long ones cannot
        for i, n in enumerate(lengths):
            *tokens, last = results[i]
            assert all("token" in e for e in tokens)
            if last.get("generated_text") is not None:
                assert last["details"]["generated_tokens"] == n == len(tokens) + 1
            else:
                assert last == {"error": "the engine stopped before this request finished", "error_type": "unavailable",
                                "request_id": last.get("request_id")} and len(last["request_id"]) == 32
        assert any("error" in results[i][-1] for i in range(3))  # 4096 slow tokens cannot finish in the drain


def assert_draining(base: str) -> None:
    """What a new connection gets during a drain: /health 503 "draining"; generation and /tokenize 503 with
    Retry-After and Connection: close."""
    health = httpx.get(f"{base}/health", timeout=10)
    assert (health.status_code, health.json()) == (503, {"status": "draining"})
    for route, body in (("/generate", {"inputs": PROMPT}), ("/tokenize", {"inputs": PROMPT})):
        r = httpx.post(f"{base}{route}", json=body, timeout=10)
        assert (r.status_code, r.json()["error_type"]) == (503, "unavailable"), r.text
        assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"


def test_sigterm_keeps_answering_503_while_a_stream_finishes_then_exits_0(char_checkpoint: Path,
                                                                          tmp_path: Path) -> None:
    """The drain as a load balancer sees it: during the drain a new connection is answered (503 + Retry-After,
    /health 503), not refused; the running stream completes whole; the process exits 0 as soon as it has, long
    before the drain timeout."""
    log = tmp_path / "server.log"
    with serving(char_checkpoint, log, "--drain-timeout", "600") as (base, proc):
        raw, streaming = [b""], threading.Event()

        def consume() -> None:
            body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4096, "do_sample": True, "seed": 3}}
            with httpx.stream("POST", f"{base}/generate_stream", json=body, timeout=120) as r:
                for chunk in r.iter_bytes():
                    raw[0] += chunk
                    streaming.set()

        thread = threading.Thread(target=consume)
        thread.start()
        assert streaming.wait(30), "the stream did not start"
        proc.send_signal(signal.SIGTERM)
        assert_draining(base)
        assert proc.wait(120) == 0, log.read_text()  # not the 600 s drain timeout: right after the stream
        thread.join(10)
        *tokens, last = parse_sse(raw[0].decode())
        assert last["details"]["finish_reason"] == "length" and len(tokens) + 1 == 4096
        assert "".join(e["token"]["text"] for e in tokens + [last]) == last["generated_text"]
        with pytest.raises(httpx.ConnectError):  # and only then is the listener closed
            httpx.get(f"{base}/health", timeout=10)
