"""What a response must look like: the body shape of its API family (TGI `{"error", "error_type"}`, OpenAI
`{"error": {"message", "type", "param", "code"}}`, Anthropic `{"type": "error", "error": {"type", "message"}}`),
each route's success shape, SSE framing (named events for Anthropic's and the Responses API's streams) and the
final event of a stream. `check_response` lists what is wrong with one response; every section that reads
responses uses it."""

from __future__ import annotations

import json
from typing import Any

from app.api.anthropic.protocol import AnthropicError
from app.api.openai.protocol import OpenAIError
from app.api.protocol import ErrorBody
from app.api.tgi.protocol import GenerateResponse, StreamResponse
from app.api.tokenizer.router import DetokenizeResponse, SimpleToken, TokenizeResponse
from app.http.errors import ANTHROPIC_PATHS, OPENAI_CODES, error_kind, family_status
from app.testing import parse_sse, parse_sse_events

NAMED_EVENTS = ("/v1/messages", "/v1/responses")  # streams of `event:` + `data:` events


def _fits(model: Any, obj: Any) -> bool:
    """`obj` validates against the pydantic model and holds no field it does not declare."""
    try:
        model.model_validate(obj)
    except Exception:
        return False
    return isinstance(obj, dict) and set(obj) <= set(model.model_fields)


def _codes_by_status() -> dict[int, set[str | None]]:
    """Status -> the `code`s an OpenAI error body may carry with it: OpenAI's string for the errors that have one
    (app/http/errors.py's OPENAI_CODES), null for every error."""
    out: dict[int, set[str | None]] = {}
    for cls, code in OPENAI_CODES.items():
        kind = error_kind(cls)
        assert kind is not None, cls  # every coded error is in the error table
        out.setdefault(family_status("/v1/", kind[0]), {None}).add(code)
    return out


OPENAI_CODES_BY_STATUS = _codes_by_status()


def _openai_error(obj: Any, status: int | None = None) -> bool:
    return (_fits(OpenAIError, obj) and set(obj["error"]) == {"message", "type", "param", "code"}
            and obj["error"]["code"] in (OPENAI_CODES_BY_STATUS.get(status, {None}) if status is not None
                                         else {None, *OPENAI_CODES.values()}))


def _anthropic_error(obj: Any) -> bool:
    return _fits(AnthropicError, obj) and set(obj["error"]) == {"type", "message"}


def _openai_completion(obj: Any, chunk: bool) -> bool:
    """A completion or chat completion (or one of their stream's chunks) with its choices."""
    kinds = {"text_completion", "chat.completion.chunk" if chunk else "chat.completion"}
    if not isinstance(obj, dict) or obj.get("object") not in kinds:
        return False
    if not {"id", "created", "model", "choices"} <= set(obj):
        return False
    choices = obj["choices"]
    if chunk and choices == [] and isinstance(obj.get("usage"), dict):  # the include_usage chunk
        return True
    if not (isinstance(choices, list) and choices and all(isinstance(c, dict) for c in choices)):
        return False
    if obj["object"] == "text_completion":
        said = [c.get("text") for c in choices]
    else:
        said = [(c.get("delta") if chunk else c.get("message")) for c in choices]
        said = [m.get("content", "") if isinstance(m, dict) and "tool_calls" not in m else "" for m in said]
    return (all(isinstance(t, str | None) for t in said)
            and all(c.get("finish_reason") in (None, "length", "stop", "tool_calls") for c in choices))


def _anthropic_answer(obj: Any) -> bool:
    if isinstance(obj, dict) and set(obj) == {"input_tokens"}:  # count_tokens
        return isinstance(obj["input_tokens"], int)
    return (isinstance(obj, dict) and obj.get("type") == "message" and obj.get("role") == "assistant"
            and isinstance(obj.get("content"), list) and isinstance(obj.get("usage"), dict)
            and obj.get("stop_reason") in ("end_turn", "max_tokens", "stop_sequence"))


def _response_object(obj: Any) -> bool:
    return (isinstance(obj, dict) and obj.get("object") == "response" and isinstance(obj.get("output"), list)
            and obj.get("status") in ("completed", "incomplete", "in_progress", "failed"))


