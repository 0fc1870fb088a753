"""Every bad input is a 4xx naming the field, the bound and the value (a short preview of it), in the error body
of its API family: TGI's 422, or on /v1/ the 400 of OpenAI, Anthropic and vLLM."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.testing import assert_openai_error, assert_tgi_error
from model.testing import make_char_checkpoint
from tests.app.api.calls import LIMIT, PROMPT, completion, generate, post_raw

TGI_INVALID = [
    ({"temperature": -1}, "parameters.temperature", "greater than or equal to 0", "got -1"),
    ({"temperature": 101}, "parameters.temperature", "less than or equal to 100", "got 101"),
    ({"top_p": 0}, "parameters.top_p", "greater than 0", "got 0"),
    ({"top_p": 1.5}, "parameters.top_p", "less than or equal to 1", "got 1.5"),
    ({"top_k": -1}, "parameters.top_k", "greater than or equal to 0", "got -1"),
    ({"max_new_tokens": 0}, "parameters.max_new_tokens", "greater than or equal to 1", "got 0"),
    ({"max_new_tokens": LIMIT + 1}, "parameters.max_new_tokens", f"[1, {LIMIT}]", f"got {LIMIT + 1}"),
    ({"seed": -1}, "parameters.seed", "greater than or equal to 0", "got -1"),
    ({"seed": 2**63}, "parameters.seed", f"less than or equal to {2**63 - 1}", f"got {2**63}"),
    ({"repetition_penalty": 0}, "parameters.repetition_penalty", "greater than 0", "got 0"),
    ({"top_n_tokens": 21}, "parameters.top_n_tokens", "less than or equal to 20", "got 21"),
    ({"truncate": 0}, "parameters.truncate", "greater than or equal to 1", "got 0"),
    ({"truncate": 65}, "parameters.truncate", "[1, 64]", "got 65"),
    ({"best_of": 2}, "parameters.best_of", "needs sampling", "got 2"),
    ({"best_of": 17, "do_sample": True}, "parameters.best_of", "less than or equal to 16", "got 17"),
    ({"temperature": "hot"}, "parameters.temperature", "valid number", "'hot'"),
    ({"max_new_tokens": 1.5}, "parameters.max_new_tokens", "valid integer", "1.5"),
    ({"stop": "###"}, "parameters.stop", "valid list", "'###'"),
    ({"details": "maybe"}, "parameters.details", "valid boolean", "'maybe'"),
    ({"typical_p": 0.5}, "parameters.typical_p", "not supported", "0.5"),
    ({"watermark": True}, "parameters.watermark", "not supported", "True"),
    ({"frequency_penalty": 2.5}, "parameters.frequency_penalty", "less than or equal to 2", "got 2.5"),
    ({"stop": [""]}, "parameters.stop", "non-empty", "''"),
    ({"stop": ["x"] * 17}, "parameters.stop", "at most 16"),
    ({"stop": ["ok", "x" * 129]}, "parameters.stop", "at most 128 characters", "one of 129", "'xxxx"),
    ({"no_such_knob": 1}, "parameters.no_such_knob", "unknown field"),
]


@pytest.mark.parametrize("route", ["/generate", "/generate_stream", "/"])
@pytest.mark.parametrize(("parameters", "field", "needles"), [(p, f, n) for p, f, *n in TGI_INVALID],
                         ids=[f"{f}={json.dumps(p)[:30]}" for p, f, *_ in TGI_INVALID])
def test_tgi_bad_parameter_is_422_naming_field_bound_and_value(
    client: TestClient, route: str, parameters: dict, field: str, needles: list[str]
) -> None:
    r = client.post(route, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, **parameters}})
    assert_tgi_error(r, 422, "validation", f"{field}:", *needles)


RANGED = [  # a bound the request model checks: the message names the whole range the field allows (app/http/errors.py)
    ("/generate", {"inputs": PROMPT, "parameters": {"temperature": -1}},
     "parameters.temperature: Input should be greater than or equal to 0 (allowed: [0, 100]), got -1"),
    ("/generate", {"inputs": PROMPT, "parameters": {"top_p": 0}},
     "parameters.top_p: Input should be greater than 0 (allowed: (0, 1]), got 0"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": 3},
     "temperature: Input should be less than or equal to 2 (allowed: [0, 2]), got 3"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1},
     "max_tokens: Input should be greater than or equal to 0 (allowed: [0, inf]), got -1"),
    ("/inspect", {"inputs": PROMPT, "sparse_threshold": 0},
     "sparse_threshold: Input should be greater than 0 (allowed: (0, 1]), got 0"),
    ("/inspect", {"inputs": PROMPT, "top_n": 99},
     "top_n: Input should be less than or equal to 20 (allowed: [0, 20]), got 99"),
]


@pytest.mark.parametrize(("route", "body", "message"), RANGED, ids=[m.split(":")[0] for _, _, m in RANGED])
def test_a_bound_names_the_range_allowed(client: TestClient, route: str, body: dict, message: str) -> None:
    r = client.post(route, json=body)
    assert r.status_code == (400 if route.startswith("/v1/") else 422)  # OpenAI's 400, TGI's 422
    error = r.json()["error"]
    assert (error["message"] if route.startswith("/v1/") else error) == message


RAW_BODIES = [
    ('{"inputs": "ab", "parameters": {"temperature": NaN}}', "parameters.temperature", "finite number"),
    ('{"inputs": "ab", "parameters": {"temperature": Infinity}}', "parameters.temperature", "finite number"),
    ('{"inputs": "ab", "parameters": {"top_p": -Infinity}}', "parameters.top_p", "finite number"),
    ('{"inputs": "ab", "parameters": {"max_new_tokens": 2,}}', "body", "not valid JSON"),
    ('{"inputs": "ab"', "body", "not valid JSON"),
    ('{"parameters": {}}', "inputs", "Field required"),
    ('{"inputs": 5}', "inputs", "valid string", "got 5"),
    ('{"inputs": "ab", "temperature": 0.5}', "temperature", "unknown field"),
    ('{"inputs": ""}', "inputs", "at least one token", "got 0"),
    ('{"inputs": "' + "a" * 65 + '"}', "inputs", "65 tokens", "context of 64", "truncate"),
    ('{"inputs": "h\\u00e9llo \\u2603"}', "inputs", "2 character(s)", "'é'", "'☃'"),
]


@pytest.mark.parametrize(("raw", "field", "needles"), [(r, f, n) for r, f, *n in RAW_BODIES],
                         ids=[r[:40] for r, *_ in RAW_BODIES])
def test_tgi_bad_body_is_422(client: TestClient, raw: str, field: str, needles: list[str]) -> None:
    for route in ("/generate", "/generate_stream"):
        r = client.post(route, content=raw, headers={"content-type": "application/json"})
        assert_tgi_error(r, 422, "validation", f"{field}:" if field != "body" else "body is", *needles)


UNPARSEABLE = [
    (b'{"inputs": "Hel\xfflo"}', "not UTF-8 (byte 0xff at offset 15)"),
    (b"[" * 5000 + b"]" * 5000, "nests arrays or objects too deeply"),
    (b'{"inputs": "ab", "parameters": {"seed": ' + b"9" * 5000 + b"}}", "Exceeds the limit (4300 digits)"),
]


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
@pytest.mark.parametrize(("raw", "needle"), UNPARSEABLE, ids=["invalid UTF-8", "deep nesting", "5000 digits"])
def test_body_json_cannot_decode_is_422_not_400(client: TestClient, route: str, raw: bytes, needle: str) -> None:
    """Where json.loads fails other than with a JSONDecodeError, FastAPI says 400 'There was an error parsing the
    body'; it is malformed JSON like any other."""
    r = client.post(route, content=raw, headers={"content-type": "application/json"})
    if route.startswith("/v1"):
        assert_openai_error(r, 400, "invalid_request_error", "body", "body is not valid JSON", needle)
    else:
        assert_tgi_error(r, 422, "validation", "body is not valid JSON", needle)


