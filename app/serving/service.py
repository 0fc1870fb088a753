"""Between HTTP and the engine: tokenisation (off the event loop when long), checks against the model, submission
into the slot admission reserved, and the engine's events with their latency metrics. The request models turn
themselves into `SamplingParams` (app/api/protocol.py). No tensors here; the engine owns those."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from app.api.protocol import Api, ServerDefaults
from app.api.structured import Requested
from app.http.errors import ClientGone, Unavailable
from app.http.metrics import Metrics
from app.http.requestlog import RequestRecord, request_record
from app.settings import Settings
from model.chat_template import special_tokens
from model.checkpoint import Checkpoint
from model.engine import Engine, EngineError, EngineStopped, Finished, GenerationStream, Reservation, Result, TokenEvent
from model.lora.batched import LoraAdapter
from model.registry import ModelRegistry
from model.sampling_params import SamplingParams, ValidationError
from model.structured import Constraint, ConstraintError, compile_constraint_async
from model.tokenizer import Tokenizer

T = TypeVar("T")
INLINE_ENCODE_CHARS = 1024  # prompts up to this long are tokenised on the event loop
# a non-streaming request's handler is woken for its tokens at most this often, not per token: under 32 concurrent
# requests the per-token wake-ups took ~1 ms of the event loop per engine step, on the cores the step runs on
RESULT_WAKE_S = 0.25


@dataclass
class Lifecycle:
    """The server's state, one for all its models: loading until the default model is loaded and warm (`ready`),
    then serving, then `draining` after SIGTERM (app/__main__.py). `in_flight` counts the admitted requests whose
    response has not ended (app/http/admission.py): what a drain waits for."""

    ready: bool = False
    draining: bool = False
    in_flight: int = 0

    def check_ready(self) -> None:
        """503 (`Unavailable`) while loading or draining: asked once per request, by admission (or, on a route
        admission does not hold, by the dependency that gives the route its service, app/serving/deps.py)."""
        if self.draining:
            raise Unavailable("the server is shutting down and admits no new requests")
        if not self.ready:
            raise Unavailable("the model is still loading")


class GenerationService:
    """One model's service: whichever engine and checkpoint the model registry (app/serving/models.py) serves the model
    `name` with now. A request works with a `pinned` copy: the engine and checkpoint the registry gave it, whatever
    a reload or an unload does meanwhile, so that its tokenizer, its engine and the checkpoint its answer names
    (`fingerprint`) are one model's."""

    def __init__(self, registry: ModelRegistry, name: str, settings: Settings, metrics: Metrics,
                 lifecycle: Lifecycle) -> None:
        self._engine: Engine | None = None
        self._checkpoint: Checkpoint | None = None
        self._tokenizer: Tokenizer | None = None
        self.registry, self.name, self.model_id = registry, name, name
        self.settings = settings
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.slot: Reservation | None = None  # a request's copy: the engine slot its first submission takes
        self.adapter: LoraAdapter | None = None  # a request's copy: the LoRA adapter it runs through (`through`)
        self.adapter_digest: str | None = None  # and a digest of that adapter's files as they were read

    def pinned(self, engine: Engine, checkpoint: Checkpoint, slot: Reservation | None = None) -> GenerationService:
        """A copy for one request that serves it with `engine` and `checkpoint` (those the registry gave it), and
        the slot held for it in `engine` (app/serving/deps.py), if the route takes one."""
        view = copy.copy(self)
        view._engine, view._checkpoint, view.slot = engine, checkpoint, slot
        return view

    def through(self, name: str, adapter: LoraAdapter | None, digest: str) -> GenerationService:
        """This request's copy running through LoRA adapter `adapter` (loaded in its engine; None for a copy that
        only describes it), `digest` of its files, its answers naming model `name`."""
        view = copy.copy(self)
        view.model_id, view.adapter, view.adapter_digest = name, adapter, digest
        return view

    def take_slot(self) -> Reservation | None:
        """The request's slot, for its first submission (the others, `n` samples or a batch of prompts, are
        submitted without one: the engine checks its capacity for each)."""
        slot, self.slot = self.slot, None
        return slot

    def _current(self) -> tuple[Engine, Checkpoint]:
        if self._engine is not None and self._checkpoint is not None:  # a request's pinned copy
            return self._engine, self._checkpoint
        for name, engine, checkpoint in self.registry.loaded():
            if name == self.name:
                return engine, checkpoint
        raise Unavailable(f"the model {self.name!r} is not loaded (it was unloaded to make room); try again")

    @property
    def loaded_engine(self) -> Engine | None:
        """The engine serving the model now, or None while it is not loaded (health and metrics: never loads)."""
        try:
            return self._current()[0]
        except Unavailable:
            return None

    @property
    def engine(self) -> Engine:
        return self._current()[0]

    @property
    def checkpoint(self) -> Checkpoint:
        return self._current()[1]

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer or self.checkpoint.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Tokenizer | None) -> None:  # a stand-in (tests gate it); None: the model's own
        self._tokenizer = tokenizer

    @property
    def fingerprint(self) -> str:
        """The served weights' sha256, shortened: answers name it (`system_fingerprint`, `X-Folio-Checkpoint`).
        Through a LoRA adapter, a digest of those and the adapter's: another adapter, or the adapter written again
        by its training run, answers with another."""
        base = (self.checkpoint.meta.get("weights_sha256") or "")[:16]
        if self.adapter_digest is None:
            return base
        return hashlib.sha256(f"{base}:{self.adapter_digest}".encode()).hexdigest()[:16]

    @property
    def quantization(self) -> str:
        """How the served weights are quantized: as the checkpoint stores them, or as --quantize did at load."""
        return self.checkpoint.meta.get("quantization") or self.settings.quantize

    @property
    def defaults(self) -> ServerDefaults:
        return ServerDefaults(self.settings.max_new_tokens_default, self.settings.max_new_tokens_limit,
                              self.settings.sequences_per_request)

    # -- submitting -----------------------------------------------------------------------------------
    async def encode(self, text: str, api: Api, parts: Sequence[tuple[str, str]] = ()) -> list[int]:
        """Tokenise: a long prompt off the event loop (a megabyte takes a while), a short one on it (well under a
        millisecond, less than the hand-off to a worker thread and back costs). Errors name `api`'s prompt field,
        or the first of `parts` (a field of the request and its text within the prompt: a system prompt) that the
        vocabulary cannot take either, with what that field holds."""
        try:
            if len(text) <= INLINE_ENCODE_CHARS:
                return self.tokenizer.encode(text)
            return await run_in_threadpool(self.tokenizer.encode, text)
        except ValueError as e:
            for field, part in parts:  # the prompt failed: its parts are tried only now
                try:
                    await run_in_threadpool(self.tokenizer.encode, part)
                except ValueError as in_part:
                    raise ValidationError(field, str(in_part)) from None
            raise ValidationError(api.field("prompt"), str(e)) from None

    async def compile(self, requested: Requested) -> Constraint:
        """The request's output constraint compiled for this model's tokenizer (off the event loop and the engine
        thread, bounded in time, the same spec compiled once): a constraint the model's vocabulary cannot produce,
        or one that is invalid or too big, is a 422 naming the field it came from."""
        try:
            return await compile_constraint_async(requested.spec, self.engine.tokenizer)
        except ConstraintError as e:
            raise ValidationError(requested.field, e.message) from None

    async def constrained(self, params: SamplingParams, requested: Requested | None) -> SamplingParams:
        """`params` with the request's output constraint (`compile`), if it asked for one."""
        if requested is None:
            return params
        return replace(params, constraint=await self.compile(requested))

    async def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          add_generation_prompt: bool, api: Api) -> str:
        """A conversation as the prompt the model's chat template makes of it (the checkpoint's, else
        --chat-template, else the default), rendered off the event loop: its work grows with the conversation. A
        template that fails, or a conversation it cannot take, is a 422 naming `api`'s field for the messages."""
        template = self.registry.chat_template(self.checkpoint)
        tokens = special_tokens(self.tokenizer)
        with api.naming_fields():
            return await run_in_threadpool(lambda: template.render(
                messages, add_generation_prompt=add_generation_prompt, tools=tools, **tokens))

    async def start(self, text: str | list[int], params: SamplingParams, truncate: int | None,
                    api: Api, parts: Sequence[tuple[str, str]] = ()) -> GenerationStream:
        """Tokenise (or take token ids as they are), then submit into the request's slot (`take_slot`): the engine
        checks the prompt against the model (its context, its vocabulary) and the parameters as it takes it.
        Errors name `api`'s fields (or one of `parts`: `encode`)."""
        return (await self.start_many(text, [params], truncate, api, parts))[0]

    async def start_many(self, text: str | list[int], params: list[SamplingParams], truncate: int | None,
                         api: Api, parts: Sequence[tuple[str, str]] = ()) -> list[GenerationStream]:
        """`start` for several samples of one prompt (`n`): tokenised once; submitted together, so that they
        share the prompt's prefill (the prefix cache). If one cannot be submitted (429, or 422 from the engine's
        checks of the prompt and the parameters), none runs."""
        engine = self.engine  # one engine for the whole request, whatever a reload swaps in meanwhile
        if self.adapter is not None:
            params = [replace(p, adapter=self.adapter) for p in params]
        prompt = await self.encode(text, api, parts) if isinstance(text, str) else text
        reservation = self.take_slot()
        try:
            with api.naming_fields():  # the engine validates (and truncates) as it takes the request: once
                return self._submit(engine, prompt, params, truncate, reservation)
        except EngineStopped:
            if self.lifecycle.draining:
                raise
        # a reload retired the engine between the slot and the submission: the new one takes the request
        _, engine, checkpoint = await self.registry.acquire(self.name)
        self._engine, self._checkpoint = engine, checkpoint  # this request's copy: its answer names them
        if self.adapter is not None:  # the new engine loads its adapters at their first request (models.py)
            raise Unavailable(f"the model {self.model_id!r} was reloaded while this request started; try again")
        with api.naming_fields():
            return self._submit(engine, prompt, params, truncate, None)

    @staticmethod
    def _submit(engine: Engine, prompt: list[int], params: list[SamplingParams], truncate: int | None,
                reservation: Reservation | None) -> list[GenerationStream]:
        streams: list[GenerationStream] = []
        try:
            for i, p in enumerate(params):
                streams.append(engine.submit(prompt, p, truncate=truncate,
                                             reservation=reservation if i == 0 else None))
        except BaseException:
            cancel_all(streams)
            raise
        return streams

    # -- running --------------------------------------------------------------------------------------
    async def event_batches(self, stream: GenerationStream, record: RequestRecord | None,
                            ) -> AsyncIterator[list[TokenEvent | Finished]]:
        """The stream's events as they arrive, several at a time when they queued up (`GenerationStream.batches`),
        with time to first token and inter-token latency recorded from when the engine made each token, and the
        request's `record` (app/http/requestlog.py) kept up to date."""
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

    async def text_batches(self, stream: GenerationStream, record: RequestRecord | None,
                           ) -> AsyncIterator[list[tuple[str, Finished | None]]]:
        """`event_batches` as (text, the end if this event ends the generation) per event: what a stream of text
        deltas (Anthropic's, the Responses API's) writes."""
        async for batch in self.event_batches(stream, record):
            yield [("", ev) if isinstance(ev, Finished) else (ev.text, ev.finished) for ev in batch]

    async def interleaved(self, streams: list[GenerationStream], record: RequestRecord | None,
                          ) -> AsyncIterator[tuple[int, list[TokenEvent | Finished]] | EngineError]:
        """The event batches of several streams (a request's choices) as they come, each with its stream's index;
        a stream that fails ends it (its error is the last item). Close it (`aclose`) when done: its readers stop
        then; cancelling the streams stays the caller's (`cancel_all`)."""
        queue: asyncio.Queue[tuple[int, list[TokenEvent | Finished]] | EngineError | None] = asyncio.Queue()

        async def pump(index: int, stream: GenerationStream) -> None:
            try:
                async for batch in self.event_batches(stream, record):
                    await queue.put((index, batch))
            except EngineError as e:
                await queue.put(e)
            finally:
                await queue.put(None)

        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        running = len(streams)
        try:
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                yield item
                if isinstance(item, EngineError):
                    return
        finally:
            for p in pumps:
                p.cancel()

    async def result(self, request: Request, stream: GenerationStream) -> Result:
        """Await a whole generation, cancelling it if the client disconnects meanwhile (`ClientGone`: 499). Woken
        for its tokens only every RESULT_WAKE_S (its record and latency metrics catch up then), not per token."""
        stream.quiet(RESULT_WAKE_S)
        batches = self.event_batches(stream, request_record(request))
        return await until_done(request, stream.collect(batches), stream.cancel)

    async def results(self, request: Request, streams: list[GenerationStream]) -> list[Result]:
        """`result` of each of a request's streams (its samples, its prompts), in order. When one fails or the
        client disconnects, the others are cancelled too (a no-op for those already finished)."""
        try:
            return list(await asyncio.gather(*(self.result(request, s) for s in streams)))
        finally:
            cancel_all(streams)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def token_bytes(self, token: int) -> bytes:
        return self.tokenizer.decode_bytes([token])


def cancel_all(streams: list[GenerationStream]) -> None:
    """Cancel every stream of a request: a no-op for those finished, the others stop and free their slots."""
    for s in streams:
        s.cancel()


async def until_done(request: Request, work: Awaitable[T], cancel: Callable[[], None]) -> T:
    """Await `work` (engine work for this request), calling `cancel` and raising `ClientGone` (499) if the client
    disconnects meanwhile. One task waits for the connection's next ASGI message (the body has been read, so the
    next is `http.disconnect`), where polling `Request.is_disconnected` every 0.25 s took about a third of the event
    loop's time at 32 concurrent requests (py-spy: each poll's anyio cancel scope formatting task reprs) and noticed
    a disconnect up to 0.25 s late."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        cancel()
        raise ClientGone()
    finally:
        for pending in (task, gone):
            if not pending.done():
                pending.cancel()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone: the request's ASGI messages up to `http.disconnect` (a receive that fails
    has lost the connection too)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - whatever broke the connection, the client cannot be answered
        return