def check_response(path: str, streamed: bool, status: int, content_type: str, body: bytes,
                   documented: set[int] | None = None) -> list[str]:
    """Problems with one response: 5xx, a status outside `documented`, or a body that is not its API family's
    shape (TGI `{"error", "error_type"}`, OpenAI `{"error": {"message", "type", "param", "code"}}`, the
    success shapes of each route, SSE framing and the final event of a stream)."""
    where = f"{path} -> {status}"
    problems = []
    if status >= 500:
        problems.append(f"{where}: server error {body[:200]!r}")
    if documented is not None and status not in documented:
        problems.append(f"{where}: status not documented ({sorted(documented)})")
    anthropic = path.startswith(ANTHROPIC_PATHS)
    openai = path.startswith("/v1/") and not anthropic
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return [*problems, f"{where}: body is not UTF-8"]
    if path == "/metrics" and status == 200:
        ok = content_type.startswith("text/plain") and "folio_requests_total" in text
        return problems if ok else [*problems, f"{where}: not a Prometheus exposition ({content_type})"]
    if status != 200:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return [*problems, f"{where}: error body is not JSON: {text[:200]!r}"]
        ok = _anthropic_error(obj) if anthropic else _openai_error(obj, status) if openai else _fits(ErrorBody, obj)
        return problems if ok else [*problems, f"{where}: error body of the wrong shape: {text[:300]}"]
    if streamed:
        if not content_type.startswith("text/event-stream"):
            return [*problems, f"{where}: stream answered as {content_type}"]
        try:
            if path.startswith(NAMED_EVENTS):
                return problems + [f"{where}: {p}" for p in _named_stream_problems(parse_sse_events(text))]
            events = parse_sse(text)
        except (AssertionError, json.JSONDecodeError) as e:
            return [*problems, f"{where}: bad SSE framing: {e}"]
        return problems + [f"{where}: {p}" for p in _stream_problems(events, openai)]
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return [*problems, f"{where}: body is not JSON: {text[:200]!r}"]
    ok = _answer_fits(path, obj, openai)
    return problems if ok else [*problems, f"{where}: body of the wrong shape: {text[:300]}"]


def _answer_fits(path: str, obj: Any, openai: bool) -> bool:
    """Whether a 200's JSON body has its route's shape."""
    if path.startswith(ANTHROPIC_PATHS):
        return _anthropic_answer(obj)
    if path == "/v1/responses":
        return _response_object(obj)
    if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        return isinstance(obj, dict) and isinstance(obj.get("lora_name"), str)
    if openai:
        return path == "/v1/models" or _openai_completion(obj, chunk=False)
    elif path == "/generate":
        return _fits(GenerateResponse, obj)
    elif path == "/":
        return isinstance(obj, list) and len(obj) == 1 and _fits(GenerateResponse, obj[0])
    elif path == "/tokenize":  # TGI's list of tokens, or vLLM's {count, max_model_len, tokens}
        return (isinstance(obj, list) and all(_fits(SimpleToken, t) for t in obj)) or _fits(TokenizeResponse, obj)
    elif path == "/detokenize":
        return _fits(DetokenizeResponse, obj)
    return True


def _stream_problems(events: list[Any], openai: bool) -> list[str]:
    """A stream must end in a final event: TGI's last token (generated_text set) or error event; OpenAI's
    [DONE], after a finish_reason or an error chunk."""
    if not events:
        return ["empty stream"]
    if openai:
        if events[-1] != "[DONE]":
            return [f"stream does not end in [DONE]: {events[-1]!r}"]
        body = events[:-1]
        bad = [e for e in body if not (_openai_completion(e, chunk=True) or _openai_error(e))]
        if bad:
            return [f"chunk of the wrong shape: {bad[0]!r}"]
        last = body[-1] if body else None
        finished = any(c["choices"] and c["choices"][0]["finish_reason"] for c in body if "choices" in c)
        if not (finished or (last is not None and "error" in last)):
            return ["stream ends without a finish_reason or an error"]
        return []
    *tokens, last = events
    bad = [e for e in tokens if not _fits(StreamResponse, e) or e.get("generated_text") is not None]
    if bad:
        return [f"token event of the wrong shape: {bad[0]!r}"]
    if _fits(ErrorBody, last):
        return []
    if not (_fits(StreamResponse, last) and last.get("generated_text") is not None and last.get("details")):
        return [f"stream ends without a final event: {last!r}"]
    return []


def _named_stream_problems(events: list[tuple[str, Any]]) -> list[str]:
    """Anthropic's and the Responses API's streams: each event's data names its own type, and the stream ends in
    its final event (message_stop; response.completed or response.incomplete) or an error."""
    if not events:
        return ["empty stream"]
    bad = [(name, data) for name, data in events if not isinstance(data, dict) or data.get("type") != name]
    if bad:
        return [f"event whose data is not of its type: {bad[0]!r}"]
    last = events[-1][0]
    if last not in ("message_stop", "response.completed", "response.incomplete", "response.failed", "error"):
        return [f"stream ends without a final event: {events[-1]!r}"]
    return []
