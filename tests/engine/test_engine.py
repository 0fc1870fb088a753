"""The engine against the naive reference loop: the same tokens alone, batched, chunked, slid, stopped, failed."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from model import sampler as sampler_module
from model.checkpoint import Checkpoint
from model.engine import (
    Engine,
    EngineStopped,
    Finished,
    GenerationError,
    GenerationStream,
    Overloaded,
    Result,
    TokenEvent,
)
from model.reference import generate_naive
from model.sampler import choose_token, mask_unusable, new_generator
from model.sampling_params import SamplingParams, ValidationError

TIMEOUT = 30.0  # seconds any single async test body may take before it counts as hung


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def naive(ck: Checkpoint, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[torch.Tensor]]:
    """The oracle: nanoGPT's cropping loop, full forward every step."""
    steps = list(generate_naive(ck.model, prompt, params, n_vocab=ck.tokenizer.n_vocab, eos_id=ck.tokenizer.eos_id))
    return [t for t, _ in steps], [logits for _, logits in steps]


@torch.no_grad()
def windowed_reference(ck: Checkpoint, prompt: list[int], params: SamplingParams, window_shift: int):
    """The engine's sliding window written out with full forwards: when the context no longer fits, keep its
    last `block_size - window_shift + 1` tokens. The repetition penalty sees the whole history."""
    block = ck.config.block_size
    keep = block - window_shift + 1
    window, history, out, slides = list(prompt), list(prompt), [], 0
    gen = None if params.is_greedy else new_generator(params.seed)
    for _ in range(params.max_new_tokens):
        if len(window) > block:
            window = window[-keep:]
            slides += 1
        logits = ck.model(torch.tensor([window]), last_only=True)[0, -1]
        token = choose_token(logits, params, n_vocab=ck.tokenizer.n_vocab, context=torch.tensor(history),
                             generator=gen)
        out.append(token)
        window.append(token)
        history.append(token)
    return out, slides


def model_logprobs(ck: Checkpoint, logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(mask_unusable(logits.float(), ck.tokenizer.n_vocab), dim=-1)


def assert_logprobs_match(ck: Checkpoint, result: Result, logits: list[torch.Tensor]) -> None:
    """Each reported log-probability is log-softmax of the oracle's logits (so the KV cache is right too)."""
    assert len(result.tokens) == len(logits)
    for ev, lg in zip(result.tokens, logits):
        assert ev.logprob == pytest.approx(model_logprobs(ck, lg)[ev.id].item(), abs=1e-4)


def random_prompt(rng: random.Random, length: int, n_vocab: int) -> list[int]:
    return [rng.randrange(n_vocab) for _ in range(length)]


def slides_expected(prompt_len: int, new_tokens: int, block: int) -> int:
    """With window_shift=1: one slide for every token chosen from a context longer than the window."""
    return sum(1 for n in range(1, new_tokens + 1) if prompt_len + n - 1 > block)


async def wait_until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)


# --- greedy parity with the naive loop ---------------------------------------------------------------------------


def test_greedy_matches_naive_for_every_prompt_length_within_the_window(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, window_shift=1)
    rng = random.Random(0)
    for length in range(1, 33):
        prompt = random_prompt(rng, length, ck.tokenizer.n_vocab)
        params = SamplingParams(max_new_tokens=33 - length)  # the last token sees exactly block_size tokens
        want, logits = naive(ck, prompt, params)
        got = engine.generate(prompt, params)
        assert got.token_ids == want, f"prompt length {length}"
        assert_logprobs_match(ck, got, logits)
        assert all(t < ck.tokenizer.n_vocab for t in got.token_ids)  # padded ids are never chosen
        f = got.finished
        assert (f.finish_reason, f.generated_tokens, f.window_slides) == ("length", 33 - length, 0)
        assert f.prompt_tokens == length and f.prefill == tuple(prompt) and f.truncated_prompt_tokens == 0
        assert f.generated_text == ck.tokenizer.decode(want) == "".join(ev.text for ev in got.tokens)
        assert [ev.index for ev in got.tokens] == list(range(1, len(want) + 1))


