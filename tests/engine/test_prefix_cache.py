"""Prefix reuse: a prompt whose first tokens a cache row already holds starts its prefill after them. Outputs must
equal a cold engine's (no reuse) token for token; the counters say how many prompt tokens came from the cache."""

from __future__ import annotations

import random

import pytest

from model.engine.prefix_cache import RowContents, common_prefix, shares_prefix
from model.sampling_params import SamplingParams
from tests.engine.references import together


def params_list():
    return [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, do_sample=True, seed=7),
            SamplingParams(max_new_tokens=12, temperature=0.8, top_k=5, seed=8, repetition_penalty=1.3)]


def test_common_prefix_equals_the_plain_loop() -> None:
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(12))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(5))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix(a, b) == common_prefix(b, a) == n
    assert shares_prefix([1, 2], [1, 2, 3]) and not shares_prefix([1, 2], [2, 2, 3])
    assert shares_prefix(list(range(40)), list(range(16)) + [99])  # 16 shared tokens suffice for long prompts
    assert not shares_prefix(list(range(40)), list(range(15)) + [99, 98])


def test_row_contents_follow_writes() -> None:
    rc = RowContents(2)
    rc.wrote(0, 0, [5, 6, 7])
    rc.wrote(0, 3, [8])
    rc.wrote(0, 1, [9])  # a slide or a new prompt overwrites from its start
    assert rc.tokens[0] == [5, 9]
    assert rc.longest([5, 9, 1], [0, 1]) == (0, 2) and rc.longest([4], [0, 1]) == (-1, 0)
    rc.forget(0)
    assert rc.tokens[0] == []


@pytest.mark.parametrize("params", params_list())
def test_the_same_prompt_again_is_not_computed_again(make_checkpoint, make_engine, params) -> None:
    ck = make_checkpoint(block_size=32)
    cold = make_engine(ck, prefix_cache=False)
    warm = make_engine(ck)
    prompt = [random.Random(1).randrange(ck.tokenizer.n_vocab) for _ in range(20)]
    want = cold.generate(prompt, params).token_ids
    assert warm.generate(prompt, params).token_ids == want
    assert warm.stats.cached_prompt_tokens_total == 0
    assert warm.generate(prompt, params).token_ids == want
    assert warm.stats.cached_prompt_tokens_total == 19  # all but the last token, whose logits are needed
    assert warm.stats.prompt_tokens_total == 40 and cold.stats.cached_prompt_tokens_total == 0


def test_a_shared_header_is_reused_from_a_running_request(make_checkpoint, make_engine) -> None:
    ck = make_checkpoint(block_size=32)
    cold = make_engine(ck, prefix_cache=False)
    warm = make_engine(ck, max_batch_size=4)
    rng = random.Random(2)
    header = [rng.randrange(ck.tokenizer.n_vocab) for _ in range(18)]
    tails = [[rng.randrange(ck.tokenizer.n_vocab) for _ in range(k)] for k in (3, 5, 1)]
    long_running = (header + tails[0], SamplingParams(max_new_tokens=10))
    first = together(warm, [long_running])
    assert first[0].token_ids == cold.generate(*long_running).token_ids
    jobs = [(header + t, q) for t, q in zip(tails[1:], params_list())]
    results = together(warm, jobs)
    for (prompt, q), got in zip(jobs, results):
        assert got.token_ids == cold.generate(prompt, q).token_ids
    assert warm.stats.cached_prompt_tokens_total == 18 + 18  # the header, for each of the two


def test_samples_of_one_prompt_share_one_prefill(make_checkpoint, make_engine) -> None:
    """n requests for one prompt submitted at once: one computes the prompt, the others wait for it and copy it."""
    ck = make_checkpoint(block_size=32)
    cold = make_engine(ck, prefix_cache=False)
    warm = make_engine(ck, max_batch_size=4)
    prompt = [random.Random(3).randrange(ck.tokenizer.n_vocab) for _ in range(25)]
    jobs = [(prompt, SamplingParams(max_new_tokens=8, do_sample=True, seed=100 + i)) for i in range(4)]
    forwards = []
    model = warm.runner.model
    real_forward = model.forward

    def counting(idx, *args, **kwargs):
        forwards.append(tuple(idx.shape))
        return real_forward(idx, *args, **kwargs)

    model.forward = counting
    try:
        results = together(warm, jobs)
    finally:
        model.forward = real_forward
    for (p, q), got in zip(jobs, results):
        assert got.token_ids == cold.generate(p, q).token_ids
    assert warm.stats.cached_prompt_tokens_total == 3 * 24
    assert sum(b * t for b, t in forwards if t > 1) == 25  # the prompt was computed once


def test_a_failed_forward_is_never_reused(make_checkpoint, make_engine, monkeypatch) -> None:
    ck = make_checkpoint(block_size=32)
    engine = make_engine(ck)
    prompt = list(range(10))
    engine.generate(prompt, SamplingParams(max_new_tokens=2))
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("injected fault inside the forward")

    monkeypatch.setattr(engine.runner.model, "forward", broken)
    with pytest.raises(Exception, match="injected fault"):
        engine.generate(prompt + [11, 12], SamplingParams(max_new_tokens=2))
    monkeypatch.undo()
    assert calls and not any(row[:1] == prompt[:1] for row in engine.scheduler.batch.contents.tokens)
    before = engine.stats.cached_prompt_tokens_total
    got = engine.generate(prompt, SamplingParams(max_new_tokens=4))
    cold = make_engine(ck, prefix_cache=False)
    assert got.token_ids == cold.generate(prompt, SamplingParams(max_new_tokens=4)).token_ids
    assert engine.stats.cached_prompt_tokens_total == before  # the row the failed forward wrote was forgotten
