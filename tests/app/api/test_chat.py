"""POST /v1/chat/completions: the conversation through the model's chat template, then the engine, exactly as a
completion of the rendered prompt would run (token for token, greedy and seeded), in OpenAI's shapes (message,
logprobs.content, chunks with the role first and the usage last), and every bad conversation a 422 naming its
field in OpenAI's error shape."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.testing import assert_openai_error, parse_sse
from model.chat_template import DEFAULT_TEMPLATE

# short enough for the test model's context of 64 characters once rendered
CONVERSATION = [{"role": "system", "content": "Be"}, {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                                  {"type": "text", "text": "yo"}]}]


def chat(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={"messages": CONVERSATION, **body})
    assert r.status_code == 200, r.text
    return r.json()


def complete(client: TestClient, **body: Any) -> dict[str, Any]:
    prompt = DEFAULT_TEMPLATE.render(CONVERSATION)
    r = client.post("/v1/completions", json={"prompt": prompt, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 0.9, "top_k": 20, "seed": 7},
                                    {"temperature": 1.0, "top_p": 0.8, "seed": 3, "n": 2}])
def test_chat_equals_a_completion_of_the_rendered_conversation(client: TestClient, params: dict) -> None:
    got = chat(client, max_tokens=12, **params)
    want = complete(client, max_tokens=12, **params)
    assert [c["message"] for c in got["choices"]] == [{"role": "assistant", "content": c["text"]}
                                                      for c in want["choices"]]
    assert [c["finish_reason"] for c in got["choices"]] == [c["finish_reason"] for c in want["choices"]]
    assert got["usage"] == want["usage"] and got["object"] == "chat.completion"
    assert got["id"].startswith("chatcmpl-") and got["model"] == want["model"]


def test_logprobs_are_openais_content_list_and_equal_the_completions(client: TestClient) -> None:
    got = chat(client, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]
    want = complete(client, max_tokens=6, temperature=0, logprobs=3)["choices"][0]["logprobs"]
    assert [t["token"] for t in got["content"]] == want["tokens"]
    assert [t["logprob"] for t in got["content"]] == pytest.approx(want["token_logprobs"])
    for entry, top in zip(got["content"], want["top_logprobs"], strict=True):
        assert entry["bytes"] == list(entry["token"].encode())
        assert {t["token"]: t["logprob"] for t in entry["top_logprobs"]} == pytest.approx(top)
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
        assert all(t["logprob"] <= 0 and math.isfinite(t["logprob"]) for t in entry["top_logprobs"])
    plain = chat(client, max_tokens=2, temperature=0, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert [t["top_logprobs"] for t in plain] == [[], []]
    assert chat(client, max_tokens=2, temperature=0)["choices"][0]["logprobs"] is None


def test_stream_sends_the_role_then_the_same_text_then_usage(client: TestClient) -> None:
    body = {"messages": CONVERSATION, "max_tokens": 10, "temperature": 0.8, "seed": 11, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    firsts = {}
    texts, finishes, tokens = ["", ""], [None, None], [0, 0]
    for c in chunks[:-1]:
        [choice] = c["choices"]
        i = choice["index"]
        if i not in firsts:
            firsts[i] = choice["delta"]
            continue
        texts[i] += choice["delta"].get("content", "")
        tokens[i] += len(choice["logprobs"]["content"]) if choice["logprobs"] else 0
        finishes[i] = choice["finish_reason"] or finishes[i]
    assert firsts == {0: {"role": "assistant", "content": ""}, 1: {"role": "assistant", "content": ""}}
    whole = chat(client, **{k: v for k, v in body.items() if k not in ("stream", "stream_options", "messages")})
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    assert finishes == [c["finish_reason"] for c in whole["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert tokens == [len(c["logprobs"]["content"]) for c in whole["choices"]]


# what the openai SDK's create may send that means nothing here, each as a client would fill it in (or null)
SDK_EXTRAS = {"store": False, "metadata": {"run": "7"}, "service_tier": "auto", "reasoning_effort": "low",
              "verbosity": "low", "prompt_cache_key": "k", "safety_identifier": "u", "modalities": ["text"],
              "prediction": {"type": "content", "content": "x"}, "audio": None, "web_search_options": None,
              "functions": None, "function_call": None, "parallel_tool_calls": True, "user": "u"}


def test_the_sdks_other_fields_are_accepted_and_change_nothing(client: TestClient) -> None:
    assert chat(client, max_tokens=12, temperature=0, **SDK_EXTRAS)["choices"] == chat(
        client, max_tokens=12, temperature=0)["choices"]


def test_max_completion_tokens_and_max_tokens_are_one_budget(client: TestClient) -> None:
    a = chat(client, max_completion_tokens=5, temperature=0, ignore_eos=True)
    b = chat(client, max_tokens=5, temperature=0, ignore_eos=True)
    assert a["choices"][0]["message"] == b["choices"][0]["message"] and a["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "'robot'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type", "image_url"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "max_completion_tokens": 4},
     "max_completion_tokens", "must agree"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100_000}, "max_completion_tokens",
     "[1, 256]"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000}, "max_tokens", "[1, 256]"),  # as sent
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21, "logprobs": True}, "top_logprobs",
     "20"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature", "allowed: [0, 2]"),
    # chat's bound on max_tokens, not completions' (where 0 scores the prompt)
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens", "allowed: [1, inf]"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 17}, "n", "16"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 5}, "n", "--max-sequences-per-request"),
    ({"messages": [{"role": "user", "content": "hi"}], "store": True}, "store", "stores no completions"),
    ({"messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]}, "modalities", "'audio'"),
    ({"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "alloy"}}, "audio", "not supported"),
    ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"messages": [{"role": "user", "content": "hi"}], "web_search_options": {}}, "web_search_options", "{}"),
])
def test_bad_conversations_are_400_naming_the_field(client: TestClient, body: dict, param: str, needle: str) -> None:
    r = client.post("/v1/chat/completions", json=body)
    assert_openai_error(r, 400, "invalid_request_error", param, needle)


def test_a_template_that_fails_is_a_400_naming_the_template(make_client: Callable[..., TestClient],
                                                             tmp_path: Path) -> None:
    path = tmp_path / "strict.jinja"
    path.write_text("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system turns') }}"
                    "{% endif %}{{ m.content }}\n{% endfor %}")
    c = make_client(chat_template=str(path))
    r = c.post("/v1/chat/completions", json={"messages": CONVERSATION})
    assert_openai_error(r, 400, "invalid_request_error", "messages", "no system turns")
    assert "--chat-template" in r.json()["error"]["message"] and "strict.jinja" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json={"messages": CONVERSATION[1:], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len("Hi\nyo\n")


def test_tokenize_counts_a_conversation_as_chat_sends_it(client: TestClient) -> None:
    r = client.post("/tokenize", json={"messages": CONVERSATION})
    assert r.status_code == 200, r.text
    prompt = DEFAULT_TEMPLATE.render(CONVERSATION)
    assert r.json()["tokens"] == client.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert r.json()["count"] == chat(client, max_tokens=1)["usage"]["prompt_tokens"]
    bare = client.post("/tokenize", json={"messages": CONVERSATION, "add_generation_prompt": False}).json()
    assert bare["count"] == len(DEFAULT_TEMPLATE.render(CONVERSATION, add_generation_prompt=False)) < r.json()["count"]
    r = client.post("/tokenize", json={"messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 422 and "messages[0].role" in r.text
    r = client.post("/tokenize", json={"messages": CONVERSATION, "prompt": "x"})
    assert r.status_code == 422 and "exactly one of inputs (TGI), prompt or messages" in r.text