@pytest.mark.parametrize("penalty", [None, 1.5])
def test_greedy_matches_naive_past_the_window_with_shift_1(make_checkpoint, make_engine, penalty) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, window_shift=1)
    rng = random.Random(1)
    distinct = set()
    for length in (1, 5, 31, 32):
        prompt = random_prompt(rng, length, ck.tokenizer.n_vocab)
        params = SamplingParams(max_new_tokens=60, repetition_penalty=penalty)
        want, logits = naive(ck, prompt, params)
        got = engine.generate(prompt, params)
        assert got.token_ids == want, f"prompt length {length}"
        assert_logprobs_match(ck, got, logits)
        assert got.finished.window_slides == slides_expected(length, 60, 32)
        assert got.finished.generated_tokens == 60
        distinct |= set(want)
    if penalty:
        assert len(distinct) > 20  # the penalty (over the whole history) keeps greedy output varied


@pytest.mark.parametrize("window_shift", [3, 8])
def test_window_shift_slides_in_steps_and_runs_to_max_new_tokens(make_checkpoint, make_engine, window_shift) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, window_shift=window_shift)
    rng = random.Random(2)
    for length in (1, 12, 32):
        prompt = random_prompt(rng, length, ck.tokenizer.n_vocab)
        params = SamplingParams(max_new_tokens=70, repetition_penalty=1.3)
        want, slides = windowed_reference(ck, prompt, params, window_shift)
        got = engine.generate(prompt, params)
        assert got.token_ids == want, f"prompt length {length}"
        assert got.finished.window_slides == slides
        # the first slide comes when the context overflows, then one every window_shift tokens
        first = 33 - length
        assert slides == 1 + (70 - first - 1) // window_shift
        assert got.finished.generated_tokens == 70 and got.finished.finish_reason == "length"


def test_sliding_rows_batched_with_decoding_rows(make_checkpoint, make_engine) -> None:
    """Rows slide at different steps, so a decode step's rows are not always 0..n-1."""
    ck = make_checkpoint(block_size=16)
    engine = make_engine(ck, window_shift=5, max_batch_size=6, start=False)
    rng = random.Random(3)
    jobs = []
    for length in (1, 3, 8, 11, 15, 16):
        params = SamplingParams(max_new_tokens=45 + length, repetition_penalty=1.2)
        jobs.append((random_prompt(rng, length, ck.tokenizer.n_vocab), params))

    async def main():
        streams = [engine.submit(p, params) for p, params in jobs]
        engine.start()
        return await asyncio.gather(*(s.collect() for s in streams))

    for (prompt, params), got in zip(jobs, run(main())):
        want, slides = windowed_reference(ck, prompt, params, 5)
        assert got.token_ids == want
        assert got.finished.window_slides == slides > 0


# --- prompt length and truncation ------------------------------------------------------------------------------


def count_prefill_forwards(engine) -> list[int]:
    """Record the batch size of every multi-token forward (a prefill step) the engine's model runs."""
    sizes: list[int] = []
    forward = engine.model.forward

    def counting(idx, **kw):
        if idx.shape[1] > 1:
            sizes.append(idx.shape[0])
        return forward(idx, **kw)

    engine.model.forward = counting
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
    assert long_result.token_ids == windowed_reference(ck, full, params, engine.window_shift)[0]
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


# --- seeds -------------------------------------------------------------------------------------------------------


