"""The batched `Sampler`'s bookkeeping: draws as `torch.multinomial` draws, a sampled row whose logits hold NaN fails
alone, and each row gets its own top-n alternatives when rows ask for different n (all brought to the host at
once)."""

from __future__ import annotations

import math

import pytest
import torch

from model.sampler import Sampler, SampleRow, draw, new_generator
from model.sampling_params import SamplingParams

VOCAB = 40


def test_draw_is_torch_multinomials_draw() -> None:
    """The same id from the same generator state, so seeded requests are what they were before the sampler stopped
    waiting for each draw."""
    for seed in range(100):
        probs = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(seed)) * 3, -1)
        want = torch.multinomial(probs, 1, generator=new_generator(seed))
        assert int(draw(probs, new_generator(seed))) == int(want)


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