WRONG_TYPES = [
    ("/generate", {"parameters": {"max_new_tokens": "4"}}, "parameters.max_new_tokens", "valid integer", "'4'"),
    ("/generate", {"parameters": {"max_new_tokens": 4.0}}, "parameters.max_new_tokens", "valid integer", "4.0"),
    ("/generate", {"parameters": {"seed": True}}, "parameters.seed", "valid integer", "True"),
    ("/generate", {"stream": "yes"}, "stream", "valid boolean", "'yes'"),
    ("/v1/completions", {"echo": 1}, "echo", "valid boolean", "got 1"),
    ("/v1/completions", {"max_tokens": "4"}, "max_tokens", "valid integer", "'4'"),
]


@pytest.mark.parametrize(("route", "fields", "field", "needles"), [(r, f, p, n) for r, f, p, *n in WRONG_TYPES],
                         ids=[f"{p}={json.dumps(f)[-12:]}" for _, f, p, *_ in WRONG_TYPES])
def test_values_of_another_json_type_are_422(client: TestClient, route: str, fields: dict, field: str,
                                             needles: list[str]) -> None:
    """No coercion: "4" or 4.0 is not an integer, 1 or "yes" not a boolean (as TGI and OpenAI answer)."""
    key = "prompt" if route.startswith("/v1") else "inputs"
    r = client.post(route, json={key: PROMPT, **fields})
    if route.startswith("/v1"):
        assert_openai_error(r, 400, "invalid_request_error", field, f"{field}:", *needles)
    else:
        assert_tgi_error(r, 422, "validation", f"{field}:", *needles)