def _mixed_requests(n_vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(5)
    jobs = []
    for i in range(16):
        length = rng.randint(1, 30)
        if i % 5 == 4:
            params = SamplingParams(max_new_tokens=rng.randint(5, 45), repetition_penalty=1.3)  # greedy
        else:
            params = SamplingParams(
                max_new_tokens=rng.randint(5, 45),
                temperature=rng.choice([0.6, 1.0, 1.4]),
                top_k=rng.choice([0, 5, 20]),
                top_p=rng.choice([None, 0.9]),
                repetition_penalty=rng.choice([None, 1.3]),
                do_sample=True,
                seed=1000 + i,
            )
        jobs.append((random_prompt(rng, length, n_vocab), params))
    return jobs


def test_seeded_sampling_is_the_same_alone_and_batched(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, window_shift=1, max_batch_size=16)
    jobs = _mixed_requests(ck.tokenizer.n_vocab)

    async def batched():
        streams = [engine.submit(p, params) for p, params in jobs]
        return await asyncio.gather(*(s.collect() for s in streams))

    together = run(batched())
    alone = [engine.generate(p, params) for p, params in jobs]
    mismatches = []
    for i, ((prompt, params), t, a) in enumerate(zip(jobs, together, alone)):
        want, logits = naive(ck, prompt, params)
        if not (t.token_ids == a.token_ids == want):
            mismatches.append(i)
        if params.seed is not None:
            assert t.finished.seed == a.finished.seed == params.seed
        assert_logprobs_match(ck, t, logits[: len(t.tokens)])
    assert not mismatches, f"{len(mismatches)}/{len(jobs)} requests differ batched vs alone vs naive: {mismatches}"
    assert len({tuple(r.token_ids) for r in together}) == len(jobs)


def test_no_seed_draws_one_and_reports_it(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck)
    params = SamplingParams(max_new_tokens=25, temperature=1.5)
    first = engine.generate([1, 2, 3], params)
    second = engine.generate([1, 2, 3], params)
    assert first.finished.seed != second.finished.seed
    assert first.token_ids != second.token_ids
    again = engine.generate([1, 2, 3], params.with_seed(first.finished.seed))
    assert again.token_ids == first.token_ids and again.finished.seed == first.finished.seed

    async def streamed():
        stream = engine.submit([1, 2, 3], params)
        result = await stream.collect()
        return stream.seed, result

    seed, result = run(streamed())
    assert result.finished.seed == seed
    assert engine.generate([1, 2, 3], params.with_seed(seed)).token_ids == result.token_ids



def test_drawn_seeds_survive_json_doubles(make_engine) -> None:
    """A drawn seed is below 2^53, so a client that reads JSON numbers as doubles (JavaScript) gets it exactly;
    a request may still name any seed up to 2^63 - 1."""
    engine = make_engine()
    params = SamplingParams(max_new_tokens=1, temperature=1.0)
    seeds = [engine.generate([1], params).finished.seed for _ in range(64)]
    assert all(0 <= seed < 2**53 for seed in seeds), [seed for seed in seeds if seed >= 2**53]
    assert len(set(seeds)) == len(seeds)  # still drawn, not fixed
    assert engine.generate([1], params.with_seed(2**63 - 1)).finished.seed == 2**63 - 1

# --- stopping ----------------------------------------------------------------------------------------------------


def test_stop_string_ends_the_output_and_is_excluded(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck)
    prompt = [7, 8, 9]
    base = SamplingParams(max_new_tokens=30, repetition_penalty=1.5)
    full = engine.generate(prompt, base)
    text = full.text
    assert len(text) == 30  # one character per token
    stop = text[9:12]
    cut = text.find(stop)
    assert cut > 0

    params = SamplingParams(max_new_tokens=30, repetition_penalty=1.5, stop=("never!", stop))

    async def streamed():
        stream = engine.submit(prompt, params)
        events = [ev async for ev in stream]
        return events

    events = run(streamed())
    finished = events[-1]
    tokens = events[:-1]
    assert isinstance(finished, Finished) and all(isinstance(ev, TokenEvent) for ev in tokens)
    assert finished.finish_reason == "stop_sequence" and finished.stop_sequence == stop
    assert finished.generated_text == text[:cut]
    assert "".join(ev.text for ev in tokens) == finished.generated_text
    # generation ran until the token completing the stop string, and not one token further
    assert [ev.id for ev in tokens] == full.token_ids[: cut + len(stop)]
    assert finished.generated_tokens == cut + len(stop)


def test_a_stop_string_that_never_completes_is_released(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck)
    base = SamplingParams(max_new_tokens=30, repetition_penalty=1.5)
    full = engine.generate([7, 8, 9], base)
    near_miss = full.text[4:8] + "#"  # its first four characters do occur: held back, then released
    got = engine.generate([7, 8, 9], SamplingParams(max_new_tokens=30, repetition_penalty=1.5, stop=(near_miss,)))
    assert got.token_ids == full.token_ids
    assert got.text == full.text == "".join(ev.text for ev in got.tokens)
    assert got.finished.finish_reason == "length" and got.finished.stop_sequence is None
    assert got.tokens[5].text == ""  # held back while it could still be the stop string


def test_eos_token_ends_generation(make_checkpoint, make_engine) -> None:
    plain = make_checkpoint(block_size=32)
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(max_new_tokens=40, repetition_penalty=1.5)
    full, _ = naive(plain, prompt, params)
    k = next(i for i in range(3, len(full)) if full[i] not in full[:i])  # a token first produced at step k
    eos = full[k]

    ck = make_checkpoint(block_size=32, eos_id=eos)
    engine = make_engine(ck, window_shift=1)
    got = engine.generate(prompt, params)
    assert got.token_ids == full[: k + 1] == naive(ck, prompt, params)[0]
    assert got.finished.finish_reason == "eos_token"
    assert got.tokens[-1].special and not any(ev.special for ev in got.tokens[:-1])
    assert got.tokens[-1].text == ""
    assert got.text == ck.tokenizer.decode(full[:k])  # the EOS character is not text

    ignore = engine.generate(prompt, SamplingParams(max_new_tokens=40, repetition_penalty=1.5, stop_at_eos=False))
    assert ignore.token_ids == full
    assert ignore.finished.finish_reason == "length"
    assert ignore.text == ck.tokenizer.decode([t for t in full if t != eos])


# --- admission, cancellation, faults, shutdown -------------------------------------------------------------------


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
    entered, release = threading.Event(), threading.Event()

    def hold(reqs):
        entered.set()
        release.wait(10)

    engine.on_step = hold
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
        engine.on_step = None
        release.set()
        return await asyncio.gather(first.collect(), second.collect())

    results = run(main())
    assert [r.finished.finish_reason for r in results] == ["length", "length"]
    assert engine.generate([7], params).finished.generated_tokens == 4  # capacity is back


def test_cancel_frees_the_slot_within_one_step(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, window_shift=4, max_batch_size=4)
    seen: list[tuple[int, ...]] = []
    engine.on_step = lambda reqs: seen.extend(tuple(r.prompt) for r in reqs)
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

    engine.on_step = fault

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
    engine.on_step = None
    assert engine.generate(list(victim), params).token_ids == naive(ck, list(victim), params)[0]


def test_a_request_failing_on_its_first_token_fails_alone(make_checkpoint, make_engine, monkeypatch) -> None:
    """The first token is chosen at the end of the prefill step; an error there once escaped to the engine loop,
    which failed every request in flight."""
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, max_batch_size=4, start=False)
    params, victim = SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, seed=13, do_sample=True)
    real_sample = sampler_module.sample_row

    def sample(masked, row):
        if row.params is victim:
            raise RuntimeError("injected fault")
        return real_sample(masked, row)

    monkeypatch.setattr(sampler_module, "sample_row", sample)
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
    entered, release = threading.Event(), threading.Event()

    def hold(reqs):
        entered.set()
        release.wait(10)

    engine.on_step = hold
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
        engine.on_step = hang
        stream = engine.submit([1, 2], SamplingParams(max_new_tokens=5))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 5)
        assert engine.liveness(30.0) == (True, "stepping")
        await wait_until(lambda: not engine.liveness(0.1)[0])
        alive, why = engine.liveness(0.1)
        assert why.startswith("the engine's current step began") and why.endswith("s ago (limit 0.1 s)"), why
        engine.on_step = None
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
    engine.on_step = lambda reqs: release.wait(10)
    try:
        with pytest.raises(GenerationError, match="timed out"):
            engine.generate([1, 2], SamplingParams(max_new_tokens=5), timeout=0.2)
    finally:
        engine.on_step = None
        release.set()
    deadline = time.monotonic() + 5
    while engine.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.busy == 0 and engine.stats.cancelled_total == 1


