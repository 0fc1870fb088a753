"""The hand-off of a request's events to its reader (model/engine/stream.py): every event in order; a reader woken
per event, or, once quiet, only for the last event and at most every so many seconds for tokens; nothing read past
a request's last event; an engine error raised after the tokens before it; and a quiet stream of a real engine
generation ending in the same result as a plain one, with far fewer wake-ups."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from model.engine import GenerationError
from model.engine.events import Finished, TokenEvent, end_of
from model.engine.stream import EventQueue, GenerationStream
from model.sampling_params import SamplingParams

_TOKENS = {i: TokenEvent(id=i, text=f"t{i}", logprob=-1.0, special=False, index=i) for i in range(1, 22)}


def _token(i: int) -> TokenEvent:
    return _TOKENS[i]


_FINISHED = Finished(finish_reason="length", generated_text="", generated_tokens=3, seed=0, prompt_tokens=1,
                     prefill=(1,))


def _last(i: int) -> TokenEvent:
    """Token `i`, the last of its generation: it carries the end."""
    return replace(_token(i), finished=replace(_FINISHED, generated_tokens=i))



async def _reads(queue: EventQueue, feed: list, gap: float) -> list[list]:
    """What the reader takes, one list per wake-up, while `feed` is put `gap` seconds apart."""
    reads: list[list] = []

    async def reader() -> None:
        while not reads or not any(end_of(ev) for ev in reads[-1]):
            reads.append(await queue.take())

    task = asyncio.ensure_future(reader())
    for ev in feed:
        await asyncio.sleep(gap)
        queue.put(ev)
    await asyncio.wait_for(task, 5)
    return reads


def test_a_plain_reader_is_woken_for_every_event() -> None:
    feed = [_token(1), _token(2), _last(3)]
    reads = asyncio.run(_reads(EventQueue(), feed, gap=0.01))
    assert reads == [[ev] for ev in feed]


def test_a_quiet_reader_is_woken_for_the_last_event_with_every_token() -> None:
    for feed in ([_token(i) for i in range(1, 6)] + [_last(6)], [_FINISHED]):  # or the end of a generation of none
        queue = EventQueue()
        queue.quiet(10.0)
        reads = asyncio.run(_reads(queue, feed, gap=0.005))
        assert reads == [feed]


def test_a_quiet_reader_is_woken_for_tokens_once_its_interval_has_passed() -> None:
    queue = EventQueue()
    queue.quiet(0.05)
    feed = [_token(i) for i in range(1, 21)] + [_last(21)]
    t0 = time.monotonic()
    reads = asyncio.run(_reads(queue, feed, gap=0.01))
    elapsed = time.monotonic() - t0
    assert [ev for read in reads for ev in read] == feed  # every event, in order
    # one wake-up per 0.05 s of tokens (put 0.01 s apart), plus the last event's: far fewer than 21
    assert 2 <= len(reads) <= elapsed / 0.05 + 2 < len(feed)


def test_a_stream_stops_at_its_last_event_and_raises_an_engine_error_after_the_tokens() -> None:
    async def main() -> tuple[list, list, Exception | None]:
        done = EventQueue()
        for ev in [_token(1), _last(2), _token(9)]:  # nothing follows a last event: the stray token is not read
            done.put(ev)
        finished = [b async for b in GenerationStream(done, lambda: None, seed=0, prompt_tokens=1).batches()]
        scored = EventQueue()
        for ev in [_FINISHED, _token(9)]:  # a generation without tokens: its end is its only event
            scored.put(ev)
        finished += [b async for b in GenerationStream(scored, lambda: None, seed=0, prompt_tokens=1).batches()]
        failed = EventQueue()
        for ev in [_token(1), _token(2), GenerationError("boom")]:
            failed.put(ev)
        seen, error = [], None
        try:
            async for b in GenerationStream(failed, lambda: None, seed=0, prompt_tokens=1).batches():
                seen.append(b)
        except GenerationError as e:
            error = e
        return finished, seen, error

    finished, seen, error = asyncio.run(main())
    assert finished == [[_token(1), _last(2)], [_FINISHED]]
    assert seen == [[_token(1), _token(2)]] and str(error) == "boom"


def test_a_quiet_stream_of_the_engine_ends_in_the_same_result(make_engine) -> None:
    """Greedy, the same prompt: the quiet reader gets the plain one's tokens and text, woken once (the generation
    takes far less than its interval), where the plain reader was woken step by step. Each step is held 5 ms: a
    test model's steps are so short that the loop could take a whole generation's deliveries in one wake-up."""
    engine = make_engine(max_batch_size=2)
    engine.fault_hook = lambda reqs: time.sleep(0.005)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_at_eos=False)

    async def generate(quiet: bool):
        stream = engine.submit([1, 2, 3], params)
        if quiet:
            stream.quiet(60.0)
        wakeups = 0

        async def counted():
            nonlocal wakeups
            async for batch in stream.batches():
                wakeups += 1
                yield batch

        return await stream.collect(counted()), wakeups

    plain, plain_wakeups = asyncio.run(generate(quiet=False))
    quiet, quiet_wakeups = asyncio.run(generate(quiet=True))
    assert len(plain.tokens) == 24 and [t.id for t in quiet.tokens] == [t.id for t in plain.tokens]
    assert (quiet.finished.finish_reason, quiet.finished.generated_text) == (
        plain.finished.finish_reason, plain.finished.generated_text)
    assert quiet_wakeups == 1 < plain_wakeups
