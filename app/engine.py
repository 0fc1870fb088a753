"""The inference engine: continuous batching over a preallocated KV cache, on its own thread.

The engine owns the model, the tokenizer and the KV cache. Callers hand it token ids and validated
`SamplingParams`; it hands back a stream of `TokenEvent`s ending in a `Finished` (or an error). Model work
runs on the engine thread only, never on the asyncio event loop; results cross over with
`loop.call_soon_threadsafe`, once per step for all of a loop's streams (`_Mailbox`).

Scheduling, one iteration of the engine loop:
1. admit waiting requests into free batch slots (FIFO), up to `max_batch_size`;
2. drop cancelled requests (their slot is free before the next model step);
3. prefill: the next chunk of the oldest admitted request, with the admitted requests whose chunks are
   closest to its length, up to `prefill_chunk` tokens in one forward (see `_prefill_step`); a long prompt
   therefore takes several iterations, and running streams get a decode step between its chunks;
4. one decode step for every running row together: each row at its own position, with its own sampling
   parameters, generator and stop rules; greedy rows choose their tokens together.

Rows: a request takes a free cache row when its prefill starts and gives it back when it leaves; a decode step
reads the running rows wherever they are (a slice when they happen to be 0..R-1).

Sliding window: position embeddings cover `block_size` positions. When a row's next token would sit at
position `block_size`, the window slides: the row keeps its last `block_size - window_shift + 1` tokens,
re-prefilled at positions 0.., so the next `window_shift - 1` tokens decode from the cache before the next
slide. With `window_shift=1` every step past the window re-prefills the last `block_size` tokens, which is
exactly what nanoGPT's cropping `generate` does (and what the naive loop does). The result reports how
often the window slid.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from model import kernels
from model.checkpoint import Checkpoint
from model.gpt import KVCache
from model.sampling import SamplingParams, ValidationError, choose_token, mask_unusable, new_generator, preview
from model.stopping import LENGTH, STOP_SEQUENCE, TextStream, check_stop_token

log = logging.getLogger("folio.engine")


class EngineError(Exception):
    """Base of the engine's domain errors (the app maps each to an HTTP status)."""


class Overloaded(EngineError):
    """The running batch and the waiting queue are both full."""


class GenerationError(EngineError):
    """Generation failed for this request (the engine keeps serving the others)."""


class EngineStopped(EngineError):
    """The engine is shutting down or stopped."""


@dataclass(frozen=True)
class TopToken:
    id: int
    text: str
    logprob: float
    special: bool


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "length", "eos_token", "stop_sequence"
    generated_text: str
    generated_tokens: int
    seed: int
    prompt_tokens: int
    prefill: tuple[int, ...]  # the prompt's token ids as the model saw them (after truncation)
    stop_sequence: str | None = None
    window_slides: int = 0
    truncated_prompt_tokens: int = 0


@dataclass(frozen=True)
class TokenEvent:
    id: int
    text: str  # the text this token releases: UTF-8 safe, stop strings held back
    logprob: float
    special: bool
    index: int  # 1-based count of generated tokens
    top_tokens: tuple[TopToken, ...] = ()
    finished: Finished | None = None  # set on the last token (a `Finished` event follows it too)
    created: float = field(default_factory=time.perf_counter)  # when the engine produced it (latency metrics)


@dataclass
class Result:
    """A whole generation, gathered from a stream (what the non-streaming routes return)."""

    tokens: list[TokenEvent]
    finished: Finished

    @property
    def text(self) -> str:
        return self.finished.generated_text

    @property
    def token_ids(self) -> list[int]:
        return [t.id for t in self.tokens]


Event = TokenEvent | Finished | EngineError


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    sink: Callable[[Event], None]
    truncated: int = 0
    context: list[int] = field(default_factory=list)  # tokens the model sees (the window)
    output: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens already in the cache
    pos: int = 0  # position of the next token fed to the model
    row: int = -1
    slides: int = 0
    cancelled: bool = False
    generator: torch.Generator | None = None
    stream: TextStream | None = None
    text: list[str] = field(default_factory=list)
    submitted_at: float = field(default_factory=time.perf_counter)


