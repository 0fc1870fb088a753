"""Section `bad_inputs`: a hand-written table (malformed JSON, wrong types, huge numbers, NaN and infinities,
negative and zero values, empty and 1 MB prompts, invalid UTF-8, characters outside the vocabulary, empty stop
strings, unknown fields) on every generation route of both API families, each with its expected status (an
invalid request: TGI's 422, OpenAI's 400)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx

from bench.reliability.harness import MB, NEW_TOKENS_LIMIT, Problems, documented_statuses
from bench.reliability.shapes import check_response

Body = bytes | dict[str, Any]
Row = tuple[str, Body, Body, int, int]  # (name, TGI body, OpenAI body, expected status for TGI, for OpenAI)
ROUTES = [("/generate", False, False), ("/generate_stream", True, False), ("/", False, False), ("/", True, False),
          ("/v1/completions", False, True), ("/v1/completions", True, True)]  # (path, streamed, OpenAI)


def tgi(**p: Any) -> dict[str, Any]:
    return {"inputs": "Hello", "parameters": {"max_new_tokens": 4, **p}}


def oa(**f: Any) -> dict[str, Any]:
    return {"prompt": "Hello", "max_tokens": 4, **f}


def raw_tgi(params: str) -> bytes:
    return ('{"inputs": "Hello", "parameters": {"max_new_tokens": 4, ' + params + "}}").encode()


def raw_oa(fields: str) -> bytes:
    return ('{"prompt": "Hello", "max_tokens": 4, ' + fields + "}").encode()


def _big() -> str:
    """1 MB of prose (a character is a byte)."""
    return ("To be, or not to be: that is the question.\n" * (MB // 44 + 1))[:MB]


def _malformed_json() -> list[Row]:
    """Malformed JSON."""
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    return [
        ("trailing comma", raw_tgi('"seed": 1,'), raw_oa('"seed": 1,'), 422, 400),
        ("truncated JSON", b'{"inputs": "Hello", "param', b'{"prompt": "Hel', 422, 400),
        ("single quotes", b"{'inputs': 'Hello'}", b"{'prompt': 'Hello'}", 422, 400),
        ("empty body", b"", b"", 422, 400),
        ("JSON null", b"null", b"null", 422, 400),
        ("JSON array", b'["Hello"]', b'["Hello"]', 422, 400),
        ("bare string", b'"Hello"', b'"Hello"', 422, 400),
        ("nesting 100000 deep", deep, deep, 422, 400),
        ("garbage bytes", bytes(range(256)), bytes(range(256)), 422, 400),
    ]


def _wrong_types() -> list[Row]:
    """Wrong types."""
    return [
        ("prompt is a number", {"inputs": 5}, {"prompt": 5}, 422, 400),
        ("prompt is null", {"inputs": None}, {"prompt": None}, 422, 400),
        ("prompt is an object", {"inputs": {"a": 1}}, {"prompt": {"a": 1}}, 422, 400),
        ("prompt is a list of two / of lists of text", {"inputs": ["a", "b"]}, {"prompt": [["a"], ["b"]]}, 422,
         400),
        ("max tokens is a word", tgi(max_new_tokens="many"), oa(max_tokens="many"), 422, 400),
        ("max tokens is a float", tgi(max_new_tokens=4.5), oa(max_tokens=4.5), 422, 400),
        ("max tokens is a numeric string", tgi(max_new_tokens="4"), oa(max_tokens="4"), 422, 400),
        ("details is 1", tgi(details=1), oa(echo=1), 422, 400),
        ("temperature is a list", tgi(temperature=[1]), oa(temperature=[1]), 422, 400),
        ("stop is a number", tgi(stop=5), oa(stop=5), 422, 400),
        ("stop is a string (TGI wants a list)", tgi(stop="a"), oa(stop="a"), 422, 200),
        ("stream is a word", {"inputs": "Hello", "stream": "yes"}, oa(stream="yes"), 422, 400),
        ("parameters is a list", {"inputs": "Hello", "parameters": [1]}, oa(stream_options=[1]), 422, 400),
        ("seed is a boolean", tgi(seed=True), oa(seed=True), 422, 400),
    ]


def _huge_numbers() -> list[Row]:
    """Huge numbers."""
    return [
        ("max tokens 10^30", tgi(max_new_tokens=10**30), oa(max_tokens=10**30), 422, 400),
        ("max tokens over the limit", tgi(max_new_tokens=NEW_TOKENS_LIMIT + 1),
         oa(max_tokens=NEW_TOKENS_LIMIT + 1), 422, 400),
        ("seed 2^64", tgi(seed=2**64), oa(seed=2**64), 422, 400),
        ("top_k 10^18", tgi(top_k=10**18, do_sample=True), oa(top_k=10**18), 422, 400),
        ("temperature 1e308", tgi(temperature=1e308), oa(temperature=1e308), 422, 400),
        ("temperature 1e400 (inf)", raw_tgi('"temperature": 1e400'), raw_oa('"temperature": 1e400'), 422, 400),
        ("5000-digit integer", raw_tgi('"seed": ' + "9" * 5000), raw_oa('"seed": ' + "9" * 5000), 422, 400),
        ("truncate 10^12", tgi(truncate=10**12), oa(user="x" * 1000), 422, 200),
    ]


def _non_finite() -> list[Row]:
    """NaN and infinities."""
    return [
        ("temperature NaN", raw_tgi('"temperature": NaN'), raw_oa('"temperature": NaN'), 422, 400),
        ("top_p Infinity", raw_tgi('"top_p": Infinity'), raw_oa('"top_p": Infinity'), 422, 400),
        ("repetition penalty -Infinity", raw_tgi('"repetition_penalty": -Infinity'),
         raw_oa('"repetition_penalty": -Infinity'), 422, 400),
        ("max tokens NaN", raw_tgi('"seed": NaN'), raw_oa('"max_tokens": NaN'), 422, 400),
    ]


def _negative_and_zero() -> list[Row]:
    """Negative and zero values."""
    return [
        ("max tokens 0", tgi(max_new_tokens=0), oa(max_tokens=0), 422, 400),
        ("max tokens -1", tgi(max_new_tokens=-1), oa(max_tokens=-1), 422, 400),
        ("temperature -1", tgi(temperature=-1), oa(temperature=-1), 422, 400),
        ("temperature 0 (greedy)", tgi(temperature=0), oa(temperature=0), 200, 200),
        ("top_p 0", tgi(top_p=0), oa(top_p=0), 422, 400),
        ("top_k 0 (off)", tgi(top_k=0), oa(top_k=0), 200, 200),
        ("top_k -1", tgi(top_k=-1), oa(top_k=-1), 422, 400),
        ("repetition penalty 0", tgi(repetition_penalty=0), oa(repetition_penalty=0), 422, 400),
        ("seed -1", tgi(seed=-1), oa(seed=-1), 422, 400),
        ("truncate 0", tgi(truncate=0), oa(logprobs=-1), 422, 400),
        ("top_n_tokens -1 / logprobs 21", tgi(top_n_tokens=-1), oa(logprobs=21), 422, 400),
    ]


def _prompts() -> list[Row]:
    """Empty and 1 MB prompts."""
    big = _big()
    return [
        ("empty prompt", {"inputs": ""}, {"prompt": ""}, 422, 400),
        ("1 MB prompt (over the context)", {"inputs": big}, {"prompt": big}, 422, 400),
        ("1 MB prompt, truncated to the context", {"inputs": big, "parameters": {"truncate": 32,
                                                                                  "max_new_tokens": 4}},
         {"prompt": [big]}, 200, 400),
        ("1 MB of unknown characters", {"inputs": "é" * (MB // 2)}, {"prompt": "é" * (MB // 2)}, 422, 400),
        ("3 MB body (over the limit)", {"inputs": big * 3}, {"prompt": big * 3}, 413, 413),
    ]


def _encodings() -> list[Row]:
    """Invalid UTF-8, and characters the char model does not know."""
    return [
        ("invalid UTF-8 byte", b'{"inputs": "Hel\xfflo"}', b'{"prompt": "Hel\xfflo"}', 422, 400),
        ("overlong UTF-8 encoding", b'{"inputs": "\xc0\xafetc"}', b'{"prompt": "\xc0\xafetc"}', 422, 400),
        ("UTF-16 body", '{"inputs": "Hello"}'.encode("utf-16"), '{"prompt": "Hello"}'.encode("utf-16"),
         200, 200),
        ("lone surrogate escape", b'{"inputs": "a\\ud800b"}', b'{"prompt": "a\\ud800b"}', 422, 400),
        ("NUL character", {"inputs": "a\x00b"}, {"prompt": "a\x00b"}, 422, 400),
        ("tab character", {"inputs": "a\tb"}, {"prompt": "a\tb"}, 422, 400),
        ("emoji", {"inputs": "hi 😀"}, {"prompt": "hi 😀"}, 422, 400),
        ("CJK", {"inputs": "中文"}, {"prompt": "中文"}, 422, 400),
        ("unknown character in a stop string", tgi(stop=["é"]), oa(stop=["é"]), 200, 200),
    ]


def _stop_strings() -> list[Row]:
    """Empty stop strings."""
    return [
        ("empty stop string", tgi(stop=[""]), oa(stop=""), 422, 400),
        ("empty among stop strings", tgi(stop=["a", ""]), oa(stop=["a", ""]), 422, 400),
        ("17 stop strings", tgi(stop=["a"] * 17), oa(stop=["a"] * 17), 422, 400),
    ]


def _unknown_fields() -> list[Row]:
    """Unknown and unsupported fields."""
    return [
        ("unknown top-level field", {"inputs": "Hello", "foo": 1}, oa(foo=1), 422, 400),
        ("unknown parameter", tgi(foo=1), oa(stream_options={"foo": 1}), 422, 400),
        ("unsupported: typical_p / suffix", tgi(typical_p=0.5), oa(suffix="x"), 422, 400),
        ("unsupported grammar / logit_bias key not an id", tgi(grammar={"type": "json"}), oa(logit_bias={"a": 1}),
         422, 400),
        ("best_of 2 greedy / n 17", tgi(best_of=2), oa(n=17), 422, 400),
        ("unsupported watermark / presence_penalty 3", tgi(watermark=True), oa(presence_penalty=3), 422, 400),
        ("another model", tgi(), oa(model="gpt-4"), 200, 404),
    ]


def bad_input_table() -> list[Row]:
    """(name, TGI body, OpenAI body, expected status for TGI, for OpenAI). Bodies are raw bytes or JSON."""
    return [*_malformed_json(), *_wrong_types(), *_huge_numbers(), *_non_finite(), *_negative_and_zero(),
            *_prompts(), *_encodings(), *_stop_strings(), *_unknown_fields()]


def _post(client: httpx.Client, path: str, streamed: bool, body: Body) -> httpx.Response | None:
    """POST `body` (raw bytes as they are, JSON with ensure_ascii off); None where a stream flag cannot be set."""
    if streamed and path != "/generate_stream":
        if isinstance(body, bytes):
            return None  # raw bytes cannot carry the flag: the same request as the whole route's
        body = {"stream": True, **body}
    content = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    return client.post(path, content=content, headers={"content-type": "application/json"})


def run(base: str) -> dict[str, Any]:
    """The table on every generation route: /generate, /generate_stream, POST / (and with "stream"),
    /v1/completions (whole and streamed). Every response: its expected status, documented, its family's shape."""
    documented = documented_statuses(base)
    problems = Problems()
    statuses: Counter[int] = Counter()
    table = bad_input_table()
    with httpx.Client(base_url=base, timeout=120) as client:
        for name, tgi_body, oa_body, tgi_status, oa_status in table:
            for path, streamed, openai in ROUTES:
                body, want = (oa_body, oa_status) if openai else (tgi_body, tgi_status)
                r = _post(client, path, streamed, body)
                if r is None:
                    continue
                statuses[r.status_code] += 1
                label = f"{name!r} on {path}{' (stream)' if streamed else ''}"
                if r.status_code != want:
                    problems.add(f"{label}: {r.status_code}, expected {want}: {r.text[:200]}")
                for p in check_response(path, streamed and r.status_code == 200, r.status_code,
                                        r.headers.get("content-type", ""), r.content, documented[("POST", path)]):
                    problems.add(f"{label}: {p}")
    return problems.figures(cases=len(table), routes=len(ROUTES), requests=sum(statuses.values()),
                            by_status=dict(sorted(statuses.items())),
                            server_errors=sum(n for s, n in statuses.items() if s >= 500))