def test_tokenize_rejects_unknown_characters(client: TestClient) -> None:
    r = client.post("/tokenize", json={"inputs": "naïve"})
    assert_tgi_error(r, 422, "validation", "inputs:", "'ï'")


def test_tokenize_over_its_limit_is_422_naming_it(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_tokenize_chars=16)
    assert len(client.post("/tokenize", json={"inputs": "a" * 16}).json()) == 16
    r = client.post("/tokenize", json={"inputs": "a" * 17})
    assert_tgi_error(r, 422, "validation", "inputs: must be at most 16 characters", "--max-tokenize-chars", "got 17")


def test_one_request_may_take_its_share_of_the_batch_and_no_more(make_client: Callable[..., TestClient]) -> None:
    """By default half of --max-batch-size (here 2 of 4): a request of 4 prompts x n 16 held 64 of a server's 80
    slots, and a stream sent beside it waited seconds for its first token."""
    client = make_client(max_sequences_per_request=0)
    assert client.get("/info").json()["max_sequences_per_request"] == 2
    r = client.post("/v1/completions", json={"prompt": ["To be", "or not"], "n": 2, "max_tokens": 2})
    assert_openai_error(r, 400, "invalid_request_error", "n", "prompts x max(n, best_of) must be at most 2",
                        "--max-sequences-per-request", "got 2 x 2 = 4")
    r = client.post("/v1/completions", json={"prompt": PROMPT, "n": 1, "best_of": 3, "max_tokens": 2})
    assert_openai_error(r, 400, "invalid_request_error", "best_of", "at most 2", "got 1 x 3 = 3")
    r = client.post("/generate", json={"inputs": PROMPT, "parameters": {"best_of": 3, "do_sample": True}})
    assert_tgi_error(r, 422, "validation", "parameters.best_of: best_of must be at most 2", "got 3")
    r = client.post("/v1/completions", json={"prompt": ["To be", "or not"], "n": 1, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    r = client.post("/generate", json={"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True,
                                                                         "details": True, "max_new_tokens": 2}})
    assert r.status_code == 200 and len(r.json()["details"]["best_of_sequences"]) == 1
    wider = make_client(max_sequences_per_request=3)
    assert wider.post("/v1/completions", json={"prompt": PROMPT, "n": 3, "max_tokens": 2}).status_code == 200


def test_a_large_body_of_bad_fields_or_items_is_one_error(make_client: Callable[..., TestClient]) -> None:
    """The work a body under the size limit costs is bounded by its shape: 150,000 unknown fields were 150,000
    errors (2-3 s of the event loop, /health waiting as long), a list of ids with a bad one was tried as each
    shape of prompt and made an error per item and per shape (seconds): now one error each."""
    client = make_client(max_body_bytes=4 * 2**20)
    unknown = {f"k{i}": 0 for i in range(150_000)}
    r = client.post("/generate", json={"inputs": PROMPT, **unknown})
    assert_tgi_error(r, 422, "validation", "body: has 150001 fields, more than the 3 it may hold (inputs, parameters, "
                     "stream); unknown fields include ['k0', 'k1', 'k2']")
    r = client.post("/generate", json={"inputs": PROMPT, "parameters": unknown})
    assert_tgi_error(r, 422, "validation", "parameters: has 150000 fields, more than the 22")
    r = client.post("/v1/completions", json={"prompt": PROMPT, **unknown})
    message = assert_openai_error(r, 400, "invalid_request_error", "body", "has 150001 fields")
    assert "more error" not in message
    r = client.post("/v1/completions", json={"prompt": [1] * 150_000 + [0.5]})
    assert_openai_error(r, 400, "invalid_request_error", "prompt", "a list of token ids", "(150001 items)")
    r = client.post("/v1/completions", json={"prompt": PROMPT, "logit_bias": {str(i): 1.0 for i in range(150_000)}})
    assert_openai_error(r, 400, "invalid_request_error", "logit_bias", "must hold at most 1024 entries")
    r = client.post("/detokenize", json={"tokens": [0.5] * 150_000})
    assert assert_tgi_error(r, 422, "validation").startswith("tokens.0: Input should be a valid integer, got 0.5")


def test_a_large_json_body_is_parsed_and_validated_off_the_event_loop(make_client: Callable[..., TestClient],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Bodies over INLINE_PARSE_BYTES (here padded with JSON's whitespace) are parsed and validated in a worker
    thread, their errors as FastAPI's own; a small one on the event loop (less work than the hand-off)."""
    import app.http.limits

    client = make_client(max_body_bytes=2**20)
    seen: list[bool] = []
    parse = app.http.limits._parse_and_validate

    def recording(field: Any, body: bytes) -> Any:
        try:
            asyncio.get_running_loop()
            seen.append(True)
        except RuntimeError:  # no event loop runs in this thread: a worker's
            seen.append(False)
        return parse(field, body)

    def post(route: str, body: bytes) -> Any:
        padded = body + b" " * app.http.limits.INLINE_PARSE_BYTES
        return client.post(route, content=padded, headers={"content-type": "application/json"})

    monkeypatch.setattr(app.http.limits, "_parse_and_validate", recording)
    r = post("/generate", json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}).encode())
    assert r.status_code == 200 and len(r.json()["generated_text"]) == 2
    assert_tgi_error(post("/generate", b'{"inputs": "ab", "nope": 1}'), 422, "validation", "nope: unknown field")
    assert_tgi_error(post("/generate", b'{"inputs": '), 422, "validation", "body is not valid JSON")
    assert_tgi_error(post("/generate", b'{"inputs": "\xff"}'), 422, "validation", "not UTF-8 (byte 0xff at offset 12)")
    r = post("/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert seen == [False] * 5
    assert client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}).status_code == 200
    assert seen == [False] * 5  # parsed by FastAPI, on the event loop


