"""Anthropic Messages' answers: the engine's result as a `message` (a text block, or a `tool_use` block when the
request's tools asked for a call and it is whole; `stop_reason`, usage), and its events as Anthropic's stream:
`message_start`, `content_block_start`, `ping`, a `content_block_delta` per token's text, `content_block_stop`,
`message_delta` (the stop reason and the output tokens), `message_stop`; a failure mid-stream is an `error` event in
Anthropic's error shape. A tool call streams once it is whole: its block's start, its input as one
`input_json_delta`, its stop (a call cut short by max_tokens comes as text instead, as in the whole message)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from app.api.anthropic.protocol import STOP_REASONS
from app.api.tools import ToolPlan
from app.http.errors import exception_body
from app.http.requestlog import RequestRecord
from app.http.sse import sse_event
from app.serving.service import GenerationService
from model.engine import EngineError, Finished, GenerationStream, Result

PATH = "/v1/messages"
TOOL_USE = "tool_use"


def stop_of(fin: Finished, call: ToolPlan | None) -> dict[str, Any]:
    if call is not None and call.whole(fin):
        return {"stop_reason": TOOL_USE, "stop_sequence": None}
    return {"stop_reason": STOP_REASONS.get(fin.finish_reason, "max_tokens"), "stop_sequence": fin.stop_sequence}


def block(text: str, fin: Finished, call: ToolPlan | None) -> dict[str, Any]:
    """The answer's content block: its text, or its tool call."""
    if call is None or not call.whole(fin):
        return {"type": "text", "text": text}
    name, arguments = call.call(text)
    return {"type": TOOL_USE, "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": name, "input": json.loads(arguments)}


def message(service: GenerationService, mid: str, result: Result, call: ToolPlan | None) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": service.model_id,
            "content": [block(result.text, result.finished, call)], **stop_of(result.finished, call),
            "usage": {"input_tokens": result.finished.prompt_tokens,
                      "output_tokens": result.finished.generated_tokens}}


def block_events(content: dict[str, Any]) -> bytes:
    """A whole content block as its start, its content in one delta (none for empty text) and its stop."""
    if content["type"] == TOOL_USE:
        start = {**content, "input": {}}
        delta: dict[str, Any] | None = {"type": "input_json_delta", "partial_json": json.dumps(content["input"])}
    else:
        start = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": content["text"]} if content["text"] else None
    out = sse_event("content_block_start", {"type": "content_block_start", "index": 0, "content_block": start})
    if delta is not None:
        out += sse_event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
    return out + sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})


async def stream_events(service: GenerationService, stream: GenerationStream, mid: str, call: ToolPlan | None,
                        record: RequestRecord | None) -> AsyncIterator[bytes]:
    start = {"id": mid, "type": "message", "role": "assistant", "model": service.model_id, "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": stream.prompt_tokens, "output_tokens": 0}}
    text = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text_start = sse_event("content_block_start", text) if call is None else b""  # a call's once it is whole
    yield (sse_event("message_start", {"type": "message_start", "message": start}) + text_start
           + sse_event("ping", {"type": "ping"}))
    held = ""  # a tool call's text until it is whole
    try:
        async for batch in service.text_batches(stream, record):
            out = []
            for text, fin in batch:
                if call is not None:
                    held += text
                elif text:
                    out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                                 "delta": {"type": "text_delta", "text": text}}))
                if fin is not None:
                    out.append((block_events(block(held, fin, call)) if call is not None
                                else sse_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
                               + sse_event("message_delta", {"type": "message_delta", "delta": stop_of(fin, call),
                                                             "usage": {"output_tokens": fin.generated_tokens}})
                               + sse_event("message_stop", {"type": "message_stop"}))
            if out:
                yield b"".join(out)
    except EngineError as e:
        yield sse_event("error", exception_body(PATH, e)[1])
    finally:
        stream.cancel()