class _Mailbox:
    """Events bound for the streams of one event loop, handed over in one callback per engine step instead of one
    `call_soon_threadsafe` per token (each of those takes the loop's lock and writes its wake-up pipe while the
    engine thread holds the GIL, and wakes the loop once per token). The engine thread posts during a step and
    flushes at its end; a post from any other thread flushes at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.closed = False  # the loop is closed: nobody is listening any more
        self._pending: list[tuple[asyncio.Queue[Event], Event]] = []
        self._scheduled = False
        self._lock = threading.Lock()

    def post(self, events: asyncio.Queue[Event], ev: Event) -> bool:
        """Queue `ev` for `events`; False when the loop is closed."""
        with self._lock:
            if self.closed:
                return False
            self._pending.append((events, ev))
        return True

    def flush(self) -> None:
        with self._lock:
            if self._scheduled or not self._pending or self.closed:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed
            with self._lock:
                self.closed = True
                self._pending.clear()

    def _deliver(self) -> None:  # on the loop
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        for events, ev in pending:
            events.put_nowait(ev)


class GenerationStream:
    """What `Engine.submit` returns: an async iterator of events; `cancel()` when the client is gone."""

    def __init__(self, engine: Engine, request: _Request, events: asyncio.Queue[Event]) -> None:
        self._engine = engine
        self._request = request
        self._events = events
        self.seed = request.seed
        self.prompt_tokens = len(request.prompt)

    def cancel(self) -> None:
        self._engine.cancel(self._request)

    def __aiter__(self) -> AsyncIterator[TokenEvent | Finished]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenEvent | Finished]:
        async for batch in self.batches():
            for ev in batch:
                yield ev

    async def batches(self) -> AsyncIterator[list[TokenEvent | Finished]]:
        """The events in arrival order, each item every event that has arrived by then (at least one): a stream
        the event loop is behind on is written in one piece, not one write per token. Ends after `Finished`;
        an engine error is raised after the events before it."""
        try:
            while True:
                batch = [await self._events.get()]
                while not self._events.empty() and not isinstance(batch[-1], (Finished, EngineError)):
                    batch.append(self._events.get_nowait())
                if isinstance(batch[-1], EngineError):
                    if len(batch) > 1:
                        yield batch[:-1]
                    raise batch[-1]
                yield batch
                if isinstance(batch[-1], Finished):
                    return
        finally:
            self.cancel()  # no-op once finished; frees the slot if the consumer stopped early

    async def collect(self) -> Result:
        tokens: list[TokenEvent] = []
        async for ev in self:
            if isinstance(ev, Finished):
                return Result(tokens, ev)
            tokens.append(ev)
        raise GenerationError("stream ended without a result")


class Reservation:
    """A slot held for a request between its admission and its submission (`Engine.reserve`)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.held = True

    def release(self) -> None:
        """Give the slot back if the request was never submitted (idempotent)."""
        with self._engine._lock:
            if self.held:
                self.held = False
                self._engine._reserved -= 1


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    cancelled_total: int = 0
    rejected_total: int = 0
    failed_total: int = 0
    generated_tokens_total: int = 0