def test_a_prompt_list_of_many_items_is_one_error(client: TestClient) -> None:
    """The list's length is checked before its items: a body of thousands of numbers is one 422 (before, pydantic
    reported every item, twice: seconds of work on the event loop and a 20x larger answer for a large body)."""
    r = client.post("/v1/completions", json={"prompt": ["a"] * 3000})
    message = assert_openai_error(r, 400, "invalid_request_error", "prompt", "a batch of at most 32", "(3000 items)")
    assert message.count("prompt") == 1


OPENAI_INVALID = [
    ({"temperature": -1}, "temperature", "greater than or equal to 0", "got -1"),
    ({"temperature": 2.5}, "temperature", "less than or equal to 2", "got 2.5"),
    ({"top_p": 0}, "top_p", "greater than 0", "got 0"),
    ({"top_p": 1.5}, "top_p", "less than or equal to 1", "got 1.5"),
    ({"top_k": -1}, "top_k", "greater than or equal to 0", "got -1"),
    ({"max_tokens": 0}, "max_tokens", "0 only with echo", "got 0"),
    ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0", "got -1"),
    ({"max_tokens": LIMIT + 1}, "max_tokens", f"[1, {LIMIT}]", f"got {LIMIT + 1}"),
    ({"seed": -1}, "seed", "greater than or equal to 0", "got -1"),
    ({"n": 17}, "n", "less than or equal to 16", "got 17"),
    ({"n": 2, "best_of": 1}, "best_of", "at least n (2)", "got 1"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20", "got 21"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2", "got 2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2", "got -3"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "token ids as strings", "got 'x'"),
    ({"logit_bias": {"²": 1}}, "logit_bias", "token ids as strings", "got '²'"),  # a digit int() refuses
    ({"logit_bias": {"１": 1}}, "logit_bias", "token ids as strings", "got '１'"),  # a digit int() would read as 1
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100.0, 100.0]", "101"),
    ({"logit_bias": {"100000": 1}}, "logit_bias", "the model's vocabulary", "got 100000"),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens", "[0, 16]", "got 17"),
    ({"min_p": 1.5}, "min_p", "less than or equal to 1", "got 1.5"),
    ({"prompt": [0, 100000]}, "prompt", "the model's vocabulary", "got 100000"),
    ({"prompt": [0, 100000], "echo": True}, "prompt", "the model's vocabulary", "got 100000"),  # before it is echoed
    ({"max_tokens": "many"}, "max_tokens", "valid integer", "'many'"),
    ({"stop": ""}, "stop", "non-empty", "''"),
    ({"stop": ["a"] * 17}, "stop", "at most 16 stop strings, got", "(17 items)"),
    ({"stop": "x" * 129}, "stop", "at most 128 characters", "one of 129", "'xxxx"),
    ({"stop": ["ok", "y" * 129]}, "stop", "at most 128 characters", "one of 129", "'yyyy"),
    ({"prompt": ["a"] * 33}, "prompt", "a batch of at most 32", "(33 items)"),
    ({"prompt": []}, "prompt", "must not be an empty list"),
    ({"prompt": ""}, "prompt", "at least one token", "got 0"),
    ({"prompt": "a" * 65}, "prompt", "65 tokens", "context of 64"),
    ({"prompt": "naïve"}, "prompt", "'ï'"),
    ({"typical_p": 0.5}, "typical_p", "unknown field"),
]


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("fields", "param", "needles"), [(b, p, n) for b, p, *n in OPENAI_INVALID],
                         ids=[f"{p}={json.dumps(b)[:30]}" for b, p, *_ in OPENAI_INVALID])
