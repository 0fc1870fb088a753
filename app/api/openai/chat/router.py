"""OpenAI's chat completions: POST /v1/chat/completions, streaming and not."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from app.api import tools
from app.api.openai.chat.protocol import CHAT, ChatCompletionRequest
from app.api.openai.chat.serving import ChatChunks, complete, stream_chunks
from app.api.openai.protocol import ERRORS
from app.http.limits import ThreadedBodyRoute
from app.http.requestlog import request_record
from app.http.responses import StrictJSONResponse
from app.http.sse import SSE_HEADERS, SSE_OR_JSON_DOC
from app.serving.deps import request_service
from app.serving.samples import sample_params

router = APIRouter(prefix="/v1", tags=["OpenAI"], route_class=ThreadedBodyRoute)


@router.post("/chat/completions", responses={**ERRORS, 200: SSE_OR_JSON_DOC})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """A conversation's next assistant message, rendered through the model's chat template (the checkpoint's,
    else --chat-template, else the default): `n` choices, logprobs with `top_logprobs`, streaming with
    `stream_options.include_usage`. `model` picks one of the models served."""
    service = await request_service(request, body.model)
    params = body.to_sampling_params(service.defaults)
    samples = body.samples(service.defaults)
    call, requested = await tools.output_plan(service, body)
    params = await service.constrained(params, requested)
    prompt = await service.render_chat(body.messages, body.tools, body.add_generation_prompt, CHAT)
    streams = await service.start_many(prompt, sample_params(params, samples), None, CHAT)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        chunks = ChatChunks(cid, created, service.model_id, service.fingerprint, body.include_usage)
        gen = stream_chunks(service, body, call, streams, chunks, request_record(request))
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    return StrictJSONResponse(await complete(request, service, body, call, streams, cid, created))
