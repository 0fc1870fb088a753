"""Server-sent events framing: `data: <json>\\n\\n`, the shape TGI and OpenAI clients read. The JSON is strict
(`app.http.responses.dumps`: non-finite numbers are null)."""

from __future__ import annotations

from typing import Any

from app.http.responses import dumps

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any) -> bytes:
    payload = data if isinstance(data, str) else dumps(data)
    return f"data: {payload}\n\n".encode()
def sse_event(event: str, data: dict[str, Any]) -> bytes:
    """A named event (`event: <name>` before its data), as Anthropic's streams are written."""
    return f"event: {event}\ndata: {dumps(data)}\n\n".encode()


SSE_DOC = {"description": "server-sent events, `data: <json>` per token", "content": {"text/event-stream": {}}}
SSE_OR_JSON_DOC = {"description": "the result as JSON; with `\"stream\": true`, server-sent events instead",
                   "content": {"text/event-stream": {}}}
