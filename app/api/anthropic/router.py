"""Anthropic's Messages API: POST /v1/messages (streaming and not) and POST /v1/messages/count_tokens, so that
clients written for Claude (the anthropic SDK, agent frameworks) run against a Folio model. The conversation goes
through the model's chat template, as /v1/chat/completions does; `x-api-key` is accepted like a bearer token."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from app.api import tools
from app.api.anthropic.protocol import MESSAGES, AnthropicError, CountTokensRequest, MessagesRequest
from app.api.anthropic.serving import message, stream_events
from app.http.limits import ThreadedBodyRoute
from app.http.requestlog import request_record
from app.http.responses import StrictJSONResponse
from app.http.sse import SSE_HEADERS, SSE_OR_JSON_DOC
from app.serving.deps import request_service

router = APIRouter(prefix="/v1", tags=["Anthropic"], route_class=ThreadedBodyRoute)
ERRORS = {code: {"model": AnthropicError} for code in (400, 401, 404, 413, 424, 503, 529)}


@router.post("/messages", responses={**ERRORS, 200: SSE_OR_JSON_DOC})
async def messages(body: MessagesRequest, request: Request) -> Response:
    """The next assistant message of a conversation (`system`, `messages` of text, tool_use and tool_result
    blocks), with Anthropic's `stop_reason` and usage; `stream` sends its event sequence. `tools` with
    `tool_choice` any or tool answer a `tool_use` block, its input generated under the tool's `input_schema`.
    `model` picks one of the models served."""
    service = await request_service(request, body.model)
    call, requested = await tools.output_plan(service, body)
    params = await service.constrained(body.to_sampling_params(service.defaults), requested)
    conversation = body.conversation()
    prompt = await service.render_chat(conversation, tools.template_tools(body), True, MESSAGES)
    system = [("system", conversation[0]["content"])] if body.system is not None else []
    stream = await service.start(prompt, params, None, MESSAGES, system)
    mid = f"msg_{uuid.uuid4().hex}"
    if body.stream:
        return StreamingResponse(stream_events(service, stream, mid, call, request_record(request)),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    [result] = await service.results(request, [stream])
    return StrictJSONResponse(message(service, mid, result, call))


@router.post("/messages/count_tokens", responses=ERRORS)
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    """The conversation's tokens, as /v1/messages would send it to the model."""
    service = await request_service(request, body.model)
    prompt = await service.render_chat(body.conversation(), tools.template_tools(body), True, MESSAGES)
    return {"input_tokens": len(await service.encode(prompt, MESSAGES))}
