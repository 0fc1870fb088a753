"""Jobs on the engine thread: an inspection runs one layer per engine step between decode steps, gives what the
offline function gives, counts toward capacity, and can be cancelled or failed alone."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from model.engine import EngineStopped, GenerationError, Overloaded
from model.inspection import InspectError, InspectOptions, Inspector, inspect
from model.sampling_params import SamplingParams
from tests.engine.references import wait_until


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30.0))


def test_an_inspection_interleaves_with_decoding_and_equals_the_offline_one(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    order: list[str] = []
    engine.fault_hook = lambda reqs: order.append("decode")

    def job_steps(inner):
        for step in inner:
            order.append("job")
            yield step

    async def main():
        stream = engine.submit([7, 8], SamplingParams(max_new_tokens=200))  # long enough to outlast the job
        collecting = asyncio.ensure_future(stream.collect())
        # the job comes once the request decodes (submitted together, the job's steps could all run while the
        # request is still being admitted, and the interleaving would be luck)
        await wait_until(lambda: "decode" in order)
        inspector = Inspector(engine.runner.model, engine.tokenizer, ids, InspectOptions())
        handle = engine.submit_job(job_steps(inspector.steps()), lambda: inspector.result)
        return await handle.result(), await collecting

    result, gen = run(main())
    offline = inspect(ck.model, ck.tokenizer, ids)
    assert [(a.layer, a.head, a.weights) for a in result.attention] == [
        (a.layer, a.head, a.weights) for a in offline.attention]
    assert [layer.top for layer in result.lens] == [layer.top for layer in offline.lens]
    assert len(gen.tokens) == 200
    # the job's steps (embeddings, 2 blocks, the scores) took turns with decode steps, never all in a row
    first, last = order.index("job"), len(order) - order[::-1].index("job")
    assert "decode" in order[first:last] and order.count("job") == ck.config.n_layer + 1


def test_an_inspection_refuses_bad_options_and_counts_toward_capacity(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, max_batch_size=1, max_waiting=0, start=False)
    model, kv_dtype = engine.runner.model, engine.runner.kv_dtype
    with pytest.raises(InspectError):
        Inspector(model, engine.tokenizer, [1, 2], InspectOptions(layers=(9,)), kv_dtype=kv_dtype)
    inspector = Inspector(model, engine.tokenizer, [1, 2, 3], InspectOptions(), kv_dtype=kv_dtype)
    handle = engine.submit_job(inspector.steps(), lambda: inspector.result)
    with pytest.raises(Overloaded):  # the job holds the only slot
        engine.generate([1], SamplingParams(max_new_tokens=1))
    engine.start()
    assert handle.wait(10).tokens == [1, 2, 3]
    assert engine.generate([1], SamplingParams(max_new_tokens=1)).finished.generated_tokens == 1


def test_a_failing_job_fails_alone_and_stop_fails_pending_jobs(make_checkpoint, make_engine) -> None:
    engine = make_engine(make_checkpoint(block_size=32))

    def broken():
        yield
        raise RuntimeError("injected fault in a job")

    with pytest.raises(GenerationError, match="injected fault"):
        engine.submit_job(broken(), lambda: None).wait(10)
    assert engine.generate([1, 2], SamplingParams(max_new_tokens=3)).finished.generated_tokens == 3
    idle = make_engine(make_checkpoint(block_size=32), start=False)
    handle = idle.submit_job(iter(()), lambda: "never")
    idle.stop()
    with pytest.raises(EngineStopped):
        handle.wait(5)


def test_a_cancelled_job_leaves(make_checkpoint, make_engine) -> None:
    engine = make_engine(make_checkpoint(block_size=32), start=False)
    handle = engine.submit_job(iter(()), lambda: "done")
    handle.cancel()
    engine.start()
    assert engine.generate([1], SamplingParams(max_new_tokens=1)).finished.generated_tokens == 1
    assert engine.busy == 0 and engine.stats.cancelled_total == 1


def test_liveness_says_when_the_engine_stalls_and_drain_finishes_what_runs(make_checkpoint, make_engine) -> None:
    engine = make_engine(make_checkpoint(block_size=32), start=False)
    assert engine.liveness(1.0) == (False, "the engine thread is not running")
    engine.start()
    assert engine.generate([1], SamplingParams(max_new_tokens=2)).finished.generated_tokens == 2
    # the last event arrives before the engine thread has finished its step: idle within moments of it
    deadline = time.monotonic() + 5
    while engine.liveness(1.0) != (True, "idle") and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.liveness(1.0) == (True, "idle")
    release = threading.Event()

    async def main():
        stream = engine.submit([1, 2], SamplingParams(max_new_tokens=5))
        await asyncio.sleep(0.3)
        alive, why = engine.liveness(0.1)
        assert not alive and "limit 0.1 s" in why
        assert engine.liveness(30.0) == (True, "stepping")
        release.set()
        drained = await asyncio.to_thread(engine.drain, 10.0)
        return drained, await stream.collect()

    engine.fault_hook = lambda reqs: release.wait(10)  # a step that hangs until released
    drained, result = run(main())
    assert drained and result.finished.generated_tokens == 5
    with pytest.raises(EngineStopped):
        engine.generate([1], SamplingParams(max_new_tokens=1))
