"""Prefill: prompts arriving together share one forward, a prompt longer than the window is refused or
truncated, and chunked prefill gives the same tokens while running streams keep decoding between chunks."""

from __future__ import annotations

import asyncio
import random

import pytest

from model.sampling_params import SamplingParams, ValidationError
from tests.engine.references import assert_logprobs_match, naive, random_prompt, run, windowed_reference


def count_prefill_forwards(engine) -> list[int]:
    """Record the batch size of every multi-token forward (a prefill step) the engine's model runs."""
    sizes: list[int] = []
    forward = engine.runner.model.forward

    def counting(idx, *args, **kw):
        if idx.shape[1] > 1:
            sizes.append(idx.shape[0])
        return forward(idx, *args, **kw)

    engine.runner.model.forward = counting
    return sizes


def test_prompts_arriving_together_are_prefilled_in_one_forward(make_checkpoint, make_engine) -> None:
    """Different lengths, right-padded into one forward, at rows freed and reused in any order: each request's
    greedy tokens are still the naive loop's."""
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, max_batch_size=6, start=False, prefill_chunk=256, window_shift=1)  # nanoGPT's crop
    sizes = count_prefill_forwards(engine)
    rng = random.Random(3)
    prompts = [[rng.randrange(ck.tokenizer.n_vocab) for _ in range(n)] for n in (3, 17, 1, 9, 30, 12)]
    params = [SamplingParams(max_new_tokens=m) for m in (12, 6, 20, 2, 2, 9)]

    async def main():
        streams = [engine.submit(p, q) for p, q in zip(prompts, params)]
        engine.start()
        first = await asyncio.gather(*(s.collect() for s in streams))
        # a second wave into the rows the first left, in a different order
        streams = [engine.submit(p, q) for p, q in zip(prompts[::-1], params)]
        return first, await asyncio.gather(*(s.collect() for s in streams))

    first, second = run(main())
    assert sizes[0] == 6  # all six prompts in the first prefill step
    for results, ps in ((first, prompts), (second, prompts[::-1])):
        for r, p, q in zip(results, ps, params):
            assert r.token_ids == naive(ck, p, q)[0]


def test_a_chunk_ending_at_the_last_slot_is_never_padded(make_checkpoint, make_engine) -> None:
    """Padding writes slots past a row's chunk, clamped to the last one: a chunk that ends at the context's last
    slot would have it overwritten. Such a chunk is prefilled without a wider companion."""
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, max_batch_size=2, start=False, prefill_chunk=24)
    sizes = count_prefill_forwards(engine)
    rng = random.Random(4)
    full, short = [rng.randrange(ck.tokenizer.n_vocab) for _ in range(32)], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    params = SamplingParams(max_new_tokens=6)

    async def main():
        streams = [engine.submit(full, params), engine.submit(short, params)]  # chunks: 24, then 8 (ends at 32)
        engine.start()
        return await asyncio.gather(*(s.collect() for s in streams))

    long_result, short_result = run(main())
    assert max(sizes) == 1  # [full 0:24], then [full 24:32] alone (short's 10 tokens would pad it), ...
    assert long_result.token_ids == windowed_reference(ck, full, params, engine.config.window_shift)[0]
    assert short_result.token_ids == naive(ck, short, params)[0]


def test_prompt_longer_than_the_window_is_refused(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck)
    with pytest.raises(ValidationError) as e:
        engine.generate(list(range(33)), SamplingParams())
    assert e.value.field == "prompt"
    assert "33" in e.value.message and "32" in e.value.message and "truncate" in e.value.message
    with pytest.raises(ValidationError) as e:
        engine.generate([], SamplingParams())
    assert e.value.field == "prompt"
    for bad in (0, -1, 33):
        with pytest.raises(ValidationError) as e:
            engine.generate(list(range(10)), SamplingParams(), truncate=bad)
        assert e.value.field == "truncate"
        assert "[1, 32]" in e.value.message and str(bad) in e.value.message
    assert engine.busy == 0 and engine.stats.rejected_total == 0


