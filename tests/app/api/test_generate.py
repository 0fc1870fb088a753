"""/generate and /generate_stream against the naive reference loop: greedy and seeded sampling, details,
stop sequences, truncation, the SSE framing and event schema, and POST /."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from app.api.tgi.protocol import StreamResponse
from app.testing import parse_sse
from model.testing import CHARS
from tests.app.api.calls import PROMPT, generate, stream


def test_greedy_generate_equals_the_naive_loop(client: TestClient, reference: Callable) -> None:
    ids, text = reference(PROMPT, 24)
    body = generate(client, max_new_tokens=24, details=True)
    assert body["generated_text"] == text
    assert [t["id"] for t in body["details"]["tokens"]] == ids
    assert body["details"]["finish_reason"] == "length" and body["details"]["generated_tokens"] == 24


def test_seeded_sampling_reproduces_and_reports_the_seed(client: TestClient, reference: Callable) -> None:
    a = generate(client, max_new_tokens=24, do_sample=True, seed=7, details=True)
    b = generate(client, max_new_tokens=24, do_sample=True, seed=7, details=True)
    other = generate(client, max_new_tokens=24, do_sample=True, seed=8)
    assert a["generated_text"] == b["generated_text"] == reference(PROMPT, 24, do_sample=True, seed=7)[1]
    assert other["generated_text"] != a["generated_text"]
    assert a["details"]["seed"] == 7


def test_unseeded_sampling_reports_a_seed_that_reproduces(client: TestClient) -> None:
    first = generate(client, max_new_tokens=24, do_sample=True, details=True)
    seed = first["details"]["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**63
    again = generate(client, max_new_tokens=24, do_sample=True, seed=seed)
    assert again["generated_text"] == first["generated_text"]


@pytest.mark.parametrize("greedy", [{}, {"greedy": True}, {"do_sample": True, "temperature": 0, "seed": 3}],
                         ids=["no-sampling-asked", "greedy", "temperature-0"])
def test_greedy_decoding_reports_no_seed(client: TestClient, greedy: dict) -> None:
    """Nothing is sampled, so there is no seed to report (TGI's rule): no details.seed (the stream's details say
    null, those of /generate leave it out, as they leave out every null), a seed sent with a greedy request
    included; a sampled request beside it reports its seed."""
    body = generate(client, max_new_tokens=4, details=True, **greedy)
    events = stream(client, max_new_tokens=4, **greedy)
    assert "seed" not in body["details"] and events[-1]["details"]["seed"] is None
    assert body["generated_text"] == events[-1]["generated_text"]
    assert stream(client, max_new_tokens=4, do_sample=True, seed=11)[-1]["details"]["seed"] == 11


def test_temperature_zero_and_top_p_one_mean_greedy(client: TestClient, reference: Callable) -> None:
    greedy = reference(PROMPT, 16)[1]
    assert generate(client, max_new_tokens=16, temperature=0, do_sample=True, seed=3)["generated_text"] == greedy
    assert generate(client, max_new_tokens=16, top_p=1.0)["generated_text"] == greedy
    sampled = generate(client, max_new_tokens=16, do_sample=True, seed=3)["generated_text"]
    assert generate(client, max_new_tokens=16, do_sample=True, seed=3, top_p=1.0)["generated_text"] == sampled


def test_return_full_text_prepends_the_prompt(client: TestClient, reference: Callable) -> None:
    body = generate(client, max_new_tokens=8, return_full_text=True)
    assert body["generated_text"] == PROMPT + reference(PROMPT, 8)[1]


def test_details_tokens_logprobs_and_top_tokens(client: TestClient) -> None:
    d = generate(client, max_new_tokens=6, details=True, top_n_tokens=3, decoder_input_details=True)["details"]
    assert d["generated_tokens"] == len(d["tokens"]) == len(d["top_tokens"]) == 6
    for token, top in zip(d["tokens"], d["top_tokens"]):
        assert token["text"] == CHARS[token["id"]] and token["special"] is False
        assert token["logprob"] <= 0
        assert len(top) == 3 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["id"] == token["id"] and math.isclose(top[0]["logprob"], token["logprob"], rel_tol=1e-5)
        assert sum(math.exp(t["logprob"]) for t in top) <= 1 + 1e-5
    assert [(p["id"], p["text"]) for p in d["prefill"]] == [(CHARS.index(c), c) for c in PROMPT]


def test_stop_sequences_end_the_output_before_the_stop(client: TestClient, reference: Callable) -> None:
    greedy = reference(PROMPT, 32)[1]
    stop = greedy[12:14]
    expected = greedy[: greedy.index(stop)]
    body = generate(client, max_new_tokens=32, stop=["not in there", stop], details=True)
    assert body["generated_text"] == expected
    assert body["details"]["finish_reason"] == "stop_sequence"
    events = stream(client, max_new_tokens=32, stop=[stop])
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"] == expected


def test_truncate_keeps_the_last_prompt_tokens(client: TestClient, reference: Callable) -> None:
    prompt = "x" * 90 + "0123456789"  # longer than block_size 64
    body = generate(client, prompt, max_new_tokens=8, truncate=10, details=True, decoder_input_details=True)
    assert [p["text"] for p in body["details"]["prefill"]] == list("0123456789")
    assert body["generated_text"] == reference("0123456789", 8)[1]
    assert body["details"]["truncated_prompt_tokens"] == 90  # the engine truncates, once: it knows how much
    last = stream(client, prompt, max_new_tokens=8, truncate=10)[-1]
    assert last["details"]["input_length"] == 10 and last["details"]["truncated_prompt_tokens"] == 90
    assert last["generated_text"] == body["generated_text"]
    assert generate(client, "0123456789", max_new_tokens=1, details=True)["details"]["truncated_prompt_tokens"] == 0



def test_generate_stream_frames_one_event_per_token(client: TestClient) -> None:
    params = dict(max_new_tokens=12, do_sample=True, seed=5)
    events = stream(client, **params)
    assert [e["index"] for e in events] == list(range(1, 13))
    assert all(e.get("generated_text") is None and e.get("details") is None for e in events[:-1])
    last = events[-1]
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 12, "seed": 5,
                               "input_length": len(PROMPT), "truncated_prompt_tokens": 0}
    text = "".join(e["token"]["text"] for e in events)
    assert text == last["generated_text"] == generate(client, **params)["generated_text"]
    assert all(e["token"]["logprob"] <= 0 for e in events)


def test_stream_events_are_exactly_the_documented_schema(client: TestClient) -> None:
    """Events are built as dicts on the hot path; each is exactly what the StreamResponse model would dump."""
    events = stream(client, max_new_tokens=5, top_n_tokens=3, return_full_text=True, seed=1, do_sample=True)
    assert len(events) == 5 and all(len(e["top_tokens"]) == 3 for e in events)
    for e in events:
        assert StreamResponse.model_validate(e).model_dump(exclude={"attention"}) == e
        assert list(e) == [f for f in StreamResponse.model_fields if f != "attention"]  # attention: when asked
    assert events[-1]["generated_text"].startswith(PROMPT)


def test_plain_token_events_are_exactly_the_documented_schema(client: TestClient) -> None:
    """Without alternatives every token but the last is formatted straight to bytes (app.api.tgi.serving.token_sse)."""
    events = stream(client, max_new_tokens=6, seed=3, do_sample=True)
    assert len(events) == 6 and all(e["top_tokens"] == [] for e in events)
    for e in events:
        assert StreamResponse.model_validate(e).model_dump(exclude={"attention"}) == e
        assert list(e) == [f for f in StreamResponse.model_fields if f != "attention"]  # attention: when asked


@pytest.mark.parametrize("text", ["a", "", '"', "\\", "\n\t", "é€😀", "\u2028</script>", "\x00\x1f"])
@pytest.mark.parametrize("logprob", [-0.0, -1.5e-08, -12.345678901234567, float("-inf")])
def test_fast_token_event_bytes_equal_the_dict_path(text: str, logprob: float) -> None:
    from app.api.tgi.serving import stream_event, token_sse
    from app.http.sse import sse
    from model.engine import TokenEvent

    for special in (False, True):
        ev = TokenEvent(id=7, text=text, logprob=logprob, special=special, index=3)
        assert token_sse(ev, "prefix") == sse(stream_event(ev, "prefix"))


def test_root_route_streams_or_answers_a_one_element_list(client: TestClient) -> None:
    payload = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "seed": 4, "do_sample": True, "details": True}}
    whole = client.post("/generate", json=payload).json()
    r = client.post("/", json={**payload, "stream": False})
    assert r.status_code == 200 and r.json() == [whole]
    r = client.post("/", json={**payload, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert len(events) == 6 and events[-1]["generated_text"] == whole["generated_text"]