# --- chunked prefill ---------------------------------------------------------------------------------------------


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

    engine.on_step = record
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


# --- log-probabilities --------------------------------------------------------------------------------------------


def test_top_n_tokens_are_the_models_alternatives(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, window_shift=1)
    for prompt in ([5], list(range(20))):
        params = SamplingParams(max_new_tokens=20, top_n_tokens=5)  # past the window for the longer prompt
        want, logits = naive(ck, prompt, params)
        got = engine.generate(prompt, params)
        assert got.token_ids == want
        for ev, lg in zip(got.tokens, logits):
            logp = model_logprobs(ck, lg)
            assert len(ev.top_tokens) == 5
            values = [t.logprob for t in ev.top_tokens]
            assert values == sorted(values, reverse=True)
            top = torch.topk(logp, 5)
            assert [t.id for t in ev.top_tokens] == top.indices.tolist()
            assert values == pytest.approx(top.values.tolist(), abs=1e-4)
            assert ev.top_tokens[0].id == ev.id and ev.top_tokens[0].logprob == pytest.approx(ev.logprob)
            assert ev.logprob == pytest.approx(logp[ev.id].item(), abs=1e-4)
            assert [t.text for t in ev.top_tokens] == [ck.tokenizer.decode([t.id]) for t in ev.top_tokens]
            assert not any(t.special for t in ev.top_tokens)
    assert all(ev.top_tokens == () for ev in engine.generate([5], SamplingParams(max_new_tokens=3)).tokens)


