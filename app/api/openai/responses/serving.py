"""OpenAI Responses' answers: the engine's result as a `response` object (one assistant message with one
`output_text` part; `status` completed, or incomplete with its reason when max_output_tokens cut it), and its
events as the Responses stream: `response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, a `response.output_text.delta` per token's text, `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`, `response.completed` (or `response.incomplete`), each
with its `sequence_number`; a failure mid-stream is an `error` event then `response.failed`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from app.api.openai.responses.protocol import ResponsesRequest
from app.http.errors import exception_body
from app.http.requestlog import RequestRecord
from app.http.sse import sse_event
from app.serving.service import GenerationService
from model.engine import EngineError, Finished, GenerationStream

PATH = "/v1/responses"


@dataclass
class ResponseWriter:
    """One response's fixed fields, and the sequence numbers of its stream's events."""

    rid: str
    mid: str
    body: ResponsesRequest
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0

    def response(self, status: str, text: str | None = None, fin: Finished | None = None,
                 prompt_tokens: int = 0) -> dict[str, Any]:
        output = [] if text is None else [self.item(text, "completed" if status == "completed" else "incomplete")]
        generated = fin.generated_tokens if fin is not None else 0
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "error": None, "incomplete_details": incomplete,
            "instructions": self.body.instructions, "max_output_tokens": self.body.max_output_tokens,
            "temperature": self.body.temperature, "top_p": self.body.top_p, "store": False,
            "text": self.body.text or {"format": {"type": "text"}}, "tools": [], "tool_choice": "auto",
            "parallel_tool_calls": False, "truncation": "disabled", "metadata": self.body.metadata or {},
            "previous_response_id": None, "reasoning": None, "user": self.body.user,
            "usage": None if fin is None else {
                "input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt_tokens + generated},
        }

    def item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.mid, "status": status, "role": "assistant",
                "content": [part(text)]}

    def event(self, kind: str, **data: Any) -> bytes:
        out = sse_event(kind, {"type": kind, "sequence_number": self.sequence, **data})
        self.sequence += 1
        return out


def part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def status_of(fin: Finished) -> str:
    """completed, unless max_output_tokens ended it (incomplete)."""
    return "incomplete" if fin.finish_reason == "length" else "completed"


async def stream_events(service: GenerationService, stream: GenerationStream, writer: ResponseWriter,
                        record: RequestRecord | None) -> AsyncIterator[bytes]:
    ids = {"item_id": writer.mid, "output_index": 0, "content_index": 0}
    yield (writer.event("response.created", response=writer.response("in_progress"))
           + writer.event("response.in_progress", response=writer.response("in_progress"))
           + writer.event("response.output_item.added", output_index=0, item={**writer.item("", "in_progress"),
                                                                             "content": []})
           + writer.event("response.content_part.added", **ids, part=part("")))
    text = ""
    try:
        async for batch in service.text_batches(stream, record):
            out = []
            for delta, fin in batch:
                if delta:
                    text += delta
                    out.append(writer.event("response.output_text.delta", **ids, delta=delta, logprobs=[]))
                if fin is not None:
                    status = status_of(fin)
                    out.append(writer.event("response.output_text.done", **ids, text=text, logprobs=[])
                               + writer.event("response.content_part.done", **ids, part=part(text))
                               + writer.event("response.output_item.done", output_index=0,
                                              item=writer.item(text, status))
                               + writer.event(f"response.{status}",
                                              response=writer.response(status, text, fin, stream.prompt_tokens)))
            if out:
                yield b"".join(out)
    except EngineError as e:
        status, body = exception_body(PATH, e)
        yield (writer.event("error", code=str(status), message=body["error"]["message"], param=None)
               + writer.event("response.failed", response={**writer.response("failed"),
                                                            "error": {"code": "server_error",
                                                                      "message": body["error"]["message"]}}))
    finally:
        stream.cancel()
