"""Hugging Face TGI's API: POST /generate, POST /generate_stream, POST / (with "stream"), POST /tokenize."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.deps import AuthDep, ReservationDep, ServiceDep
from app.errors import TGI, exception_body
from app.responses import json_number
from app.schemas import (
    Details,
    ErrorBody,
    GenerateRequest,
    GenerateResponse,
    PrefillToken,
    SimpleToken,
    Token,
    TokenizeRequest,
)
from app.service import GenerationService
from app.sse import SSE_DOC, SSE_HEADERS, SSE_OR_JSON_DOC, sse
from model.engine import EngineError, GenerationStream, Reservation, Result, TokenEvent
from model.sampling_params import ValidationError
from model.tokenizer import Tokenizer

router = APIRouter(tags=["TGI"])
ERRORS = {code: {"model": ErrorBody} for code in (401, 413, 422, 424, 429, 503)}


async def _start(service: GenerationService, body: GenerateRequest, reservation: Reservation | None,
                 ) -> GenerationStream:
    service.check_ready()
    params = body.parameters.to_sampling_params(service.defaults)
    return await service.start(body.inputs, params, body.parameters.truncate, TGI, reservation)


def _token(ev: TokenEvent, text: str | None = None) -> Token:
    return Token(id=ev.id, text=ev.text if text is None else text, logprob=ev.logprob, special=ev.special)


def _response(service: GenerationService, body: GenerateRequest, result: Result) -> GenerateResponse:
    p = body.parameters
    text = (body.inputs if p.return_full_text else "") + result.text
    details = None
    if p.details:
        fin = result.finished
        prefill = (
            [PrefillToken(id=i, text=service.token_text(i)) for i in fin.prefill] if p.decoder_input_details else []
        )
        details = Details(
            finish_reason=fin.finish_reason,
            generated_tokens=fin.generated_tokens,
            seed=fin.seed,
            prefill=prefill,
            tokens=[Token(id=t.id, text=service.token_text(t.id), logprob=t.logprob, special=t.special)
                    for t in result.tokens],
            top_tokens=[[Token(id=a.id, text=a.text, logprob=a.logprob, special=a.special) for a in t.top_tokens]
                        for t in result.tokens] if p.top_n_tokens else [],
            window_slides=fin.window_slides,
        )
    return GenerateResponse(generated_text=text, details=details)


@router.post("/generate", response_model=GenerateResponse, responses=ERRORS)
async def generate(body: GenerateRequest, request: Request, service: ServiceDep, reservation: ReservationDep,
                   _: AuthDep) -> Response:
    """Generate text for a prompt and return it whole."""
    result = await service.result(request, await _start(service, body, reservation))
    return Response(_response(service, body, result).model_dump_json(exclude_none=True),
                    media_type="application/json")


async def _events(service: GenerationService, body: GenerateRequest, stream: GenerationStream) -> AsyncIterator[bytes]:
    prefix = body.inputs if body.parameters.return_full_text else ""
    try:
        async for batch in service.event_batches(stream):
            # every event that has arrived, in one write; each is StreamResponse's JSON (built as a dict: the
            # per-token path is the hot one)
            yield b"".join(_token_sse(ev, prefix) for ev in batch if isinstance(ev, TokenEvent))
    except EngineError as e:
        yield sse(exception_body("/generate_stream", e)[1])
    finally:
        stream.cancel()  # the client went away mid-stream (or we are done): free the slot


def _token_sse(ev: TokenEvent, prefix: str) -> bytes:
    """One token's server-sent event: `sse(_stream_event(ev, prefix))`. A token that neither ends the stream nor
    carries alternatives (all but the last, without top_n_tokens) is formatted straight into the same bytes,
    without building and encoding the dict: the per-token path is the server's hot one."""
    if ev.finished is not None or ev.top_tokens:
        return sse(_stream_event(ev, prefix))
    return (b'data: {"index":%d,"token":{"id":%d,"text":%b,"logprob":%b,"special":%b},"top_tokens":[],'
            b'"generated_text":null,"details":null}\n\n'
            % (ev.index, ev.id, json.dumps(ev.text, ensure_ascii=False).encode(), json_number(ev.logprob),
               b"true" if ev.special else b"false"))


