"""Jobs: model work that is not a generation (an inspection), run on the engine thread one step at a time between
the engine's own steps, so that a long job never stalls the running streams for more than one step's share.

A job is an iterator whose steps do the work; when it is exhausted, `result()` gives its answer. Its caller gets
a `JobHandle`: `await handle.result()` from an event loop, `handle.wait()` from a thread, `handle.cancel()`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from model.engine.events import EngineError


@dataclass(eq=False)
class Job:
    id: int
    steps: Iterator[Any]
    result: Callable[[], Any]  # the answer, once `steps` is exhausted
    deliver: Callable[[Any], None]  # called once, on the engine thread, with the answer or an EngineError
    cancelled: bool = False


@dataclass
class JobHandle:
    cancel: Callable[[], None]
    _future: asyncio.Future | None = None  # from an event loop
    _done: threading.Event = field(default_factory=threading.Event)  # from a thread
    _outcome: list[Any] = field(default_factory=list)

    async def result(self) -> Any:
        """The job's answer (raises its EngineError); cancels the job if the caller is cancelled meanwhile."""
        assert self._future is not None, "submitted without an event loop: use wait()"
        try:
            outcome = await asyncio.shield(self._future)
        except asyncio.CancelledError:
            self.cancel()
            raise
        if isinstance(outcome, EngineError):
            raise outcome
        return outcome

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            self.cancel()
            raise TimeoutError("the job did not finish in time")
        if isinstance(self._outcome[0], EngineError):
            raise self._outcome[0]
        return self._outcome[0]

    def settle(self, outcome: Any) -> None:
        """Record the outcome (any thread); wakes whoever waits."""
        self._outcome.append(outcome)
        self._done.set()
        future = self._future
        if future is not None:
            try:
                future.get_loop().call_soon_threadsafe(_set, future, outcome)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass


def _set(future: asyncio.Future, outcome: Any) -> None:
    if not future.done():
        future.set_result(outcome)
