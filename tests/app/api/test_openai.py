"""/v1/completions: the same generations as /generate, OpenAI's body, usage, finish reasons, logprobs, echo
and streaming."""

from __future__ import annotations

import math
import re

from fastapi.testclient import TestClient

from app.testing import assert_openai_error, parse_sse
from tests.app.api.calls import PROMPT, completion, completion_stream, generate


def test_completions_match_generate_greedy_and_seeded(client: TestClient) -> None:
    greedy = generate(client, max_new_tokens=10)["generated_text"]
    body = completion(client, max_tokens=10, temperature=0)
    assert body["choices"][0]["text"] == greedy
    sampled = generate(client, max_new_tokens=10, temperature=0.8, top_p=0.9, seed=11)["generated_text"]
    assert completion(client, max_tokens=10, temperature=0.8, top_p=0.9, seed=11)["choices"][0]["text"] == sampled
    # OpenAI samples at temperature 1 when none is given; TGI needs do_sample for that
    sampled = generate(client, max_new_tokens=10, do_sample=True, seed=12)["generated_text"]
    assert completion(client, max_tokens=10, seed=12)["choices"][0]["text"] == sampled


def test_completion_body_usage_and_finish_reasons(client: TestClient) -> None:
    body = completion(client, max_tokens=7, temperature=0, model="tiny-char")
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "tiny-char" and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert (choice["index"], choice["finish_reason"], choice["logprobs"]) == (0, "length", None)
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 7, "total_tokens": len(PROMPT) + 7}
    text = choice["text"]
    stopped = completion(client, max_tokens=7, temperature=0, stop=text[3:5])
    assert stopped["choices"][0]["text"] == text[: text.index(text[3:5])]
    assert stopped["choices"][0]["finish_reason"] == "stop"


def test_completion_logprobs_and_echo(client: TestClient) -> None:
    """With echo, the logprobs cover the prompt's tokens first (the first has no context: null, as OpenAI and vLLM
    write it), then the generated ones; greedy tokens are each their position's most likely."""
    body = completion(client, max_tokens=5, temperature=0, logprobs=2, echo=True)
    choice = body["choices"][0]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) == len(PROMPT) + 5
    lp = choice["logprobs"]
    n = len(PROMPT)
    assert lp["tokens"] == list(choice["text"])
    assert lp["text_offset"] == list(range(n + 5))
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 5
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i, (token, logprob, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])):
        if i == 0:
            continue
        assert len(top) == 2 and logprob <= 0 and max(top.values()) >= logprob - 1e-6
        if i >= n:  # generated greedily
            assert max(top, key=top.get) == token and math.isclose(top[token], logprob, rel_tol=1e-5)


def test_completion_stream_equals_the_whole_completion(client: TestClient) -> None:
    whole = completion(client, max_tokens=9, seed=21)["choices"][0]
    chunks = completion_stream(client, max_tokens=9, seed=21)
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    echoed = completion_stream(client, max_tokens=9, seed=21, echo=True)
    assert "".join(c["choices"][0]["text"] for c in echoed) == PROMPT + whole["text"]


def test_completion_stream_include_usage_ends_with_a_usage_chunk(client: TestClient) -> None:
    chunks = completion_stream(client, max_tokens=4, temperature=0, stream_options={"include_usage": True})
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 4,
                                   "total_tokens": len(PROMPT) + 4}


def test_completion_for_another_model_is_404(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "model": "gpt-4"})
    assert_openai_error(r, 404, "invalid_request_error", "model", "'gpt-4'", "'tiny-char'", code="model_not_found")


def test_max_tokens_absent_or_null_is_openais_default_of_16(client: TestClient) -> None:
    """One field, one default: null means what leaving it out means (the server's --max-new-tokens-default is for
    the APIs that have none of their own)."""
    for body in ({}, {"max_tokens": None}):
        got = completion(client, temperature=0, ignore_eos=True, **body)
        assert got["usage"]["completion_tokens"] == 16, body


def test_logprobs_offsets_follow_the_text_where_tokens_split_characters(bpe_client: TestClient) -> None:
    """Byte-level BPE writes a character of several bytes in several tokens: each of those is named as OpenAI names
    it (`bytes:\\xf0\\x9f`), starts where its character does in `text`, and the stream says the same."""
    body = {"prompt": "Café ☕ naïve 日本", "max_tokens": 24, "seed": 1, "temperature": 1.0, "logprobs": 2}
    r = bpe_client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert any(not c.isascii() for c in text)  # the case at hand: characters of several bytes
    split = [t for t in lp["tokens"] if t.startswith("bytes:")]
    assert split and all(re.fullmatch(r"bytes:(\\x[0-9a-f]{2})+", t) for t in split)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and max(lp["text_offset"]) < len(text)
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        if not token.startswith("bytes:"):
            assert text[offset:offset + len(token)] == token
    chunks = [c for c in parse_sse(bpe_client.post("/v1/completions", json={**body, "stream": True}).text)
              if c != "[DONE]"]
    streamed = [c["choices"][0]["logprobs"] for c in chunks]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]
    assert [t for s in streamed for t in s["top_logprobs"]] == lp["top_logprobs"]
