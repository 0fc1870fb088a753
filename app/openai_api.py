"""OpenAI-compatible API: POST /v1/completions (streaming and not) and GET /v1/models."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from app.deps import AuthDep, ReservationDep, ServiceDep
from app.errors import OPENAI, error_body, exception_body
from app.responses import StrictJSONResponse
from app.schemas import CompletionRequest, OpenAIError
from app.service import GenerationService
from app.sse import SSE_HEADERS, SSE_OR_JSON_DOC, sse
from model.engine import EngineError, Finished, GenerationStream, TokenEvent
from model.sampling_params import preview

router = APIRouter(prefix="/v1", tags=["OpenAI"])
ERRORS = {code: {"model": OpenAIError} for code in (401, 404, 413, 422, 424, 429, 503)}
FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


def _logprobs(service: GenerationService, tokens: list[TokenEvent], offset: int) -> dict[str, Any]:
    texts = [service.token_text(t.id) for t in tokens]
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{a.text: a.logprob for a in t.top_tokens} for t in tokens],
        "text_offset": offsets,
    }


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@router.get("/models")
async def models(service: ServiceDep) -> dict[str, Any]:
    created = int(service.checkpoint.path.stat().st_mtime) if service.checkpoint.path else 0
    return {"object": "list",
            "data": [{"id": service.model_id, "object": "model", "created": created, "owned_by": "folio"}]}


@router.post("/completions", responses={**ERRORS, 200: SSE_OR_JSON_DOC})
async def completions(body: CompletionRequest, request: Request, service: ServiceDep, reservation: ReservationDep,
                      _: AuthDep) -> Response:
    """OpenAI's legacy completions: one prompt, one choice."""
    service.check_ready()
    if body.model is not None and body.model != service.model_id:
        msg = f"model: the model {preview(body.model)} does not exist; this server serves {service.model_id!r}"
        return StrictJSONResponse(error_body("/v1/", 404, "not_found", "invalid_request_error", msg, "model"), 404)
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]  # a list holds one (schemas.py)
    params = body.to_sampling_params(service.defaults)
    stream = await service.start(prompt, params, None, OPENAI, reservation)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    echo = prompt if body.echo else ""
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = _stream(service, stream, cid, created, echo, body.logprobs is not None, include_usage)
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    result = await service.result(request, stream)
    fin = result.finished
    choice = {
        "text": echo + result.text,
        "index": 0,
        "logprobs": _logprobs(service, result.tokens, len(echo)) if body.logprobs is not None else None,
        "finish_reason": FINISH[fin.finish_reason],
    }
    return StrictJSONResponse({
        "id": cid, "object": "text_completion", "created": created, "model": service.model_id,
        "choices": [choice], "usage": _usage(fin.prompt_tokens, fin.generated_tokens),
    })


async def _stream(
    service: GenerationService, stream: GenerationStream, cid: str, created: int, echo: str, logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    def chunk(text: str, finish: str | None, lp: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {"id": cid, "object": "text_completion", "created": created, "model": service.model_id,
               "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return out

    offset = len(echo)
    try:
        if echo:
            yield sse(chunk(echo, None))
        async for batch in service.event_batches(stream):  # every event that has arrived, in one write
            out = []
            for ev in batch:
                if isinstance(ev, Finished):
                    break
                finish = FINISH[ev.finished.finish_reason] if ev.finished else None
                if ev.text or finish or logprobs:
                    out.append(sse(chunk(ev.text, finish, _logprobs(service, [ev], offset) if logprobs else None)))
                offset += len(ev.text)
                if ev.finished and include_usage:
                    out.append(sse({"id": cid, "object": "text_completion", "created": created,
                                    "model": service.model_id, "choices": [],
                                    "usage": _usage(ev.finished.prompt_tokens, ev.finished.generated_tokens)}))
            if out:
                yield b"".join(out)
        yield sse("[DONE]")
    except EngineError as e:
        yield sse(exception_body("/v1/completions", e)[1])
        yield sse("[DONE]")
    finally:
        stream.cancel()
