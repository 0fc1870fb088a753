"""What goes over the wire is strict JSON and whole UTF-8 characters: a model that computes NaN writes null,
and byte-level BPE tokens that split a character are held back until it is whole."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from app.testing import assert_tgi_error, parse_sse, strict_json
from model.checkpoint import load_checkpoint
from model.testing import EMOJI_CJK
from tests.app.api.calls import BASE, PROMPT, generate, stream


@pytest.fixture(scope="module")
def nan_client(char_checkpoint: Path) -> Iterator[TestClient]:
    """The app serving the char checkpoint with every weight of its (tied) embedding and LM head set to NaN after
    loading: every logit and log-probability is NaN (a checkpoint whose weights hold NaN, or a model that
    overflows)."""
    ck = load_checkpoint(char_checkpoint)
    with torch.no_grad():
        ck.model.lm_head.weight.fill_(float("nan"))
    with TestClient(create_app(Settings(checkpoint=char_checkpoint, **BASE), checkpoint=ck)) as client:
        yield client


def test_non_finite_numbers_are_written_as_null(nan_client: TestClient) -> None:
    """Every body and every event is strict JSON: a NaN log-probability is null (the hot byte-formatted path and
    the dict path alike), /v1/completions with logprobs is no 500, and the server keeps serving."""
    def post(route: str, body: dict) -> Any:
        r = nan_client.post(route, json=body)
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("text/event-stream"):
            return parse_sse(r.text)  # strict
        return strict_json(r.text)

    greedy = {"max_new_tokens": 4, "greedy": True}
    d = post("/generate", {"inputs": PROMPT, "parameters": {**greedy, "details": True, "top_n_tokens": 2}})["details"]
    assert [t["logprob"] for t in d["tokens"]] == [None] * 4
    assert [a["logprob"] for top in d["top_tokens"] for a in top] == [None] * 8
    for top_n in (0, 2):  # without alternatives the events are formatted straight to bytes (app.api.tgi's token_sse)
        events = post("/generate_stream", {"inputs": PROMPT, "parameters": {**greedy, "top_n_tokens": top_n}})
        assert [e["token"]["logprob"] for e in events] == [None] * 4
        assert [a["logprob"] for e in events for a in e["top_tokens"]] == [None] * 4 * top_n
    assert post("/", {"inputs": PROMPT, "parameters": {**greedy, "details": True}})[0]["details"]["tokens"][0][
        "logprob"] is None
    assert len(post("/", {"inputs": PROMPT, "parameters": greedy, "stream": True})) == 4
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    lp = post("/v1/completions", body)["choices"][0]["logprobs"]  # the echoed prompt's tokens, then the 4 new
    n_prompt = len(lp["token_logprobs"]) - 4
    assert n_prompt == len(PROMPT) and lp["token_logprobs"] == [None] * (n_prompt + 4)
    assert lp["top_logprobs"][0] is None and all(set(t.values()) == {None} for t in lp["top_logprobs"][1:])
    chunks = post("/v1/completions", {**body, "stream": True})
    assert [c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks[1:-1]] == [[None]] * 4
    # sampling from NaN probabilities fails that request alone, in a well-formed error
    assert_tgi_error(nan_client.post("/generate", json={"inputs": PROMPT, "parameters": {"do_sample": True}}), 424,
                     "generation")
    events = parse_sse(nan_client.post("/generate_stream", json={"inputs": PROMPT,
                                                                 "parameters": {"do_sample": True}}).text)
    assert events[-1]["error_type"] == "generation"
    for route in ("/health", "/info", "/v1/models"):
        r = nan_client.get(route)
        assert r.status_code == 200 and strict_json(r.text)


def test_the_json_encoder_writes_null_for_every_non_finite_float() -> None:
    from app.http.responses import StrictJSONResponse, dumps
    from app.http.sse import sse

    data = {"a": [1.5, float("nan"), {"b": (float("inf"), -float("inf"))}], "c": "NaN", "d": -0.0}
    assert dumps(data) == '{"a":[1.5,null,{"b":[null,null]}],"c":"NaN","d":-0.0}'
    assert strict_json(StrictJSONResponse(data).body) == strict_json(dumps(data))
    assert sse(data) == f"data: {dumps(data)}\n\n".encode()



BPE_PROMPT = "emoji 😀 and 中文 ok"


def test_bpe_emoji_prompt_streams_whole_characters(bpe_client: TestClient) -> None:
    # the model cycles through F0 9F 98 80 E4 B8 AD: every character arrives split over 3 or 4 tokens
    body = generate(bpe_client, BPE_PROMPT, max_new_tokens=14, details=True)
    assert body["generated_text"] == EMOJI_CJK * 2
    assert body["details"]["finish_reason"] == "length"
    events = stream(bpe_client, BPE_PROMPT, max_new_tokens=14)
    texts = [e["token"]["text"] for e in events]
    assert len(events) == 14 and not any("\ufffd" in t for t in texts)
    assert [t for t in texts if t] == ["😀", "中", "😀", "中"]
    assert "".join(texts) == events[-1]["generated_text"] == EMOJI_CJK * 2
    chunks = parse_sse(bpe_client.post("/v1/completions", json={"prompt": BPE_PROMPT, "max_tokens": 14,
                                                                "temperature": 0, "stream": True}).text)
    pieces = [c["choices"][0]["text"] for c in chunks[:-1]]
    assert not any("\ufffd" in p for p in pieces) and "".join(pieces) == EMOJI_CJK * 2


def test_bpe_tokenize_offsets_count_characters(bpe_client: TestClient) -> None:
    tokens = bpe_client.post("/tokenize", json={"inputs": BPE_PROMPT}).json()
    assert tokens[0]["start"] == 0 and tokens[-1]["stop"] == len(BPE_PROMPT)
    assert all(a["stop"] == b["start"] for a, b in zip(tokens, tokens[1:]))
    for t in tokens:
        if "\ufffd" not in t["text"]:  # a token of whole characters covers exactly its text
            assert BPE_PROMPT[t["start"] : t["stop"]] == t["text"]
