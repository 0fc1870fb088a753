"""The engine's public face: submit token ids with validated `SamplingParams`, get back a stream of events.

`Engine` owns the model (through its `ModelRunner`), the tokenizer and the `Scheduler`, whose loop runs every
model step on the engine thread, never on an asyncio event loop; events reach each event loop once per step
(`stream.Mailbox`). Callers use `submit` (async streams), `generate` (blocking, for scripts and tests),
`reserve` (hold a slot before a request is parsed) and `cancel`. LoRA adapters over its model are loaded and
unloaded with `load_adapter` and `unload_adapter`; a request names one in `SamplingParams.adapter`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from model.checkpoint import Checkpoint, load_checkpoint
from model.engine.ahead import default_async_scheduling
from model.engine.attention import check_spec
from model.engine.config import NGRAM, EngineConfig
from model.engine.events import EngineError, EngineStopped, Event, GenerationError, Result, TokenEvent, end_of
from model.engine.jobs import Job, JobHandle
from model.engine.request import Request
from model.engine.runner import ModelRunner
from model.engine.scheduler import Scheduler
from model.engine.stream import EventQueue, GenerationStream, Mailbox, Reservation
from model.lora import batched as lora
from model.sampling_params import MAX_SEED, ContextTooLong, SamplingParams, ValidationError, preview
from model.speculative import DraftModelProposer, NgramProposer, Proposer, check_same_tokenizer, measure_token_cost

# seeds drawn for requests that set none stay below 2^53, so that a JavaScript client (the playground) reads
# the reported seed exactly and can send it back
DRAWN_SEED_LIMIT = min(2**53, MAX_SEED + 1)


class Engine:
    """Continuous-batching generation over one model. Start with `start()`, stop with `stop()`. The model side
