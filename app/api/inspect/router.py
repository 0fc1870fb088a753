"""Looking inside the model over HTTP: `POST /inspect` (a text, or a prompt and a generation request, in; its
tokens, attention maps, logit lens and each token's probability and alternatives out) and `GET /inspect/limits`.

The work is `model.inspection`'s `Inspector`, run as an engine job: on the engine thread, one layer (or one chunk of
the LM head) between two decode steps, so running streams keep streaming. The route holds a slot like a generation
(admission, `app/http/admission.py`); with a generation request it takes a second slot for the inspection before the
generation starts, so that a full server refuses the request before doing any of it.

Everything is bounded before any work: the text's length (`--max-tokenize-chars`, 413), the model's context
(422), layers x heads x tokens of attention and the logit lens' work (`model.inspection`'s budgets, 413), and the
answer's size, estimated from the shapes asked for (`MAX_RESPONSE_BYTES`, 413). Weights and probabilities are
written with 6 decimals; the answer's JSON is built off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from app.api.inspect.protocol import DECIMALS, INSPECT, InspectRequest, InspectResponse
from app.api.protocol import error_docs
from app.api.tgi.protocol import TGI
from app.http.limits import ThreadedBodyRoute
from app.http.responses import dumps
from app.serving.deps import ServiceDep, described_service
from app.serving.service import GenerationService, until_done
from model.config import GPTConfig
from model.engine import Reservation
from model.engine.attention import MAX_REQUEST_WEIGHTS, MAX_TOKEN_WEIGHTS
from model.inspection import (
    MAX_ATTENTION_ROWS,
    MAX_LENS_LOGITS,
    MAX_TOP,
    Inspection,
    InspectOptions,
    Inspector,
    InspectTooLarge,
    check_options,
)
from model.sampling_params import ValidationError
from model.tokenizer import Tokenizer

router = APIRouter(tags=["inspect"], route_class=ThreadedBodyRoute)
ERRORS = error_docs(401, 413, 422, 424, 429, 503)
MAX_RESPONSE_BYTES = 32 * 2**20  # an answer's estimated size, at most: GPT-2 small's whole context fits (~27 MB)
# the estimate's bytes per item, from the JSON written (a weight "0.123456," or key "1023,"; a lens entry
# "[50256,0.123456]," and its text in `vocab`; a token with its offsets; an alternative)
NUMBER_BYTES, LENS_BYTES, TOKEN_BYTES, ALTERNATIVE_BYTES = 10, 48, 120, 64


@dataclass(frozen=True)
class Generated:
    text: str
    tokens: int


def estimated_bytes(n: int, options: InspectOptions, config: GPTConfig) -> tuple[int, int]:
    """An estimate of the answer's size for `n` tokens, from the shapes asked for: (attention's bytes, the rest)."""
    maps = len(options.layers or range(config.n_layer)) * len(options.heads or range(config.n_head))
    per_map = NUMBER_BYTES * (n * (n + 1) // 2 if n <= options.dense_max_tokens else 2 * n * options.sparse_top)
    lens = len(options.lens_layers or range(config.n_layer + 1)) * n * options.lens_top if options.lens else 0
    return (maps * (per_map + 4 * n) if options.attention else 0,
            lens * LENS_BYTES + n * (TOKEN_BYTES + options.top_n * ALTERNATIVE_BYTES))


def check_request(service: GenerationService, options: InspectOptions, n: int) -> None:
    """Everything about an inspection of `n` tokens that can be refused before any work: `InspectError` (422) or
    `InspectTooLarge` (413), naming the request's fields."""
    with INSPECT.naming_fields():
        check_options(options, n, service.engine.runner.model, service.tokenizer.n_vocab)  # the model's config only
    attention, rest = estimated_bytes(n, options, service.checkpoint.config)
    if attention + rest > MAX_RESPONSE_BYTES:
        field = "layers" if attention > rest else "lens_layers"
        raise InspectTooLarge(field, f"the answer would be about {attention + rest} bytes, more than the limit of "
                                     f"{MAX_RESPONSE_BYTES}: ask for fewer layers or heads, sparse attention (a lower "
                                     "dense_max_tokens), fewer lens layers, or a shorter text")


@router.post("/inspect", response_model=InspectResponse, responses=ERRORS)
async def inspect(body: InspectRequest, request: Request, service: ServiceDep) -> Response:
    """Look inside the model for a text: its tokens, attention maps, logit lens, and each token's probability and
    alternatives (with `parameters`: generate first, then inspect the prompt and its generated tokens)."""
    limit = service.settings.max_tokenize_chars
    if len(body.inputs) > limit:
        raise InspectTooLarge("inputs", f"must be at most {limit} characters (the server's --max-tokenize-chars), "
                                        f"got {len(body.inputs)}")
    ids = await service.encode(body.inputs, INSPECT)
    options = body.to_options()
    generated = None
    if body.parameters is None:
        check_request(service, options, min(len(ids), body.truncate or len(ids)))
        reservation = service.take_slot()
    else:
        ids, generated, reservation = await _generate(request, service, body, ids, options)
    ids = ids[-(body.truncate or len(ids)) :]
    engine = service.engine
    inspector = Inspector(engine.runner.model, engine.tokenizer, ids, options, kv_dtype=engine.runner.kv_dtype)
    handle = engine.submit_job(inspector.steps(), lambda: inspector.result, reservation=reservation)
    inspection = await until_done(request, handle.result(), handle.cancel)
    answer = await run_in_threadpool(render, inspection, body, generated, service.tokenizer)
    return Response(answer, media_type="application/json")