def test_sampled_logprobs_ignore_temperature(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, window_shift=1)
    params = SamplingParams(max_new_tokens=15, temperature=3.0, top_k=10, seed=9, top_n_tokens=2)
    want, logits = naive(ck, [1, 2, 3], params)
    got = engine.generate([1, 2, 3], params)
    assert got.token_ids == want
    assert_logprobs_match(ck, got, logits)


# --- construction --------------------------------------------------------------------------------------------------


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


# --- OpenAI's controls through the engine ----------------------------------------------------------------------


def test_openai_controls_are_the_same_alone_batched_and_in_the_reference_loop(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32, eos_id=5)
    engine = make_engine(ck, window_shift=1, max_batch_size=8)
    rng = random.Random(9)
    jobs = []
    for i in range(8):
        params = SamplingParams(
            max_new_tokens=rng.randint(8, 40), seed=2000 + i, do_sample=i % 4 != 3,
            temperature=rng.choice([0.7, 1.0, 1.3]), min_p=rng.choice([None, 0.05, 0.2]),
            presence_penalty=rng.choice([0.0, 0.8, -0.5]), frequency_penalty=rng.choice([0.0, 0.4, 1.5]),
            logit_bias=rng.choice([{}, {5: 3.0, 7: -100.0}, {2: 1.5}]), min_tokens=rng.choice([0, 6]),
        )
        jobs.append((random_prompt(rng, rng.randint(1, 30), ck.tokenizer.n_vocab), params))

    async def batched():
        streams = [engine.submit(p, params) for p, params in jobs]
        return await asyncio.gather(*(s.collect() for s in streams))

    together = run(batched())
    for (prompt, params), t in zip(jobs, together):
        want, logits = naive(ck, prompt, params)
        assert t.token_ids == engine.generate(prompt, params).token_ids == want
        assert_logprobs_match(ck, t, logits)
        if (7, -100.0) in params.logit_bias:
            assert 7 not in t.token_ids
        assert 5 not in t.token_ids[: params.min_tokens]  # EOS never comes before min_tokens