(the model on its device, its KV cache, the kernels) is `runner`'s, a draft model's `draft_runner`'s (speculative
decoding with `speculative_model` a checkpoint directory); the configuration as resolved, `config`."""

    def __init__(self, checkpoint: Checkpoint, config: EngineConfig | None = None, **fields: Any) -> None:
        """`config`, with `fields` of `EngineConfig` over it (`Engine(checkpoint, max_batch_size=4)`)."""
        config = replace(config or EngineConfig(), **fields)
        self.model_config, self.tokenizer = checkpoint.config, checkpoint.tokenizer
        self.block_size = self.model_config.block_size
        window_shift = config.window_shift_for(self.block_size)
        self.runner = ModelRunner(checkpoint, config)
        self.draft_runner: ModelRunner | None = None  # the draft model's, with `--speculative-model PATH`
        proposer = self._proposer(checkpoint, config)
        async_scheduling = config.async_scheduling
        if async_scheduling is None:
            async_scheduling = default_async_scheduling(self.runner.device)
        self.config = replace(config, device=self.runner.device, dtype=self.runner.dtype, threads=self.runner.threads,
                              window_shift=window_shift, async_scheduling=async_scheduling,
                              draft_token_cost=proposer.token_cost if isinstance(proposer, DraftModelProposer)
                              else config.draft_token_cost)
        self.n_vocab, self.eos_id = self.tokenizer.n_vocab, self.tokenizer.eos_id
        self.scheduler = Scheduler(self.runner, self.tokenizer, self.config, proposer)
        self.stats = self.scheduler.stats  # the counters /metrics reads
        self.scheduler.flush = self._flush
        self._lock = self.scheduler.lock
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        # per event loop that submitted: its events of the current step (a loop that is gone drops its mailbox)
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
        # LoRA adapters by name; every adapter this engine loaded (one unloaded still serves the requests holding it)
        self._adapters: dict[str, lora.LoraAdapter] = {}
        self._own_adapters: weakref.WeakSet[lora.LoraAdapter] = weakref.WeakSet()
        if self.config.max_loras:
            self.runner.use_adapters()  # before the engine thread runs a forward: hooks are not added mid-step

    def _proposer(self, checkpoint: Checkpoint, config: EngineConfig) -> Proposer | None:
        """Where speculative decoding's drafts come from (`config.speculative_model`): prompt lookup, or a draft
        model, loaded from its checkpoint directory onto this engine's device and dtype with a KV-cache row per batch
        slot (`draft_runner`), its tokenizer checked against the served model's (ValueError naming both), its step's
        cost measured against the served model's unless `config.draft_token_cost` gives it; None: off."""
        if config.speculative_model is None:
            return None
        if config.speculative_model == NGRAM:
            return NgramProposer(config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max)
        draft = load_checkpoint(config.speculative_model)
        check_same_tokenizer(checkpoint.tokenizer, draft.tokenizer, str(checkpoint.path), str(draft.path))
        runner = self.runner
        self.draft_runner = ModelRunner(draft, replace(config, device=runner.device, dtype=runner.dtype,
                                                       threads=runner.threads or None, max_loras=0))
        cost = config.draft_token_cost
        if cost is None:
            cost = measure_token_cost(self.draft_runner, runner)
        return DraftModelProposer(self.draft_runner, self.tokenizer.n_vocab, cost)

    # -- LoRA adapters ----------------------------------------------------------------------------------
    @property
    def adapters(self) -> dict[str, lora.LoraAdapter]:
        """The adapters loaded now, by name."""
        with self._lock:
            return dict(self._adapters)

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> lora.LoraAdapter:
        """Read the PEFT adapter at `path`, check it against this engine's model and make it `name` (blocking: not
        on an event loop). ValueError naming what differs or what is wrong (adapters off, `max_loras` reached, the
        name taken); nothing changes then."""
        if not self.config.max_loras:
            raise ValueError("LoRA adapters are off for this engine (max_loras is 0)")
        adapter = lora.load_adapter(path, self.model_config, name=name).to(self.runner.device)
        with self._lock:
            if name in self._adapters:
                raise ValueError(f"an adapter named {name!r} is already loaded; unload it first")
            if len(self._adapters) >= self.config.max_loras:
                raise ValueError(f"{len(self._adapters)} adapters are loaded, the most max_loras allows "
                                 f"({self.config.max_loras}); unload one first")
            self._adapters[name] = adapter
            self._own_adapters.add(adapter)
        return adapter

    def reload_adapter(self, name: str, path: str | os.PathLike[str]) -> lora.LoraAdapter:
        """Read adapter `name` again from `path` (its files changed) and serve the new factors to the requests
        submitted from now on; those running finish with the old ones. ValueError (the old one kept) where the new
        files cannot be read or do not fit; KeyError where `name` is not loaded."""
        adapter = lora.load_adapter(path, self.model_config, name=name).to(self.runner.device)
        with self._lock:
            if name not in self._adapters:
                raise KeyError(name)
            self._adapters[name] = adapter
            self._own_adapters.add(adapter)
        return adapter

    def unload_adapter(self, name: str) -> lora.LoraAdapter:
        """Forget adapter `name` (KeyError if none is loaded): no new request can name it; the requests already
        submitted through it finish with it."""
        with self._lock:
            return self._adapters.pop(name)

    @property
    def fault_hook(self) -> Callable[[list[Request]], None] | None:
        """A hook called with each request before its model step (fault injection); raising fails that request."""
        return self.scheduler.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Callable[[list[Request]], None] | None) -> None:
        self.scheduler.fault_hook = hook

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self.scheduler.run, name="folio-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Fail whatever is still queued or running with `EngineStopped`, then join the thread."""
        with self._lock:
            self.scheduler.stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        else:  # never started: no loop will fail what is queued, so fail it here
            with self._lock:
                self.scheduler.fail_all(EngineStopped("the engine stopped before this request started"))

    DRAIN_POLL_S = 0.05

    def drain(self, timeout: float | None = None) -> bool:
        """Admit nothing new (submissions raise EngineStopped), let what is in flight finish (for up to `timeout`
        seconds; None: however long it takes, each request being bounded by its own max_new_tokens), then stop.
        True if everything finished."""
        with self._lock:
            self.scheduler.closing = True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.busy and (deadline is None or time.monotonic() < deadline):
            time.sleep(self.DRAIN_POLL_S)
        finished = not self.busy
        self.stop()
        return finished

    def liveness(self, stall_after: float) -> tuple[bool, str]:
        """Whether the engine thread is alive and stepping: started, not dead, and idle or within `stall_after`
        seconds of its current step's start. With a reason."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return False, "the engine thread is not running"
        started = self.scheduler.step_started
        if started is not None and (age := time.monotonic() - started) > stall_after:
            return False, f"the engine's current step began {age:.1f} s ago (limit {stall_after:g} s)"
        return True, "idle" if started is None else "stepping"

    @property
    def busy(self) -> int:
        """Requests submitted and not finished: waiting, prefilling or decoding."""
        with self._lock:
            return self.scheduler.in_flight()

    WARMUP_ROWS, WARMUP_NEW_TOKENS = 8, 4

    def warmup(self) -> None:
        """Short generations, WARMUP_ROWS of them together (at most the batch size), so that the first real request,
        alone or in a batch, pays no first-call costs: the int8 GEMM (from 4 or 8 rows) packs each weight at its first
        use, ~0.4 s for GPT-2 small, which the first batch of requests would otherwise wait for."""
        params = SamplingParams(max_new_tokens=self.WARMUP_NEW_TOKENS, seed=0)
        prompt = [0] * min(8, self.block_size - 1)
        pending = []
        for _ in range(min(self.WARMUP_ROWS, self.config.max_batch_size)):
            events: queue.Queue[Event] = queue.Queue()
            pending.append((self._enqueue(prompt, params, events.put, None), events))
        self.start()
        for req, events in pending:
            self._wait(req, events, None)

    # -- submission -----------------------------------------------------------------------------------
    def validate(self, prompt: list[int], truncate: int | None = None,
                 params: SamplingParams | None = None) -> list[int]:
        """The prompt the model will see; `ValidationError` (field `prompt` or `truncate`) for an empty or too
        long prompt, a truncation outside the context or a token id outside the vocabulary, (field `logit_bias`) for
        a bias on an id outside it, (field `top_n_tokens` or `prompt_logprobs`) for more alternatives per token
        than the model's vocabulary holds, and (field `attention...`) for streamed attention the model cannot give
        or the limits refuse (`model.engine.attention.check_spec`), and (field `constraint`) for a constraint compiled
        for another tokenizer."""
        if params is not None:
            if params.adapter is not None and params.adapter not in self._own_adapters:
                raise ValidationError("model", f"the adapter {params.adapter.name!r} was not loaded by this engine "
                                               "(Engine.load_adapter)")
            if params.constraint is not None and params.constraint.tokenizer is not self.tokenizer:
                raise ValidationError("constraint", "was compiled for another model's tokenizer; compile it with this "
                                                    "engine's (Engine.tokenizer)")
            if params.attention is not None:
                check_spec(params.attention, self.model_config, params.max_new_tokens)
            for name in ("top_n_tokens", "prompt_logprobs"):
                if (n := getattr(params, name)) is not None and n > self.n_vocab:
                    raise ValidationError(name, f"must be at most the model's vocabulary size, {self.n_vocab}, "
                                                f"got {n}")
        if truncate is not None:
            if not 1 <= truncate <= self.block_size:
                raise ValidationError("truncate", f"must be an integer in [1, {self.block_size}], "
                                                  f"got {preview(truncate)}")
            prompt = prompt[-truncate:]
        if not prompt:
            raise ValidationError("prompt", "the prompt must hold at least one token, got 0")
        if len(prompt) > self.block_size:
            raise ContextTooLong(
                "prompt",
                f"the prompt is {len(prompt)} tokens, more than the model's context of {self.block_size}; "
                f"shorten it or truncate it to at most {self.block_size} tokens",
            )
        self._check_ids("prompt", prompt)  # ids a client sent (a tokenizer's are in range): at most block_size
        if params is not None and params.logit_bias:
            self._check_ids("logit_bias", [i for i, _ in params.logit_bias])
        return prompt

    def _check_ids(self, name: str, ids: list[int]) -> None:
        bad = next((i for i in ids if not 0 <= i < self.n_vocab), None)
        if bad is not None:
            raise ValidationError(name, f"token ids must be in [0, {self.n_vocab - 1}] (the model's vocabulary), "
                                        f"got {preview(bad)}")

    @property
    def reserved(self) -> int:
        """Slots held by `reserve` for requests not yet submitted (or for work that never is: /tokenize)."""
        return self.scheduler.reserved

    def check_capacity(self) -> None:
        """Raise `Overloaded` (counted as a rejection) where `reserve` would, holding nothing: the admission check
        made before a request's body is read, so that a full server reads no body."""
        with self._lock:
            self.scheduler.refuse_if_full()

    def reserve(self) -> Reservation:
        """Hold a slot for a request that is about to be parsed, validated and submitted, or raise `Overloaded`
        (counted as a rejection) at once. A burst is then refused as it arrives: without the hold, every request
        of a burst would pass a capacity check made before any of them was submitted, and each would be parsed
        and tokenised before being refused. Pass the reservation to `submit`, or `release()` it."""
        with self._lock:
            self.scheduler.refuse_if_full()
            self.scheduler.reserved += 1
        held = [True]

        def give_back() -> bool:
            with self._lock:
                if not held[0]:
                    return False
                held[0] = False
                self.scheduler.reserved -= 1
                return True

        return Reservation(give_back, owner=self)

    def submit(self, prompt: list[int], params: SamplingParams, *, truncate: int | None = None,
               reservation: Reservation | None = None) -> GenerationStream:
        """From the event loop: enqueue and return the request's async stream (raises Overloaded at once unless
        `reservation` holds a slot for it)."""
        mailbox = self._mailbox(asyncio.get_running_loop())
        events = EventQueue()

        def sink(ev: Event) -> None:
            if not mailbox.post(events, ev):  # the caller's event loop is closed: nobody is listening any more
                req.cancelled = True
            elif threading.current_thread() is not self._thread:
                mailbox.flush()  # not from a step, which flushes at its end (see `_flush`)

        req = self._enqueue(prompt, params, sink, truncate, reservation)
        return GenerationStream(events, lambda: self.cancel(req), seed=req.seed, prompt_tokens=len(req.prompt))

    def generate(self, prompt: list[int], params: SamplingParams, *, truncate: int | None = None,
                 timeout: float | None = None) -> Result:
        """Blocking convenience for scripts and tests (not for the event loop)."""
        events: queue.Queue[Event] = queue.Queue()
        req = self._enqueue(prompt, params, events.put, truncate)
        self.start()
        return self._wait(req, events, timeout)

    def _wait(self, req: Request, events: queue.Queue[Event], timeout: float | None) -> Result:
        """`req`'s result from the queue its events go to (`generate`, `warmup`); cancelled after `timeout` seconds
        without an event."""
        tokens: list[TokenEvent] = []
        while True:
            try:
                ev = events.get(timeout=timeout)
            except queue.Empty:
                self.cancel(req)
                raise GenerationError("generation timed out") from None
            if isinstance(ev, EngineError):
                raise ev
            if isinstance(ev, TokenEvent):
                tokens.append(ev)
            if end := end_of(ev):
                return Result(tokens, end)

    def submit_job(self, steps: Iterator[Any], result: Callable[[], Any], *,
                   reservation: Reservation | None = None) -> JobHandle:
        """Run `steps` on the engine thread, one step between two engine steps; the handle gives `result()` once
        they are done (raises Overloaded at once unless `reservation` holds a slot for it)."""
        try:
            future = asyncio.get_running_loop().create_future()
        except RuntimeError:  # from a plain thread: wait() on the handle
            future = None
        holder: list[Job] = []
        handle = JobHandle(lambda: self.cancel(holder[0]), future)
        job = Job(next(self._ids), steps, result, handle.settle)
        holder.append(job)
        with self._lock:
            self._admit(reservation)
            self.scheduler.add_job(job)
        return handle

    def cancel(self, req: Request | Job) -> None:
        """Thread-safe; the request leaves the batch before the next model step."""
        with self._lock:
            self.scheduler.cancel(req)

    def _enqueue(self, prompt: list[int], params: SamplingParams, sink: Callable[[Event], None],
                 truncate: int | None, reservation: Reservation | None = None) -> Request:
        seen = self.validate(prompt, truncate, params)
        seed = params.seed
        if params.is_greedy:
            seed = None  # greedy decoding samples nothing: no seed to report (TGI's details say null)
        elif seed is None:
            seed = random.SystemRandom().randrange(DRAWN_SEED_LIMIT)
        req = Request(next(self._ids), seen, params, seed, sink, truncated=len(prompt) - len(seen))
        with self._lock:
            self._admit(reservation)
            self.scheduler.enqueue(req)
        return req

    def _admit(self, reservation: Reservation | None) -> None:
        """Under the lock: refuse when stopping, else take the reservation's slot or check there is one free."""
        if self.scheduler.stopping or self.scheduler.closing:
            if reservation is not None:
                reservation.release()
            raise EngineStopped("the engine is shutting down")
        # a held reservation's slot becomes this request's (the lock is reentrant)
        if reservation is None or not reservation.release():
            self.scheduler.refuse_if_full()

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        with self._lock:
            mailbox = self._mailboxes.get(loop)
            if mailbox is None:
                mailbox = self._mailboxes[loop] = Mailbox(loop)
            return mailbox

    def _flush(self) -> None:
        """Hand every event loop the events of the step just done."""
        with self._lock:
            mailboxes = list(self._mailboxes.values())
        for mailbox in mailboxes:
            mailbox.flush()
