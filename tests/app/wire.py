"""What the app tests read off the wire: server-sent events, Prometheus text, the two error body shapes."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def _not_json(constant: str) -> Any:
    raise AssertionError(f"{constant} is not JSON (JSON has no NaN or infinities)")


def strict_json(text: str | bytes) -> Any:
    """`json.loads`, refusing the NaN / Infinity / -Infinity that Python's json module reads and writes but strict
    parsers (JavaScript's JSON.parse, Go, Rust) refuse."""
    return json.loads(text, parse_constant=_not_json)


def parse_sse(body: str) -> list[Any]:
    """Events of an SSE body, checking the framing: every event is exactly `data: <payload>\\n\\n`.

    JSON payloads come back parsed (strict JSON); OpenAI's terminator comes back as the string "[DONE]"."""
    assert body.endswith("\n\n"), f"SSE body does not end an event: {body[-80:]!r}"
    events = []
    for chunk in body[:-2].split("\n\n"):
        assert chunk.startswith("data: ") and "\n" not in chunk, f"not one 'data: ' line: {chunk!r}"
        payload = chunk.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else strict_json(payload))
    return events


def metric(metrics_text: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus exposition (sample name as exposed, e.g. `..._total`)."""
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name}{labels or ''} in /metrics")


def assert_tgi_error(response: Any, status: int, error_type: str, *needles: str) -> str:
    """TGI's error body `{"error": message, "error_type": kind}`, with every needle in the message."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error", "error_type"}, body
    assert body["error_type"] == error_type, body
    for needle in needles:
        assert needle in body["error"], (needle, body["error"])
    return body["error"]


def assert_openai_error(response: Any, status: int, error_type: str, param: str | None, *needles: str) -> str:
    """OpenAI's error body `{"error": {"message", "type", "param", "code"}}`."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert (err["type"], err["param"], err["code"]) == (error_type, param, status), err
    for needle in needles:
        assert needle in err["message"], (needle, err["message"])
    return err["message"]
