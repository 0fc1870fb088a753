"""Speculative decoding's verification (`Sampler.verify`): each token it gives is distributed exactly as plain
sampling's at that position, given the tokens before it (rejection sampling of a point-mass draft), under every
control, and is the very token plain sampling draws from the same generator; greedy gives the argmax."""

from __future__ import annotations

import pytest
import torch

from model.sampler import Sampler, SampleRow, adjust, new_generator, sampling_distribution, usable_logits
from model.sampling_params import SamplingParams
from tests.sampling.distributions import LOGITS, chi_square_ok

V = len(LOGITS)
POSITIONS = torch.stack([torch.tensor(LOGITS), torch.tensor(LOGITS).roll(3), torch.tensor(LOGITS).flip(0) * 1.5])
HISTORY = [1, 6]  # the prompt: ids the repetition penalty sees


def rows(params: SamplingParams, draft: list[int], generator: torch.Generator | None) -> list[SampleRow]:
    return [SampleRow(params, generator, HISTORY + draft[:i] if params.repetition_penalty else (), draft[:i])
            for i in range(len(draft) + 1)]


def distributions(params: SamplingParams, draft: list[int]) -> list[torch.Tensor]:
    """What plain sampling draws from at each position, the draft's tokens before it taken."""
    masked = usable_logits(POSITIONS, V)
    return [sampling_distribution(adjust(masked[i], row, None), params)
            for i, row in enumerate(rows(params, draft, None))]


CASES = {
    "temperature, a likely draft": (dict(temperature=0.8), [1, 9]),
    "top-k, top-p, an unlikely draft": (dict(top_k=6, top_p=0.9, temperature=1.2), [4, 0]),
    "repetition penalty, a penalised draft": (dict(do_sample=True, repetition_penalty=1.8), [6, 1]),
    "top-k: a draft filtered out, never taken": (dict(top_k=3, do_sample=True), [7, 2]),
}


@pytest.mark.parametrize("case", CASES)
def test_each_token_is_distributed_as_plain_samplings_given_the_ones_before(case: str) -> None:
    kwargs, draft = CASES[case]
    params = SamplingParams(**kwargs)
    assert not params.is_greedy
    want = distributions(params, draft)
    sampler, gen = Sampler(V), new_generator(5)
    first, second, third = [0] * V, [0] * V, [0] * V
    for _ in range(8_000):
        tokens = sampler.verify(POSITIONS, rows(params, draft, gen), draft).tokens
        assert 1 <= len(tokens) <= 3 and tokens[:-1] == draft[: len(tokens) - 1]  # accepted, then its own
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
        if len(tokens) > 2:
            third[tokens[2]] += 1
    for counts, p in ((first, want[0]), (second, want[1]), (third, want[2])):
        if sum(counts) >= 200:
            ok, detail = chi_square_ok(counts, p.tolist())
            assert ok, detail
    # drafted tokens are accepted as often as the model draws them
    assert first[draft[0]] / sum(first) == pytest.approx(float(want[0][draft[0]]), abs=0.02)
    if float(want[0][draft[0]]) == 0:
        assert sum(second) == 0


def test_greedy_takes_the_drafted_tokens_that_are_the_argmax_then_the_argmax() -> None:
    sampler = Sampler(V)
    best = [int(POSITIONS[i].argmax()) for i in range(3)]
    params = SamplingParams(greedy=True)
    assert sampler.verify(POSITIONS, rows(params, best[:2], None), best[:2]).tokens == best
    assert sampler.verify(POSITIONS, rows(params, [best[0], 0], None), [best[0], 0]).tokens == best[:2]
    assert sampler.verify(POSITIONS, rows(params, [0, 0], None), [0, 0]).tokens == best[:1]
    out = sampler.verify(POSITIONS, rows(params, best[:2], None), best[:2])
    assert out.logprobs == pytest.approx(torch.log_softmax(POSITIONS, -1)[[0, 1, 2], best].tolist(), abs=1e-6)


def test_each_position_draws_what_plain_sampling_draws_with_the_same_generator() -> None:
    """Sampled, the tokens verify gives are those `Sampler.__call__` draws at each position from a generator in the
    same state: a seed means the same text with or without speculation."""
    sampler = Sampler(V)
    params = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.2)
    lengths = set()
    for seed in range(300):
        draft = [seed % V, (seed * 7) % V]
        tokens = sampler.verify(POSITIONS, rows(params, draft, new_generator(seed)), draft).tokens
        plain = new_generator(seed)
        want = [sampler(POSITIONS[i:i + 1], [rows(params, draft, plain)[i]]).tokens[0] for i in range(len(tokens))]
        assert tokens == want
        lengths.add(len(tokens))
    assert lengths == {1, 2, 3}  # drafts rejected at once, after one, and taken whole
