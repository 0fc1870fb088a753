"""TGI's answers: the engine's results and events written as `/generate`'s JSON (details, best_of sequences,
prefill tokens) and `/generate_stream`'s server-sent events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from app.api.tgi.protocol import TGI, BestOfSequence, Details, GenerateRequest, GenerateResponse, PrefillToken, Token
from app.http.errors import exception_body
from app.http.requestlog import RequestRecord
from app.http.responses import json_number
from app.http.sse import sse
from app.serving.samples import ranked, sample_params
from app.serving.service import GenerationService
from model.engine import EngineError, GenerationStream, Result, TokenEvent
from model.engine.events import TokenAttention as EngineAttention
from model.stopping import CONSTRAINT_DONE


def finish_reason(reason: str) -> str:
    """TGI's finish reasons: a constraint that is done ends generation as the EOS token that grammar allows only
    then would (TGI's own grammars end so)."""
    return "eos_token" if reason == CONSTRAINT_DONE else reason


async def start(service: GenerationService, body: GenerateRequest,
                 stream: bool = False) -> list[GenerationStream]:
    """Submit the request: `best_of` samples (sample i seeded with the request's seed + i), one unless asked."""
    params = await service.constrained(body.parameters.to_sampling_params(service.defaults),
                                       body.parameters.constraint())
    samples = body.parameters.samples(params, stream, service.defaults)
    return await service.start_many(body.inputs, sample_params(params, samples), body.parameters.truncate, TGI)


async def generate_response(service: GenerationService, body: GenerateRequest, request: Request) -> GenerateResponse:
    results = await service.results(request, await start(service, body))
    ordered = ranked(results)  # best_of: the best answers, the others follow
    return response(service, body, ordered[0], ordered[1:] if len(ordered) > 1 else None)


def _token(ev: TokenEvent, text: str | None = None) -> Token:
    return Token(id=ev.id, text=ev.text if text is None else text, logprob=ev.logprob, special=ev.special)


def _sequence(service: GenerationService, body: GenerateRequest, result: Result) -> dict[str, Any]:
    """What TGI's details say of one generated sequence (the answer's, or one of `best_of_sequences`)."""
    p, fin = body.parameters, result.finished
    prefill = []
    if p.decoder_input_details:
        scores = result.prompt_logprobs or ()
        prefill = [PrefillToken(id=t.id, text=service.token_text(t.id), logprob=t.logprob) for t in scores]
    return dict(
        generated_text=(body.inputs if p.return_full_text else "") + result.text,
        finish_reason=finish_reason(fin.finish_reason),
        generated_tokens=fin.generated_tokens,
        seed=fin.seed,
        prefill=prefill,
        tokens=[Token(id=t.id, text=service.token_text(t.id), logprob=t.logprob, special=t.special)
                for t in result.tokens],
        top_tokens=[[Token(id=a.id, text=a.text, logprob=a.logprob, special=a.special) for a in t.top_tokens]
                    for t in result.tokens] if p.top_n_tokens else [],
    )


def response(service: GenerationService, body: GenerateRequest, result: Result,
              others: list[Result] | None = None) -> GenerateResponse:
    seq = _sequence(service, body, result)
    details = None
    if body.parameters.details:
        details = Details(**{k: v for k, v in seq.items() if k != "generated_text"},
                          window_slides=result.finished.window_slides,
                          truncated_prompt_tokens=result.finished.truncated_prompt_tokens,
                          best_of_sequences=[BestOfSequence(**_sequence(service, body, r)) for r in others]
                          if others else None,
                          attention=[_attention(t.attention) for t in result.tokens if t.attention]
                          if body.parameters.attention else None)
    return GenerateResponse(generated_text=seq["generated_text"], details=details)


async def events(service: GenerationService, body: GenerateRequest, stream: GenerationStream,
                  record: RequestRecord | None) -> AsyncIterator[bytes]:
    prefix = body.inputs if body.parameters.return_full_text else ""
    try:
        async for batch in service.event_batches(stream, record):
            # every event that has arrived, in one write; each is StreamResponse's JSON (built as a dict: the
            # per-token path is the hot one)
            yield b"".join(token_sse(ev, prefix) for ev in batch if isinstance(ev, TokenEvent))
    except EngineError as e:
        yield sse(exception_body("/generate_stream", e)[1])
    finally:
        stream.cancel()  # the client went away mid-stream (or we are done): free the slot


def token_sse(ev: TokenEvent, prefix: str) -> bytes:
    """One token's server-sent event: `sse(stream_event(ev, prefix))`. A token that neither ends the stream nor
    carries alternatives (all but the last, without top_n_tokens) is formatted straight into the same bytes,
    without building and encoding the dict: the per-token path is the server's hot one."""
    if ev.finished is not None or ev.top_tokens or ev.attention is not None:
        return sse(stream_event(ev, prefix))
    return (b'data: {"index":%d,"token":{"id":%d,"text":%b,"logprob":%b,"special":%b},"top_tokens":[],'
            b'"generated_text":null,"details":null}\n\n'
            % (ev.index, ev.id, json.dumps(ev.text, ensure_ascii=False).encode(), json_number(ev.logprob),
               b"true" if ev.special else b"false"))


def stream_event(ev: TokenEvent, prefix: str) -> dict[str, Any]:
    """`StreamResponse(...).model_dump()` for one token, without building the model (`attention` only when asked)."""
    fin = ev.finished
    event = {
        "index": ev.index,
        "token": {"id": ev.id, "text": ev.text, "logprob": ev.logprob, "special": ev.special},
        "top_tokens": [{"id": a.id, "text": a.text, "logprob": a.logprob, "special": a.special}
                       for a in ev.top_tokens],
        "generated_text": None if fin is None else prefix + fin.generated_text,
        "details": None if fin is None else {"finish_reason": finish_reason(fin.finish_reason),
                                             "generated_tokens": fin.generated_tokens, "seed": fin.seed,
                                             "input_length": fin.prompt_tokens,
                                             "truncated_prompt_tokens": fin.truncated_prompt_tokens},
    }
    if ev.attention is not None:
        event["attention"] = _attention(ev.attention)
    return event


def _attention(att: EngineAttention) -> dict[str, Any]:
    """`TokenAttention`'s JSON (without `heads` for the mean over them, as `model_dump_json(exclude_none=True)`)."""
    heads = {} if att.heads is None else {"heads": list(att.heads)}
    return {"start": att.start, "layers": list(att.layers), **heads, "weights": att.weights}