def test_truncate_keeps_the_last_tokens(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, window_shift=1)
    prompt = random_prompt(random.Random(4), 50, ck.tokenizer.n_vocab)
    params = SamplingParams(max_new_tokens=12)
    for n in (1, 10, 32):
        got = engine.generate(prompt, params, truncate=n)
        assert got.token_ids == naive(ck, prompt[-n:], params)[0]
        f = got.finished
        assert f.prefill == tuple(prompt[-n:])
        assert f.truncated_prompt_tokens == 50 - n and f.prompt_tokens == n
    got = engine.generate(prompt[:5], params, truncate=20)  # shorter than truncate: nothing is cut
    assert got.finished.prefill == tuple(prompt[:5]) and got.finished.truncated_prompt_tokens == 0



def test_chunked_prefill_gives_the_same_tokens(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=64)
    chunked = make_engine(ck, prefill_chunk=4, window_shift=1)
    whole = make_engine(ck, prefill_chunk=512, window_shift=1)
    rng = random.Random(6)
    for length in (3, 4, 5, 33, 63, 64):
        prompt = random_prompt(rng, length, ck.tokenizer.n_vocab)
        params = SamplingParams(max_new_tokens=12, repetition_penalty=1.3)
        want, logits = naive(ck, prompt, params)
        a, b = chunked.generate(prompt, params), whole.generate(prompt, params)
        assert a.token_ids == b.token_ids == want, f"prompt length {length}"
        assert_logprobs_match(ck, a, logits)


def test_a_running_stream_decodes_between_prefill_chunks(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=64)
    engine = make_engine(ck, prefill_chunk=4, window_shift=1, max_batch_size=4, start=False)
    runner, long_prompt = [1, 2, 3], random_prompt(random.Random(7), 60, ck.tokenizer.n_vocab)
    log: list[tuple[str, str]] = []

    def record(reqs):
        for r in reqs:
            who = "runner" if r.prompt == runner else "long"
            phase = "prefill" if r.prefilled < len(r.prompt) else "decode"
            log.append((who, phase))

    engine.fault_hook = record
    runner_params = SamplingParams(max_new_tokens=40, repetition_penalty=1.3)
    long_params = SamplingParams(max_new_tokens=3)

    async def main():
        a = engine.submit(runner, runner_params)
        b = engine.submit(long_prompt, long_params)
        engine.start()
        return await asyncio.gather(a.collect(), b.collect())

    a_result, b_result = run(main())
    long_chunks = [i for i, entry in enumerate(log) if entry == ("long", "prefill")]
    assert len(long_chunks) == 15  # 60 tokens, 4 at a time
    for i, j in zip(long_chunks, long_chunks[1:]):
        assert log[i + 1 : j] == [("runner", "decode")], "the runner must decode once between two chunks"
    assert log.index(("runner", "decode")) < long_chunks[0]
    assert a_result.token_ids == naive(ck, runner, runner_params)[0]
    assert b_result.token_ids == naive(ck, long_prompt, long_params)[0]


def test_a_prefilled_row_moves_down_when_runners_finish_during_its_prefill(make_checkpoint, make_engine) -> None:
    """The long prompt is prefilled into row 2; both runners finish meanwhile, so it must decode from row 0."""
    ck = make_checkpoint(block_size=64)
    engine = make_engine(ck, prefill_chunk=4, window_shift=1, max_batch_size=4, start=False)
    rng = random.Random(8)
    jobs = [
        ([1, 2, 3], SamplingParams(max_new_tokens=3)),
        ([4, 5], SamplingParams(max_new_tokens=6)),
        (random_prompt(rng, 57, ck.tokenizer.n_vocab), SamplingParams(max_new_tokens=7, top_n_tokens=3)),
    ]

    async def main():
        streams = [engine.submit(p, params) for p, params in jobs]
        engine.start()
        return await asyncio.gather(*(s.collect() for s in streams))

    for (prompt, params), got in zip(jobs, run(main())):
        want, logits = naive(ck, prompt, params)
        assert got.token_ids == want
        assert_logprobs_match(ck, got, logits)
