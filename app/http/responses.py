"""JSON the server writes is always strict JSON: a float that is not finite (NaN or an infinity, e.g. the
log-probability of a model whose weights hold NaN) is written as `null`, never as the `NaN` / `Infinity` that
Python's json module writes by default and that strict parsers (JavaScript's JSON.parse, Go, Rust) refuse.

`dumps` is the one encoder: every response body (`StrictJSONResponse`, the app's default) and every server-sent
event (`app.http.sse`) goes through it. Pydantic models dumped with `model_dump_json` already write `null` (pydantic's
default `ser_json_inf_nan`)."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse


def finite(data: Any) -> Any:
    """`data` with every non-finite float inside it (in dicts, lists and tuples) replaced by None."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [finite(v) for v in data]
    return data


def dumps(data: Any) -> str:
    """Compact JSON, non-ASCII characters as they are, non-finite floats as null. The common case (all finite)
    costs one json.dumps; only a body that holds NaN or an infinity is walked and written again."""
    try:
        return json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:  # "Out of range float values are not JSON compliant"
        return json.dumps(finite(data), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def json_number(x: float) -> bytes:
    """`dumps(x)` for one float, encoded: its repr when finite (what json.dumps writes), else null."""
    return repr(x).encode() if math.isfinite(x) else b"null"


class StrictJSONResponse(JSONResponse):
    """Starlette's JSONResponse (which raises on NaN, a 500), writing `dumps`' strict JSON instead."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")