class Engine:
    """Continuous-batching generation over one model. Start with `start()`, stop with `stop()`."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        max_batch_size: int = 16,
        max_waiting: int = 64,
        prefill_chunk: int = 512,
        window_shift: int | None = None,
        threads: int | None = None,
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        if self.device.type == "cpu":
            torch.set_num_threads(threads or os.cpu_count() or 1)
        # the CPU decode kernels (built once and cached; torch's ops serve where they cannot be): /info says which
        self.cpu_kernels = "not used on this device"
        if self.device.type == "cpu" and self.dtype == torch.float32:
            kernels.load()
            self.cpu_kernels = kernels.status()
        self.model = checkpoint.model.to(device=self.device, dtype=self.dtype).eval()
        # the kernels' modules in place of torch's, with packed weights for batched decode steps (as much memory
        # again as the weights); nothing where the kernels are not used
        self.packed_bytes = kernels.install(self.model).packed_bytes
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.n_vocab = self.tokenizer.n_vocab
        self.eos_id = self.tokenizer.eos_id
        self.block_size = self.config.block_size
        if max_batch_size < 1 or max_waiting < 0 or prefill_chunk < 1:
            raise ValueError("max_batch_size and prefill_chunk must be >= 1, max_waiting >= 0")
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self.window_shift = window_shift or max(1, self.block_size // 8)
        if not 1 <= self.window_shift < self.block_size:
            raise ValueError(f"window_shift must be in [1, {self.block_size - 1}], got {self.window_shift}")
        # a cache row per slot; a request holds its row from its first prefill step until it leaves
        self.cache = KVCache(self.config, max_batch_size, device=self.device, dtype=self.dtype)
        self._free_rows = list(range(max_batch_size - 1, -1, -1))
        self.stats = EngineStats()
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._prefilling: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._reserved = 0  # slots held by `reserve` for requests not yet submitted
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._step_started: float | None = None  # monotonic time the current loop iteration began; None when idle
        # per event loop that submitted: its events of the current step (a loop that is gone drops its mailbox)
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()
        self.on_step: Callable[[list[_Request]], None] | None = None  # test hook: fault injection

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="folio-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Fail whatever is still queued or running with `EngineStopped`, then join the thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        else:  # never started: no loop will fail what is queued, so fail it here
            with self._lock:
                self._fail_all(EngineStopped("the engine stopped before this request started"))

    def liveness(self, stall_after: float) -> tuple[bool, str]:
        """Whether the engine thread is alive and stepping: started, not dead, and idle or within `stall_after`
        seconds of its current step's start. With a reason."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return False, "the engine thread is not running"
        started = self._step_started
        if started is not None and (age := time.monotonic() - started) > stall_after:
            return False, f"the engine's current step began {age:.1f} s ago (limit {stall_after:g} s)"
        return True, "idle" if started is None else "stepping"

    @property
    def busy(self) -> int:
        with self._lock:
            return len(self._running) + len(self._prefilling) + len(self._waiting)

    @property
    def reserved(self) -> int:
        """Slots held by `reserve` for requests not yet submitted (or for work that never is: /tokenize)."""
        return self._reserved

    def warmup(self) -> None:
        """One short generation so the first real request pays no first-call costs."""
        self.generate([0] * min(8, self.block_size - 1), SamplingParams(max_new_tokens=4, seed=0))

    # -- submission -----------------------------------------------------------------------------------
    def validate(self, prompt: list[int], params: SamplingParams, truncate: int | None = None) -> list[int]:
        """The prompt the model will see; raises `ValidationError` for an empty or too long prompt, and for
        parameters beyond this model (more alternatives per token than its vocabulary holds)."""
        if params.top_n_tokens > self.n_vocab:
            raise ValidationError("top_n_tokens", f"must be at most the model's vocabulary size, {self.n_vocab}, "
                                                  f"got {params.top_n_tokens}")
        if truncate is not None:
            if not 1 <= truncate <= self.block_size:
                raise ValidationError("truncate", f"must be an integer in [1, {self.block_size}], "
                                                  f"got {preview(truncate)}")
            prompt = prompt[-truncate:]
        if not prompt:
            raise ValidationError("inputs", "the prompt must hold at least one token, got 0")
        if len(prompt) > self.block_size:
            raise ValidationError(
                "inputs",
                f"the prompt is {len(prompt)} tokens, more than the model's context of {self.block_size}; "
                f"shorten it or truncate it to at most {self.block_size} tokens",
            )
        return prompt

    def _enqueue(self, prompt: list[int], params: SamplingParams, sink: Callable[[Event], None],
                 truncate: int | None, reservation: Reservation | None = None) -> _Request:
        seen = self.validate(prompt, params, truncate)
        # a drawn seed stays below 2^53, so it survives clients that read JSON numbers as doubles (JavaScript):
        # pasted back, it gives the same text. A request may still name any seed up to 2^63 - 1
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**53)
        req = _Request(next(self._ids), seen, params, seed, sink, truncated=len(prompt) - len(seen))
        with self._lock:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            if reservation is not None and reservation.held:
                reservation.release()  # its slot becomes this request's (the lock is reentrant)
            else:
                self._refuse_if_full()
            self._waiting.append(req)
            self.stats.waiting = len(self._waiting)
            self._lock.notify_all()
        return req

    def reserve(self) -> Reservation:
        """Hold a slot for a request that is about to be parsed, validated and submitted, or raise `Overloaded`
        (counted as a rejection) at once. A burst is then refused as it arrives: without the hold, every request
        of a burst would pass a capacity check made before any of them was submitted, and each would be parsed
        and tokenised before being refused. Pass the reservation to `submit`, or `release()` it."""
        with self._lock:
            self._refuse_if_full()
            self._reserved += 1
            return Reservation(self)

    def check_capacity(self) -> None:
        """Raise `Overloaded` (counted as a rejection) where `reserve` would, holding nothing: the admission check
        made before a request's body is read, so that a full server reads no body."""
        with self._lock:
            self._refuse_if_full()

    def _refuse_if_full(self) -> None:
        # bound the total, not just the waiting queue: requests wait in `_waiting` until the engine thread
        # admits them, so a burst (or an engine not yet started) must not grow the backlog past capacity;
        # reserved slots count as taken
        in_flight = len(self._running) + len(self._prefilling) + len(self._waiting) + self._reserved
        if in_flight >= self.max_batch_size + self.max_waiting:
            self.stats.rejected_total += 1
            raise Overloaded(f"the server is at capacity ({self.max_batch_size} running, {self.max_waiting} waiting)")

    def submit(self, prompt: list[int], params: SamplingParams, *, truncate: int | None = None,
               reservation: Reservation | None = None) -> GenerationStream:
        """From the event loop: enqueue and return the request's async stream (raises Overloaded at once unless
        `reservation` holds a slot for it)."""
        mailbox = self._mailbox(asyncio.get_running_loop())
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:
            if not mailbox.post(events, ev):  # the caller's event loop is closed: nobody is listening any more
                req.cancelled = True
            elif threading.current_thread() is not self._thread:
                mailbox.flush()  # not from a step, which flushes at its end (see `_flush`)

        req = self._enqueue(prompt, params, sink, truncate, reservation)
        return GenerationStream(self, req, events)

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        with self._lock:
            mailbox = self._mailboxes.get(loop)
            if mailbox is None:
                mailbox = self._mailboxes[loop] = _Mailbox(loop)
            return mailbox

    def _flush(self) -> None:
        """Hand every event loop the events of the step just done."""
        with self._lock:
            mailboxes = list(self._mailboxes.values())
        for mailbox in mailboxes:
            mailbox.flush()

    def generate(self, prompt: list[int], params: SamplingParams, *, truncate: int | None = None,
                 timeout: float | None = None) -> Result:
        """Blocking convenience for scripts and tests (not for the event loop)."""
        events: queue.Queue[Event] = queue.Queue()
        req = self._enqueue(prompt, params, events.put, truncate)
        self.start()
        tokens: list[TokenEvent] = []
        while True:
            try:
                ev = events.get(timeout=timeout)
            except queue.Empty:
                self.cancel(req)
                raise GenerationError("generation timed out") from None
            if isinstance(ev, EngineError):
                raise ev
            if isinstance(ev, Finished):
                return Result(tokens, ev)
            tokens.append(ev)

    def cancel(self, req: _Request) -> None:
        """Thread-safe; the request leaves the batch before the next model step."""
        with self._lock:
            if not req.cancelled and (req in self._waiting or req in self._prefilling or req in self._running):
                req.cancelled = True
                self._lock.notify_all()

    # -- the engine thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._lock:
                self._step_started = None
                while not (self._stopping or self._waiting or self._prefilling or self._running):
                    self._lock.wait()
                self._step_started = time.monotonic()
                if self._stopping:
                    self._fail_all(EngineStopped("the engine stopped before this request finished"))
                    self._flush()
                    return
                self._reap_cancelled()
                while self._waiting and len(self._running) + len(self._prefilling) < self.max_batch_size:
                    self._prefilling.append(self._waiting.popleft())
                self.stats.waiting = len(self._waiting)
                self._count_running()
            try:
                with torch.inference_mode():
                    if self._prefilling:
                        self._prefill_step()
                        self._flush()  # first tokens go out now, not after the decode step
                    if self._running:
                        # torch's small ops of a decode step on this thread alone; the kernels use their own pool
                        with kernels.serial_torch_ops():
                            self._decode_step()
            except Exception as e:  # a bug in the loop itself: fail what is in flight, keep serving
                log.exception("engine step failed")
                with self._lock:
                    for req in list(self._running) + list(self._prefilling):
                        self._fail(req, GenerationError(f"generation failed: {e}"))
            self._flush()

    def _reap_cancelled(self) -> None:
        for req in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(req)
            self.stats.cancelled_total += 1
        for req in [r for r in self._prefilling if r.cancelled]:
            self._prefilling.remove(req)
            self._release_row(req)
            self.stats.cancelled_total += 1
        for req in [r for r in self._running if r.cancelled]:
            self._remove_running(req)
            self.stats.cancelled_total += 1

    def _fail_all(self, err: EngineError) -> None:
        failed = list(self._waiting) + list(self._prefilling) + list(self._running)
        self._waiting.clear()
        self._prefilling.clear()
        self._running.clear()
        for req in failed:
            self._release_row(req)
        self.stats.waiting = 0
        self._count_running()
        for req in failed:
            req.sink(err)

    def _fail(self, req: _Request, err: EngineError) -> None:
        self.stats.failed_total += 1
        if req in self._running:
            self._remove_running(req)
        elif req in self._prefilling:
            self._prefilling.remove(req)
            self._release_row(req)
            self._count_running()
        req.sink(err)

    def _count_running(self) -> None:
        """The running-batch gauge: the slots taken, by requests being prefilled or decoded. Updated wherever a
        request takes or leaves a slot, before its last event is sent, so that a client told its request ended
        never finds it still counted in /metrics."""
        self.stats.running = len(self._running) + len(self._prefilling)

    def _remove_running(self, req: _Request) -> None:
        self._running.remove(req)
        self._release_row(req)
        self._count_running()

    def _release_row(self, req: _Request) -> None:
        if req.row >= 0:
            self._free_rows.append(req.row)
            req.row = -1

    def _begin(self, req: _Request) -> None:
        req.row = self._free_rows.pop()  # running + prefilling <= max_batch_size: there is always one
        req.context = list(req.prompt)
        req.generator = None if req.params.is_greedy else new_generator(req.seed, self.device)
        skip = [self.eos_id] if self.eos_id is not None else []
        req.stream = TextStream(self.tokenizer, req.params.stop, skip_ids=skip)

    def _prefill_step(self) -> None:
        """Feed the next prompt chunk of every admitted request that fits, in one forward.

        The oldest admitted request always goes, then the others whose chunks are closest to its length (little
        padding), as many as fit in `prefill_chunk` tokens counted with padding. A prompt longer than that is fed
        `prefill_chunk` tokens per step, between decode steps, so a long prompt never stalls the running streams
        for more than one chunk. Shorter chunks are right-padded; padding writes cache slots past its row's
        position, which nothing reads before the row's own tokens overwrite them (a query at position p reads
        slots 0..p)."""
        def chunk(r: _Request) -> int:
            return min(len(r.prompt) - r.prefilled, self.prefill_chunk)

        oldest = self._prefilling[0]
        others = sorted(list(self._prefilling)[1:], key=lambda r: abs(chunk(r) - chunk(oldest)))
        batch: list[_Request] = []
        sizes: list[int] = []
        for req in [oldest, *others]:
            n = chunk(req)
            width = max(sizes + [n])
            if batch and width * (len(batch) + 1) > self.prefill_chunk:
                continue
            # padding needs slots past the chunk: a chunk ending at the context's last slot is never padded
            if batch and any(r.prefilled + m == self.block_size and m < width
                             for r, m in zip(batch + [req], sizes + [n])):
                continue
            batch.append(req)
            sizes.append(n)
        for req in batch:
            if req.prefilled == 0:
                self._begin(req)
        kept = self._on_step(batch, " during prefill")
        sizes = [n for req, n in zip(batch, sizes) if req in kept]
        batch = kept
        if not batch:
            return
        chunks = [req.prompt[req.prefilled : req.prefilled + n] for req, n in zip(batch, sizes)]
        try:
            logits = self._forward_rows(batch, chunks, [req.prefilled for req in batch])
        except Exception as e:
            for req in batch:
                log.warning("request %d failed in prefill: %s", req.id, e)
                self._fail(req, GenerationError(f"generation failed during prefill: {e}"))
            return
        for req, chunk, row_logits in zip(batch, chunks, logits):
            req.prefilled += len(chunk)
            req.pos = req.prefilled
            if req.prefilled < len(req.prompt):
                continue
            self._prefilling.remove(req)
            self._running.append(req)
            try:
                self._emit_next(req, row_logits)
            except Exception as e:  # this request's own failure (its first token): it alone fails
                log.warning("request %d failed choosing its first token: %s", req.id, e)
                self._fail(req, GenerationError(f"generation failed: {e}"))

    def _on_step(self, reqs: list[_Request], phase: str) -> list[_Request]:
        """Run the `on_step` hook (fault injection) per request; a request it raises for fails alone. The rest."""
        if self.on_step is None:
            return reqs
        kept = []
        for req in reqs:
            try:
                self.on_step([req])
                kept.append(req)
            except Exception as e:
                log.warning("request %d failed%s: %s", req.id, phase, e)
                self._fail(req, GenerationError(f"generation failed{phase}: {e}"))
        return kept

    def _forward_rows(self, reqs: list[_Request], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Forward each request's `chunk` at positions start.. in its own cache row, right-padded to the longest;
        the logits of each chunk's last token, (len(reqs), vocab)."""
        width = max(len(c) for c in chunks)
        last = self.block_size - 1
        idx = [c + [0] * (width - len(c)) for c in chunks]
        pos = [[min(start + t, last) for t in range(width)] for start in starts]
        take = torch.tensor([len(c) - 1 for c in chunks], device=self.device)
        rows = torch.tensor([r.row for r in reqs], device=self.device)
        logits = self.model(torch.tensor(idx, device=self.device), pos=torch.tensor(pos, device=self.device),
                            kv_cache=self.cache, rows=rows, kv_len=min(self.block_size, max(starts) + width),
                            take=take)
        return logits[:, 0]

    def _decode_step(self) -> None:
        """One token for every running row; rows whose window is full slide it (re-prefill) first."""
        rows = self._on_step(list(self._running), "")
        slid: dict[int, torch.Tensor] = {}  # the logits of rows whose window slid, by request id
        normal = []
        for req in rows:
            if req.pos > self.block_size:  # the unfed token would sit at position block_size
                keep = self.block_size - self.window_shift + 1
                req.context = req.context[-keep:]
                req.slides += 1
                slid[req.id] = self._forward_rows([req], [req.context], [0])[0]
                req.pos = len(req.context)
            else:
                normal.append(req)
        if not rows:
            return
        stacked = None  # the rows' logits, in their order
        if normal:
            n = len(normal)
            # rows are wherever each request got one; 0..n-1 in order needs no index (cheaper without the kernels)
            contiguous = [r.row for r in normal] == list(range(n))
            idx = torch.tensor([[r.context[-1]] for r in normal], dtype=torch.long, device=self.device)
            pos = torch.tensor([[r.pos - 1] for r in normal], dtype=torch.long, device=self.device)
            kv_len = max(r.pos for r in normal)
            row_idx = None if contiguous else torch.tensor([r.row for r in normal], device=self.device)
            stacked = self.model(idx, pos=pos, kv_cache=self.cache, rows=row_idx, kv_len=kv_len, last_only=True)[:, -1]
        if slid:  # rare: the slid rows' logits between the others' (`normal` keeps the rows' order)
            others = iter(() if stacked is None else stacked)
            stacked = torch.stack([slid[r.id] if r.id in slid else next(others) for r in rows])
        assert stacked is not None
        masked = mask_unusable(stacked.float(), self.n_vocab)
        logprobs = torch.log_softmax(masked, dim=-1)
        # greedy rows without a repetition penalty choose together: one argmax and one gather for all of them,
        # not a few tensor ops each (the same argmax of the same masked logits as `choose_token`)
        chosen: dict[int, tuple[int, float]] = {}
        plain = [i for i, r in enumerate(rows) if r.params.is_greedy and r.params.repetition_penalty in (None, 1.0)]
        if plain:
            sel = torch.tensor(plain, device=masked.device)
            tokens = masked[sel].argmax(dim=-1)
            lps = logprobs[sel].gather(1, tokens[:, None])[:, 0]
            chosen = {i: (t, lp) for i, t, lp in zip(plain, tokens.tolist(), lps.tolist())}
        for i, req in enumerate(rows):
            try:
                if i in chosen:
                    token, logprob = chosen[i]
                else:
                    token = self._choose(req, stacked[i])
                    logprob = float(logprobs[i, token])
                self._emit(req, token, logprob, logprobs[i])
            except Exception as e:
                log.warning("request %d failed choosing a token: %s", req.id, e)
                self._fail(req, GenerationError(f"generation failed: {e}"))

    def _choose(self, req: _Request, logits: torch.Tensor) -> int:
        """The request's next token from its logits (steps 1-7 of model/sampling.py)."""
        context = None
        if req.params.repetition_penalty not in (None, 1.0):
            # every id seen so far (prompt and output), as the naive loop does; `req.context` is only the
            # window once it has slid
            context = torch.tensor(req.prompt + req.output, device=logits.device)
        return choose_token(logits, req.params, n_vocab=self.n_vocab, context=context, generator=req.generator)

    def _emit_next(self, req: _Request, logits: torch.Tensor) -> None:
        """Choose the next token from `logits`, stream it, and finish the request if it should stop."""
        token = self._choose(req, logits)
        logprobs = torch.log_softmax(mask_unusable(logits.float(), self.n_vocab), dim=-1)
        self._emit(req, token, float(logprobs[token]), logprobs)

    def _emit(self, req: _Request, token: int, logprob: float, logprobs: torch.Tensor) -> None:
        """Stream the chosen `token` (its log-probability `logprob`; `logprobs` the row's, for the top-n
        alternatives) and finish the request if it should stop."""
        params = req.params
        top: tuple[TopToken, ...] = ()
        if params.top_n_tokens:
            values, ids = torch.topk(logprobs, params.top_n_tokens)
            top = tuple(
                TopToken(i, self._token_text(i), v, self._special(i))
                for i, v in zip(ids.tolist(), values.tolist())
            )
        req.output.append(token)
        req.context.append(token)
        req.pos += 1
        self.stats.generated_tokens_total += 1
        assert req.stream is not None
        text = req.stream.push(token)
        stop, reason = check_stop_token(token, len(req.output), params.max_new_tokens, self.eos_id,
                                        params.stop_at_eos)
        if req.stream.stopped_by is not None:
            stop, reason = True, STOP_SEQUENCE
        if stop:
            text += req.stream.finish()
        req.text.append(text)
        finished = None
        if stop:
            finished = Finished(
                finish_reason=reason or LENGTH,
                generated_text="".join(req.text),
                generated_tokens=len(req.output),
                seed=req.seed,
                prompt_tokens=len(req.prompt),
                prefill=tuple(req.prompt),
                stop_sequence=req.stream.stopped_by,
                window_slides=req.slides,
                truncated_prompt_tokens=req.truncated,
            )
        req.sink(TokenEvent(token, text, logprob, self._special(token), len(req.output), top, finished))
        if finished is not None:
            self._remove_running(req)
            req.sink(finished)

    def _special(self, token: int) -> bool:
        return self.eos_id is not None and token == self.eos_id

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])
