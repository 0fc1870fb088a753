"""Streamed attention over HTTP (`parameters.attention` on the TGI routes): each token event's weights equal the
rows /inspect gives for the prompt and the tokens generated so far, /generate carries the same in its details, a
stream that does not ask is unchanged, and what the model cannot give is a 422 naming the field."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from app.testing import assert_tgi_error, parse_sse, strict_json
from tests.app.api.calls import generate, stream

PROMPT = "KING RICHARD:\nNow is the winter"
PARAMS = {"max_new_tokens": 30, "do_sample": True, "temperature": 0.8, "seed": 11}


@pytest.fixture(scope="module")
def bundled_client(make_client: Callable[..., TestClient], repo: Path) -> TestClient:
    return make_client(repo / "weights" / "shakespeare-char")


def inspected_rows(client: TestClient, text: str) -> dict[tuple[int, int], list[list[float]]]:
    r = client.post("/inspect", json={"inputs": text, "lens": False, "top_n": 0})
    assert r.status_code == 200, r.text
    return {(m["layer"], m["head"]): m["weights"] for m in strict_json(r.text)["attention"]["maps"]}


def test_each_token_carries_the_attention_inspect_gives(bundled_client: TestClient) -> None:
    events = stream(bundled_client, PROMPT, **PARAMS, attention={"layers": [0, 5], "heads": [1, 4]})
    text = PROMPT + "".join(e["token"]["text"] for e in events)
    rows = inspected_rows(bundled_client, text)  # one character a token: the text is the token sequence
    for i, ev in enumerate(events):
        att = ev["attention"]
        assert (att["start"], att["layers"], att["heads"]) == (0, [0, 5], [1, 4])
        query = len(PROMPT) + i - 1  # the token before this one chose it
        want = [rows[layer, head][query] for layer in (0, 5) for head in (1, 4)]
        assert [len(row) for row in att["weights"]] == [query + 1] * 4
        torch.testing.assert_close(torch.tensor(att["weights"]), torch.tensor(want), rtol=0, atol=2e-6)


def test_without_heads_each_layers_row_is_the_mean_over_its_heads(bundled_client: TestClient) -> None:
    events = stream(bundled_client, PROMPT, **PARAMS, attention={})
    rows = inspected_rows(bundled_client, PROMPT + "".join(e["token"]["text"] for e in events))
    for i, ev in enumerate(events):
        att = ev["attention"]
        assert att["layers"] == list(range(6)) and "heads" not in att and len(att["weights"]) == 6
        query = len(PROMPT) + i - 1
        for layer, row in enumerate(att["weights"]):
            want = torch.tensor([rows[layer, head][query] for head in range(6)]).mean(0)
            torch.testing.assert_close(torch.tensor(row), want, rtol=0, atol=5e-6)


def test_whole_answers_carry_it_in_details_and_other_streams_are_unchanged(bundled_client: TestClient) -> None:
    spec = {"layers": [3]}
    events = stream(bundled_client, PROMPT, **PARAMS, attention=spec)
    whole = generate(bundled_client, PROMPT, **PARAMS, attention=spec, details=True)
    assert whole["details"]["attention"] == [e["attention"] for e in events]
    compat = bundled_client.post("/", json={"inputs": PROMPT, "stream": True,
                                            "parameters": {**PARAMS, "attention": spec}})
    assert [e["attention"] for e in parse_sse(compat.text)] == [e["attention"] for e in events]
    plain = stream(bundled_client, PROMPT, **PARAMS)
    assert all("attention" not in e for e in plain)
    assert [e["token"] for e in plain] == [e["token"] for e in events]
    assert "attention" not in generate(bundled_client, PROMPT, **PARAMS, details=True)["details"]


@pytest.mark.parametrize("route", ["/generate", "/"])
def test_a_whole_answer_needs_details_for_it(bundled_client: TestClient, route: str) -> None:
    r = bundled_client.post(route, json={"inputs": PROMPT, "parameters": {"attention": {}}})
    assert_tgi_error(r, 422, "validation", "parameters.attention:", "parameters.details")


@pytest.mark.parametrize("case", [
    ({"layers": [6]}, "parameters.attention.layers:", "[0, 5]", "[6]"),
    ({"heads": [2, 2]}, "parameters.attention.heads:", "distinct", "[2, 2]"),
    ({"heads": []}, "parameters.attention.heads:", "left out"),
    ({"layers": "all"}, "parameters.attention.layers:", "got 'all'"),
    ({"mean": True}, "parameters.attention.mean: unknown field"),
])
def test_attention_the_model_cannot_give_is_422(bundled_client: TestClient, case: tuple) -> None:
    attention, *needles = case
    r = bundled_client.post("/generate_stream", json={"inputs": PROMPT, "parameters": {"attention": attention}})
    assert_tgi_error(r, 422, "validation", *needles)


def test_the_limits_bound_a_token_and_a_request(bundled_client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from model.engine import attention

    monkeypatch.setattr(attention, "MAX_TOKEN_WEIGHTS", 1000)
    monkeypatch.setattr(attention, "MAX_REQUEST_WEIGHTS", 20_000)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 10, "attention": {"heads": [0, 1]}}}
    assert_tgi_error(bundled_client.post("/generate_stream", json=body), 422, "validation", "parameters.attention:",
                     "is 1536 weights per token", "more than 1000")  # 6 layers x 2 heads x 128 positions
    body["parameters"]["attention"] = {"layers": [0]}  # 128 a token
    assert_tgi_error(bundled_client.post("/generate_stream", json=body | {"parameters": {
        **body["parameters"], "max_new_tokens": 200}}), 422, "validation", "is 25600 weights", "more than 20000")
    assert len(stream(bundled_client, PROMPT, max_new_tokens=10, attention={"layers": [0]})) == 10
    r = bundled_client.post("/v1/completions", json={"prompt": "A", "attention": {}})
    assert r.status_code == 400 and "attention: unknown field" in r.text  # an extension of TGI's routes only
