"""OpenAI-compatible API: POST /v1/completions (streaming and not) and GET /v1/models."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from app.completions import FINISH, Scored, best, choice_logprobs, logprobs_block, sample_params, usage
from app.deps import ReservationDep, service_for
from app.errors import exception_body
from app.fields import OPENAI
from app.limits import ThreadedBodyRoute
from app.models import served_models
from app.requestlog import RequestRecord, request_record
from app.responses import StrictJSONResponse
from app.schemas import CompletionRequest, OpenAIError
from app.service import GenerationService, cancel_all
from app.sse import SSE_HEADERS, SSE_OR_JSON_DOC, sse
from model.engine import EngineError, Finished, GenerationStream, TokenEvent

router = APIRouter(prefix="/v1", tags=["OpenAI"], route_class=ThreadedBodyRoute)
ERRORS = {code: {"model": OpenAIError} for code in (401, 404, 413, 422, 424, 429, 503)}


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    """The models served, each with its state (app/models.py; loads none)."""
    return {"object": "list", "data": [{"id": m["name"], "object": "model", "created": int(m["loaded_at"] or 0),
                                        "owned_by": "folio", **m} for m in served_models(request).describe()]}


@router.post("/completions", responses={**ERRORS, 200: SSE_OR_JSON_DOC})
async def completions(body: CompletionRequest, request: Request, reservation: ReservationDep) -> Response:
    """OpenAI's legacy completions: one prompt or a batch, `n` choices each (`best_of` to rank more), logprobs
    of the generated and (with `echo`) the prompt's tokens; `max_tokens: 0` with `echo` scores a prompt.
    `model` picks one of the models served (app/models.py)."""
    service = await service_for(request, body.model)
    params, samples = body.to_sampling_params(service.defaults), body.samples(service.defaults)
    prompts = body.prompts()
    echoes = [(p if isinstance(p, str) else service.tokenizer.decode(p)) if body.echo else "" for p in prompts]
    streams: list[list[GenerationStream]] = []
    try:
        for k, prompt in enumerate(prompts):
            streams.append(await service.start_many(prompt, sample_params(params, samples), None, OPENAI,
                                                    reservation if k == 0 else None))
    except BaseException:
        cancel_all([s for group in streams for s in group])
        raise
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = ChunkWriter(cid, created, service.model_id, include_usage, service.fingerprint)
        gen = _stream(service, streams, echoes, chunks, body.logprobs is not None, request_record(request))
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    return StrictJSONResponse(await _complete(request, service, body, streams, echoes, cid, created))


async def _complete(request: Request, service: GenerationService, body: CompletionRequest,
                    streams: list[list[GenerationStream]], echoes: list[str], cid: str, created: int,
                    ) -> dict[str, Any]:
    results = await service.results(request, [s for group in streams for s in group])
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for k, echo in enumerate(echoes):
        mine = results[k * len(streams[0]):(k + 1) * len(streams[0])]
        prompt_tokens += mine[0].finished.prompt_tokens
        completion_tokens += sum(r.finished.generated_tokens for r in mine)
        for result in best(mine, body.n):
            lp = choice_logprobs(result, body.echo, service.token_text) if body.logprobs is not None else None
            choices.append({"text": echo + result.text, "index": len(choices), "logprobs": lp,
                            "finish_reason": _finish(result.finished)})
    return {"id": cid, "object": "text_completion", "created": created, "model": service.model_id,
            "system_fingerprint": service.fingerprint, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


def _finish(fin: Finished) -> str:
    return FINISH.get(fin.finish_reason, "length")  # max_tokens 0: the prompt is scored, nothing generated


def _prompt_scores(ev: TokenEvent | Finished) -> list[Scored] | None:
    scores = ev.prompt_logprobs
    return None if scores is None else [Scored.of(t) for t in scores]


@dataclass
class ChunkWriter:
    """The server-sent chunks of one streamed completion."""

    cid: str
    created: int
    model: str
    include_usage: bool
    fingerprint: str

    def chunk(self, index: int, text: str, finish: str | None, lp: dict[str, Any] | None = None) -> bytes:
        out = {"id": self.cid, "object": "text_completion", "created": self.created, "model": self.model,
               "system_fingerprint": self.fingerprint,
               "choices": [{"text": text, "index": index, "logprobs": lp, "finish_reason": finish}]}
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return sse({"id": self.cid, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": [], "usage": usage(prompt_tokens, completion_tokens)})


async def _pump(service: GenerationService, stream: GenerationStream, index: int, record: RequestRecord | None,
                out: asyncio.Queue[tuple[int, list[TokenEvent | Finished]] | Exception | None]) -> None:
    try:
        async for batch in service.event_batches(stream, record):
            await out.put((index, batch))
    except EngineError as e:
        await out.put(e)
    finally:
        await out.put(None)


async def _stream(service: GenerationService, streams: list[list[GenerationStream]], echoes: list[str],
                  chunks: ChunkWriter, logprobs: bool, record: RequestRecord | None) -> AsyncIterator[bytes]:
    """Every choice's tokens as they come, interleaved (each chunk names its `index`), then the usage if asked."""
    flat = [s for group in streams for s in group]
    per_prompt = len(streams[0])
    queue: asyncio.Queue[tuple[int, list[TokenEvent | Finished]] | Exception | None] = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(service, s, i, record, queue)) for i, s in enumerate(flat)]
    offsets = [len(echoes[i // per_prompt]) for i in range(len(flat))]
    prompt_tokens = sum(group[0].prompt_tokens for group in streams)
    completion_tokens, running = 0, len(flat)
    echoed = [False] * len(flat)
    try:
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, Exception):
                yield sse(exception_body("/v1/completions", item)[1])
                break
            index, batch = item
            out = []
            if not echoed[index]:  # the echo goes first, with the prompt's logprobs (they come with the first event)
                echoed[index] = True
                if offsets[index]:
                    scored = _prompt_scores(batch[0]) if logprobs else None
                    lp = logprobs_block(scored, service.token_text, 0) if scored is not None else None
                    out.append(chunks.chunk(index, echoes[index // per_prompt], None, lp))
            for ev in batch:
                if isinstance(ev, Finished):  # max_tokens 0: the echo was all, and the end is the only event
                    out.append(chunks.chunk(index, "", _finish(ev)))
                    break
                finish = _finish(ev.finished) if ev.finished else None
                if ev.text or finish or logprobs:
                    lp = logprobs_block([Scored.of(ev)], service.token_text, offsets[index]) if logprobs else None
                    out.append(chunks.chunk(index, ev.text, finish, lp))
                offsets[index] += len(ev.text)
                completion_tokens += 1
            if out:
                yield b"".join(out)
        else:
            if chunks.include_usage:
                yield chunks.usage(prompt_tokens, completion_tokens)
        yield sse("[DONE]")
    finally:
        cancel_all(flat)
        for p in pumps:
            p.cancel()
