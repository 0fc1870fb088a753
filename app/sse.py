"""Server-sent events framing: `data: <json>\\n\\n`, the shape TGI and OpenAI clients read."""

from __future__ import annotations

import json
import math
from typing import Any

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_number(x: float) -> bytes:
    """`json.dumps(x)` for a float, encoded: its repr when finite (what json.dumps writes), else json's
    Infinity/NaN spelling."""
    return (repr(x) if math.isfinite(x) else json.dumps(x)).encode()


def sse(data: Any) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
SSE_DOC = {"description": "server-sent events, `data: <json>` per token", "content": {"text/event-stream": {}}}
SSE_OR_JSON_DOC = {"description": "the result as JSON; with `\"stream\": true`, server-sent events instead",
                   "content": {"text/event-stream": {}}}
