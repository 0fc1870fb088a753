"""Hugging Face TGI's API: POST /generate, POST /generate_stream, POST / (with "stream"). Its /tokenize is in
app/api/tokenizer/router.py."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from app.api.protocol import error_docs
from app.api.tgi.protocol import GenerateRequest, GenerateResponse
from app.api.tgi.serving import events, generate_response, start
from app.http.limits import ThreadedBodyRoute
from app.http.requestlog import request_record
from app.http.sse import SSE_DOC, SSE_HEADERS, SSE_OR_JSON_DOC
from app.serving.deps import RecordDep, ServiceDep

router = APIRouter(tags=["TGI"], route_class=ThreadedBodyRoute)
CHECKPOINT_HEADER = "X-Folio-Checkpoint"  # the served weights' sha256 (shortened): which weights answered
ERRORS = error_docs(401, 413, 422, 424, 429, 503)


@router.post("/generate", response_model=GenerateResponse, responses=ERRORS)
async def generate(body: GenerateRequest, request: Request, service: ServiceDep) -> Response:
    """Generate text for a prompt and return it whole."""
    return Response((await generate_response(service, body, request)).model_dump_json(exclude_none=True),
                    media_type="application/json", headers={CHECKPOINT_HEADER: service.fingerprint})


@router.post("/generate_stream", responses={**ERRORS, 200: SSE_DOC})
async def generate_stream(body: GenerateRequest, service: ServiceDep,
                          record: RecordDep) -> StreamingResponse:
    """Generate text as server-sent events, one per token; the last carries generated_text and details."""
    [stream] = await start(service, body, stream=True)
    return StreamingResponse(events(service, body, stream, record), media_type="text/event-stream",
                             headers={**SSE_HEADERS, CHECKPOINT_HEADER: service.fingerprint})


@router.post("/", responses={**ERRORS, 200: SSE_OR_JSON_DOC}, summary="TGI compatibility route")
async def compat(body: GenerateRequest, request: Request, service: ServiceDep) -> Response:
    """TGI's root route: `"stream": true` streams like /generate_stream, else answers like /generate
    (as a one-element list, as TGI does)."""
    if body.stream:
        return await generate_stream(body, service, request_record(request))
    response = await generate_response(service, body, request)
    return Response("[" + response.model_dump_json(exclude_none=True) + "]",
                    media_type="application/json", headers={CHECKPOINT_HEADER: service.fingerprint})
