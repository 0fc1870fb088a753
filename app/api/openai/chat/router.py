"""OpenAI's chat completions: POST /v1/chat/completions, streaming and not."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from app.api.openai.chat.protocol import AUTO, CHAT, ChatCompletionRequest, ToolPlan
from app.api.openai.chat.serving import ChatChunks, complete, stream_chunks
from app.api.openai.protocol import ERRORS
from app.api.structured import Requested, one_of
from app.http.limits import ThreadedBodyRoute
from app.http.requestlog import request_record
from app.http.responses import StrictJSONResponse
from app.http.sse import SSE_HEADERS, SSE_OR_JSON_DOC
from app.serving.deps import request_service
from app.serving.samples import sample_params
from app.serving.service import GenerationService
from model.sampling_params import ValidationError
from model.structured import ConstraintSpec


async def check_auto_tools(service: GenerationService, body: ChatCompletionRequest) -> None:
    """tool_choice auto: the model is told of the tools only through its chat template; one that never reads them
    cannot call any, a 422 saying so. Each tool's schema is still checked (compiled, cached): an invalid one is
    a 422 naming it, as it would be under tool_choice required."""
    template = service.registry.chat_template(service.checkpoint)
    if not template.reads_tools:
        raise ValidationError("tool_choice", f"'auto' needs a chat template that tells the model of its tools; this "
                              f"model's ({template.source}) has none: use 'required' or name a function, which "
                              f"generate the call under its schema")
    for i, tool in enumerate(body.tools or ()):
        spec = ConstraintSpec.json_schema(tool["function"].get("parameters") or {"type": "object"}, strict=False)
        await service.compile(Requested(spec, f"tools[{i}].function.parameters"))


router = APIRouter(prefix="/v1", tags=["OpenAI"], route_class=ThreadedBodyRoute)


@router.post("/chat/completions", responses={**ERRORS, 200: SSE_OR_JSON_DOC})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """A conversation's next assistant message, rendered through the model's chat template (the checkpoint's,
    else --chat-template, else the default): `n` choices, logprobs with `top_logprobs`, streaming with
    `stream_options.include_usage`. `model` picks one of the models served."""
    service = await request_service(request, body.model)
    params = body.to_sampling_params(service.defaults)
    samples = body.samples(service.defaults)
    plan = body.tool_plan()
    tools = plan if isinstance(plan, ToolPlan) else None
    if plan == AUTO:
        await check_auto_tools(service, body)
    requested = one_of(tools.requested if tools else None, body.constraint())
    params = await service.constrained(params, requested)
    prompt = await service.render_chat(body.messages, body.tools, body.add_generation_prompt, CHAT)
    streams = await service.start_many(prompt, sample_params(params, samples), None, CHAT)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        chunks = ChatChunks(cid, created, service.model_id, service.fingerprint, body.include_usage)
        gen = stream_chunks(service, body, tools, streams, chunks, request_record(request))
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    return StrictJSONResponse(await complete(request, service, body, tools, streams, cid, created))
