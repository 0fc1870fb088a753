"""The batched `Sampler`'s bookkeeping: draws by inverse transform sampling, the same alone or batched, a sampled
row whose logits hold NaN fails alone, and each row gets its own top-n alternatives when rows ask for different n
(all brought to the host at once)."""

from __future__ import annotations

import math

import pytest
import torch

from model.sampler import Sampler, SampleRow, draw, new_generator, uniforms
from model.sampling_params import SamplingParams
from tests.sampling.distributions import inverse_cdf

VOCAB = 40


def test_draw_inverts_the_cumulative_distribution_at_its_generators_uniform() -> None:
    """One uniform number per row from the row's generator, so a seed draws the same id however the row is
    batched; ids of probability 0 (a filtered vocabulary) are never drawn."""
    for seed in range(100):
        probs = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(seed)) * 3, -1)
        probs[torch.randperm(1000, generator=torch.Generator().manual_seed(seed))[:700]] = 0  # top-k/top-p's zeros
        assert int(draw(probs, uniforms([new_generator(seed)]))) == inverse_cdf(probs, seed)
    probs = torch.zeros(50)
    probs[[0, 17, 49]] = torch.tensor([0.0, 1e-30, 1.0])
    assert {int(draw(probs, uniforms([new_generator(seed)]))) for seed in range(200)} == {49}


def test_rows_drawn_together_are_each_rows_own_draw() -> None:
    """A 2-D `draw` inverts each row at that row's own number: the ids the rows draw one at a time."""
    probs = torch.softmax(torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)) * 3, -1)
    together = draw(probs, uniforms([new_generator(seed) for seed in range(6)]))
    assert together.tolist() == [int(draw(probs[i], uniforms([new_generator(i)]))) for i in range(6)]


def test_sampled_rows_of_different_parameters_filtered_together_draw_as_each_alone() -> None:
    """The sampled rows of a step are filtered in one pass (each filter once, with a parameter per row) and raced
    together: every row draws what it draws alone, seed for seed, whatever the other rows ask for."""
    params = [SamplingParams(do_sample=True, seed=1), SamplingParams(do_sample=True, seed=2, temperature=0.3),
              SamplingParams(do_sample=True, seed=3, top_k=5), SamplingParams(do_sample=True, seed=4, top_p=0.5),
              SamplingParams(do_sample=True, seed=5, min_p=0.2, temperature=1.7),
              SamplingParams(do_sample=True, seed=6, top_k=20, top_p=0.8, min_p=0.05, temperature=0.6),
              SamplingParams(), SamplingParams(do_sample=True, seed=7, top_k=1)]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(11)) * 3

    def row(p: SamplingParams, step: int) -> SampleRow:
        return SampleRow(p, None if p.is_greedy else new_generator(p.seed + 100 * step))

    for step in range(30):
        together = Sampler(VOCAB)(logits, [row(p, step) for p in params]).tokens
        alone = [Sampler(VOCAB)(logits[i: i + 1], [row(p, step)]).tokens[0] for i, p in enumerate(params)]
        assert together == alone, step
    distinct = {Sampler(VOCAB)(logits[4:5], [SampleRow(params[4], new_generator(s))]).tokens[0] for s in range(50)}
    assert len(distinct) > 3  # the rows really draw: min_p 0.2 at temperature 1.7 leaves several ids


def rows_and_logits() -> tuple[list[SampleRow], torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    params = [SamplingParams(top_n_tokens=3), SamplingParams(do_sample=True, seed=5, top_n_tokens=5),
              SamplingParams(), SamplingParams(do_sample=True, seed=6, top_k=10, logit_bias={4: 2.0}),
              SamplingParams(top_n_tokens=3, repetition_penalty=1.3)]
    rows = [SampleRow(p, new_generator(p.seed) if not p.is_greedy else None, history=[1, 2, 4]) for p in params]
    return rows, torch.randn(len(rows), VOCAB, generator=g) * 4


def test_rows_asking_for_different_top_n_get_their_own() -> None:
    rows, logits = rows_and_logits()
    out = Sampler(VOCAB)(logits, rows)
    logprobs = torch.log_softmax(logits, -1)
    for i, row in enumerate(rows):
        assert out.logprobs[i] == pytest.approx(float(logprobs[i, out.tokens[i]]), abs=1e-5)
        n = row.params.top_n_tokens
        values, ids = torch.topk(logprobs[i], n) if n else (torch.tensor([]), torch.tensor([]))
        assert [t for t, _ in out.top[i]] == ids.tolist()
        assert [v for _, v in out.top[i]] == pytest.approx(values.tolist(), abs=1e-5)
    assert out.tokens[0] == int(logits[0].argmax()) and not out.errors


@pytest.mark.parametrize("bad", [1, 3], ids=["sampled", "sampled-adjusted"])
def test_a_sampled_row_whose_logits_hold_nan_fails_alone(bad: int) -> None:
    """NaN logits are no distribution to draw from: that row fails (as `torch.multinomial` refused them), the
    others get what they get without it."""
    rows, logits = rows_and_logits()
    want = Sampler(VOCAB)(logits, rows_and_logits()[0])
    logits[bad, 7] = math.nan
    out = Sampler(VOCAB)(logits, rows)
    assert list(out.errors) == [bad] and "NaN" in str(out.errors[bad]) and out.tokens[bad] == -1
    keep = [i for i in range(len(rows)) if i != bad]
    assert [out.tokens[i] for i in keep] == [want.tokens[i] for i in keep]
    assert [out.logprobs[i] for i in keep] == [want.logprobs[i] for i in keep]


@pytest.mark.parametrize("bad", [0, 4], ids=["greedy", "greedy-adjusted"])
def test_a_greedy_row_whose_logits_hold_nan_takes_its_argmax(bad: int) -> None:
    """A greedy row has nothing to draw: it takes its argmax, with a NaN log-probability (null over HTTP:
    tests/app/api/test_encoding.py), and nothing fails."""
    rows, logits = rows_and_logits()
    logits[bad, 7] = math.nan
    out = Sampler(VOCAB)(logits, rows)
    assert not out.errors and out.tokens[bad] >= 0 and math.isnan(out.logprobs[bad])
