"""Sampled tokens follow the exact distribution of every filter (temperature, top-k, top-p and all three),
and the check catches a wrong one."""

from __future__ import annotations

import pytest
import torch

from model.sampler import choose_token, new_generator, sampling_distribution
from model.sampling_params import SamplingParams
from tests.sampling.distributions import LOGITS, chi_square_ok, expected

CASES = {
    "temperature": (dict(temperature=0.7), dict(temperature=0.7)),
    "top_k": (dict(top_k=4, do_sample=True), dict(top_k=4)),
    "top_p": (dict(top_p=0.8), dict(top_p=0.8)),
    # top_p 0.85 (not 0.9) so that it drops a token of the five top-k keeps at this temperature
    "all_three": (dict(top_k=5, top_p=0.85, temperature=1.3), dict(top_k=5, top_p=0.85, temperature=1.3)),
}


@pytest.mark.parametrize("case", CASES)
def test_sampled_tokens_follow_the_exact_distribution(case: str, cpu_draw: str) -> None:
    kwargs, expect_kwargs = CASES[case]
    params = SamplingParams(**kwargs)
    assert not params.is_greedy
    want = expected(**expect_kwargs)
    logits = torch.tensor(LOGITS)
    support = {i for i, p in enumerate(want) if p > 0}
    if case != "temperature":
        assert 3 <= len(support) < len(LOGITS)  # the filter really removes tokens, and not all but one

    probs = sampling_distribution(logits, params)
    assert probs.tolist() == pytest.approx(want, abs=1e-6)

    # the bulk: 20,000 draws from that distribution
    bulk = torch.multinomial(probs, 20_000, replacement=True, generator=new_generator(11))
    counts = torch.bincount(bulk, minlength=len(LOGITS)).tolist()
    ok, detail = chi_square_ok(counts, want)
    assert ok, detail

    # and choose_token itself, one draw at a time with one generator
    gen = new_generator(12)
    drawn = [choose_token(logits, params, n_vocab=len(LOGITS), generator=gen) for _ in range(2_000)]
    assert set(drawn) <= support, f"tokens outside the kept set: {set(drawn) - support}"
    ok, detail = chi_square_ok([drawn.count(i) for i in range(len(LOGITS))], want)
    assert ok, detail


def test_a_wrong_distribution_fails_the_chi_square_check() -> None:
    """The check above can fail: draws at temperature 1 are rejected against temperature 0.7."""
    probs = torch.tensor(expected(temperature=1.0))
    draws = torch.multinomial(probs, 20_000, replacement=True, generator=new_generator(11))
    ok, _ = chi_square_ok(torch.bincount(draws, minlength=len(LOGITS)).tolist(), expected(temperature=0.7))
    assert not ok
