"""What came back for one `Spec`: `Outcome` (status, text, token count, finish reason, error) read off the
response and checked: its shape, and for a finished generation the token count (exactly max_new_tokens when it
ends by length; at most that and no stop string in the text when a stop string ended it) and that text and count
agree (a character model: one character per token)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx

from app.testing import parse_sse
from bench.reliability.shapes import check_response
from bench.reliability.spec import Spec


@dataclasses.dataclass
class Outcome:
    status: int
    text: str = ""  # the generated text (prompt echo removed)
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None  # a non-200 body's message, or a stream's final error event
    problems: list[str] = dataclasses.field(default_factory=list)


def _read_openai_stream(spec: Spec, events: list[Any], out: Outcome, echo: Any) -> bool:
    """Fill `out` from OpenAI's chunks; False when the stream ended in an error chunk."""
    chunks = [e for e in events[:-1] if "choices" in e]
    errors = [e for e in events[:-1] if "error" in e]
    out.text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    out.finish_reason = next((c["choices"][0]["finish_reason"] for c in chunks
                              if c["choices"] and c["choices"][0]["finish_reason"]), None)
    usage = [c["usage"] for c in chunks if c.get("usage")]
    out.tokens = usage[0]["completion_tokens"] if usage else len(out.text) - (len(spec.prompt) if echo else 0)
    if errors:
        out.error = errors[0]["error"]["message"]
        return False
    return True


def _read_tgi_stream(spec: Spec, events: list[Any], out: Outcome, echo: Any) -> bool:
    """Fill `out` from TGI's token events; False when the stream ended in an error event."""
    *tokens, last = events
    if "error" in last:
        out.error, out.tokens = last["error"], len(tokens)
        return False
    tokens.append(last)
    out.tokens, out.finish_reason = len(tokens), last["details"]["finish_reason"]
    out.text = last["generated_text"]
    if last["details"]["generated_tokens"] != len(tokens):
        out.problems.append(f"{spec.route}: details say {last['details']['generated_tokens']} tokens, "
                            f"{len(tokens)} events came")
    if "".join(t["token"]["text"] for t in tokens) != out.text[len(spec.prompt) if echo else 0 :]:
        out.problems.append(f"{spec.route}: the token texts do not add up to generated_text")
    return True


def _read_whole(spec: Spec, obj: Any, out: Outcome, echo: Any) -> None:
    if spec.openai:
        choice = obj["choices"][0]
        out.text, out.finish_reason = choice["text"], choice["finish_reason"]
        out.tokens = obj["usage"]["completion_tokens"]
        return
    result = obj[0] if spec.route == "root" else obj
    out.text = result["generated_text"]
    details = result.get("details")
    if details:
        out.tokens, out.finish_reason = details["generated_tokens"], details["finish_reason"]
    else:
        out.tokens, out.finish_reason = len(out.text) - (len(spec.prompt) if echo else 0), "length"


def _check_tokens(spec: Spec, out: Outcome, echo: Any) -> None:
    """Strip the echoed prompt, then check the token count and the text against how the generation ended."""
    if echo:
        if not out.text.startswith(spec.prompt):
            out.problems.append(f"{spec.route}: echo/return_full_text does not start with the prompt")
        out.text = out.text[len(spec.prompt):]
    n = spec.max_new_tokens
    if out.finish_reason == "length":
        if out.tokens != n or len(out.text) != n:
            out.problems.append(f"{spec.route}: finished by length with {out.tokens} tokens, {len(out.text)} "
                                f"characters; max_new_tokens was {n}")
    elif out.finish_reason in ("stop", "stop_sequence"):
        if not spec.stop or out.tokens > n or any(s in out.text for s in spec.stop):
            out.problems.append(f"{spec.route}: stopped with {out.tokens} tokens, text {out.text!r}, stop "
                                f"{spec.stop}, max_new_tokens {n}")
    else:
        out.problems.append(f"{spec.route}: unexpected finish_reason {out.finish_reason!r}")


def read_outcome(spec: Spec, status: int, content_type: str, body: bytes) -> Outcome:
    """Parse a response to `spec` and check it (see the module docstring)."""
    path, _ = spec.request()
    out = Outcome(status, problems=check_response(path, spec.streamed, status, content_type, body))
    if out.problems:
        return out
    if status != 200:
        obj = json.loads(body)
        out.error = obj["error"]["message"] if spec.openai else obj["error"]
        return out
    echo = spec.params.get("return_full_text") or spec.params.get("echo")
    if spec.streamed:
        read = _read_openai_stream if spec.openai else _read_tgi_stream
        if not read(spec, parse_sse(body.decode()), out, echo):
            return out
    else:
        _read_whole(spec, json.loads(body), out, echo)
    _check_tokens(spec, out, echo)
    return out


async def send(client: httpx.AsyncClient, spec: Spec) -> Outcome:
    """POST `spec` (reading a stream to its end) and read the outcome."""
    path, body = spec.request()
    if spec.streamed:
        async with client.stream("POST", path, json=body) as r:
            raw = await r.aread()
    else:
        r = await client.post(path, json=body)
        raw = r.content
    return read_outcome(spec, r.status_code, r.headers.get("content-type", ""), raw)
