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
from app.api.tools import ToolPlan
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


def tool_call(text: str, tools: ToolPlan) -> dict[str, Any]:
    """OpenAI's tool call from a whole constrained output."""
    name, arguments = tools.call(text)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def called(result: Result, tools: ToolPlan | None) -> bool:
    """Whether `result` is a whole tool call: its constraint done (not cut by max_tokens)."""
    return tools is not None and tools.whole(result.finished)


def message(result: Result, tools: ToolPlan | None) -> tuple[dict[str, Any], str]:
    """A choice's message and finish_reason: its text, or its tool call."""
    if called(result, tools):
        assert tools is not None
        return {"role": "assistant", "content": None, "tool_calls": [tool_call(result.text, tools)]}, \
            "tool_calls"
    return {"role": "assistant", "content": result.text}, finish_reason(result.finished)


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
    comes whole in one chunk once its arguments are complete (they are generated under their schema)."""
    top = body.top_logprobs is not None
    completion_tokens = 0
    held = [""] * len(streams)  # a tool call's text until it is whole
    items = service.interleaved(streams, record)
    try:
        yield b"".join(chunks.chunk(i, {"role": "assistant", "content": ""}, None) for i in range(len(streams)))
        async for item in items:
            if isinstance(item, Exception):
                yield sse(exception_body("/v1/chat/completions", item)[1])
                break
            index, batch = item
            out = []
            for ev in batch:
                if isinstance(ev, Finished):
                    out.append(chunks.chunk(index, {}, finish_reason(ev)))
                    break
                completion_tokens += 1
                lp = {"content": [token_logprobs(service, ev, top)]} if body.logprobs else None
                if tools is not None:
                    held[index] += ev.text
                    if ev.finished is None:
                        if lp:
                            out.append(chunks.chunk(index, {}, None, lp))
                        continue
                    if tools.whole(ev.finished):
                        call = {"index": 0, **tool_call(held[index], tools)}
                        out.append(chunks.chunk(index, {"tool_calls": [call]}, "tool_calls", lp))
                    else:
                        out.append(chunks.chunk(index, {"content": held[index]}, finish_reason(ev.finished), lp))
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
