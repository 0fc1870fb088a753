"""The hand-off between the engine thread and asyncio: a request's event stream, the per-loop mailbox that
delivers events once per engine step, and the slot reservation an admission check holds.

Neither the stream nor the reservation knows the engine: each is given the one callback it needs (cancel the
request; give the slot back), so callers never reach into the engine's lock or counters.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from model.engine.events import EngineError, Event, Finished, GenerationError, Result, TokenEvent, end_of


class EventQueue:
    """One stream's events on its event loop. The reader takes every event queued so far and is woken for each new
    one; or, once `quiet`, only for the last (the generation's end, an error) and at most every so many seconds for
tokens: a
    reader that wants the whole generation (a non-streaming request) is not woken once per token. Under 32
    concurrent requests those wake-ups (through the server's per-token bookkeeping) took ~1 ms of the event loop
    per engine step, on the cores the step runs on. Used on the loop only."""

    def __init__(self) -> None:
        self._items: deque[Event] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._every: float | None = None
        self._woken = time.monotonic()

    def quiet(self, seconds: float) -> None:
        """Wake the reader for tokens at most every `seconds` from now on (the last event wakes it at once)."""
        self._every = seconds

    def put(self, ev: Event) -> None:
        self._items.append(ev)
        if self._waiter is None or self._waiter.done():
            return
        now = time.monotonic()
        last = not isinstance(ev, TokenEvent) or ev.finished is not None
        if self._every is None or last or now - self._woken >= self._every:
            self._woken = now
            self._waiter.set_result(None)

    async def take(self) -> list[Event]:
        """Every event queued, in order, waiting for at least one."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        return items


class Mailbox:
    """Events bound for the streams of one event loop, handed over in one callback per engine step instead of one
    `call_soon_threadsafe` per token (each of those takes the loop's lock and writes its wake-up pipe while the
    engine thread holds the GIL, and wakes the loop once per token). The engine thread posts during a step and
    flushes at its end; a post from any other thread flushes at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.closed = False  # the loop is closed: nobody is listening any more
        self._pending: list[tuple[EventQueue, Event]] = []
        self._scheduled = False
        self._lock = threading.Lock()

    def post(self, events: EventQueue, ev: Event) -> bool:
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
            events.put(ev)


class GenerationStream:
    """What `Engine.submit` returns: an async iterator of events; `cancel()` when the client is gone."""

    def __init__(self, events: EventQueue, cancel: Callable[[], None], *, seed: int | None,
                 prompt_tokens: int) -> None:
        self._events = events
        self._cancel = cancel
        self.seed = seed
        self.prompt_tokens = prompt_tokens

    def cancel(self) -> None:
        """Thread-safe and idempotent; the request leaves the batch before the next model step."""
        self._cancel()

    def quiet(self, seconds: float) -> None:
        """The reader wants the whole generation: woken for tokens at most every `seconds` (`EventQueue.quiet`)."""
        self._events.quiet(seconds)

    def __aiter__(self) -> AsyncIterator[TokenEvent | Finished]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenEvent | Finished]:
        async for batch in self.batches():
            for ev in batch:
                yield ev

    async def batches(self) -> AsyncIterator[list[TokenEvent | Finished]]:
        """The events in arrival order, each item every event that has arrived by then (at least one): a stream
        the event loop is behind on is written in one piece, not one write per token. Ends after the generation's
        end (`end_of`); an engine error is raised after the events before it."""
        try:
            while True:
                batch = await self._events.take()
                end = next((i for i, ev in enumerate(batch) if isinstance(ev, EngineError) or end_of(ev)), None)
                if end is not None:
                    batch = batch[:end + 1]  # nothing follows a request's last event
                if isinstance(batch[-1], EngineError):
                    if len(batch) > 1:
                        yield batch[:-1]
                    raise batch[-1]
                yield batch
                if end_of(batch[-1]):
                    return
        finally:
            self.cancel()  # no-op once finished; frees the slot if the consumer stopped early

    async def collect(self, batches: AsyncIterator[list[TokenEvent | Finished]] | None = None) -> Result:
        """The whole generation; from `batches` (the stream's `batches()` seen through a caller's bookkeeping,
        e.g. the server's latency metrics) if given."""
        tokens: list[TokenEvent] = []
        async for batch in batches if batches is not None else self.batches():
            for ev in batch:
                if isinstance(ev, TokenEvent):
                    tokens.append(ev)
                if end := end_of(ev):
                    return Result(tokens, end)
        raise GenerationError("stream ended without a result")


class Reservation:
    """A slot held for a request between its admission and its submission (`Engine.reserve`)."""

    def __init__(self, give_back: Callable[[], bool], owner: object = None) -> None:
        self._give_back = give_back  # frees the slot once; True if it was still held
        self.owner = owner  # the engine the slot is held in

    def release(self) -> bool:
        """Give the slot back if the request was never submitted (idempotent); True if it was still held."""
        return self._give_back()