def test_openai_bad_parameter_is_400_with_param(
    client: TestClient, streaming: bool, fields: dict, param: str, needles: list[str]
) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": streaming, **fields})
    code = "context_length_exceeded" if "context of 64" in needles else None  # OpenAI's code for that one
    assert_openai_error(r, 400, "invalid_request_error", param, f"{param}:", *needles, code=code)


def test_openai_raw_nan_missing_prompt_and_malformed_json_are_400(client: TestClient) -> None:
    for raw, param, needle in [('{"prompt": "ab", "temperature": NaN}', "temperature", "finite number"),
                               ('{"prompt": "ab", "top_p": Infinity}', "top_p", "finite number"),
                               ('{"max_tokens": 3}', "prompt", "Field required"),
                               ('{"prompt": "ab",', "body", "not valid JSON")]:
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_openai_error(r, 400, "invalid_request_error", param, needle)



LONE_SURROGATES = [
    ("/generate", {"inputs": "hi \ud800", "parameters": {"return_full_text": True}}, "inputs"),
    ("/generate", {"inputs": "hi", "parameters": {"stop": ["ok", "\udfff"]}}, "parameters.stop"),
    ("/generate_stream", {"inputs": "\ud800 hi", "parameters": {"return_full_text": True}}, "inputs"),
    ("/", {"inputs": "x\ud83d", "stream": True}, "inputs"),
    ("/tokenize", {"inputs": "\udc00"}, "inputs"),
    ("/v1/completions", {"prompt": "hi \ud800", "echo": True}, "prompt"),
    ("/v1/completions", {"prompt": ["hi \ud800"], "echo": True, "stream": True}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": "\ud800"}, "stop"),
    ("/v1/completions", {"prompt": "hi", "user": "\ud800"}, "user"),
    ("/v1/completions", {"prompt": "hi", "model": "\ud800"}, "model"),
]


@pytest.mark.parametrize(("route", "body", "field"), LONE_SURROGATES,
                         ids=[f"{r}-{f}-{i}" for i, (r, _, f) in enumerate(LONE_SURROGATES)])
def test_a_lone_surrogate_in_any_string_is_422_naming_the_field(bpe_client: TestClient, route: str, body: dict,
                                                                field: str) -> None:
    """JSON's \\ud800 escape decodes to a lone surrogate, which no UTF-8 text can hold: on a BPE model it used to
    give a plain-text 500 (echoing the prompt), a stream cut off mid-way, or tokens of U+FFFD."""
    r = post_raw(bpe_client, route, body)
    needles = (f"{field}:", "lone surrogate", "valid Unicode")
    if route.startswith("/v1"):
        assert_openai_error(r, 400, "invalid_request_error", field, *needles)
    else:
        assert_tgi_error(r, 422, "validation", *needles)


def test_a_surrogate_pair_is_one_character(bpe_client: TestClient) -> None:
    parameters = {"max_new_tokens": 7, "return_full_text": True}
    r = post_raw(bpe_client, "/generate", {"inputs": "emoji \ud83d\ude00", "parameters": parameters})
    assert r.status_code == 200
    assert r.json() == generate(bpe_client, "emoji 😀", **parameters)
    assert r.json()["generated_text"].startswith("emoji 😀")


def test_top_n_tokens_beyond_the_vocabulary_is_422_naming_its_size(make_client: Callable[..., TestClient],
                                                                  tmp_path: Path) -> None:
    """A model of 4 characters has 4 alternatives to report, not 5 (torch's top-k failed: a 424)."""
    client = make_client(make_char_checkpoint(tmp_path / "four-chars", chars=["\n", " ", "a", "b"]))
    details = generate(client, "ab", max_new_tokens=3, details=True, top_n_tokens=4)["details"]
    assert [len(top) for top in details["top_tokens"]] == [4, 4, 4]
    for route in ("/generate", "/generate_stream", "/"):
        r = client.post(route, json={"inputs": "ab", "parameters": {"top_n_tokens": 5}})
        assert_tgi_error(r, 422, "validation", "parameters.top_n_tokens:", "vocabulary size, 4", "got 5")
    for streaming in (False, True):
        r = client.post("/v1/completions", json={"prompt": "ab", "logprobs": 5, "stream": streaming})
        assert_openai_error(r, 400, "invalid_request_error", "logprobs", "logprobs:", "vocabulary size, 4", "got 5")
    logprobs = completion(client, prompt="ab", max_tokens=2, logprobs=4)["choices"][0]["logprobs"]
    assert [len(top) for top in logprobs["top_logprobs"]] == [4, 4]


LARGE_VALUES = [
    ("/generate", {"inputs": "hi", "parameters": {"stop": ["x"] * 3000}}, "parameters.stop", "(3000 items)"),
    ("/generate", {"inputs": ["a"] * 3000}, "inputs", "(3000 items)"),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 10**4000}}, "parameters.max_new_tokens",
     "(4001 digits)"),
    ("/generate", {"inputs": "hi", "parameters": {"stop": [1] * 3000}}, "parameters.stop", "(3000 items)"),
    ("/v1/completions", {"prompt": ["a"] * 3000}, "prompt", "(3000 items)"),
    ("/v1/completions", {"prompt": "hi", "stop": [1] * 3000}, "stop", "stop strings, got [1, 1, 1, 1, ...] (3000"),
    ("/generate", {"inputs": "hi", "parameters": {"z" * 12000: 1}}, "parameters.zzzz", "unknown field"),
    ("/generate", {"inputs": "hi", "parameters": {"stop": ["y" * 12000]}}, "parameters.stop", "(12000 characters)"),
    ("/generate", {"inputs": "hi", "parameters": {"truncate": 10**4000}}, "parameters.truncate", "(4001 digits)"),
    ("/tokenize", {"inputs": "".join(map(chr, range(256, 2256)))}, "inputs", "2000 character(s) outside"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(1100)}}, "logit_bias",
     "(1100 items)"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**4000}, "max_tokens", "(4001 digits)"),
    ("/v1/completions", {"prompt": "hi", "stop": "s" * 12000}, "stop", "(12000 characters)"),
    ("/v1/completions", {"prompt": "hi", "model": "m" * 12000}, "model", "(12000 characters)"),
]