def test_min_tokens_holds_off_eos_and_stop_strings(make_checkpoint, make_engine) -> None:
    params = dict(max_new_tokens=30, repetition_penalty=1.2)
    free = make_engine(make_checkpoint(block_size=32)).generate([7, 8, 9], SamplingParams(**params))
    eos = free.token_ids[3]  # the same weights with this id as EOS: the unconstrained output ends at token 4
    engine = make_engine(make_checkpoint(block_size=32, eos_id=eos))
    assert engine.generate([7, 8, 9], SamplingParams(**params)).finished.finish_reason == "eos_token"
    # ignore_eos (stop_at_eos off): the same ids as without an EOS, through EOS to max_new_tokens
    through = engine.generate([7, 8, 9], SamplingParams(**params, stop_at_eos=False))
    assert through.token_ids == free.token_ids and through.finished.finish_reason == "length"
    held = engine.generate([7, 8, 9], SamplingParams(**params, min_tokens=10))
    assert eos not in held.token_ids[:10] and held.finished.generated_tokens > 10
    # a stop string is matched only in the text generated after min_tokens tokens (EOS makes no text)
    text = engine.generate([7, 8, 9], SamplingParams(**params, min_tokens=10, stop_at_eos=False)).text
    stop = text[1:3]
    later = text.find(stop, 10)
    cut = engine.generate([7, 8, 9], SamplingParams(**params, stop=(stop,), min_tokens=10, stop_at_eos=False))
    assert text.find(stop) == 1 and cut.text == (text[:later] if later >= 0 else text)
    assert engine.generate([7, 8, 9], SamplingParams(**params, stop=(stop,), stop_at_eos=False)).text == text[:1]


# --- prompt log-probabilities ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prefill_chunk", [512, 5])
def test_prompt_logprobs_equal_a_full_forward_chunked_and_batched(make_checkpoint, make_engine, prefill_chunk) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, prefill_chunk=prefill_chunk, max_batch_size=4)
    rng = random.Random(3)
    prompts = [random_prompt(rng, n, ck.tokenizer.n_vocab) for n in (1, 7, 19, 32)]
    params = [SamplingParams(max_new_tokens=0, prompt_logprobs=3), SamplingParams(max_new_tokens=4, prompt_logprobs=0),
              SamplingParams(max_new_tokens=0, prompt_logprobs=5), SamplingParams(max_new_tokens=2)]

    async def batched():
        streams = [engine.submit(p, q) for p, q in zip(prompts, params)]
        return await asyncio.gather(*(s.collect() for s in streams))

    results = run(batched())
    for prompt, q, result in zip(prompts, params, results):
        fin = result.finished
        assert len(result.tokens) == q.max_new_tokens == fin.generated_tokens
        if q.prompt_logprobs is None:
            assert fin.prompt_logprobs is None
            continue
        with torch.no_grad():
            want = model_logprobs(ck, ck.model(torch.tensor([prompt]))[0])  # (T, vocab): row t predicts t + 1
        scored = fin.prompt_logprobs
        assert [t.id for t in scored] == prompt and scored[0].logprob is None and scored[0].top_tokens == ()
        for t in range(1, len(prompt)):
            assert scored[t].logprob == pytest.approx(want[t - 1, prompt[t]].item(), abs=1e-4)
            top = torch.topk(want[t - 1], q.prompt_logprobs)
            assert [a.id for a in scored[t].top_tokens] == top.indices.tolist()
            assert [a.logprob for a in scored[t].top_tokens] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert scored[t].text == ck.tokenizer.decode([prompt[t]])
        if result.tokens:  # the first token event carries them too
            assert result.tokens[0].prompt_logprobs == scored and result.tokens[1].prompt_logprobs is None
        assert result.token_ids == naive(ck, prompt, SamplingParams(max_new_tokens=q.max_new_tokens or 1))[0][
            : q.max_new_tokens]
    assert engine.busy == 0


def test_zero_new_tokens_needs_prompt_logprobs() -> None:
    with pytest.raises(ValidationError) as e:
        SamplingParams(max_new_tokens=0)
    assert e.value.field == "max_new_tokens" and "[1, 1000000]" in e.value.message
