"""OpenAI's controls: min-p, logit bias, presence and frequency penalties, and min_tokens holding EOS back;
and their validation."""

from __future__ import annotations

import math

import pytest
import torch

from model.sampler import SampleRow, adjust, choose_token, new_generator, sampling_distribution
from model.sampling_params import SamplingParams, ValidationError
from tests.sampling.distributions import LOGITS, chi_square_ok, softmax

# --- OpenAI's controls: logit bias, min_tokens, presence/frequency penalties, min-p -------------------------------


def test_min_p_keeps_tokens_at_least_p_times_the_most_likely_exactly() -> None:
    logits = torch.tensor(LOGITS)
    probs = softmax([v / 0.9 for v in LOGITS])
    keep = [p >= 0.3 * max(probs) for p in probs]
    assert 2 <= sum(keep) < len(LOGITS)  # the filter removes some tokens, not all but one
    want = softmax([v / 0.9 if k else -math.inf for v, k in zip(LOGITS, keep)])
    params = SamplingParams(temperature=0.9, min_p=0.3)
    assert not params.is_greedy and SamplingParams(min_p=0.3).is_greedy is False
    assert sampling_distribution(logits, params).tolist() == pytest.approx(want, abs=1e-6)
    gen = new_generator(21)
    drawn = [choose_token(logits, params, n_vocab=len(LOGITS), generator=gen) for _ in range(2_000)]
    ok, detail = chi_square_ok([drawn.count(i) for i in range(len(LOGITS))], want)
    assert ok, detail


def test_logit_bias_is_added_before_greedy_and_sampling() -> None:
    logits = torch.tensor(LOGITS)
    assert choose_token(logits, SamplingParams(), n_vocab=len(LOGITS)) == 1
    assert choose_token(logits, SamplingParams(logit_bias={7: 4.7}), n_vocab=len(LOGITS)) == 7  # -2.5 + 4.7 > 2.1
    assert choose_token(logits, SamplingParams(logit_bias={1: -100}), n_vocab=len(LOGITS)) == 6  # banned: next best
    params = SamplingParams(temperature=1.0, do_sample=True, logit_bias={0: 2.0, 1: -1.5})
    biased = list(LOGITS)
    biased[0] += 2.0
    biased[1] -= 1.5
    gen = new_generator(22)
    drawn = [choose_token(logits, params, n_vocab=len(LOGITS), generator=gen) for _ in range(2_000)]
    ok, detail = chi_square_ok([drawn.count(i) for i in range(len(LOGITS))], softmax(biased))
    assert ok, detail
    # a bias on an id past the logits (a padded vocabulary's end) changes nothing
    assert choose_token(logits, SamplingParams(logit_bias={99: 100}), n_vocab=len(LOGITS)) == 1


def test_presence_and_frequency_penalties_exact_values() -> None:
    """OpenAI's formula over the generated ids only: logit - presence * [count > 0] - frequency * count."""
    logits = torch.tensor(LOGITS)
    output = [1, 1, 1, 6, 3]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    row = SampleRow(params, history=[0, 0, 0], output=output)  # the prompt's ids (0) are not penalised
    got = adjust(logits, row, eos_id=None)
    want = [v - (0.5 + 0.25 * output.count(i) if i in output else 0.0) for i, v in enumerate(LOGITS)]
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    # 1: 2.1 - 1.25 = 0.85, 6: 1.8 - 0.75 = 1.05, 3: 1.4 - 0.75 = 0.65: the unpenalised 9 (1.1) wins
    assert choose_token(logits, params, n_vocab=len(LOGITS), output=output) == 9
    encourage = SamplingParams(presence_penalty=-2.0)  # negative values encourage repetition
    assert choose_token(logits, encourage, n_vocab=len(LOGITS), output=[7]) == 1  # -2.5 + 2 still small
    assert choose_token(logits, encourage, n_vocab=len(LOGITS), output=[9]) == 9  # 1.1 + 2 > 2.1


def test_min_tokens_keeps_eos_out_until_reached() -> None:
    logits = torch.tensor(LOGITS)  # EOS (id 1) is the argmax
    params = SamplingParams(min_tokens=3, max_new_tokens=5)
    assert [choose_token(logits, params, n_vocab=len(LOGITS), output=[0] * n, eos_id=1) for n in range(5)] == [
        6, 6, 6, 1, 1]
    gen = new_generator(23)
    sampled = SamplingParams(min_tokens=2, max_new_tokens=4, temperature=5.0)
    assert 1 not in {choose_token(logits, sampled, n_vocab=len(LOGITS), output=[0], eos_id=1, generator=gen)
                     for _ in range(300)}


def test_new_controls_are_validated() -> None:
    for kwargs, field, part in [({"presence_penalty": 2.5}, "presence_penalty", "[-2.0, 2.0]"),
                                ({"frequency_penalty": -3}, "frequency_penalty", "[-2.0, 2.0]"),
                                ({"min_p": 1.5}, "min_p", "[0.0, 1.0]"),
                                ({"min_tokens": 21}, "min_tokens", "[0, 20]"),
                                ({"logit_bias": {5: 101}}, "logit_bias", "[-100.0, 100.0]"),
                                ({"logit_bias": {-1: 1}}, "logit_bias", "got -1")]:
        with pytest.raises(ValidationError) as e:
            SamplingParams(**kwargs)
        assert e.value.field == field and part in e.value.message