@pytest.mark.parametrize(("route", "body", "field", "needle"), LARGE_VALUES,
                         ids=[f"{r}-{f}-{i}" for i, (r, _, f, _) in enumerate(LARGE_VALUES)])
def test_errors_echo_a_short_preview_of_a_large_value(client: TestClient, route: str, body: dict, field: str,
                                                      needle: str) -> None:
    """An error names the field and shows a preview of the value (about 80 characters, saying how long it was),
    never the value: a 5 MB list used to come back whole."""
    r = post_raw(client, route, body)
    assert r.status_code in (404, 400 if route.startswith("/v1/") else 422), r.text[:200]
    assert len(r.content) < 700, r.text[:200]
    message = r.json()["error"]["message"] if route.startswith("/v1") else r.json()["error"]
    assert message.startswith(field) and needle in message, message


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_sent_as_another_type_is_told_to_say_json(client: TestClient, content_type: str | None) -> None:
    """curl -d sends form-encoded; the body is JSON all the same: the 400 says what to send, not what bytes are."""
    headers = {"content-type": content_type} if content_type else {}
    r = client.post("/v1/completions", content=b'{"prompt": "A", "max_tokens": 2}', headers=headers)
    assert_openai_error(r, 400, "invalid_request_error", "body", "Content-Type: application/json",
                        repr(content_type) if content_type else "got None")
