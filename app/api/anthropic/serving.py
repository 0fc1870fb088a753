"""Anthropic Messages' answers: the engine's result as a `message` (one text block, `stop_reason`, usage), and
its events as Anthropic's stream: `message_start`, `content_block_start`, `ping`, a `content_block_delta` per
token's text, `content_block_stop`, `message_delta` (the stop reason and the output tokens), `message_stop`; a
failure mid-stream is an `error` event in Anthropic's error shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from app.api.anthropic.protocol import STOP_REASONS
from app.http.errors import exception_body
from app.http.requestlog import RequestRecord
from app.http.sse import sse_event
from app.serving.service import GenerationService
from model.engine import EngineError, Finished, GenerationStream, Result

PATH = "/v1/messages"


def stop_of(fin: Finished) -> dict[str, Any]:
    return {"stop_reason": STOP_REASONS.get(fin.finish_reason, "max_tokens"), "stop_sequence": fin.stop_sequence}


def message(service: GenerationService, mid: str, result: Result) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": service.model_id,
            "content": [{"type": "text", "text": result.text}], **stop_of(result.finished),
            "usage": {"input_tokens": result.finished.prompt_tokens,
                      "output_tokens": result.finished.generated_tokens}}


async def stream_events(service: GenerationService, stream: GenerationStream, mid: str,
                        record: RequestRecord | None) -> AsyncIterator[bytes]:
    start = {"id": mid, "type": "message", "role": "assistant", "model": service.model_id, "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": stream.prompt_tokens, "output_tokens": 0}}
    yield (sse_event("message_start", {"type": "message_start", "message": start})
           + sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}})
           + sse_event("ping", {"type": "ping"}))
    try:
        async for batch in service.text_batches(stream, record):
            out = []
            for text, fin in batch:
                if text:
                    out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                                 "delta": {"type": "text_delta", "text": text}}))
                if fin is not None:
                    out.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
                               + sse_event("message_delta", {"type": "message_delta", "delta": stop_of(fin),
                                                             "usage": {"output_tokens": fin.generated_tokens}})
                               + sse_event("message_stop", {"type": "message_stop"}))
            if out:
                yield b"".join(out)
    except EngineError as e:
        yield sse_event("error", exception_body(PATH, e)[1])
    finally:
        stream.cancel()
