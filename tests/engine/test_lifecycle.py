"""A request's life in the engine: admission and the overload answer, reserved slots, cancellation, a failing
request that fails alone, stopping the engine, liveness, timeouts, and the engine's arguments."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import pytest
import torch

from model import sampler as sampler_module
from model.engine import Engine, EngineConfig, EngineStopped, GenerationError, GenerationStream, Overloaded, Result
from model.engine.runner import default_threads
from model.sampling_params import SamplingParams
from tests.engine.references import assert_logprobs_match, hold_steps, naive, run, wait_until, windowed_reference


def test_overloaded_when_batch_and_queue_are_full_engine_not_started(make_engine) -> None:
    engine = make_engine(max_batch_size=1, max_waiting=1, start=False)
    params = SamplingParams(max_new_tokens=3)

    async def main():
        first = engine.submit([1], params)
        second = engine.submit([2], params)
        for _ in range(2):
            t0 = time.perf_counter()
            with pytest.raises(Overloaded, match="capacity"):
                engine.submit([3], params)
            assert time.perf_counter() - t0 < 0.5
        assert engine.stats.rejected_total == 2 and engine.busy == 2
        engine.start()
        return await asyncio.gather(first.collect(), second.collect())

    results = run(main())
    assert [r.finished.generated_tokens for r in results] == [3, 3]


def test_reserved_slots_count_as_taken_until_submitted_or_released(make_engine) -> None:
    """`reserve` holds a slot between admission and submission: reserved slots refuse others, submitting into a
    reservation never refuses nor counts twice, and a released or consumed reservation gives the slot back."""
    engine = make_engine(max_batch_size=1, max_waiting=1, start=False)
    params = SamplingParams(max_new_tokens=2)

    async def main():
        a, b = engine.reserve(), engine.reserve()
        with pytest.raises(Overloaded):
            engine.reserve()
        with pytest.raises(Overloaded):
            engine.submit([1], params)  # no reservation: both slots are held
        assert engine.stats.rejected_total == 2
        first = engine.submit([1], params, reservation=a)  # into its own slot, though the engine looks full
        b.release()
        b.release()  # idempotent
        second = engine.submit([2], params)  # the released slot
        a.release()  # consumed by submit: nothing to give back
        with pytest.raises(Overloaded):
            engine.submit([3], params)
        assert engine.busy == 2 and engine.scheduler.reserved == 0
        engine.start()
        return await asyncio.gather(first.collect(), second.collect())

    assert [r.finished.generated_tokens for r in run(main())] == [2, 2]


def test_overloaded_while_the_engine_is_busy(make_engine) -> None:
    engine = make_engine(max_batch_size=1, max_waiting=1)
    entered, release = hold_steps(engine)
    params = SamplingParams(max_new_tokens=4)

    async def main():
        first = engine.submit([1, 2], params)
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 5)
        second = engine.submit([3, 4], params)
        with pytest.raises(Overloaded):
            engine.submit([5, 6], params)
        with pytest.raises(Overloaded):
            engine.generate([5, 6], params)  # the blocking API refuses at once too
        assert engine.stats.rejected_total == 2
        engine.fault_hook = None
        release.set()
        return await asyncio.gather(first.collect(), second.collect())

    results = run(main())
    assert [r.finished.finish_reason for r in results] == ["length", "length"]
    assert engine.generate([7], params).finished.generated_tokens == 4  # capacity is back


def test_cancel_frees_the_slot_within_one_step(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, window_shift=4, max_batch_size=4)
    seen: list[tuple[int, ...]] = []
    engine.fault_hook = lambda reqs: seen.extend(tuple(r.prompt) for r in reqs)
    long_one, others = [10, 11, 12], [[20, 21], [30, 31, 32, 33]]
    params = SamplingParams(max_new_tokens=100_000, repetition_penalty=1.2)  # runs until cancelled
    short = SamplingParams(max_new_tokens=60, repetition_penalty=1.2)

    async def main():
        victim = engine.submit(long_one, params)
        rest = [engine.submit(p, short) for p in others]
        async for ev in victim:
            if ev.index == 3:
                victim.cancel()
                mark = len(seen)
                break
        await wait_until(lambda: engine.stats.cancelled_total == 1)
        assert engine.busy <= 2
        results = await asyncio.gather(*(s.collect() for s in rest))
        return mark, results

    mark, results = run(main())
    assert seen[mark:].count(tuple(long_one)) <= 1  # at most the step that was under way when cancel() returned
    assert engine.stats.cancelled_total == 1  # the consumer's own cancel on exit did not count twice
    for prompt, got in zip(others, results):
        assert got.token_ids == windowed_reference(ck, prompt, short, 4)[0]
    assert engine.busy == 0


def test_an_abandoned_stream_is_cancelled(make_engine) -> None:
    engine = make_engine(window_shift=4)

    async def main():
        stream = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=100_000))
        async for _ in stream:
            break  # the client went away
        await wait_until(lambda: engine.busy == 0)

    run(main())
    assert engine.stats.cancelled_total == 1


def test_cancel_a_waiting_request(make_engine) -> None:
    engine = make_engine(max_batch_size=1, max_waiting=4, start=False)
    params = SamplingParams(max_new_tokens=5)

    async def main():
        first = engine.submit([1], params)
        waiting = engine.submit([2], params)
        waiting.cancel()
        engine.start()
        result = await first.collect()
        await wait_until(lambda: engine.busy == 0)
        return result

    assert run(main()).finished.generated_tokens == 5
    assert engine.stats.cancelled_total == 1 and engine.stats.generated_tokens_total == 5


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_failing_request_does_not_take_the_others_down(make_checkpoint, make_engine, phase) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, window_shift=1, max_batch_size=4, start=False)
    # the victim's prompt is short and the last row's long: when the last row moves into the victim's row, any
    # write still made for the victim lands in one of the moved row's valid cache slots
    prompts = [[1, 2, 3], [4, 5], [10], list(range(11, 23))]
    victim = tuple(prompts[1])
    params = SamplingParams(max_new_tokens=30)

    def fault(reqs):
        for r in reqs:
            if tuple(r.prompt) != victim:
                continue
            prefilling = r.prefilled < len(r.prompt)
            if (phase == "prefill" and prefilling) or (phase == "decode" and len(r.output) >= 3):
                raise RuntimeError("injected fault")

    engine.fault_hook = fault

    async def main():
        streams = [engine.submit(p, params) for p in prompts]
        engine.start()
        return await asyncio.gather(*(s.collect() for s in streams), return_exceptions=True)

    results = run(main())
    for prompt, got in zip(prompts, results):
        if tuple(prompt) == victim:
            assert isinstance(got, GenerationError) and "injected fault" in str(got)
        else:
            assert isinstance(got, Result), got
            want, logits = naive(ck, prompt, params)
            assert got.token_ids == want
            assert_logprobs_match(ck, got, logits)  # the cache rows of the others were not disturbed
    assert engine.stats.failed_total == 1
    engine.fault_hook = None
    assert engine.generate(list(victim), params).token_ids == naive(ck, list(victim), params)[0]


def test_a_request_failing_on_its_first_token_fails_alone(make_checkpoint, make_engine, monkeypatch) -> None:
    """The first token is chosen at the end of the prefill step; an error there once escaped to the engine loop,
    which failed every request in flight."""
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, max_batch_size=4, start=False)
    params = SamplingParams(max_new_tokens=12)
    victim = SamplingParams(max_new_tokens=12, seed=13, do_sample=True, repetition_penalty=1.3)
    real_edits = sampler_module.row_edits

    def row_edits(row, eos_id, width):  # the row's own work before the batch's: where its failure is its alone
        if row.params is victim:
            raise RuntimeError("injected fault")
        return real_edits(row, eos_id, width)

    monkeypatch.setattr(sampler_module, "row_edits", row_edits)
    prompts = [[1, 2, 3], [4, 5], [10]]

    async def main():
        streams = [engine.submit(p, victim if i == 1 else params) for i, p in enumerate(prompts)]
        engine.start()
        return await asyncio.gather(*(s.collect() for s in streams), return_exceptions=True)

    results = run(main())
    assert isinstance(results[1], GenerationError) and "injected fault" in str(results[1])
    for i in (0, 2):
        assert isinstance(results[i], Result) and results[i].token_ids == naive(ck, prompts[i], params)[0]
    assert engine.stats.failed_total == 1


def test_stop_fails_running_and_waiting_requests(make_engine) -> None:
    engine = make_engine(max_batch_size=1, max_waiting=4, window_shift=4)
    entered, release = hold_steps(engine)
    params = SamplingParams(max_new_tokens=100_000)

    async def main():
        running = engine.submit([1, 2], params)
        waiting = engine.submit([3, 4], params)
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 5)
        threading.Timer(0.1, release.set).start()
        engine.stop()
        outcomes = await asyncio.gather(running.collect(), waiting.collect(), return_exceptions=True)
        with pytest.raises(EngineStopped):
            engine.submit([5], params)
        return outcomes

    outcomes = run(main())
    assert all(isinstance(o, EngineStopped) for o in outcomes), outcomes
    with pytest.raises(EngineStopped):
        engine.generate([5], SamplingParams())


def test_stop_fails_requests_of_an_engine_never_started(make_engine) -> None:
    engine = make_engine(start=False)

    async def main():
        streams = [engine.submit([1], SamplingParams()), engine.submit([2], SamplingParams())]
        engine.stop()
        return await asyncio.gather(*(s.collect() for s in streams), return_exceptions=True)

    outcomes = run(main())
    assert all(isinstance(o, EngineStopped) for o in outcomes), outcomes
    assert engine.busy == 0


def test_liveness_says_when_the_thread_is_gone_or_a_step_hangs(make_engine) -> None:
    engine = make_engine(start=False)
    assert engine.liveness(1.0) == (False, "the engine thread is not running")
    engine.start()
    assert engine.generate([1], SamplingParams(max_new_tokens=2)).finished.generated_tokens == 2
    entered, release = threading.Event(), threading.Event()

    def hang(reqs):  # a step that hangs until released
        entered.set()
        release.wait(10)

    async def main():
        await wait_until(lambda: engine.liveness(0.1) == (True, "idle"))  # waiting for work: no step to time
        engine.fault_hook = hang
        stream = engine.submit([1, 2], SamplingParams(max_new_tokens=5))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 5)
        assert engine.liveness(30.0) == (True, "stepping")
        await wait_until(lambda: not engine.liveness(0.1)[0])
        alive, why = engine.liveness(0.1)
        assert why.startswith("the engine's current step began") and why.endswith("s ago (limit 0.1 s)"), why
        engine.fault_hook = None
        release.set()
        result = await stream.collect()
        await wait_until(lambda: engine.liveness(0.1) == (True, "idle"))  # the stall is over: alive again
        return result

    assert run(main()).finished.generated_tokens == 5
    engine.stop()
    assert engine.liveness(1.0) == (False, "the engine thread is not running")


def test_generate_timeout_cancels_the_request(make_engine) -> None:
    engine = make_engine()
    release = threading.Event()
    engine.fault_hook = lambda reqs: release.wait(10)
    try:
        with pytest.raises(GenerationError, match="timed out"):
            engine.generate([1, 2], SamplingParams(max_new_tokens=5), timeout=0.2)
    finally:
        engine.fault_hook = None
        release.set()
    deadline = time.monotonic() + 5
    while engine.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.busy == 0 and engine.stats.cancelled_total == 1



def test_engine_arguments_are_checked(make_checkpoint) -> None:
    ck = make_checkpoint(block_size=16)
    for kwargs in ({"window_shift": 16}, {"max_batch_size": 0}, {"prefill_chunk": 0}, {"max_waiting": -1}):
        with pytest.raises(ValueError):
            Engine(ck, device="cpu", threads=1, **kwargs)


def test_stream_type_and_prompt_tokens(make_engine) -> None:
    engine = make_engine()

    async def main():
        stream = engine.submit([1, 2, 3, 4], SamplingParams(max_new_tokens=2))
        assert isinstance(stream, GenerationStream) and stream.prompt_tokens == 4
        return await stream.collect()

    assert run(main()).finished.prompt_tokens == 4


@pytest.mark.parametrize("params, cores, want", [(100_000, 2, 1), (10_700_000, 2, 1), (16_000_000, 2, 2),
                                                 (124_000_000, 2, 2), (124_000_000, 16, 15), (124_000_000, 64, 15)])
def test_default_threads_is_one_per_8m_parameters_within_the_cores(params: int, cores: int, want: int) -> None:
    assert default_threads(params, cores) == want


def test_an_engine_without_threads_takes_the_rule(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint()
    assert make_engine(ck, threads=None, start=False).config.threads == default_threads(ck.config.num_params()) == 1


def test_the_engine_config_is_built_once_and_kept_as_resolved(make_checkpoint) -> None:
    ck = make_checkpoint(block_size=16)
    config = EngineConfig(device="cpu", threads=1, max_batch_size=3, max_waiting=5, prefill_chunk=7)
    engine = Engine(ck, config, prefix_cache=False)  # keywords go over the object's fields
    try:
        assert engine.config == replace(config, device=torch.device("cpu"), dtype=torch.float32, window_shift=2,
                                        prefix_cache=False, async_scheduling=False)
        assert engine.runner.cache.k.shape[1] == 3 and engine.scheduler.batch.prefix_cache is False
        scheduler = engine.scheduler
        assert (scheduler.max_waiting, scheduler.prefill_chunk, scheduler.window_shift) == (5, 7, 2)
    finally:
        engine.stop()
