"""What a finished request reports: where stop strings and EOS end it, its top-n alternatives and
log-probabilities, and its prompt's log-probabilities."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from model.engine import Finished, TokenEvent
from model.sampling_params import SamplingParams, ValidationError
from tests.engine.references import assert_logprobs_match, model_logprobs, naive, random_prompt, run


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

    tokens = run(streamed())
    finished = tokens[-1].finished  # the last token carries the end, and nothing follows it
    assert isinstance(finished, Finished) and all(isinstance(ev, TokenEvent) for ev in tokens)
    assert all(ev.finished is None for ev in tokens[:-1])
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
            assert result.prompt_logprobs is None
            continue
        with torch.no_grad():
            want = model_logprobs(ck, ck.model(torch.tensor([prompt]))[0])  # (T, vocab): row t predicts t + 1
        scored = result.prompt_logprobs
        assert [t.id for t in scored] == prompt and scored[0].logprob is None and scored[0].top_tokens == ()
        for t in range(1, len(prompt)):
            assert scored[t].logprob == pytest.approx(want[t - 1, prompt[t]].item(), abs=1e-4)
            top = torch.topk(want[t - 1], q.prompt_logprobs)
            assert [a.id for a in scored[t].top_tokens] == top.indices.tolist()
            assert [a.logprob for a in scored[t].top_tokens] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert scored[t].text == ck.tokenizer.decode([prompt[t]])
        if result.tokens:  # the first token's event carries them, and no other event
            assert result.tokens[0].prompt_logprobs == scored and result.tokens[1].prompt_logprobs is None
            assert fin.prompt_logprobs is None
        else:  # the end is the only event, with them
            assert fin.prompt_logprobs == scored
        assert result.token_ids == naive(ck, prompt, SamplingParams(max_new_tokens=q.max_new_tokens or 1))[0][
            : q.max_new_tokens]
    assert engine.busy == 0


def test_zero_new_tokens_needs_prompt_logprobs() -> None:
    with pytest.raises(ValidationError) as e:
        SamplingParams(max_new_tokens=0)
    assert e.value.field == "max_new_tokens" and "[1, 1000000]" in e.value.message


def test_a_generation_ends_with_one_event(make_engine) -> None:
    """The last token's event carries the end, and nothing follows it; a generation without tokens (a prompt only
    scored) has the end as its only event. The prompt's log-probabilities come once, on the first event."""
    engine = make_engine(max_batch_size=2)

    async def events(params: SamplingParams) -> list:
        stream = engine.submit([4, 5, 6], params)
        return [ev for batch in [b async for b in stream.batches()] for ev in batch]

    generated = run(events(SamplingParams(max_new_tokens=3, prompt_logprobs=1, stop_at_eos=False)))
    assert [type(ev) for ev in generated] == [TokenEvent] * 3
    assert [ev.finished is not None for ev in generated] == [False, False, True]
    assert generated[-1].finished.generated_tokens == 3 and generated[-1].finished.prompt_logprobs is None
    assert generated[0].prompt_logprobs is not None and generated[1].prompt_logprobs is None
    [scored] = run(events(SamplingParams(max_new_tokens=0, prompt_logprobs=1)))
    assert isinstance(scored, Finished) and scored.generated_tokens == 0
    assert scored.prompt_logprobs == generated[0].prompt_logprobs
    assert engine.busy == 0
