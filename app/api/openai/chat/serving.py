"""OpenAI chat completions' answers: the conversation rendered by the model's chat template, and the engine's
results and events written as a `chat.completion` and its stream of `chat.completion.chunk`s (a first chunk with
the assistant's role, then the content as it comes, each choice's `finish_reason`, the usage if asked, `[DONE]`),
with `logprobs.content` in OpenAI's shape (token, logprob, bytes, top_logprobs)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from app.api.openai.chat.protocol import ChatCompletionRequest
from app.api.openai.protocol import finish_reason, usage
from app.api.tools import Call, ToolPlan
from app.http.errors import exception_body
from app.http.requestlog import RequestRecord
from app.http.sse import sse
from app.serving.service import GenerationService, cancel_all
from model.engine import Finished, GenerationStream, Result, TokenEvent


def token_logprobs(service: GenerationService, ev: TokenEvent, top: bool) -> dict[str, Any]:
    """One entry of `logprobs.content`: the token, its log-probability and UTF-8 bytes, and its alternatives."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        raw = service.tokenizer.decode_bytes([token_id])
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    out = entry(ev.id, ev.logprob)
    out["top_logprobs"] = [entry(a.id, a.logprob) for a in ev.top_tokens] if top else []
    return out


def tool_call(call: Call) -> dict[str, Any]:
    """OpenAI's tool call (its arguments cut short if the call was)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def tool_end(text: str, fin: Finished, tools: ToolPlan) -> tuple[dict[str, Any] | None, str]:
    """The tool call of an output under `tools` (None if it ended before the function's name) and the choice's
    finish_reason: `tool_calls` for a whole call, else why it was cut short."""
    call = tools.call(text, fin)
    finish = "tool_calls" if call is not None and call.whole else finish_reason(fin)
    return (tool_call(call) if call is not None else None), finish


def message(result: Result, tools: ToolPlan | None) -> tuple[dict[str, Any], str]:
    """A choice's message and finish_reason: its text, or its tool call."""
    if tools is None:
        return {"role": "assistant", "content": result.text}, finish_reason(result.finished)
    call, finish = tool_end(result.text, result.finished, tools)
    return {"role": "assistant", "content": None, **({"tool_calls": [call]} if call else {})}, finish


async def complete(request: Any, service: GenerationService, body: ChatCompletionRequest, tools: ToolPlan | None,
                   streams: list[GenerationStream], cid: str, created: int) -> dict[str, Any]:
    results = await service.results(request, streams)
    choices = []
    for i, result in enumerate(results):
        lp = {"content": [token_logprobs(service, t, body.top_logprobs is not None) for t in result.tokens]} \
            if body.logprobs else None
        said, finish = message(result, tools)
        choices.append({"index": i, "message": said, "logprobs": lp, "finish_reason": finish})
    prompt_tokens = results[0].finished.prompt_tokens
    return {"id": cid, "object": "chat.completion", "created": created, "model": service.model_id,
            "system_fingerprint": service.fingerprint, "choices": choices,
            "usage": usage(prompt_tokens, sum(r.finished.generated_tokens for r in results))}


@dataclass
class ChatChunks:
    """The server-sent chunks of one streamed chat completion."""

    cid: str
    created: int
    model: str
    fingerprint: str
    include_usage: bool

    def chunk(self, index: int, delta: dict[str, Any], finish: str | None,
              logprobs: dict[str, Any] | None = None) -> bytes:
        out: dict[str, Any] = {
            "id": self.cid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return sse({"id": self.cid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "system_fingerprint": self.fingerprint, "choices": [],
                    "usage": usage(prompt_tokens, completion_tokens)})


async def stream_chunks(service: GenerationService, body: ChatCompletionRequest, tools: ToolPlan | None,
                        streams: list[GenerationStream], chunks: ChatChunks,
                        record: RequestRecord | None) -> AsyncIterator[bytes]:
    """Every choice's role, then its content as it comes, interleaved (each chunk names its `index`). A tool call
    comes in one chunk once it ends (whole, or cut short), then its finish_reason in a chunk of its own."""
    top = body.top_logprobs is not None
    completion_tokens = 0
    held = [""] * len(streams)  # a tool call's text until it is whole

    def tool_chunks(index: int, fin: Finished, lp: dict[str, Any] | None) -> bytes:
        """A tool call's end: its call (whole, or cut short) with the last token's logprobs, then, as OpenAI ends a
        choice, its finish_reason in a chunk of its own."""
        assert tools is not None
        call, finish = tool_end(held[index], fin, tools)
        delta = {"tool_calls": [{"index": 0, **call}]} if call is not None else {}
        return (chunks.chunk(index, delta, None, lp) if delta or lp else b"") + chunks.chunk(index, {}, finish)

    items = service.interleaved(streams, record)
    try:
        # OpenAI's first chunk: the role, and no content yet (null before a tool call)
        first = {"role": "assistant", "content": "" if tools is None else None}
        yield b"".join(chunks.chunk(i, first, None) for i in range(len(streams)))
        async for item in items:
            if isinstance(item, Exception):
                yield sse(exception_body("/v1/chat/completions", item)[1])
                break
            index, batch = item
            out = []
            for ev in batch:
                if isinstance(ev, Finished):
                    out.append(tool_chunks(index, ev, None) if tools is not None
                               else chunks.chunk(index, {}, finish_reason(ev)))
                    break
                completion_tokens += 1
                lp = {"content": [token_logprobs(service, ev, top)]} if body.logprobs else None
                if tools is not None:
                    held[index] += ev.text
                    if ev.finished is not None:
                        out.append(tool_chunks(index, ev.finished, lp))
                    elif lp:
                        out.append(chunks.chunk(index, {}, None, lp))
                    continue
                finish = finish_reason(ev.finished) if ev.finished else None
                out.append(chunks.chunk(index, {"content": ev.text} if ev.text else {}, finish, lp))
            if out:
                yield b"".join(out)
        else:
            if chunks.include_usage:
                yield chunks.usage(streams[0].prompt_tokens, completion_tokens)
        yield sse("[DONE]")
    finally:
        await items.aclose()  # its readers stop
        cancel_all(streams)