async def _generate(request: Request, service: GenerationService, body: InspectRequest, ids: list[int],
                    options: InspectOptions,
                    ) -> tuple[list[int], Generated, Reservation]:
    """Generate from the prompt in the admission's slot, holding another for the inspection: (the prompt's and
    the generated tokens, what was generated, the inspection's slot)."""
    assert body.parameters is not None
    if body.parameters.attention is not None:
        raise ValidationError("parameters.attention", "is for streams: /inspect answers with its own attention maps "
                                                      "(layers, heads)")
    if (body.parameters.best_of or 1) > 1:
        raise ValidationError("parameters.best_of", f"must be 1: /inspect looks into one sequence, got "
                                                    f"{body.parameters.best_of}")
    params = body.parameters.to_sampling_params(service.defaults)
    prompt = ids[-body.parameters.truncate :] if body.parameters.truncate else ids
    total, context = len(prompt) + params.max_new_tokens, service.checkpoint.config.block_size
    if total > context and not body.truncate:
        raise ValidationError("parameters.max_new_tokens", f"the prompt's {len(prompt)} tokens and the new ones must "
                              f"fit the model's context of {context} to be inspected, got {total} (or set truncate)")
    check_request(service, options, min(total, body.truncate or total))
    slot = service.engine.reserve()  # 429 now if the server is full, before the generation runs
    try:
        stream = await service.start(body.inputs, params, body.parameters.truncate, TGI)
        result = await service.result(request, stream)
    except BaseException:
        slot.release()
        raise
    return list(result.finished.prefill) + result.token_ids, Generated(result.text, len(result.token_ids)), slot


def render(inspection: Inspection, body: InspectRequest, generated: Generated | None, tokenizer: Tokenizer) -> bytes:
    """The answer as JSON (`InspectResponse`). It can hold a million numbers: each map and lens layer is encoded by
    its own call, so that the encoder, which holds the GIL for the whole of one call, lets the engine thread and
    the event loop run between two of them (one call for 2 MB stalls every stream for ~0.1 s)."""
    first_generated = len(inspection.tokens) - (generated.tokens if generated else 0)
    tokens = [
        {"id": t.id, "text": text, "start": start, "stop": stop, "logprob": t.logprob,
         "top_tokens": [{"id": a.id, "text": a.text, "logprob": a.logprob} for a in t.top_tokens],
         "generated": i >= first_generated}
        for i, (t, (text, start, stop)) in enumerate(zip(inspection.next_tokens, inspection.spans))
    ]
    head = {"tokens": tokens, "generated_text": generated.text if generated else None}
    parts = [dumps(head)[:-1], ',"attention":']
    if body.attention:
        about = {"format": "dense" if inspection.dense else "sparse", "threshold": inspection.sparse_threshold,
                 "top": None if inspection.dense else body.sparse_top}
        maps = (dumps({"layer": a.layer, "head": a.head, "weights": a.weights,
                       **({} if a.keys is None else {"keys": a.keys})}) for a in inspection.attention)
        parts += [dumps(about)[:-1], ',"maps":[', ",".join(maps), "]}"]
    else:
        parts.append("null")
    vocab: dict[str, str] = {}
    if body.lens:
        lens = (dumps({"layer": layer.layer, "top": layer.top}) for layer in inspection.lens)
        parts += [',"lens":[', ",".join(lens), "]"]
        ids = {token for layer in inspection.lens for position in layer.top for token, _ in position}
        vocab = {str(i): tokenizer.decode([i]) for i in sorted(ids)}
    else:
        parts.append(',"lens":null')
    parts += [',"vocab":', dumps(vocab), "}"]
    return "".join(parts).encode()


@router.get("/inspect/limits")
async def limits(request: Request) -> dict[str, Any]:
    """What `POST /inspect` and streamed attention allow on this model and server (`model`: null for a model that
    is not loaded, which this open route does not load)."""
    _, service = await described_service(request)
    model = None
    if service is not None:
        cfg = service.checkpoint.config
        model = {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "block_size": cfg.block_size,
                 "n_vocab": service.tokenizer.n_vocab}
    settings = request.app.state.settings
    return {
        "max_chars": settings.max_tokenize_chars, "max_tokens": model and model["block_size"],
        "max_attention_rows": MAX_ATTENTION_ROWS, "max_lens_logits": MAX_LENS_LOGITS,
        "max_response_bytes": MAX_RESPONSE_BYTES, "max_top": MAX_TOP, "decimals": DECIMALS,
        "stream_attention": {"max_token_weights": MAX_TOKEN_WEIGHTS, "max_request_weights": MAX_REQUEST_WEIGHTS},
        "model": model,
    }
