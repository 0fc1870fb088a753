"""Anthropic Messages' answers: the engine's result as a `message` (a text block, or a `tool_use` block when the
request's tools asked for a call; `stop_reason`, usage), and its events as Anthropic's stream: `message_start`,
`content_block_start`, `ping`, a `content_block_delta` per token's text, `content_block_stop`, `message_delta` (the
stop reason and the output tokens), `message_stop`; a failure mid-stream is an `error` event in Anthropic's error
shape. A tool call streams once it ends: its block's start, its input's JSON text as one `input_json_delta`, its
stop (a call that max_tokens cut has its input cut short, as Anthropic's has; one cut before its name has no block)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from app.api.anthropic.protocol import STOP_REASONS
from app.api.tools import Call, ToolPlan
from app.http.errors import exception_body
from app.http.requestlog import RequestRecord
from app.http.sse import sse_event
from app.serving.service import GenerationService
from model.engine import EngineError, Finished, GenerationStream, Result

PATH = "/v1/messages"
TOOL_USE = "tool_use"


def stop_of(fin: Finished, call: Call | None) -> dict[str, Any]:
    if call is not None and call.whole:
        return {"stop_reason": TOOL_USE, "stop_sequence": None}
    return {"stop_reason": STOP_REASONS.get(fin.finish_reason, "max_tokens"), "stop_sequence": fin.stop_sequence}


def answer(text: str, fin: Finished, plan: ToolPlan | None) -> tuple[list[dict[str, Any]], Call | None]:
    """The answer's content blocks and its tool call: its text; or under a tool plan its call, whole or cut short
    (its input as much as is whole, as Anthropic answers a call that max_tokens cut), none if cut before its name."""
    if plan is None:
        return [{"type": "text", "text": text}], None
    call = plan.call(text, fin)
    if call is None:
        return [], None
    return [{"type": TOOL_USE, "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name, "input": call.input()}], \
        call


def message(service: GenerationService, mid: str, result: Result, plan: ToolPlan | None) -> dict[str, Any]:
    content, call = answer(result.text, result.finished, plan)
    return {"id": mid, "type": "message", "role": "assistant", "model": service.model_id, "content": content,
            **stop_of(result.finished, call),
            "usage": {"input_tokens": result.finished.prompt_tokens,
                      "output_tokens": result.finished.generated_tokens}}


def call_events(block: dict[str, Any], call: Call) -> bytes:
    """A tool_use block as its start, its input's JSON text in one `input_json_delta`, and its stop."""
    return (sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": {**block, "input": {}}})
            + sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
            + sse_event("content_block_stop", {"type": "content_block_stop", "index": 0}))


async def stream_events(service: GenerationService, stream: GenerationStream, mid: str, plan: ToolPlan | None,
                        record: RequestRecord | None) -> AsyncIterator[bytes]:
    start = {"id": mid, "type": "message", "role": "assistant", "model": service.model_id, "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": stream.prompt_tokens, "output_tokens": 0}}
    text = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text_start = sse_event("content_block_start", text) if plan is None else b""  # a call's once it ends
    yield (sse_event("message_start", {"type": "message_start", "message": start}) + text_start
           + sse_event("ping", {"type": "ping"}))
    held = ""  # a tool call's text until it ends
    try:
        async for batch in service.text_batches(stream, record):
            out = []
            for text, fin in batch:
                if plan is not None:
                    held += text
                elif text:
                    out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                                 "delta": {"type": "text_delta", "text": text}}))
                if fin is not None:
                    if plan is None:
                        end, call = sse_event("content_block_stop", {"type": "content_block_stop", "index": 0}), None
                    else:
                        content, call = answer(held, fin, plan)
                        end = call_events(content[0], call) if call is not None else b""
                    out.append(end + sse_event("message_delta", {"type": "message_delta", "delta": stop_of(fin, call),
                                                                 "usage": {"output_tokens": fin.generated_tokens}})
                               + sse_event("message_stop", {"type": "message_stop"}))
            if out:
                yield b"".join(out)
    except EngineError as e:
        yield sse_event("error", exception_body(PATH, e)[1])
    finally:
        stream.cancel()
