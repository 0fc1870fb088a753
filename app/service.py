"""Between HTTP and the engine: request models -> validated `SamplingParams` (request value, then server
default, then hard default), tokenisation off the event loop, and engine events -> response shapes.
No tensors here; the engine owns those."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from app.admission import current_reservation
from app.errors import Unavailable
from app.metrics import Metrics
from app.requestlog import current_request
from app.schemas import CompletionRequest, GenerateParameters
from app.settings import Settings
from model.checkpoint import Checkpoint
from model.engine import Engine, Finished, GenerationStream, Result, TokenEvent
from model.sampling_params import SamplingParams, ValidationError, preview

INLINE_ENCODE_CHARS = 1024  # prompts up to this long are tokenised on the event loop


@dataclass(frozen=True)
class Api:
    """How one API names the engine's fields (`inputs`, `max_new_tokens`, ...) in its error messages."""

    renamed: dict[str, str]
    prefix: str = ""  # for the fields not renamed
    truncate_hint: str = ""  # how to fit a prompt longer than the context, if the API has a way

    def field(self, name: str) -> str:
        return self.renamed.get(name, self.prefix + name)


TGI = Api({"prompt": "inputs"}, prefix="parameters.", truncate_hint=" (parameters.truncate)")
OPENAI = Api({"prompt": "prompt", "max_new_tokens": "max_tokens", "top_n_tokens": "logprobs"})


class ClientGone(Exception):
    """The client disconnected; its generation was cancelled."""


@dataclass
class Prepared:
    prompt: list[int]
    params: SamplingParams
    truncate: int | None


class GenerationService:
    def __init__(self, engine: Engine, checkpoint: Checkpoint, settings: Settings, metrics: Metrics) -> None:
        self.engine = engine
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.settings = settings
        self.metrics = metrics
        self.ready = False
        self.draining = False
        self.in_flight = 0  # admitted requests whose response has not ended yet (app/admission.py)
        self.model_id = settings.model_id or checkpoint.path.name

    def check_ready(self) -> None:
        if self.draining:
            raise Unavailable("the server is shutting down and admits no new requests")
        if not self.ready:
            raise Unavailable("the model is still loading")

    # -- parameters -----------------------------------------------------------------------------------
    def _max_new_tokens(self, value: int | None, field: str) -> int:
        limit = self.settings.max_new_tokens_limit
        value = value if value is not None else min(self.settings.max_new_tokens_default, limit)
        if value > limit:
            raise ValidationError(field, f"must be an integer in [1, {limit}], got {preview(value)}")
        return value

    @staticmethod
    def _sampling_params(api: Api, **values: object) -> SamplingParams:
        """`SamplingParams(**values)`, its errors naming the API's fields."""
        try:
            return SamplingParams(**values)  # type: ignore[arg-type]
        except ValidationError as e:
            raise ValidationError(api.field(e.field), e.message) from None

    def params_from_tgi(self, p: GenerateParameters) -> tuple[SamplingParams, int | None]:
        unsupported = {
            "typical_p": p.typical_p not in (None, 1.0),
            "frequency_penalty": p.frequency_penalty not in (None, 0.0),
            "watermark": p.watermark,
        }
        for name, bad in unsupported.items():
            if bad:
                raise ValidationError(TGI.field(name), f"is not supported by Folio, got {preview(getattr(p, name))}")
        params = self._sampling_params(
            TGI,
            max_new_tokens=self._max_new_tokens(p.max_new_tokens, "parameters.max_new_tokens"),
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            do_sample=p.do_sample,
            greedy=p.greedy,
            repetition_penalty=p.repetition_penalty,
            seed=p.seed,
            stop=tuple(p.stop),
            top_n_tokens=p.top_n_tokens or 0,
        )
        return params, p.truncate

    def params_from_openai(self, r: CompletionRequest) -> SamplingParams:
        stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
        greedy = r.temperature == 0
        return self._sampling_params(
            OPENAI,
            max_new_tokens=self._max_new_tokens(r.max_tokens, "max_tokens"),
            temperature=r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            do_sample=not greedy,  # OpenAI samples at temperature 1 unless told otherwise
            greedy=greedy,
            repetition_penalty=r.repetition_penalty,
            seed=r.seed,
            stop=tuple(stop),
            top_n_tokens=r.logprobs or 0,
        )

    async def encode(self, text: str, field: str = "inputs") -> list[int]:
        """Tokenise: a long prompt off the event loop (a megabyte takes a while), a short one on it (well under a
        millisecond, less than the hand-off to a worker thread and back costs)."""
        try:
            if len(text) <= INLINE_ENCODE_CHARS:
                return self.tokenizer.encode(text)
            return await run_in_threadpool(self.tokenizer.encode, text)
        except ValueError as e:
            raise ValidationError(field, str(e)) from None

    async def prepare(self, text: str, params: SamplingParams, truncate: int | None, api: Api) -> Prepared:
        """Tokenise and check the prompt and parameters against the model (its context, its vocabulary); errors
        name this API's fields (`inputs`, `parameters.truncate` for TGI, `prompt`, `logprobs` for OpenAI)."""
        prompt = await self.encode(text, api.field("prompt"))
        try:
            prompt = self.engine.validate(prompt, truncate, params)
        except ValidationError as e:
            hint = api.truncate_hint if e.field == "prompt" and "context" in e.message else ""
            raise ValidationError(api.field(e.field), e.message + hint) from None
        return Prepared(prompt, params, truncate)

    def submit(self, prepared: Prepared) -> GenerationStream:
        """Submit into the slot the admission middleware reserved for this request (if it did)."""
        self.check_ready()
        return self.engine.submit(prepared.prompt, prepared.params, truncate=prepared.truncate,
                                  reservation=current_reservation.get())

    # -- running --------------------------------------------------------------------------------------
    async def events(self, stream: GenerationStream) -> AsyncIterator[TokenEvent | Finished]:
        """The stream's events one by one (see `event_batches`)."""
        async for batch in self.event_batches(stream):
            for ev in batch:
                yield ev

    async def event_batches(self, stream: GenerationStream) -> AsyncIterator[list[TokenEvent | Finished]]:
        """The stream's events as they arrive, several at a time when they queued up (`GenerationStream.batches`),
        with time to first token and inter-token latency recorded from when the engine made each token, and the
        request's record (app/requestlog.py) kept up to date."""
        record = current_request.get()
        if record is not None:
            record.prompt_tokens = stream.prompt_tokens
        last = time.perf_counter()
        first = True
        try:
            async for batch in stream.batches():
                for ev in batch:
                    if isinstance(ev, TokenEvent):
                        gap = max(0.0, ev.created - last)
                        (self.metrics.ttft if first else self.metrics.itl).observe(gap)
                        if not first:
                            self.metrics.vllm.token_gap(gap)
                        first = False
                        last = ev.created
                if record is not None:
                    record.saw(batch)
                yield batch
        except Exception:  # the engine's GenerationError or EngineStopped
            if record is not None:
                record.finish_reason = "error"
            raise

    async def result(self, request: Request, stream: GenerationStream) -> Result:
        """Await a whole generation, cancelling it if the client disconnects meanwhile."""
        async def gather() -> Result:
            tokens: list[TokenEvent] = []
            async for ev in self.events(stream):
                if isinstance(ev, Finished):
                    return Result(tokens, ev)
                tokens.append(ev)
            raise RuntimeError("stream ended without a result")

        task = asyncio.ensure_future(gather())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    self.cancel(stream)
                    raise ClientGone()
        finally:
            if not task.done():
                task.cancel()

    def cancel(self, stream: GenerationStream) -> None:
        stream.cancel()

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])
