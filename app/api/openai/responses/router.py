"""OpenAI's Responses API, stateless: POST /v1/responses, streaming and not."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from app.api import tools
from app.api.openai.protocol import ERRORS
from app.api.openai.responses.protocol import RESPONSES, ResponsesRequest
from app.api.openai.responses.serving import ResponseWriter, status_of, stream_events
from app.http.limits import ThreadedBodyRoute
from app.http.requestlog import request_record
from app.http.responses import StrictJSONResponse
from app.http.sse import SSE_HEADERS, SSE_OR_JSON_DOC
from app.serving.deps import request_service

router = APIRouter(prefix="/v1", tags=["OpenAI"], route_class=ThreadedBodyRoute)


@router.post("/responses", responses={**ERRORS, 200: SSE_OR_JSON_DOC})
async def responses(body: ResponsesRequest, request: Request) -> Response:
    """A response to `input` (after `instructions`) through the model's chat template, as chat completions would
    answer the same conversation; `text.format` constrains it (JSON, a JSON schema); `tools` with `tool_choice`
    required or a named function answer a `function_call` item, its arguments generated under the function's
    `parameters`. Nothing is stored."""
    service = await request_service(request, body.model)
    messages = body.messages()
    call, requested = await tools.output_plan(service, body)
    params = await service.constrained(body.to_sampling_params(service.defaults), requested)
    prompt = await service.render_chat(messages, tools.template_tools(body), True, RESPONSES)
    instructions = [("instructions", body.instructions)] if body.instructions is not None else []
    stream = await service.start(prompt, params, None, RESPONSES, instructions)
    writer = ResponseWriter(f"resp_{uuid.uuid4().hex}", body, service.model_id, call)
    if body.stream:
        return StreamingResponse(stream_events(service, stream, writer, request_record(request)),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    [result] = await service.results(request, [stream])
    fin = result.finished
    return StrictJSONResponse(writer.response(status_of(fin), writer.output(result.text, fin), fin, fin.prompt_tokens))
