"""The engine against the naive reference loop: the same tokens and log-probabilities for every prompt length,
past the window, batched and slid, for greedy, seeded and OpenAI-controlled requests."""

from __future__ import annotations

import asyncio
import random

import pytest

from model.sampling_params import SamplingParams
from tests.engine.references import (
    assert_logprobs_match,
    naive,
    random_prompt,
    run,
    slides_expected,
    windowed_reference,
)


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
    params = SamplingParams(max_new_tokens=1, do_sample=True)  # sampled: a greedy request draws no seed
    seeds = [engine.generate([1], params).finished.seed for _ in range(64)]
    assert all(0 <= seed < 2**53 for seed in seeds), [seed for seed in seeds if seed >= 2**53]
    assert len(set(seeds)) == len(seeds)  # still drawn, not fixed
    assert engine.generate([1], params.with_seed(2**63 - 1)).finished.seed == 2**63 - 1


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
