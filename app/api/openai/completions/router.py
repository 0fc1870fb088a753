"""OpenAI's completions: POST /v1/completions, streaming and not."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from app.api.openai.completions.protocol import OPENAI, CompletionRequest
from app.api.openai.completions.serving import ChunkWriter, complete, stream_choices
from app.api.openai.protocol import ERRORS
from app.http.limits import ThreadedBodyRoute
from app.http.requestlog import request_record
from app.http.responses import StrictJSONResponse
from app.http.sse import SSE_HEADERS, SSE_OR_JSON_DOC
from app.serving.deps import request_service
from app.serving.samples import sample_params
from app.serving.service import cancel_all
from model.engine import GenerationStream

router = APIRouter(prefix="/v1", tags=["OpenAI"], route_class=ThreadedBodyRoute)


@router.post("/completions", responses={**ERRORS, 200: SSE_OR_JSON_DOC})
async def completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI's legacy completions: one prompt or a batch, `n` choices each (`best_of` to rank more), logprobs
    of the generated and (with `echo`) the prompt's tokens; `max_tokens: 0` with `echo` scores a prompt.
    `model` picks one of the models served (app/serving/models.py)."""
    service = await request_service(request, body.model)
    params, samples = body.to_sampling_params(service.defaults), body.samples(service.defaults)
    params = await service.constrained(params, body.constraint())
    prompts = body.prompts()
    streams: list[list[GenerationStream]] = []
    try:
        for prompt in prompts:
            streams.append(await service.start_many(prompt, sample_params(params, samples), None, OPENAI))
    except BaseException:
        cancel_all([s for group in streams for s in group])
        raise
    # the engine took the prompts: a prompt of ids holds only ids the tokenizer decodes
    echoes = [(p if isinstance(p, str) else service.tokenizer.decode(p)) if body.echo else "" for p in prompts]
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = ChunkWriter(cid, created, service.model_id, include_usage, service.fingerprint)
        gen = stream_choices(service, streams, echoes, chunks, body.logprobs is not None, request_record(request))
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    return StrictJSONResponse(await complete(request, service, body, streams, echoes, cid, created))