def _stream_event(ev: TokenEvent, prefix: str) -> dict[str, Any]:
    """`StreamResponse(...).model_dump()` for one token, without building the model."""
    fin = ev.finished
    return {
        "index": ev.index,
        "token": {"id": ev.id, "text": ev.text, "logprob": ev.logprob, "special": ev.special},
        "top_tokens": [{"id": a.id, "text": a.text, "logprob": a.logprob, "special": a.special}
                       for a in ev.top_tokens],
        "generated_text": None if fin is None else prefix + fin.generated_text,
        "details": None if fin is None else {"finish_reason": fin.finish_reason,
                                             "generated_tokens": fin.generated_tokens, "seed": fin.seed,
                                             "input_length": fin.prompt_tokens},
    }


@router.post("/generate_stream", responses={**ERRORS, 200: SSE_DOC})
async def generate_stream(body: GenerateRequest, service: ServiceDep, reservation: ReservationDep,
                          _: AuthDep) -> StreamingResponse:
    """Generate text as server-sent events, one per token; the last carries generated_text and details."""
    stream = await _start(service, body, reservation)
    return StreamingResponse(_events(service, body, stream), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/", responses={**ERRORS, 200: SSE_OR_JSON_DOC}, summary="TGI compatibility route")
async def compat(body: GenerateRequest, request: Request, service: ServiceDep, reservation: ReservationDep,
                 _: AuthDep) -> Response:
    """TGI's root route: `"stream": true` streams like /generate_stream, else answers like /generate
    (as a one-element list, as TGI does)."""
    if body.stream:
        return await generate_stream(body, service, reservation, None)
    result = await service.result(request, await _start(service, body, reservation))
    return Response("[" + _response(service, body, result).model_dump_json(exclude_none=True) + "]",
                    media_type="application/json")


@router.post("/tokenize", response_model=list[SimpleToken], responses=ERRORS)
async def tokenize(body: TokenizeRequest, service: ServiceDep, _: AuthDep) -> Response:
    """The prompt's tokens with their text and character offsets (inputs of up to `--max-tokenize-chars`)."""
    service.check_ready()
    limit = service.settings.max_tokenize_chars
    if len(body.inputs) > limit:
        raise ValidationError("inputs", f"must be at most {limit} characters (the server's --max-tokenize-chars), "
                                        f"got {len(body.inputs)}")
    # tokenising and writing the answer both take time proportional to the input: off the event loop
    return Response(await run_in_threadpool(_tokens_json, service.tokenizer, body.inputs),
                    media_type="application/json")


def _tokens_json(tokenizer: Tokenizer, text: str) -> bytes:
    """`/tokenize`'s answer as JSON: a list of `SimpleToken`s, each token's id, text and character offsets."""
    try:
        ids = tokenizer.encode(text)
    except ValueError as e:
        raise ValidationError("inputs", str(e)) from None
    pieces: dict[int, tuple[bytes, int]] = {}  # id -> (its JSON before the offsets, its length in characters)
    out, pos = [], 0
    for i in ids:
        piece = pieces.get(i)
        if piece is None:
            # character offsets: count the characters that start inside this token's bytes
            chars = sum(1 for b in tokenizer.decode_bytes([i]) if b & 0xC0 != 0x80)
            text_json = json.dumps(tokenizer.decode([i]), ensure_ascii=False).encode()
            piece = pieces[i] = (b'{"id":%d,"text":%b,' % (i, text_json), chars)
        out.append(b'%b"start":%d,"stop":%d}' % (piece[0], pos, pos + piece[1]))
        pos += piece[1]
    return b"[" + b",".join(out) + b"]"
