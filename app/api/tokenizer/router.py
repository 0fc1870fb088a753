"""The tokenizer over HTTP: POST /tokenize (TGI's `{"inputs"}` shape, or vLLM's `{"prompt"}`), POST /detokenize and
GET /tokenizer_info (vLLM's shapes). With the last three, lm-evaluation-harness's `local-completions` uses the
server's own tokenizer (its "remote" backend), so scores need no tokenizer download. Work proportional to the
input (tokenising, decoding, writing a long answer) runs off the event loop, on inputs of at most
`--max-tokenize-chars` characters or ids."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from app.api.protocol import error_docs
from app.api.tokenizer.protocol import (
    TOKENIZE,
    DetokenizeRequest,
    DetokenizeResponse,
    SimpleToken,
    TokenizeRequest,
    TokenizeResponse,
)
from app.http.limits import ThreadedBodyRoute
from app.serving.deps import ServiceDep, request_service
from model.sampling_params import ValidationError, preview
from model.tokenizer import CharTokenizer, Tokenizer

router = APIRouter(tags=["Tokenizer"], route_class=ThreadedBodyRoute)
ERRORS = error_docs(401, 404, 413, 422, 429, 503)  # 404: a model not served


@router.post("/tokenize", response_model=list[SimpleToken] | TokenizeResponse, responses=ERRORS)
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    """The text's tokens: with `inputs` (TGI), each token's id, text and character offsets; with `prompt` or
    `messages` (vLLM), `{count, max_model_len, tokens}`. `model` (vLLM's), else the `X-Folio-Model` header, picks
    the model whose tokenizer answers."""
    service = await request_service(request, body.model)
    limit = service.settings.max_tokenize_chars
    if body.messages is not None:
        text = await service.render_chat(body.messages, body.tools, body.add_generation_prompt, TOKENIZE)
    else:
        text = body.inputs if body.inputs is not None else body.prompt  # type: ignore[assignment]
    if len(text) > limit:
        raise ValidationError(body.field, f"must be at most {limit} characters (the server's --max-tokenize-chars), "
                                          f"got {len(text)}")
    if body.inputs is None:
        ids = await run_in_threadpool(_encode, service.tokenizer, text, body.field)
        answer = TokenizeResponse(count=len(ids), max_model_len=service.engine.block_size, tokens=ids)
        return Response(answer.model_dump_json(), media_type="application/json")
    # tokenising and writing the answer both take time proportional to the input: off the event loop
    return Response(await run_in_threadpool(_tokens_json, service.tokenizer, text),
                    media_type="application/json")


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """Token ids back to text (vLLM's shape; ids of up to `--max-tokenize-chars` in number), by the tokenizer of the
    model `model` names (else the `X-Folio-Model` header's)."""
    service = await request_service(request, body.model)
    limit, vocab = service.settings.max_tokenize_chars, service.engine.n_vocab
    if len(body.tokens) > limit:
        raise ValidationError("tokens", f"must hold at most {limit} ids (the server's --max-tokenize-chars), "
                                        f"got {len(body.tokens)}")
    return DetokenizeResponse(prompt=await run_in_threadpool(_detokenize, service.tokenizer, vocab, body.tokens))


@router.get("/tokenizer_info")
async def tokenizer_info(service: ServiceDep) -> dict[str, object]:
    """vLLM's tokenizer facts: the end-of-text token (null for a character vocabulary, which has none), the
    vocabulary size and the context. Folio's `characters`: a character vocabulary's characters, in id order (the
    playground marks a prompt's others before sending it); null for byte-level BPE, which encodes any text."""
    tok = service.tokenizer
    eos = tok.decode([tok.eos_id]) if tok.eos_id is not None else None
    chars = "".join(tok.chars) if isinstance(tok, CharTokenizer) else None
    return {"tokenizer_class": type(tok).__name__, "eos_token": eos, "bos_token": None, "pad_token": None,
            "vocab_size": tok.n_vocab, "model_max_length": service.engine.block_size, "characters": chars}


def _encode(tokenizer: Tokenizer, text: str, field: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except ValueError as e:
        raise ValidationError(field, str(e)) from None


def _detokenize(tokenizer: Tokenizer, vocab: int, ids: list[int]) -> str:
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise ValidationError("tokens", f"token ids must be in [0, {vocab - 1}] (the model's vocabulary), got "
                                        f"{preview(bad)}")
    return tokenizer.decode(ids)


def _tokens_json(tokenizer: Tokenizer, text: str) -> bytes:
    """TGI's answer as JSON: a list of `SimpleToken`s, each token's id, text and character offsets."""
    ids = _encode(tokenizer, text, "inputs")
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
