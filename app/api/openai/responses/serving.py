"""OpenAI Responses' answers: the engine's result as a `response` object (its output item: an assistant message with
one `output_text` part, or a `function_call` when the request's tools asked for a call; `status` completed, or
incomplete with its reason when max_output_tokens cut it), and its events as the Responses stream:
`response.created`, `response.in_progress`, then the item's events, then `response.completed` (or
`response.incomplete`), each with its `sequence_number`. A message's events are `response.output_item.added`,
`response.content_part.added`, a `response.output_text.delta` per token's text, `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`; a call's, once it ends, `response.output_item.added`,
its arguments in one `response.function_call_arguments.delta`, `response.function_call_arguments.done`,
`response.output_item.done` (a call that max_output_tokens cut is an `incomplete` item with its arguments cut short,
as OpenAI's is; one cut before its name is no item). A failure mid-stream is an `error` event then
`response.failed`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from app.api.openai.responses.protocol import ResponsesRequest
from app.api.tools import ToolPlan
from app.http.errors import exception_body
from app.http.requestlog import RequestRecord
from app.http.sse import sse_event
from app.serving.service import GenerationService
from model.engine import EngineError, Finished, GenerationStream

PATH = "/v1/responses"


@dataclass
class ResponseWriter:
    """One response's fixed fields, its tool plan, and the sequence numbers of its stream's events."""

    rid: str
    body: ResponsesRequest
    model: str
    plan: ToolPlan | None
    mid: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0

    def response(self, status: str, output: list[dict[str, Any]] | None = None, fin: Finished | None = None,
                 prompt_tokens: int = 0) -> dict[str, Any]:
        """The response object: `output` its items (`output`), `fin` its end and usage (None while it runs)."""
        generated = fin.generated_tokens if fin is not None else 0
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output or [], "error": None, "incomplete_details": incomplete,
            "instructions": self.body.instructions, "max_output_tokens": self.body.max_output_tokens,
            "temperature": self.body.temperature, "top_p": self.body.top_p, "store": False,
            "text": self.body.text or {"format": {"type": "text"}}, "tools": self.body.tools or [],
            "tool_choice": self.body.tool_choice or "auto",
            "parallel_tool_calls": self.body.parallel_tool_calls is not False, "truncation": "disabled",
            "metadata": self.body.metadata or {}, "previous_response_id": None, "reasoning": None,
            "user": self.body.user,
            "usage": None if fin is None else {
                "input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt_tokens + generated},
        }

    def output(self, text: str, fin: Finished) -> list[dict[str, Any]]:
        """The response's output items: its message; or under a tool plan its call, whole (`completed`) or cut
        short (`incomplete`, its arguments cut, as OpenAI answers a call that max_output_tokens cut), none if cut
        before the function's name."""
        if self.plan is None:
            return [self.item(text, status_of(fin))]
        call = self.plan.call(text, fin)
        if call is None:
            return []
        return [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": f"call_{uuid.uuid4().hex[:24]}",
                 "name": call.name, "arguments": call.arguments, "status": "completed" if call.whole else "incomplete"}]

    def item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.mid, "status": status, "role": "assistant",
                "content": [part(text)]}

    def event(self, kind: str, **data: Any) -> bytes:
        out = sse_event(kind, {"type": kind, "sequence_number": self.sequence, **data})
        self.sequence += 1
        return out

    @property
    def text_ids(self) -> dict[str, Any]:
        """Where the message's text events point: its item, its one part."""
        return {"item_id": self.mid, "output_index": 0, "content_index": 0}

    def message_start(self) -> bytes:
        return (self.event("response.output_item.added", output_index=0, item={**self.item("", "in_progress"),
                                                                               "content": []})
                + self.event("response.content_part.added", **self.text_ids, part=part("")))

    def text_delta(self, delta: str) -> bytes:
        return self.event("response.output_text.delta", **self.text_ids, delta=delta, logprobs=[])

    def item_done(self, item: dict[str, Any]) -> bytes:
        """The events that end the output item (a message's, whose start was sent; a call's, all of them)."""
        if item["type"] == "function_call":
            ids = {"item_id": item["id"], "output_index": 0}
            return (self.event("response.output_item.added", output_index=0,
                               item={**item, "arguments": "", "status": "in_progress"})
                    + self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
                    + self.event("response.function_call_arguments.done", **ids, arguments=item["arguments"])
                    + self.event("response.output_item.done", output_index=0, item=item))
        text = item["content"][0]["text"]
        return (self.event("response.output_text.done", **self.text_ids, text=text, logprobs=[])
                + self.event("response.content_part.done", **self.text_ids, part=part(text))
                + self.event("response.output_item.done", output_index=0, item=item))


def part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def status_of(fin: Finished) -> str:
    """completed, unless max_output_tokens ended it (incomplete)."""
    return "incomplete" if fin.finish_reason == "length" else "completed"


async def stream_events(service: GenerationService, stream: GenerationStream, writer: ResponseWriter,
                        record: RequestRecord | None) -> AsyncIterator[bytes]:
    yield (writer.event("response.created", response=writer.response("in_progress"))
           + writer.event("response.in_progress", response=writer.response("in_progress"))
           + (writer.message_start() if writer.plan is None else b""))  # text as it comes; a call once it ends
    text = ""
    try:
        async for batch in service.text_batches(stream, record):
            out = []
            for delta, fin in batch:
                text += delta
                if delta and writer.plan is None:
                    out.append(writer.text_delta(delta))
                if fin is not None:
                    items = writer.output(text, fin)
                    status = status_of(fin)
                    out.append(b"".join(writer.item_done(item) for item in items)
                               + writer.event(f"response.{status}",
                                              response=writer.response(status, items, fin, stream.prompt_tokens)))
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
