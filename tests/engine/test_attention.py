"""Streamed attention (`SamplingParams.attention`): each generated token's weights equal an independent
softmax(q k^T / sqrt(d)) reference over the tokens before it (window slides included), asking for them changes no
token, and what the model cannot give or the limits refuse is a ValidationError naming the field."""

from __future__ import annotations

import pytest
import torch

from model.engine.attention import MAX_REQUEST_WEIGHTS, MAX_TOKEN_WEIGHTS
from model.sampling_params import AttentionSpec, SamplingParams, ValidationError
from tests.model.references import reference_attention

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def expected_rows(model, seq: list[int], start: int, n_keys: int, spec: AttentionSpec) -> torch.Tensor:
    """The reference rows for a token whose keys are seq[start : start + n_keys] at positions 0..n_keys-1."""
    window = seq[start : start + n_keys]
    rows = []
    for layer in spec.layers if spec.layers is not None else range(model.config.n_layer):
        att = reference_attention(model, window, layer)[:, -1]  # (n_head, n_keys): the last query
        rows += [att[h] for h in spec.heads] if spec.heads else [att.mean(0)]
    return torch.stack(rows)


@pytest.mark.parametrize("spec", [AttentionSpec(), AttentionSpec(layers=(1,), heads=(1, 0))], ids=["mean", "heads"])
def test_each_tokens_attention_equals_the_reference(make_checkpoint, make_engine, spec) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck)
    result = engine.generate(PROMPT, SamplingParams(max_new_tokens=12, attention=spec))
    seq = PROMPT + result.token_ids
    for i, ev in enumerate(result.tokens):
        att = ev.attention
        assert att is not None and att.start == 0 and att.heads == spec.heads
        assert att.layers == (spec.layers or (0, 1))
        n_keys = len(PROMPT) + i  # every token before this one
        assert all(len(row) == n_keys for row in att.weights)
        want = expected_rows(engine.runner.model, seq, 0, n_keys, spec)
        torch.testing.assert_close(torch.tensor(att.weights, dtype=torch.float32), want, rtol=0, atol=1e-5)


def test_attention_after_the_window_slides_covers_the_window(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=16)
    engine = make_engine(ck, window_shift=4)
    spec = AttentionSpec(heads=(0, 1))
    result = engine.generate(PROMPT, SamplingParams(max_new_tokens=30, attention=spec))
    assert result.finished.window_slides > 0
    seq = PROMPT + result.token_ids
    starts = [ev.attention.start for ev in result.tokens]
    assert starts[0] == 0 and max(starts) > 0 and starts == sorted(starts)
    for i, ev in enumerate(result.tokens):
        n_keys = len(ev.attention.weights[0])
        assert ev.attention.start + n_keys == len(PROMPT) + i and n_keys <= 16  # up to the token before it
        want = expected_rows(engine.runner.model, seq, ev.attention.start, n_keys, spec)
        torch.testing.assert_close(torch.tensor(ev.attention.weights, dtype=torch.float32), want, rtol=0, atol=1e-5)


def test_asking_for_attention_changes_no_token(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, max_batch_size=4)
    runs = [SamplingParams(max_new_tokens=40, greedy=True),
            SamplingParams(max_new_tokens=40, do_sample=True, temperature=0.9, seed=7, top_n_tokens=3)]
    for params in runs:
        plain = engine.generate(PROMPT, params)
        watched = engine.generate(PROMPT, SamplingParams(**{**params.__dict__, "attention": AttentionSpec()}))
        assert watched.token_ids == plain.token_ids  # fp32: token for token
        assert [t.logprob for t in watched.tokens] == [t.logprob for t in plain.tokens]
        assert [t.top_tokens for t in watched.tokens] == [t.top_tokens for t in plain.tokens]
        assert all(t.attention is None for t in plain.tokens) and all(t.attention for t in watched.tokens)


def test_attention_beside_requests_that_do_not_ask(make_checkpoint, make_engine) -> None:
    """In one batch, the watching row gets its weights and the others' tokens are what they are alone."""
    import asyncio

    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck, max_batch_size=4)
    alone = [engine.generate(p, SamplingParams(max_new_tokens=15)).token_ids for p in ([7, 8], [9, 10, 11])]

    async def together():
        streams = [engine.submit([7, 8], SamplingParams(max_new_tokens=15)),
                   engine.submit(PROMPT, SamplingParams(max_new_tokens=15, attention=AttentionSpec(layers=(0,)))),
                   engine.submit([9, 10, 11], SamplingParams(max_new_tokens=15))]
        return await asyncio.gather(*(s.collect() for s in streams))

    first, watched, third = asyncio.run(together())
    assert [first.token_ids, third.token_ids] == alone
    assert all(t.attention is None for t in first.tokens + third.tokens)
    assert [len(t.attention.weights) for t in watched.tokens] == [1] * 15


def test_attention_outside_the_model_or_the_limits_is_refused(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)  # 2 layers, 2 heads
    engine = make_engine(ck, start=False)
    cases = [(AttentionSpec(layers=(2,)), 100, "attention.layers", "[0, 1]"),
             (AttentionSpec(heads=(0, 0)), 100, "attention.heads", "distinct"),
             (AttentionSpec(layers=()), 100, "attention.layers", "left out")]
    for spec, n, field, needle in cases:
        with pytest.raises(ValidationError) as e:
            engine.validate([1, 2], params=SamplingParams(max_new_tokens=n, attention=spec))
        assert e.value.field == field and needle in e.value.message, e.value
    # 2 layers x 2 heads x 32 positions = 128 weights a token: the request's total is what the limit bounds
    n = MAX_REQUEST_WEIGHTS // 128 + 1
    with pytest.raises(ValidationError) as e:
        engine.validate([1, 2], params=SamplingParams(max_new_tokens=n, attention=AttentionSpec(heads=(0, 1))))
    assert e.value.field == "attention" and str(MAX_REQUEST_WEIGHTS) in e.value.message
    engine.validate([1, 2], params=SamplingParams(max_new_tokens=n - 1, attention=AttentionSpec(heads=(0, 1))))
    big = make_engine(make_checkpoint(block_size=MAX_TOKEN_WEIGHTS // 2 + 1), start=False)  # 2 layers: over it
    with pytest.raises(ValidationError) as e:
        big.validate([1], params=SamplingParams(max_new_tokens=1, attention=AttentionSpec()))
    assert e.value.field == "attention" and str(MAX_TOKEN_WEIGHTS) in e.value.message
